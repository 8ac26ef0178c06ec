"""plexus: train PyTorch models under every classic distributed deep-learning architecture."""
from __future__ import annotations

__version__ = "0.1.0"


def run(config):
    """Train as ``plexus train`` would and return the summary; see ``plexus.train.job.run``."""
    from plexus.train.job import run as _run
    return _run(config)


__all__ = ["run", "__version__"]
