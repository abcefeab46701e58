"""Pytree helpers with paths, on top of optree.

Paths are written ``"layers/3/attn/wq"``: dict keys, sequence indices and namedtuple field indices joined
by ``/`` (as t5x / MaxText rules match them).

Example:
    >>> from funcshard import pytree
    >>> [p for p, _ in pytree.leaves_with_path({"a": [1, 2], "b": {"c": 3}})]
    ['a/0', 'a/1', 'b/c']
"""

from ._src.tree.pytree import broadcast_prefix as broadcast_prefix
from ._src.tree.pytree import flatten as flatten
from ._src.tree.pytree import leaves_with_path as leaves_with_path
from ._src.tree.pytree import tree_map as tree_map
from ._src.tree.pytree import tree_path as tree_path
from ._src.tree.pytree import unflatten as unflatten

__all__ = ["broadcast_prefix", "flatten", "leaves_with_path", "tree_map", "tree_path", "unflatten"]
