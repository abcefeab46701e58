"""Spec trees from rules: regex rules on leaf paths (t5x / MaxText) and logical axis rules (flax / MaxText).

``spec_rules`` gives each leaf of a tree the spec of the first ``(pattern, spec)`` rule whose pattern
``re.fullmatch``-es the leaf's path (``"layers/3/attn/wq"``). ``logical_to_mesh`` turns specs written with
logical axis names (``P("batch", "seq", "embed")``) into specs over mesh axes, from ``(logical, mesh_axes)``
rules tried in order, each mesh axis used at most once per spec.

Pure data: this module knows nothing of backends. A "mesh" here is anything with ``axis_names`` (tuple) and
``shape`` (dict name -> size).

Example:
    >>> import torch
    >>> params = {"wq": torch.zeros(8, 8), "norm": torch.zeros(8)}
    >>> spec_rules(params, [(r".*w[qkv]", P(None, "tp"))])
    {'wq': P(None, 'tp'), 'norm': P()}
    >>> logical_to_mesh(P("batch", "embed"), [("batch", "dp"), ("embed", "tp")])
    P('dp', 'tp')
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..errors import ShardingError
from .pytree import flatten, leaves_with_path, unflatten
from .spec import Entry, P, check_spec, format_mesh, is_spec

__all__ = ["logical_to_mesh", "restrict_spec", "spec_rules"]

PyTree = Any
SpecFn = Callable[[str, Any], P]
Rule = tuple[str | re.Pattern[str], P | SpecFn]
LogicalRule = tuple[str, str | tuple[str, ...] | None]


# -- helpers -----------------------------------------------------------------------------------------------


def _axis_sizes(mesh: Any) -> Mapping[str, int]:
    """Axis name -> size of a mesh, or of a plain ``{name: size}`` mapping."""
    return mesh if isinstance(mesh, Mapping) else mesh.shape


def _at(fn: str, path: str) -> str:
    return f"{fn} at '{path}'" if path else fn


def _is_shaped(x: Any) -> bool:
    """Leaf test: tensors, ``torch.Size`` and any non-container object with a ``.shape`` (e.g. ``fs.Array``)."""
    if isinstance(x, (torch.Tensor, torch.Size)):
        return True
    return type(x) not in (dict, list, tuple) and not isinstance(x, (dict, list)) and hasattr(x, "shape")


def _shape_of(leaf: Any) -> tuple[int, ...] | None:
    """The shape of a leaf, ``()`` for a Python number, ``None`` when it has none."""
    if isinstance(leaf, torch.Size):
        return tuple(leaf)
    if hasattr(leaf, "shape"):
        try:
            return tuple(int(s) for s in leaf.shape)
        except TypeError:
            return None
    if isinstance(leaf, (bool, int, float, complex)):
        return ()
    return None


def _describe_leaf(leaf: Any) -> str:
    shape = _shape_of(leaf)
    return f"shape {shape}" if shape is not None else f"a {type(leaf).__name__} with no shape"


def restrict_spec(spec: P, mesh: Any, *, drop_size_one: bool = False) -> P:
    """Drop from ``spec`` the axes ``mesh`` does not have (and, optionally, those of size 1).

    An axis the mesh lacks behaves as an axis of size 1, so dropping it leaves the layout unchanged; this lets
    one rule set serve every mesh. A dim left with no axis becomes replicated (``None``).

    Args:
        spec: the spec to restrict.
        mesh: a mesh, or a ``{name: size}`` mapping.
        drop_size_one: also drop the axes of size 1.

    Returns:
        The restricted spec.

    Example:
        >>> restrict_spec(P(("dp", "fsdp"), "tp"), {"dp": 2, "tp": 1}, drop_size_one=True)
        P('dp', None)
    """
    if not isinstance(spec, P):
        raise ShardingError(f"restrict_spec: expected a spec P(...), found {spec!r}; wrap axis names in P.")
    sizes = _axis_sizes(mesh)
    out: list[Entry] = []
    for axes in spec.dim_axes(len(spec)):
        kept = tuple(a for a in axes if a in sizes and not (drop_size_one and sizes[a] == 1))
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*out)


# -- spec_rules --------------------------------------------------------------------------------------------


def _compile_rules(rules: Sequence[Rule] | Mapping[Any, Any]) -> list[tuple[re.Pattern[str], P | SpecFn]]:
    items = list(rules.items()) if isinstance(rules, Mapping) else rules
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise ShardingError(
            f"spec_rules: rules must be a sequence of (pattern, spec) pairs, found {type(rules).__name__}; "
            f"write e.g. [(r'.*attn/w[qkv]', P(None, 'tp')), (r'.*', P())]."
        )
    compiled = []
    for i, rule in enumerate(items):
        if not isinstance(rule, (tuple, list)) or len(rule) != 2:
            raise ShardingError(
                f"spec_rules: rule {i} is {rule!r}, not a (pattern, spec) pair; "
                f"write e.g. (r'.*attn/w[qkv]', P(None, 'tp'))."
            )
        pattern, spec = rule
        if isinstance(pattern, re.Pattern):
            regex = pattern
        elif isinstance(pattern, str):
            try:
                regex = re.compile(pattern)
            except re.error as e:
                raise ShardingError(
                    f"spec_rules: rule {i} has pattern {pattern!r}, which is not a valid regular expression "
                    f"({e}); fix the pattern, or re.escape() text meant literally."
                ) from None
        else:
            raise ShardingError(
                f"spec_rules: rule {i} has pattern {pattern!r} of type {type(pattern).__name__}; "
                f"give a regular expression string matched against paths like 'layers/3/attn/wq'."
            )
        if not (isinstance(spec, P) or callable(spec)):
            raise ShardingError(
                f"spec_rules: rule {i} ({pattern!r}) has spec {spec!r} of type {type(spec).__name__}; give a "
                f"P(...) (e.g. P(None, 'tp')) or a callable (path, leaf) -> P."
            )
        compiled.append((regex, spec))
    return compiled


def _call_spec(spec: P | SpecFn, path: str, leaf: Any, what: str) -> P:
    if isinstance(spec, P):
        return spec
    out = spec(path, leaf)
    if not isinstance(out, P):
        raise ShardingError(
            f"{_at('spec_rules', path)}: {what} is a callable that returned {out!r} "
            f"(type {type(out).__name__}) for a leaf of {_describe_leaf(leaf)}; it must return a P(...)."
        )
    return out


def spec_rules(
    tree: PyTree,
    rules: Sequence[Rule],
    default: P | SpecFn | None = P(),  # noqa: B008 - P is immutable
    *,
    mesh: Any = None,
    drop_missing_axes: bool = False,
) -> PyTree:
    """A spec tree for ``tree``: each leaf gets the spec of the first rule whose pattern fully matches its path.

    Paths are written ``"layers/3/attn/wq"`` (dict keys, list and namedtuple indices joined by ``/``) and
    matched with ``re.fullmatch``, so ``"wq"`` matches only a top-level ``wq``; write ``r".*/wq"`` for any
    depth. Rules are tried in order and the first match wins, as in t5x / MaxText.

    Args:
        tree: any optree pytree; leaves are tensors, ``fs.Array``s, ``torch.Size``s or anything with a
            ``.shape``.
        rules: ``(pattern, spec)`` pairs; ``spec`` is a ``P`` or a callable ``(path, leaf) -> P`` for
            shape-dependent rules.
        default: the spec (or callable) of leaves no rule matches; ``None`` makes them an error that lists
            every unmatched leaf.
        mesh: when given, every spec is checked against its leaf's shape on this mesh.
        drop_missing_axes: drop from each spec the axes ``mesh`` does not have (see :func:`restrict_spec`),
            so one rule set serves every mesh. Needs ``mesh``.

    Returns:
        A tree of ``P`` with the structure of ``tree`` (``None`` nodes stay ``None``).

    Raises:
        ShardingError: for a malformed rule or pattern, for unmatched leaves under ``default=None``, and,
            with ``mesh``, for a spec that does not fit its leaf (naming the path).

    Example:
        >>> import torch
        >>> params = {"layers": [{"wq": torch.zeros(8, 8), "wo": torch.zeros(8, 8)}]}
        >>> rules = [(r"layers/\\d+/wq", P(None, "tp")), (r"layers/\\d+/wo", P("tp", None))]
        >>> spec_rules(params, rules, default=None)
        {'layers': [{'wq': P(None, 'tp'), 'wo': P('tp', None)}]}
    """
    compiled = _compile_rules(rules)
    if not (default is None or isinstance(default, P) or callable(default)):
        raise ShardingError(
            f"spec_rules: default is {default!r}; give a P(...), a callable (path, leaf) -> P, or None to make "
            f"unmatched leaves an error."
        )
    if drop_missing_axes and mesh is None:
        raise ShardingError("spec_rules: drop_missing_axes=True needs a mesh; pass mesh=... as well.")

    pairs = leaves_with_path(tree, is_leaf=_is_shaped)
    _, treespec = flatten(tree, is_leaf=_is_shaped)
    specs: list[P] = []
    unmatched: list[tuple[str, Any]] = []
    for path, leaf in pairs:
        for regex, spec in compiled:
            if regex.fullmatch(path):
                specs.append(_call_spec(spec, path, leaf, f"the spec of rule {regex.pattern!r}"))
                break
        else:
            if default is None:
                unmatched.append((path, leaf))
            else:
                specs.append(_call_spec(default, path, leaf, "default"))
    if unmatched:
        raise ShardingError(_unmatched_message(unmatched, compiled))

    if mesh is not None:
        specs = [
            _fit(spec, path, leaf, mesh, drop_missing_axes) for (path, leaf), spec in zip(pairs, specs, strict=True)
        ]
    return unflatten(treespec, specs)


def _fit(spec: P, path: str, leaf: Any, mesh: Any, drop_missing_axes: bool) -> P:
    """``spec`` checked against ``mesh`` for ``leaf`` (its axes the mesh lacks dropped, if asked)."""
    if drop_missing_axes:
        spec = restrict_spec(spec, mesh)
    shape = _shape_of(leaf)
    if shape is None:
        if spec != P():
            raise ShardingError(
                f"{_at('spec_rules', path)}: spec {spec!r} on mesh {format_mesh(mesh)} is for a leaf of "
                f"type {type(leaf).__name__}, which has no shape; match it with P() instead."
            )
    else:
        check_spec(spec, shape, mesh, path=path, fn="spec_rules")
    return spec


def _unmatched_message(unmatched: list[tuple[str, Any]], compiled: list[tuple[re.Pattern[str], Any]]) -> str:
    lines = []
    for path, leaf in unmatched:
        line = f"  '{path or '<root>'}' ({_describe_leaf(leaf)})"
        partial = next((r.pattern for r, _ in compiled if r.search(path)), None)
        if partial is not None:
            line += f"; pattern {partial!r} matches only part of it (rules use re.fullmatch: try '.*{partial}')"
        lines.append(line)
    patterns = [r.pattern for r, _ in compiled]
    return (
        f"spec_rules: {len(unmatched)} leaves match no rule and default=None:\n"
        + "\n".join(lines)
        + f"\nPatterns tried, in order: {patterns}. Add a rule for these paths (e.g. (r'.*norm', P())), "
        f"or pass default=P() to replicate whatever no rule matches."
    )


# -- logical axis rules ------------------------------------------------------------------------------------


def _group_logical_rules(rules: Sequence[LogicalRule] | Mapping[str, Any]) -> dict[str, list[tuple[str, ...]]]:
    """Logical name -> its candidate mesh-axis tuples, in priority order (``()`` means replicated)."""
    items = list(rules.items()) if isinstance(rules, Mapping) else rules
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise ShardingError(
            f"logical_to_mesh: rules must be a sequence of (logical_name, mesh_axes) pairs, found "
            f"{type(rules).__name__}; write e.g. [('batch', ('dp', 'fsdp')), ('embed', 'fsdp'), ('mlp', 'tp')]."
        )
    grouped: dict[str, list[tuple[str, ...]]] = {}
    for i, rule in enumerate(items):
        ok = isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
        target = rule[1] if ok else None
        if ok and target is None:
            axes: tuple[str, ...] = ()
        elif ok and isinstance(target, str):
            axes = (target,)
        elif ok and isinstance(target, (tuple, list)) and all(isinstance(a, str) for a in target):
            axes = tuple(target)
            ok = len(set(axes)) == len(axes)
        else:
            ok = False
        if not ok:
            raise ShardingError(
                f"logical_to_mesh: rule {i} is {rule!r}; each rule is a (logical_name, mesh_axes) pair with "
                f"mesh_axes None (replicated), a mesh axis name, or a tuple of distinct axis names, "
                f"e.g. ('mlp', 'tp'), ('batch', ('dp', 'fsdp')) or ('seq', None)."
            )
        grouped.setdefault(rule[0], []).append(axes)
    return grouped


def _map_spec(spec: P, grouped: dict[str, list[tuple[str, ...]]], mesh: Any, path: str) -> P:
    where = _at("logical_to_mesh", path)
    sizes = _axis_sizes(mesh) if mesh is not None else None
    owner: dict[str, tuple[str, int]] = {}  # mesh axis -> (logical name, dim) that took it
    out: list[Entry] = []
    for dim, names in enumerate(spec.dim_axes(len(spec))):
        dim_axes: list[str] = []
        for name in names:
            if name not in grouped:
                raise ShardingError(
                    f"{where}: logical axis '{name}' (dim {dim} of {spec!r}) has no rule; the rules name "
                    f"{sorted(grouped)}. Add one, e.g. ('{name}', 'tp') to shard it or ('{name}', None) to "
                    f"replicate it."
                )
            chosen: tuple[str, ...] | None = None
            blocked: list[str] = []
            absent = False
            for cand in grouped[name]:
                axes = cand if sizes is None else tuple(a for a in cand if a in sizes)
                if cand and not axes:  # every axis missing from the mesh: as if of size 1
                    absent = True
                    continue
                taken = [a for a in axes if a in owner]
                if taken:
                    blocked.extend(a for a in taken if a not in blocked)
                    continue
                chosen = axes
                break
            if chosen is None and absent:
                chosen = ()
            if chosen is None:
                raise ShardingError(_conflict_message(where, spec, name, dim, blocked, owner))
            for a in chosen:
                owner[a] = (name, dim)
            dim_axes.extend(chosen)
        out.append(None if not dim_axes else dim_axes[0] if len(dim_axes) == 1 else tuple(dim_axes))
    return P(*out)


def _conflict_message(where: str, spec: P, name: str, dim: int, blocked: list[str], owner: dict[str, Any]) -> str:
    takers = [f"mesh axis '{a}' is already taken by logical axis '{owner[a][0]}' (dim {owner[a][1]})" for a in blocked]
    other = owner[blocked[0]][0]
    return (
        f"{where}: logical axis '{name}' (dim {dim} of {spec!r}) has no usable rule: "
        + "; ".join(takers)
        + f", and a mesh axis may shard at most one dim of a spec. Add a fallback rule after the others, "
        f"e.g. ('{name}', None) to replicate it, or map '{other}' to another axis."
    )


def logical_to_mesh(
    logical_specs: PyTree,
    rules: Sequence[LogicalRule],
    *,
    mesh: Any = None,
) -> PyTree:
    """Translate specs over logical axis names into specs over mesh axes, as flax's ``logical_axis_rules``.

    For each spec independently, each logical name is given the first of its rules whose mesh axes are free:
    not used by an earlier dim (or earlier name) of the same spec. A name may have several rules, tried in
    order as fallbacks; a rule to ``None`` means replicated; a rule to a tuple shards over the product of its
    axes. With ``mesh``, axes the mesh lacks are treated as size 1 and dropped from the rules (a rule none of
    whose axes the mesh has is skipped; a name left with only such rules is replicated), so one rule set
    serves every mesh.

    Args:
        logical_specs: a ``P`` or a tree of them whose entries are logical names, e.g.
            ``P("batch", "seq", "embed")`` or ``P(("heads", "kv"), "embed")``.
        rules: ``(logical_name, mesh_axes)`` pairs, ``mesh_axes`` ``None``, an axis name or a tuple of them.
        mesh: optional mesh (or ``{name: size}`` mapping) whose axes the result may use.

    Returns:
        A ``P`` for a ``P``, else a tree of ``P`` of the same structure, over mesh axis names.

    Raises:
        ShardingError: for a malformed rule, a logical name with no rule, or a name whose every rule is
            blocked by axes earlier dims took (naming both logical names, the axis and the leaf path).

    Example:
        >>> rules = [("batch", ("dp", "fsdp")), ("embed", "fsdp"), ("embed", None), ("mlp", "tp")]
        >>> logical_to_mesh({"x": P("batch", "embed"), "w1": P("embed", "mlp")}, rules)
        {'x': P(('dp', 'fsdp'), None), 'w1': P('fsdp', 'tp')}
    """
    grouped = _group_logical_rules(rules)
    if isinstance(logical_specs, P):
        return _map_spec(logical_specs, grouped, mesh, "")
    out = []
    for path, leaf in leaves_with_path(logical_specs, is_leaf=is_spec):
        if not isinstance(leaf, P):
            raise ShardingError(
                f"{_at('logical_to_mesh', path)}: expected a spec P(...) of logical axis names, found {leaf!r} "
                f"(type {type(leaf).__name__}); write e.g. P('batch', 'embed')."
            )
        out.append(_map_spec(leaf, grouped, mesh, path))
    _, treespec = flatten(logical_specs, is_leaf=is_spec)
    return unflatten(treespec, out)
