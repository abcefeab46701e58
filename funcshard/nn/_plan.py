"""Tensor-parallel plans for any module: patterns to styles, checked once, and the specs they give each parameter.

A plan maps module path patterns (``"model.layers.*.self_attn.q_proj"``; ``*`` is one path component) to Hugging
Face's style names. A pattern matches a submodule's full dotted path, or, for a Hugging Face model, its path
inside the base model (``"layers.*.mlp.up_proj"`` names ``model.layers.0.mlp.up_proj`` of a ``LlamaForCausalLM``, as
``config.base_model_tp_plan`` writes it). The first pattern that matches a path gives its style.

Specs (one per parameter): ``colwise`` shards a linear's output features (``weight`` ``P("tp", None)``, ``bias``
``P("tp")``), ``rowwise`` its input features (``P(None, "tp")``, the bias replicated), ``vocab`` an embedding's rows;
an ``fsdp`` axis shards dim 0 of every parameter (minor to ``tp`` where both split it: ``P(("tp", "fsdp"), None)``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..extend import ConfigError, P, ShardingError
from ._instances import tied_names

__all__ = [
    "ALIASES",
    "AXES",
    "STYLES",
    "Layout",
    "default_plan",
    "fsdp_unit_paths",
    "layout",
    "resolve_plan",
    "tie_styles",
]

STYLES = (
    "colwise",
    "rowwise",
    "colwise_rep",
    "rowwise_rep",
    "vocab",
    "replicated_with_grad_allreduce",
    "sequence_parallel",
)
# Hugging Face's other spellings of the same styles (a model's ``tp_plan`` uses them)
ALIASES = {"colwise_gather_output": "colwise_rep", "embedding_rowwise": "vocab"}
AXES = ("dp", "fsdp", "tp")  # the mesh axes parallelize knows: data (replicated params), fully sharded, tensor
_GRAD_OVER_TP = ("replicated_with_grad_allreduce", "sequence_parallel")
_LINEAR = ("colwise", "rowwise", "colwise_rep", "rowwise_rep")


@dataclass(frozen=True)
class Layout:
    """What a plan gives on a mesh, once: each planned submodule's style, each parameter's spec, the axes each
    parameter's gradient is summed over (where it is replicated while its inputs vary), the batch spec."""

    styles: dict[str, str]  # submodule path -> style
    specs: dict[str, P]  # parameter / buffer name -> spec
    replicas: dict[str, tuple[str, ...]]  # parameter name -> axes to make it vary over (gradient summed there)
    tp: str | None
    fsdp: str | None
    data_axes: tuple[str, ...]

    @property
    def batch_spec(self) -> P:
        """The spec of an input whose dim 0 is the batch: split over the data axes (``dp`` then ``fsdp``)."""
        if not self.data_axes:
            return P()
        return P(self.data_axes[0] if len(self.data_axes) == 1 else self.data_axes)


def default_plan(module: nn.Module) -> dict[str, str]:
    """The module's own Hugging Face plan: ``config.base_model_tp_plan`` under the base model's prefix (as the
    model's ``tp_plan`` gives it, with the entries transformers adds: the embedding), and the head's entry of the
    model class (``lm_head``).

    Raises:
        ConfigError: the module has no ``config.base_model_tp_plan``.

    Example:
        >>> default_plan(nn.Linear(2, 2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        funcshard._src.errors.ConfigError: parallelize: plan=None reads config.base_model_tp_plan, ...
    """
    base = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
    if not base:
        raise ConfigError(
            f"parallelize: plan=None reads config.base_model_tp_plan, but the {type(module).__name__} has none; "
            f"pass plan={{'path.pattern': 'colwise', ...}} (styles: {', '.join(STYLES)})."
        )
    full = getattr(module, "tp_plan", None)
    if isinstance(full, dict) and full:
        return dict(full)
    prefix = _base_prefix(module)
    plan = {prefix + k: v for k, v in base.items()}
    for k, v in (getattr(type(module), "_tp_plan", None) or {}).items():
        plan.setdefault(k, v)
    return plan


def _base_prefix(module: nn.Module) -> str:
    """``"model."`` for a Hugging Face model whose base model is ``module.model``; ``""`` otherwise."""
    prefix = getattr(module, "base_model_prefix", "")
    return f"{prefix}." if prefix and isinstance(getattr(module, prefix, None), nn.Module) else ""


def _pattern(pat: str) -> re.Pattern[str]:
    return re.compile(".".join("[^.]+" if part == "*" else re.escape(part) for part in pat.split(".")))


def resolve_plan(module: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``{submodule path: style}`` for a plan: every pattern must name a submodule and a known style, and the
    style must fit the submodule's type.

    Raises:
        ConfigError: a pattern naming no submodule, an unknown style, or a style the submodule cannot take.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        >>> resolve_plan(mlp, {"0": "colwise", "2": "rowwise"})
        {'0': 'colwise', '2': 'rowwise'}
    """
    if not isinstance(plan, dict):
        raise ConfigError(f"parallelize: plan must be a dict of path pattern -> style, found {type(plan).__name__}.")
    prefix = _base_prefix(module)
    paths = [(p, m) for p, m in module.named_modules() if p]
    out: dict[str, str] = {}
    for pat, style in plan.items():
        canon = ALIASES.get(style, style)
        if canon not in STYLES:
            raise ConfigError(
                f"parallelize: the plan gives {pat!r} the style {style!r}, which parallelize does not know; "
                f"the styles are {', '.join(STYLES)}."
            )
        rx, hits = _pattern(pat), 0
        for path, mod in paths:
            inner = path[len(prefix) :] if prefix and path.startswith(prefix) else None
            if rx.fullmatch(path) or (inner is not None and rx.fullmatch(inner)):
                hits += 1
                if path not in out:
                    out[path] = _fit(canon, mod, path)
        if not hits:
            example = next((p for p, m in paths if not list(m.children())), paths[0][0] if paths else "")
            raise ConfigError(
                f"parallelize: the plan's pattern {pat!r} names no submodule of the {type(module).__name__} "
                f"(paths look like {example!r}; '*' stands for one path component)."
            )
    return out


def fsdp_unit_paths(module: nn.Module, units: list[str] | tuple[str, ...] | None = None) -> list[str]:
    """The paths of the submodules that are FSDP units (each gathered as one bucket just before it runs), outermost
    first; the root (``""``) is always one, for the parameters no other unit holds.

    ``units`` are path patterns (as a plan's: ``"model.layers.*"``; ``*`` is one path component) or class names;
    ``None``: the module's Hugging Face ``_no_split_modules`` classes (its decoder layers), or, for a module that
    names none, the root's direct children. A unit inside another unit is not one (its parameters are the outer's).

    Raises:
        ConfigError: a pattern naming no submodule.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        >>> fsdp_unit_paths(mlp), fsdp_unit_paths(mlp, ["2"]), fsdp_unit_paths(mlp, ["Linear"])
        (['', '0', '1', '2'], ['', '2'], ['', '0', '2'])
    """
    paths = [(p, m) for p, m in module.named_modules() if p]
    if units is None:
        classes = set(getattr(module, "_no_split_modules", None) or ())
        hits = [p for p, m in paths if type(m).__name__ in classes]
        if not hits:
            hits = [p for p, _ in module.named_children()]
    else:
        prefix = _base_prefix(module)
        hits = []
        for pat in units:
            rx = _pattern(pat)
            found = [
                p
                for p, m in paths
                if type(m).__name__ == pat
                or rx.fullmatch(p)
                or (prefix and p.startswith(prefix) and rx.fullmatch(p[len(prefix) :]))
            ]
            if not found:
                raise ConfigError(
                    f"parallelize: the fsdp unit {pat!r} names no submodule or class of the {type(module).__name__}; "
                    f"give path patterns ('model.layers.*') or class names ('LlamaDecoderLayer')."
                )
            hits.extend(found)
    chosen = set(hits)
    out = [""]
    for p, _ in paths:  # module order; a unit inside an earlier one is left out
        if p in chosen and not any(p.startswith(q + ".") for q in out if q):
            out.append(p)
    return out


def _fit(style: str, mod: nn.Module, path: str) -> str:
    """``style`` for ``mod`` (``rowwise`` of an embedding is ``vocab``), or ConfigError if it cannot take it."""
    if isinstance(mod, nn.Embedding):
        style = "vocab" if style == "rowwise" else style
        if style in ("vocab", "colwise", *_GRAD_OVER_TP):
            return _own_forward(mod, nn.Embedding, path, style) if style == "vocab" else style
    elif isinstance(mod, nn.Linear):
        if style in (*_LINEAR, *_GRAD_OVER_TP):
            return _own_forward(mod, nn.Linear, path, style) if style in _LINEAR else style
    elif style in _GRAD_OVER_TP:
        return style
    raise ConfigError(
        f"parallelize: the plan gives {path!r} ({type(mod).__name__}) the style {style!r}, which applies to "
        + ("torch.nn.Embedding only" if style == "vocab" else "torch.nn.Linear (or torch.nn.Embedding)")
        + f"; a {type(mod).__name__} can take {', '.join(_GRAD_OVER_TP)}."
    )


def tie_styles(module: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    """``styles`` with the unplanned user of a tied weight given the split of its planned other user: an embedding
    tied to a vocab-split head is ``vocab``, a linear tied to a vocab-split embedding ``colwise_rep``.

    Example:
        >>> m = nn.Sequential(nn.Embedding(8, 2), nn.Linear(2, 8, bias=False))
        >>> m[1].weight = m[0].weight
        >>> tie_styles(m, {"1": "colwise"})
        {'1': 'colwise', '0': 'vocab'}
    """
    out = dict(styles)
    mods = dict(module.named_modules())
    for alias, kept in tied_names(module).items():
        a, b = alias.rpartition(".")[0], kept.rpartition(".")[0]
        for planned, other in ((a, b), (b, a)):
            mod, style = mods.get(other), out.get(planned)
            if other in out or style is None or _tp_dim(mods[planned], style, "weight") != 0:
                continue
            if isinstance(mod, nn.Embedding):
                out[other] = "vocab"
            elif isinstance(mod, nn.Linear):
                out[other] = "colwise_rep"
    return out


def _own_forward(mod: nn.Module, base: type[nn.Module], path: str, style: str) -> str:
    """``style``, or ConfigError where it would replace the forward of a subclass that has its own."""
    if type(mod).forward is not base.forward:
        raise ConfigError(
            f"parallelize: {path!r} is a {type(mod).__name__}, a {base.__name__} with its own forward; the style "
            f"{style!r} replaces {base.__name__}.forward, which would drop what the subclass adds. Leave it out of "
            f"the plan, or give it 'replicated_with_grad_allreduce'."
        )
    if isinstance(mod, nn.Embedding) and (mod.max_norm is not None or mod.sparse):
        raise ConfigError(f"parallelize: {path!r}: an embedding with max_norm or sparse=True cannot be split.")
    return style


def _tp_dim(mod: nn.Module, style: str | None, attr: str) -> int | None:
    """The dim of ``mod``'s parameter ``attr`` that ``style`` splits over ``tp`` (None: replicated)."""
    if style is None or style in _GRAD_OVER_TP:
        return None
    if isinstance(mod, nn.Embedding):
        return 0 if style == "vocab" else 1 if attr == "weight" else None
    if style in ("colwise", "colwise_rep"):
        return 0
    return 1 if attr == "weight" else None  # rowwise: the bias is added once, after the sum


def check_mesh(mesh: Any) -> None:
    """ShardingError for an axis parallelize does not know."""
    for a in mesh.axis_names:
        if a not in AXES:
            raise ShardingError(
                f"parallelize: the mesh {dict(mesh.shape)} has axis {a!r}; parallelize knows {', '.join(AXES)} "
                f"(dp: the batch, parameters replicated; fsdp: the batch, parameters sharded; tp: tensor parallel)."
            )


def _check_heads(module: nn.Module, tp: int) -> None:
    """ShardingError where ``tp`` would split an attention head (a Hugging Face config's head counts)."""
    cfg = getattr(module, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(cfg, field, None)
        if isinstance(n, int) and n % tp:
            raise ShardingError(
                f"parallelize: config.{field}={n} is not divisible by tp={tp}, so a tensor-parallel shard would "
                f"split a head; choose tp dividing {field}."
            )


def layout(module: nn.Module, mesh: Any, styles: dict[str, str]) -> Layout:
    """The specs and gradient-sum axes of every parameter of ``module`` for ``styles`` on ``mesh``.

    Raises:
        ShardingError: an unknown mesh axis, a head split by ``tp``, a dim its axes do not divide, or a tied
            parameter given two different layouts.
    """
    check_mesh(mesh)
    shape = dict(mesh.shape)
    tp = "tp" if "tp" in shape else None
    fsdp = "fsdp" if "fsdp" in shape else None
    data = tuple(a for a in ("dp", "fsdp") if a in shape)
    if tp is not None and styles:
        _check_heads(module, shape[tp])
    alias = tied_names(module)
    specs: dict[str, P] = {}
    replicas: dict[str, tuple[str, ...]] = {}
    for path, mod in module.named_modules():
        style = styles.get(path) if tp is not None else None
        for attr, t in mod.named_parameters(prefix="", recurse=False):
            full = f"{path}.{attr}" if path else attr
            name = alias.get(full, full)
            spec = _spec(t, _tp_dim(mod, style, attr), tp, fsdp, shape, name, mesh)
            if name in specs and specs[name] != spec:
                raise ShardingError(
                    f"parallelize: the tied parameter {name!r} (also {full!r}) is laid out as {specs[name]!r} by one "
                    f"use and {spec!r} by another; give the modules that share it styles that split it alike."
                )
            specs[name] = spec
            grad_tp = (tp,) if style in _GRAD_OVER_TP else ()
            sharded_fsdp = fsdp is not None and t.dim() > 0
            replicas[name] = tuple(a for a in data if not (a == fsdp and sharded_fsdp)) + grad_tp
        for attr, _ in mod.named_buffers(prefix="", recurse=False):
            full = f"{path}.{attr}" if path else attr
            specs.setdefault(alias.get(full, full), P())
    return Layout(styles if tp is not None else {}, specs, replicas, tp, fsdp, data)


def _spec(
    t: torch.Tensor, tp_dim: int | None, tp: str | None, fsdp: str | None, shape: dict, name: str, mesh: Any
) -> P:
    """The spec of one parameter: ``tp`` on ``tp_dim``, ``fsdp`` on dim 0 (minor to ``tp`` there); checked."""
    entries: list[Any] = [None] * t.dim()
    if tp_dim is not None:
        entries[tp_dim] = tp
    if fsdp is not None and t.dim() > 0:
        entries[0] = (tp, fsdp) if entries[0] == tp and tp is not None else fsdp
    while entries and entries[-1] is None:
        entries.pop()
    spec = P(*entries)
    for d, e in enumerate(entries):
        axes = (e,) if isinstance(e, str) else tuple(e or ())
        n = math.prod(shape[a] for a in axes)
        if n > 1 and t.shape[d] % n:
            raise ShardingError(
                f"parallelize: parameter {name!r} of shape {tuple(t.shape)} gets spec {spec!r} on mesh "
                f"{dict(mesh.shape)}, but dim {d} ({t.shape[d]}) is not divisible by {' x '.join(axes)} = {n}; "
                f"choose axis sizes that divide it, or leave its module out of the plan."
            )
    return spec
