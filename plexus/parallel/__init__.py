"""Model parallelism: a model's fx graph cut into stages (``partition.py``, pure) and the
stage programs that run them (``stages.py``); ``executor.py`` runs each stage in its own
process (``plexus train --stages K``, the loop in ``train/stage_runner.py``), and with
``--workers R`` runs R such replicas whose stage k all-reduce their gradients together."""
from __future__ import annotations

from plexus.parallel.partition import (METHODS, GraphNode, ModelGraph, Partition, PartitionPlan, Transfer,
                                       format_bytes, format_plan, plan_partitions, trace_model)
from plexus.parallel.stages import StageProgram, StageStep, build_stages, forward_backward, merge_state_dicts

__all__ = ["METHODS", "GraphNode", "ModelGraph", "Partition", "PartitionPlan", "Transfer", "format_bytes",
           "format_plan", "plan_partitions", "trace_model", "StageProgram", "StageStep", "build_stages",
           "forward_backward", "merge_state_dicts"]
