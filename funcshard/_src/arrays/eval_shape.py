"""``fs.eval_shape``: the shapes and dtypes a function returns, computed on meta tensors (JAX's ``eval_shape``).

Example:
    >>> import torch, funcshard as fs
    >>> fs.eval_shape(lambda a, b: a @ b, fs.ShapeDtype((8, 4)), torch.ones(4, 2))  # [8, 4] @ [4, 2]
    ShapeDtype(shape=(8, 2), dtype=torch.float32)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from ..tree.shapes import shape_dtype_of, to_meta

__all__ = ["eval_shape"]

PyTree = Any


def eval_shape(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> PyTree:
    """The shapes and dtypes of ``fn(*args, **kwargs)``, without computing it or allocating its memory.

    As ``jax.eval_shape``: ``fn`` runs once on meta tensors (torch's data-less device) with ``meta`` as the
    default device, so the tensors it makes (``torch.zeros``, ``fs.random`` draws, parameters of any size) hold
    no data and nothing is computed; a 405B-parameter ``llama.init`` takes milliseconds. Leaves of the
    arguments that are :class:`fs.ShapeDtype` or tensors enter as meta tensors of their shape and dtype; other
    values (Python numbers, configs, strings, ``fs.Array`` s) as they are. Code that needs a tensor's values
    (``.item()``, ``bool(t)``, ``.tolist()``, data-dependent shapes such as ``t[t > 0]``) cannot run on meta
    tensors and raises torch's error.

    Args:
        fn: the function, called as ``fn(*args, **kwargs)``.
        *args: its positional arguments, pytrees whose leaves may be ``fs.ShapeDtype`` s.
        **kwargs: its keyword arguments, likewise.

    Returns:
        ``fn``'s output tree with each tensor leaf (anything with ``shape`` and ``dtype``) replaced by its
        ``fs.ShapeDtype``; other leaves (numbers, strings, None) as ``fn`` returned them.

    Example:
        >>> import funcshard as fs
        >>> f = lambda x, w: {"y": torch.relu(x @ w.T), "n": x.shape[0]}
        >>> fs.eval_shape(f, fs.ShapeDtype((32, 512), torch.bfloat16), fs.ShapeDtype((1024, 512), torch.bfloat16))
        {'y': ShapeDtype(shape=(32, 1024), dtype=torch.bfloat16), 'n': 32}
        >>> fs.eval_shape(fs.random.normal, fs.random.key(0), (10**6, 10**6))  # 10**12 draws, none computed
        ShapeDtype(shape=(1000000, 1000000), dtype=torch.float32)
    """
    args, kwargs = optree.tree_map(to_meta, (args, kwargs))
    with torch.device("meta"):
        out = fn(*args, **kwargs)
    return optree.tree_map(shape_dtype_of, out)
