"""``fs.ShapeDtype``: a value's shape and element type with no data (JAX's ``ShapeDtypeStruct``).

The leaves of an abstract program: ``fs.eval_shape`` returns them, an ``"abstract"`` mesh takes them where a real
one takes tensors, and :func:`to_meta` turns one into the data-less tensor torch computes shapes with.

Example:
    >>> import torch
    >>> s = ShapeDtype((2, 3), torch.bfloat16)
    >>> s, s.nbytes
    (ShapeDtype(shape=(2, 3), dtype=torch.bfloat16), 12)
    >>> to_meta(s).device
    device(type='meta')
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["ShapeDtype", "is_shape_dtype", "shape_dtype_of", "to_meta"]


class ShapeDtype:
    """A value's global shape and dtype, without data (an optree leaf).

    Attributes:
        shape: the shape, a tuple of ints.
        dtype: the torch dtype.

    Example:
        >>> ShapeDtype((4,), torch.float32) == ShapeDtype([4], torch.float32)
        True
    """

    __slots__ = ("dtype", "shape")

    def __init__(self, shape: Any, dtype: torch.dtype = torch.float32) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype

    @property
    def ndim(self) -> int:
        """The number of dims."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """The number of elements."""
        return math.prod(self.shape)

    def numel(self) -> int:
        """The number of elements (torch's spelling)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """The bytes a tensor of this shape and dtype holds."""
        return math.prod(self.shape) * dtype_bytes(self.dtype)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShapeDtype) and other.shape == self.shape and other.dtype == self.dtype

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype))

    def __repr__(self) -> str:
        return f"ShapeDtype(shape={self.shape}, dtype={self.dtype})"


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``.

    Example:
        >>> dtype_bytes(torch.bfloat16)
        2
    """
    return dtype.itemsize


def is_shape_dtype(x: Any) -> bool:
    """Whether ``x`` is a :class:`ShapeDtype`."""
    return isinstance(x, ShapeDtype)


def shape_dtype_of(x: Any) -> Any:
    """The :class:`ShapeDtype` of a tensor (or anything with ``shape`` and ``dtype``); other values as they are.

    Example:
        >>> shape_dtype_of(torch.zeros(2, dtype=torch.int64))
        ShapeDtype(shape=(2,), dtype=torch.int64)
    """
    if isinstance(x, ShapeDtype):
        return x
    if isinstance(x, torch.Tensor) or (hasattr(x, "shape") and hasattr(x, "dtype")):
        return ShapeDtype(tuple(x.shape), x.dtype)
    return x


def to_meta(x: Any) -> Any:
    """A meta tensor of a :class:`ShapeDtype`'s shape and dtype; a tensor moved to ``meta``; other values as they are.

    Example:
        >>> to_meta(ShapeDtype((3,), torch.int32)).shape
        torch.Size([3])
    """
    if isinstance(x, ShapeDtype):
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    if isinstance(x, torch.Tensor) and not x.is_meta:
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x
