"""The global 2-norm of a sharded pytree, and gradient clipping by it (one psum per distinct axis set)."""

from __future__ import annotations

from typing import Any

import optree
import torch

from .. import lax, pytree
from ..extend import Array, ConfigError, P, ShardingError, get_vma, is_spec, maybe_current, official_vma
from ._base import (
    ClipByGlobalNormState,
    Optimizer,
    PyTree,
    check_like,
    check_nonneg,
    check_state,
    is_array,
    named_leaves,
    scalar_like,
)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def global_norm(tree: PyTree, *, specs: PyTree = None, params: PyTree = None) -> torch.Tensor:
    """The 2-norm of all leaves of ``tree`` taken together, over every shard of the global value.

    Inside ``shard_map``, each leaf's sum of squares is psum-ed over the mesh axes the leaf is sharded on:
    those ``specs`` names (a spec tree prefix of ``tree``) when given, else those of the matching ``params``
    leaf's vma tag, else those of the leaf's own tag. Leaves sharded over the same axes are summed first, so
    there is one psum per distinct axis set (axes of size 1 are skipped). Outside ``shard_map``: no psum.

    Args:
        tree: a pytree of tensors (local shards inside shard_map).
        specs: optional spec tree (prefix) naming each leaf's sharded axes; wins over the tags.
        params: optional tree of the same structure whose tags name the sharded axes (e.g. the params whose
            gradients ``tree`` holds).

    Returns:
        A 0-dim tensor (float32, or float64 for float64 leaves), invariant over every mesh axis.

    Raises:
        ShardingError: ``specs`` or ``params`` do not fit ``tree``, or ``specs`` names an axis the mesh lacks, or
            (``check_vma=False``) a leaf's axes are not known from either.

    Example:
        >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})
        tensor(5.)
    """
    names, leaves, _ = named_leaves("global_norm", "tree", tree)
    if not leaves:
        return torch.zeros(())
    ctx = maybe_current()
    axis_sets: list[tuple[str, ...]] = [()] * len(leaves)
    if ctx is not None:
        mesh = ctx.mesh
        if specs is not None:
            spec_list = pytree.broadcast_prefix(specs, tree, prefix_is_leaf=is_spec, where="global_norm: specs: ")
            raw = []
            for n, s in zip(names, spec_list, strict=True):
                if not isinstance(s, P):
                    raise ShardingError(f"global_norm: specs leaf for '{n}' must be a P(...), found {s!r}.")
                bad = [a for a in s.axes if a not in mesh.shape]
                if bad:
                    raise ShardingError(
                        f"global_norm: specs for '{n}' is {s!r}, which names axis '{bad[0]}' that the mesh "
                        f"{dict(mesh.shape)} lacks; use the param specs of this mesh."
                    )
                raw.append(frozenset(s.axes))
        else:
            p_leaves = check_like("global_norm", "params", params, tree, "tree") if params is not None else None
            raw = []
            for k, g in enumerate(leaves):
                tag = official_vma(p_leaves[k]) if p_leaves is not None else None
                if tag is None:
                    tag = get_vma(g) if ctx.check_vma else official_vma(g)
                if tag is None:  # never taken as invariant: that would give this shard's norm, silently
                    raise ShardingError(
                        f"global_norm: the axes leaf '{names[k]}' is sharded over are unknown: with check_vma=False "
                        f"only shard_map's arguments, the results of collectives and fs.value_and_grad's gradients "
                        f"carry them. Pass specs= (the param specs) or params=, or use check_vma=True."
                    )
                raw.append(tag)
        axis_sets = [tuple(a for a in mesh.axis_names if a in r and mesh.shape[a] > 1) for r in raw]
    groups: dict[tuple[str, ...], torch.Tensor] = {}
    for g, axes in zip(leaves, axis_sets, strict=True):
        sq = torch.sum(torch.square(g.to(_acc_dtype(g.dtype))))  # [*s] -> [], this shard's sum of squares
        groups[axes] = sq if axes not in groups else groups[axes] + sq
    order = {a: i for i, a in enumerate(ctx.mesh.axis_names)} if ctx is not None else {}
    total: torch.Tensor | None = None
    for axes in sorted(groups, key=lambda k: (len(k), [order[a] for a in k])):  # the same order on every device
        s = groups[axes]
        if axes:
            s = lax.psum(s, axes)  # [] -> [], summed over the shards of these leaves
        total = s if total is None else total + s
    return torch.sqrt(total) if total is not None else torch.zeros(())


def clip_by_global_norm(max_norm: float, *, specs: PyTree = None) -> Optimizer:
    """Scale the updates by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` the global 2-norm of all of them.

    As ``torch.nn.utils.clip_grad_norm_``, with the norm over every shard (see :func:`global_norm`): the
    axes a leaf is sharded on come from ``specs`` when given, else from the vma tags of the params (or, with
    no params, of the updates) that ``shard_map`` puts on its inputs. The state keeps the last norm.

    Args:
        max_norm: the largest global norm let through, > 0.
        specs: optional spec tree (prefix) of the updates, for values without tags.

    Returns:
        An :class:`Optimizer`; chain it before the optimiser proper.

    Raises:
        ValueError: ``max_norm`` not a finite number > 0.

    Example:
        >>> clip = clip_by_global_norm(1.0)
        >>> u, state = clip.transform({"a": torch.tensor([3.0, 4.0])}, clip.init(None), None)
        >>> state.norm, u["a"]
        (tensor(5.), tensor([0.6000, 0.8000]))
    """
    fn = "clip_by_global_norm"
    check_nonneg(fn, max_norm=max_norm)
    if max_norm <= 0:
        raise ConfigError(f"{fn}: max_norm must be > 0, found {max_norm!r}.")
    max_norm = float(max_norm)

    def init(params: PyTree) -> ClipByGlobalNormState:
        leaves = [x for x in optree.tree_leaves(params, is_leaf=is_array) if isinstance(x, (torch.Tensor, Array))]
        dtype = torch.float64 if any(x.dtype == torch.float64 for x in leaves) else torch.float32
        return ClipByGlobalNormState(scalar_like(params, 0.0, dtype))

    def transform(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, ClipByGlobalNormState]:
        check_state(fn, state, ClipByGlobalNormState)
        norm = global_norm(grads, specs=specs, params=params)
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # [] as torch: max_norm / (norm + 1e-6) <= 1
        return optree.tree_map(lambda g: g * scale, grads), ClipByGlobalNormState(norm)

    return Optimizer(init, transform, lambda param_specs: ClipByGlobalNormState(P()), name=fn)
