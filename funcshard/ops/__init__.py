"""Parallel building blocks as pure functions over local shards, for use inside ``shard_map``.

Example:
    >>> from funcshard.ops import column_parallel_linear, row_parallel_linear, fsdp_gather
"""

from .attention import attention as attention
from .fsdp import fsdp_gather as fsdp_gather
from .fsdp import fsdp_unsharded_specs as fsdp_unsharded_specs
from .tp import column_parallel_linear as column_parallel_linear
from .tp import row_parallel_linear as row_parallel_linear
from .tp import sequence_gather as sequence_gather
from .tp import sequence_scatter as sequence_scatter
from .tp import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from .tp import vocab_parallel_embedding as vocab_parallel_embedding

__all__ = [
    "attention",
    "column_parallel_linear",
    "fsdp_gather",
    "fsdp_unsharded_specs",
    "row_parallel_linear",
    "sequence_gather",
    "sequence_scatter",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]
