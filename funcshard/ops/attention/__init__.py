"""Attention, local and over a context-parallel axis: the attention family of :mod:`funcshard.ops`.

- ``local.py``: :func:`attention` on this device's shards (SDPA, or the Triton kernels where they take the
  inputs and the log-sum-exp is asked for); ``_torch_kernel.py``: its torch path.
- ``ring.py``: :func:`ring_attention` and the zigzag layout; ``_ring_kernel.py``: the ring's forward and backward.
- ``ulysses.py``: :func:`ulysses_attention` (all-to-all over heads).
- ``triton.py``: ``funcshard.ops.triton``, the flash-attention kernels (``_triton_kernels.py``), built on first use.

The public names are :mod:`funcshard.ops`' (``funcshard.ops.attention``, ``funcshard.ops.ring_attention``, ...).

Example:
    >>> import torch
    >>> from funcshard.ops import attention
    >>> attention(*(torch.randn(1, 2, 4, 8),) * 3).shape
    torch.Size([1, 2, 4, 8])
"""

from . import triton as triton  # funcshard.ops.triton.flash_attention; imports no Triton until it runs
from .local import attention as attention
from .ring import layout_positions as layout_positions
from .ring import ring_attention as ring_attention
from .ring import ring_work as ring_work
from .ring import zigzag_chunk_sizes as zigzag_chunk_sizes
from .ring import zigzag_indices as zigzag_indices
from .ring import zigzag_inverse_indices as zigzag_inverse_indices
from .ring import zigzag_merge as zigzag_merge
from .ring import zigzag_positions as zigzag_positions
from .ring import zigzag_split as zigzag_split
from .ulysses import ulysses_attention as ulysses_attention
