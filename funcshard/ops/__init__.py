"""Parallel building blocks as pure functions over local shards, for use inside ``shard_map``.

Every op names the mesh axis it works over with ``axis=``; ``axis=None`` means the value is not split there:
plain local math (``F.linear``, ``F.embedding``, ``F.cross_entropy``, :func:`attention`, the identity), so a
model calls the same ops on every mesh and takes each axis from its parallel plan.

Example:
    >>> import torch, torch.nn.functional as F
    >>> from funcshard.ops import column_parallel_linear, row_parallel_linear, fsdp_gather
    >>> x, w = torch.randn(2, 8), torch.randn(4, 8)
    >>> torch.equal(column_parallel_linear(x, w, axis=None), F.linear(x, w))
    True
"""

from . import moe as moe  # funcshard.ops.moe: routing, grouped experts, the MoE layer
from . import triton as triton  # funcshard.ops.triton.flash_attention; imports no Triton until it runs
from .attention import attention as attention
from .attention import layout_positions as layout_positions
from .attention import ring_attention as ring_attention
from .attention import ring_work as ring_work
from .attention import ulysses_attention as ulysses_attention
from .attention import zigzag_chunk_sizes as zigzag_chunk_sizes
from .attention import zigzag_indices as zigzag_indices
from .attention import zigzag_inverse_indices as zigzag_inverse_indices
from .attention import zigzag_merge as zigzag_merge
from .attention import zigzag_positions as zigzag_positions
from .attention import zigzag_split as zigzag_split
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
    "layout_positions",
    "ring_attention",
    "ring_work",
    "row_parallel_linear",
    "sequence_gather",
    "sequence_scatter",
    "ulysses_attention",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
    "zigzag_chunk_sizes",
    "zigzag_indices",
    "zigzag_inverse_indices",
    "zigzag_merge",
    "zigzag_positions",
    "zigzag_split",
]
