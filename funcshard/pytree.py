"""Pytree helpers with paths, on top of optree.

Paths are written ``"layers/3/attn/wq"``: dict keys, sequence indices and namedtuple field indices joined
by ``/`` (as t5x / MaxText rules match them).

Example:
    >>> from funcshard import pytree
    >>> [p for p, _ in pytree.leaves_with_path({"a": [1, 2], "b": {"c": 3}})]
    ['a/0', 'a/1', 'b/c']
"""

from ._src.tree.pytree import *  # noqa: F403 (the names its __all__ lists)
from ._src.tree.pytree import __all__ as __all__
