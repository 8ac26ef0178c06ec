"""Model parallelism: a model's fx graph cut into stages (``partition.py``, pure) and the
stage programs that run them (``stages.py``). The partitioned executor that runs each
stage in its own process builds on these."""
from __future__ import annotations

from plexus.parallel.partition import (METHODS, GraphNode, ModelGraph, Partition, PartitionPlan, Transfer,
                                       format_bytes, format_plan, plan_partitions, trace_model)
from plexus.parallel.stages import StageProgram, StageStep, build_stages, forward_backward, merge_state_dicts

__all__ = ["METHODS", "GraphNode", "ModelGraph", "Partition", "PartitionPlan", "Transfer", "format_bytes",
           "format_plan", "plan_partitions", "trace_model", "StageProgram", "StageStep", "build_stages",
           "forward_backward", "merge_state_dicts"]
