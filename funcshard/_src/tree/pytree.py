"""Pytree helpers with paths, as ``funcshard.pytree`` exports them (see its docstring)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

__all__ = [
    "broadcast_prefix",
    "flatten",
    "leaves_with_path",
    "tree_map",
    "tree_path",
    "unflatten",
]

PyTree = Any


def tree_path(path: tuple[Any, ...]) -> str:
    """Join an optree path (a tuple of keys) into the ``"a/b/0"`` form.

    Args:
        path: a tuple of dict keys, indices or field names, as optree returns them.

    Returns:
        The keys joined with ``/``; the empty path is ``""``.

    Example:
        >>> tree_path(("layers", 3, "wq"))
        'layers/3/wq'
    """
    return "/".join(str(k) for k in path)


def leaves_with_path(tree: PyTree, *, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
    """List ``(path, leaf)`` pairs of a tree, paths in the ``"a/b/0"`` form.

    Example:
        >>> leaves_with_path({"w": 1})
        [('w', 1)]
    """
    paths, leaves, _ = optree.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(tree_path(p), leaf) for p, leaf in zip(paths, leaves, strict=True)]


def flatten(tree: PyTree, *, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], Any]:
    """Flatten a tree into its leaves and a treespec (optree's).

    Args:
        tree: the tree to flatten.
        is_leaf: optional predicate; subtrees it accepts are leaves.

    Returns:
        ``(leaves, treespec)``: the leaves in optree's order and the structure, for :func:`unflatten`.

    Example:
        >>> leaves, spec = flatten({"b": [2, 3], "a": 1})
        >>> leaves
        [1, 2, 3]
    """
    leaves, spec = optree.tree_flatten(tree, is_leaf=is_leaf)
    return leaves, spec


def unflatten(treespec: Any, leaves: list[Any]) -> PyTree:
    """Rebuild a tree from a treespec and leaves.

    Args:
        treespec: the structure, as :func:`flatten` returns it.
        leaves: one leaf per leaf of ``treespec``, in its order.

    Returns:
        The tree with ``leaves`` in place.

    Example:
        >>> leaves, spec = flatten({"a": 1, "b": [2, 3]})
        >>> unflatten(spec, [x * 10 for x in leaves])
        {'a': 10, 'b': [20, 30]}
    """
    return optree.tree_unflatten(treespec, leaves)


def tree_map(
    fn: Callable[..., Any], tree: PyTree, *rest: PyTree, is_leaf: Callable[[Any], bool] | None = None
) -> PyTree:
    """Map ``fn`` over the leaves of one or more trees of the same structure.

    Args:
        fn: called with one leaf of ``tree`` and the matching leaf of each tree in ``rest``.
        tree: the first tree; it gives the structure of the result.
        *rest: more trees with the structure of ``tree``.
        is_leaf: optional predicate; subtrees it accepts are leaves.

    Returns:
        A tree with the structure of ``tree`` and ``fn``'s results as leaves.

    Example:
        >>> tree_map(lambda x, y: x + y, {"a": 1, "b": [2, 3]}, {"a": 10, "b": [20, 30]})
        {'a': 11, 'b': [22, 33]}
    """
    return optree.tree_map(fn, tree, *rest, is_leaf=is_leaf)


def broadcast_prefix(
    prefix: PyTree,
    full: PyTree,
    *,
    prefix_is_leaf: Callable[[Any], bool],
    what: str = "spec tree",
    where: str = "",
    full_treedef: Any = None,
) -> list[Any]:
    """Broadcast a prefix tree (e.g. of specs) to the leaves of ``full``.

    Each leaf of ``prefix`` stands for a whole subtree of ``full``; the result lists one prefix leaf per
    leaf of ``full``, in ``full``'s leaf order. A prefix with ``full``'s very structure (one spec per leaf,
    the usual case) costs one flatten and a structure comparison; any other prefix takes a walk of both trees.

    Args:
        prefix: the prefix tree; its leaves are the subtrees ``prefix_is_leaf`` accepts.
        full: the value tree.
        prefix_is_leaf: the leaf test of ``prefix`` (e.g. ``is_spec``).
        what: how error messages name ``prefix``.
        where: text put in front of error messages (e.g. ``"device_put: "``).
        full_treedef: ``full``'s structure (``flatten(full)[1]``) when the caller has it already; ``None``:
            computed here.

    Returns:
        One leaf of ``prefix`` per leaf of ``full``, in ``full``'s leaf order.

    Raises:
        ShardingError: when ``prefix`` is not a prefix of ``full``; the message names the first path
            where the two trees part.

    Example:
        >>> broadcast_prefix("s", {"a": 1, "b": [2, 3]}, prefix_is_leaf=lambda x: isinstance(x, str))
        ['s', 's', 's']
    """
    if full_treedef is None:
        full_treedef = optree.tree_structure(full)
    if optree.tree_structure(prefix, is_leaf=prefix_is_leaf) == full_treedef:
        # The usual case, one spec per leaf: the prefix has ``full``'s very structure, so each of its leaves
        # stands for exactly one leaf of ``full`` (a leaf of a structure is one leaf) and the walk below would
        # list them in this order. Anything else (a spec for a subtree, list vs tuple) takes the walk.
        flat = optree.tree_leaves(prefix, is_leaf=prefix_is_leaf)
        if all(map(prefix_is_leaf, flat)):
            return flat
    return _broadcast_walk(prefix, full, prefix_is_leaf, what, where)


def _broadcast_walk(
    prefix: PyTree, full: PyTree, prefix_is_leaf: Callable[[Any], bool], what: str, where: str
) -> list[Any]:
    """:func:`broadcast_prefix` by a walk of both trees (any prefix; names where they part)."""
    from ..errors import ShardingError

    out: list[Any] = []

    def walk(p: Any, f: Any, path: tuple[Any, ...]) -> None:
        if prefix_is_leaf(p):
            out.extend([p] * len(optree.tree_leaves(f)))
            return
        p_node = _one_level(p)
        f_node = _one_level(f)
        if p_node is None or f_node is None or not _same_node(p, f, p_node, f_node):
            loc = tree_path(path) or "<root>"
            raise ShardingError(
                f"{where}{what} is not a prefix of the value tree at '{loc}': the {what} has "
                f"{_describe(p)} where the value has {_describe(f)}. Give one spec P(...) per leaf, or one "
                f"spec for a whole subtree, with the same containers (dict keys, list lengths) as the value."
            )
        for key, pc, fc in zip(p_node.entries, p_node.children, f_node.children, strict=True):
            walk(pc, fc, (*path, key))

    walk(prefix, full, ())
    return out


def _one_level(x: Any) -> Any:
    if optree.tree_is_leaf(x):
        return None
    return optree.tree_flatten_one_level(x)


def _same_node(p: Any, f: Any, p_node: Any, f_node: Any) -> bool:
    both_seq = type(p) in (list, tuple) and type(f) in (list, tuple)
    if type(p) is not type(f) and not both_seq:
        return False
    return tuple(p_node.entries) == tuple(f_node.entries)


def _describe(x: Any) -> str:
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of length {len(x)}"
    if x is None:
        return "None"
    if isinstance(x, str):
        return f"the string {x!r} (write P({x!r}) for a spec)"
    return f"a leaf of type {type(x).__name__}"
