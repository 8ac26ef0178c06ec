"""plexus: train PyTorch models under every classic distributed deep-learning architecture."""
from __future__ import annotations

__version__ = "0.1.0"
