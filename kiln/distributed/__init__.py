"""Tensor and pipeline parallelism on torch.distributed: where a rank sits in the grid
(parallel_state.py) and the few collectives the model calls (comm.py).

Imports nothing else of kiln: models, layers, runtime and executor all read it.
"""

from kiln.distributed.parallel_state import ParallelContext, RankLayout, split_layers

__all__ = ["ParallelContext", "RankLayout", "split_layers"]
