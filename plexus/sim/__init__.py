"""The simulator: clusters larger than this machine, with the real maths under virtual time.

``plexus simulate`` runs a job's own rules (all-reduce cost models and bucket layout,
consistency gates, server optimizers, staleness accounting, batch plans) on a discrete-event
queue (``events.py``) against a described cluster (``cluster.py``): time is simulated,
gradients and accuracy are real (``maths.py``), or skipped with ``--timing-only``.
``engines.py`` holds one simulated job per strategy, ``run.py`` the run directory.
"""
from plexus.sim.run import SIMULATED, simulate

__all__ = ["simulate", "SIMULATED"]
