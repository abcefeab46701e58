"""``funcshard.ops.triton``: the Triton flash-attention kernels' public names, from
:mod:`funcshard.ops.attention.triton` (where the kernels, their docs and examples live)."""

from .attention.triton import MAX_HEAD_DIM as MAX_HEAD_DIM
from .attention.triton import flash_attention as flash_attention
from .attention.triton import kernels_take as kernels_take
from .attention.triton import uses_triton as uses_triton

__all__ = ["MAX_HEAD_DIM", "flash_attention", "kernels_take", "uses_triton"]
