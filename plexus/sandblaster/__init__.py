"""Sandblaster L-BFGS (Dean et al. 2012, section 4.2): the algorithm over shard commands
(``lbfgs.py``), the wire format (``wire.py``), the shards (``shard.py``), the coordinator
(``coordinator.py``) and the work-unit scheduler (``scheduler.py``); the strategy that
runs them is ``plexus/strategies/sandblaster.py``."""
