"""How the Llama's parameters and batches are laid out over the axes of a parallel plan.

Rules (t5x / MaxText style, regex on the leaf path) are written with role names as axis names: vocab and
the output features of q/k/v/gate/up are split over ``tp`` (column-parallel), the input features of o/down
over ``tp`` (row-parallel); ``fsdp`` splits each weight's outer (row) dim, minor to ``tp`` where both split it
(``P(("tp", "fsdp"), None)``: what a device gathers over ``fsdp`` is then a contiguous block of rows, as FSDP2's
``Shard(0)``, so unpacking a gathered bucket and packing its gradient move whole rows; a tp-split dim that
``tp x fsdp`` does not divide, e.g. an odd vocabulary, keeps ``fsdp`` on the inner dim instead), and the norms
over ``fsdp``; the stacked layer dim over ``pp`` (natural layer order, so stage ``r`` holds a contiguous block of
layers and a checkpoint loads into a mesh with or without ``pp``: checkpoints hold global tensors, whatever the
layout; embedding, final norm and head are replicated over ``pp``). The batch dim goes over ``dp`` and ``fsdp``
(and ``ep``, which the Llama, having no experts, runs as one more data axis), the sequence over ``cp``. A
:class:`~funcshard.models.ParallelPlan` turns each role into the mesh axis that plays it (``logical_to_mesh``),
dropping the roles that are off, so one rule set serves every mesh, whatever its axes are called. Without a plan,
each role is played by the mesh axis of its own name (``dp``, ``fsdp``, ``tp``, ``cp``, ``pp``, ``ep``).

Example:
    >>> import funcshard as fs
    >>> from funcshard.models import plan_from_mesh
    >>> from funcshard.models.llama import Config
    >>> cfg = Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    >>> param_specs(cfg, fs.make_mesh({"dp": 2, "tp": 2}, backend="sim"))["layers"]["wq"]
    P(None, 'tp', None)
    >>> mesh = fs.make_mesh({"data": 2, "model": 2}, backend="sim")
    >>> param_specs(cfg, mesh, plan_from_mesh(mesh, {"dp": "data", "tp": "model"}))["layers"]["wq"]
    P(None, 'model', None)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from ...extend import ConfigError, P, ShardingError, spec_rules
from ...pipeline.schedules import Schedule, ScheduleError, by_name
from ..plan import ParallelPlan, plan_from_mesh
from .config import Config

__all__ = [
    "INNER",
    "RULES",
    "batch_spec",
    "check_mesh",
    "heads_fit",
    "kv_rules",
    "kv_shared",
    "model_plan",
    "param_shapes",
    "param_specs",
    "pipeline_schedule",
    "rule_specs",
    "specs_for",
]

# the roles the Llama plays (and, without a plan, the axes' names); it has no experts: an ``ep`` axis is one more
# data axis (the batch split over it, the gradients summed over it), as ``dp``
KNOWN_AXES = ("dp", "fsdp", "tp", "cp", "pp", "ep")
BATCH = P(("dp", "fsdp", "ep"), "cp")  # a [batch, seq] token tensor, in role names

RULES = [
    (r"embed", P(("tp", "fsdp"), None)),
    (r"head", P(("tp", "fsdp"), None)),
    (r"norm", P("fsdp")),
    (r"layers/(attn|mlp|q|k)_norm", P("pp", "fsdp")),
    (r"layers/(wq|wk|wv|w1|w3)", P("pp", ("tp", "fsdp"), None)),
    (r"layers/(wo|w2)", P("pp", "fsdp", "tp")),
]
# where ``tp x fsdp`` does not divide a rule's split dim (e.g. an odd vocabulary over fsdp): ``fsdp`` on the other
# dim (then each gathered piece is a column block: unpacking and the gradient's packing copy strided pieces)
INNER = {
    "embed": P("tp", "fsdp"),
    "head": P("tp", "fsdp"),
    "layers/(wq|wk|wv|w1|w3)": P("pp", "tp", "fsdp"),
}
# where tp exceeds n_kv_heads (``kv_shared``): wk and wv hold every kv head on each tp device (replicated over
# tp, as torchtitan and Megatron do), their rows over fsdp (columns where fsdp does not divide the rows); in
# front of RULES (the first match wins)
KV_REPLICATED = [(r"layers/(wk|wv)", P("pp", "fsdp", None))]
KV_REPLICATED_INNER = {r"layers/(wk|wv)": P("pp", None, "fsdp")}


def param_shapes(cfg: Config) -> dict[str, Any]:
    """The parameter tree's shapes (``torch.Size`` leaves); layers stacked on a leading dim.

    Args:
        cfg: the model config.

    Returns:
        ``{"embed", "layers": {...}, "norm"}`` (and ``"head"`` unless ``cfg.tie_embeddings``) of ``torch.Size``.

    Example:
        >>> from funcshard.models.llama import Config
        >>> cfg = Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> shapes = param_shapes(cfg)
        >>> shapes["embed"], shapes["layers"]["wk"]  # [vocab, dim], [n_layers, n_kv_heads * head_dim, dim]
        (torch.Size([256, 64]), torch.Size([2, 32, 64]))
    """
    d, f, v, n, hd = cfg.dim, cfg.ffn_dim, cfg.vocab_size, cfg.n_layers, cfg.head_dim
    kv = cfg.n_kv_heads * hd
    layers = {
        "attn_norm": (n, d),
        "wq": (n, cfg.n_heads * hd, d),
        "wk": (n, kv, d),
        "wv": (n, kv, d),
        "wo": (n, d, cfg.n_heads * hd),
        "mlp_norm": (n, d),
        "w1": (n, f, d),
        "w3": (n, f, d),
        "w2": (n, d, f),
    }
    if cfg.qk_norm:  # Qwen3: RMSNorm of each head's queries and keys
        layers |= {"q_norm": (n, hd), "k_norm": (n, hd)}
    tree: dict[str, Any] = {"embed": (v, d), "layers": layers, "norm": (d,)}
    if not cfg.tie_embeddings:
        tree["head"] = (v, d)
    return {
        k: ({a: torch.Size(b) for a, b in val.items()} if isinstance(val, dict) else torch.Size(val))
        for k, val in tree.items()
    }


def _default_roles(mesh: Any) -> dict[str, str]:
    """Each role the Llama plays, by the mesh axis of its own name (the mesh's axes without a plan)."""
    return {r: r for r in KNOWN_AXES if r in mesh.shape}


def kv_shared(cfg: Config, plan: ParallelPlan) -> int:
    """The tp devices that share each kv head: ``tp // n_kv_heads`` where the ``tp`` size exceeds ``n_kv_heads``
    (then ``wk`` and ``wv`` are replicated over tp and device ``i`` uses kv head ``i // kv_shared``, the one its
    query heads group with), else 1 (``wk`` and ``wv`` split by heads over tp).

    Example:
        >>> cfg = Config(dim=64, n_heads=8, n_kv_heads=2)
        >>> kv_shared(cfg, ParallelPlan(tp="tp", mesh_shape=(("tp", 4),))), kv_shared(cfg, ParallelPlan())
        (2, 1)
    """
    tp = plan.size("tp")
    return tp // cfg.n_kv_heads if tp > cfg.n_kv_heads else 1


def kv_rules(
    cfg: Config, plan: ParallelPlan, rules: list[tuple[str, P]], inner: dict[str, P]
) -> tuple[list[tuple[str, P]], dict[str, P]]:
    """``rules`` and ``inner`` with the replicated kv weights' rule in front where ``kv_shared(cfg, plan) > 1``.

    Example:
        >>> cfg = Config(dim=64, n_heads=8, n_kv_heads=2)
        >>> kv_rules(cfg, ParallelPlan(tp="tp", mesh_shape=(("tp", 4),)), RULES, INNER)[0][0]
        ('layers/(wk|wv)', P('pp', 'fsdp', None))
    """
    if kv_shared(cfg, plan) == 1:
        return rules, inner
    return [*KV_REPLICATED, *rules], {**inner, **KV_REPLICATED_INNER}


def heads_fit(cfg: Config, tp: int) -> bool:
    """Whether a ``tp`` axis of size ``tp`` can split the heads: ``n_heads`` divisible by it, and ``n_kv_heads``
    divisible by it or (kv heads replicated over tp) dividing it.

    Example:
        >>> cfg = Config(dim=64, n_heads=8, n_kv_heads=2)
        >>> [tp for tp in (1, 2, 3, 4, 8, 16) if heads_fit(cfg, tp)]
        [1, 2, 4, 8]
    """
    nh, nkv = cfg.n_heads, cfg.n_kv_heads
    return nh % tp == 0 and (nkv % tp == 0 if tp <= nkv else tp % nkv == 0)


def _check_heads(cfg: Config, tp: int, tp_name: str) -> None:
    """ShardingError when the ``tp`` size cannot split the heads: ``n_heads`` not divisible by it, or
    ``n_kv_heads`` neither divisible by it nor dividing it (kv heads replicated over groups of tp devices)."""
    nh, nkv = cfg.n_heads, cfg.n_kv_heads
    if nh % tp:
        raise ShardingError(
            f"llama: n_heads={nh} is not divisible by tp={tp}; choose {tp_name} dividing n_heads (or change n_heads; "
            f"n_kv_heads={nkv} must then divide it or be a multiple of it)."
        )
    if tp <= nkv and nkv % tp:
        raise ShardingError(
            f"llama: n_kv_heads={nkv} is not divisible by tp={tp}; choose {tp_name} dividing n_kv_heads, or a "
            f"multiple of it dividing n_heads={nh} (the kv heads are then replicated over tp)."
        )
    if tp > nkv and tp % nkv:
        raise ShardingError(
            f"llama: tp={tp} is more than n_kv_heads={nkv} but not a multiple of it (n_heads={nh}); each kv head "
            f"serves a group of tp devices, so choose {tp_name} a multiple of n_kv_heads dividing n_heads, or one "
            f"dividing n_kv_heads."
        )


def _check_sizes(cfg: Config, plan: ParallelPlan) -> None:
    """ShardingError when the tp or fsdp size does not divide the model's sizes."""
    tp, fsdp = plan.size("tp"), plan.size("fsdp")
    tp_name = "tp" if plan.tp in (None, "tp") else f"tp (axis {plan.tp!r})"
    # (a vocabulary tp does not divide is split unevenly, as torch.tensor_split splits it)
    _check_heads(cfg, tp, tp_name)
    if cfg.ffn_dim % tp:
        raise ShardingError(
            f"llama: ffn_dim={cfg.ffn_dim} is not divisible by tp={tp}; choose {tp_name} dividing ffn_dim (or change "
            f"ffn_dim)."
        )
    if cfg.dim % fsdp:
        fsdp_name = "fsdp" if plan.fsdp == "fsdp" else f"fsdp (axis {plan.fsdp!r})"
        raise ShardingError(f"llama: dim={cfg.dim} is not divisible by fsdp={fsdp}; choose {fsdp_name} dividing dim.")


def check_mesh(cfg: Config, mesh: Any, plan: ParallelPlan | None = None) -> None:
    """Raise a one-line error saying what to change when the model cannot use ``mesh`` (with ``plan``).

    Args:
        cfg: the model config.
        mesh: the mesh to check (without a plan, its axes among ``dp``, ``fsdp``, ``tp``, ``cp``, ``pp``).
        plan: the parallel plan, from :func:`~funcshard.models.plan_from_mesh`; ``None``: each role played
            by the axis of its own name.

    Raises:
        ShardingError: an axis the model does not use (no plan), or a size that does not divide the model.
        ConfigError: a plan built for another mesh, a ``pp`` size the layers or the schedule cannot use
            (see :func:`pipeline_schedule`), or a plan without sequence parallelism for a config that asks
            for it.

    Example:
        >>> import funcshard as fs
        >>> from funcshard.models.llama import Config
        >>> cfg = Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> check_mesh(cfg, fs.make_mesh({"dp": 2, "tp": 2}, backend="sim"))  # fits: returns None
        >>> check_mesh(cfg, fs.make_mesh({"tp": 8}, backend="sim"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        funcshard._src.errors.ShardingError: llama: n_heads=4 is not divisible by tp=8; choose tp dividing n_heads ...
    """
    if plan is None:
        shape = mesh.shape
        unknown = [a for a in mesh.axis_names if a not in KNOWN_AXES and shape[a] > 1]
        if unknown:
            raise ShardingError(
                f"llama: the mesh has axis {unknown[0]!r} of size {shape[unknown[0]]}, which the Llama does not "
                f"use; use the axes {list(KNOWN_AXES)} (e.g. --mesh dp=2,tp=2). From Python, axes of other names "
                f"take roles through a plan: llama.param_specs(cfg, mesh, plan_from_mesh(mesh, {{'dp': ..., ...}}))."
            )
        plan = ParallelPlan(**_default_roles(mesh), mesh_shape=tuple(shape.items()))
    else:
        plan.check_mesh(mesh, "llama")
        if cfg.sequence_parallel and plan.tp is not None and not plan.sp:
            raise ConfigError(
                "llama: the config has sequence_parallel=True but the plan has no sequence parallelism; build it "
                "with plan_from_mesh(mesh, roles, sequence_parallel=True), or set the config's to False."
            )
    _check_sizes(cfg, plan)
    if plan.pp is not None:
        pipeline_schedule(cfg, plan)


def pipeline_schedule(cfg: Config, plan: ParallelPlan) -> Schedule:
    """The schedule the Llama runs on the plan's ``pp`` axis: ``cfg.pp_schedule`` over ``plan.size("pp")``
    stages and ``cfg.microbatches(pp)`` microbatches, checked against the number of layers.

    Layers stay stacked in natural order, sharded ``P("pp", ...)`` on the layer dim, so stage ``r`` holds
    ``torch.tensor_split``'s block ``r`` of them (earlier stages take one layer more when ``p`` does not divide
    ``n_layers``). The ``p v`` virtual stages of a schedule with ``v`` chunks per stage split the layers the
    same way, in virtual-stage order (:func:`funcshard.pipeline.chunk_layers`; a virtual stage may hold no
    layer when they outnumber the layers, and is then the identity), and
    :func:`funcshard.pipeline.to_chunks` gives each stage its chunks.

    Raises:
        ConfigError: fewer layers than ``pp`` stages (a physical stage with no layer), or a microbatch count
            the schedule cannot run.

    Example:
        >>> import funcshard as fs
        >>> from funcshard.models import plan_from_mesh
        >>> cfg = Config(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32,
        ...              pp_schedule="interleaved")
        >>> pipeline_schedule(cfg, plan_from_mesh(fs.make_mesh({"pp": 2}, backend="sim")))
        Schedule('interleaved_1f1b', n_stages=2, n_microbatches=4, n_virtual=2)
    """
    p = plan.size("pp")
    m = cfg.microbatches(p)
    try:
        sched = by_name(cfg.pp_schedule, p, m)
    except ScheduleError as e:
        raise ConfigError(
            f"llama: pp_schedule={cfg.pp_schedule!r} cannot run pp_microbatches={m} on pp={p}: {e}"
        ) from None
    if cfg.n_layers < p:  # a physical stage with no layer (virtual stages with none are the identity)
        raise ConfigError(
            f"llama: n_layers={cfg.n_layers} is fewer than the pp={p} stages: every stage needs a layer; use "
            f"n_layers >= {p} or a smaller pp."
        )
    return sched


def model_plan(cfg: Config, mesh: Any, plan: ParallelPlan | None = None) -> ParallelPlan:
    """The checked plan the Llama runs with on ``mesh``: ``plan`` itself, or by default each role played by
    the axis of its own name, with sequence parallelism when ``cfg.sequence_parallel`` and there is a ``tp``.

    Args:
        cfg: the model config.
        mesh: the mesh.
        plan: an explicit plan (from :func:`~funcshard.models.plan_from_mesh`), or None.

    Returns:
        The validated :class:`~funcshard.models.ParallelPlan`.

    Raises:
        ShardingError, ConfigError: as :func:`check_mesh`.

    Example:
        >>> import funcshard as fs
        >>> from funcshard.models.llama import Config
        >>> cfg = Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32,
        ...              sequence_parallel=True)
        >>> plan = model_plan(cfg, fs.make_mesh({"dp": 2, "tp": 2}, backend="sim"))
        >>> plan.dp, plan.tp, plan.sp
        ('dp', 'tp', True)
    """
    check_mesh(cfg, mesh, plan)
    if plan is not None:
        return plan
    sp = cfg.sequence_parallel and "tp" in mesh.shape
    return plan_from_mesh(mesh, _default_roles(mesh), sequence_parallel=sp)


def specs_for(cfg: Config, plan: ParallelPlan, mesh: Any = None) -> dict[str, Any]:
    """The parameters' spec tree under ``plan`` (checked against each shape on ``mesh`` when given).

    Example:
        >>> from funcshard.models import ParallelPlan
        >>> from funcshard.models.llama import Config
        >>> cfg = Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> specs_for(cfg, ParallelPlan(fsdp="shard"))["layers"]["wo"]
        P(None, 'shard', None)
    """
    return rule_specs(param_shapes(cfg), *kv_rules(cfg, plan, RULES, INNER), plan, mesh)


def rule_specs(
    shapes: dict[str, Any], rules: list[tuple[str, P]], inner: dict[str, P], plan: ParallelPlan, mesh: Any = None
) -> dict[str, Any]:
    """The spec tree of the parameter ``shapes`` from ``rules`` written in role names (the first pattern that
    matches a leaf's path wins), ``inner[pattern]`` in place of a rule where ``tp x fsdp`` does not divide its
    dim; checked against each shape on ``mesh`` when given. The Llama's specs are ``RULES`` and ``INNER`` on its
    shapes; a model built on it (the Mixtral) adds its own rules in front.

    Example:
        >>> from funcshard.models import ParallelPlan
        >>> rule_specs({"w": torch.Size([4, 8])}, [("w", P("tp", None))], {}, ParallelPlan())
        {'w': P(None, None)}
    """
    sizes = dict(plan.mesh_shape)
    out = []
    for pattern, spec in rules:
        spec = plan.to_mesh(spec)  # role names -> this mesh's axes
        alt = inner.get(pattern)
        if alt is not None and plan.to_mesh(alt) != spec:  # fsdp on: the outer dim where the shape allows
            spec = functools.partial(_outer_or_inner, spec, plan.to_mesh(alt), sizes)
        out.append((pattern, spec))
    return spec_rules(shapes, out, default=None, mesh=mesh)


def _outer_or_inner(outer: P, inner: P, sizes: dict[str, int], path: str, shape: torch.Size) -> P:
    """``outer`` where each dim of ``shape`` splits evenly over its axes (of unknown size: 1), else ``inner``."""
    fits = all(n % math.prod(sizes.get(a, 1) for a in axes) == 0 for n, axes in zip(shape, outer.dim_axes(len(shape))))
    return outer if fits else inner


def param_specs(cfg: Config, mesh: Any, plan: ParallelPlan | None = None) -> dict[str, Any]:
    """The spec tree of the parameters on ``mesh`` (only the axes the plan gives a role).

    Args:
        cfg: the model config.
        mesh: the mesh the parameters are laid out on.
        plan: the parallel plan (:func:`~funcshard.models.plan_from_mesh`); ``None``: each role played by the
            mesh axis of its own name (``dp``, ``fsdp``, ``tp``, ``cp``).

    Returns:
        A tree of ``P`` specs with the structure of ``param_shapes(cfg)``.

    Raises:
        ShardingError: the mesh has an axis the model cannot use, or a size that does not divide the model.
        ConfigError: a plan that does not fit the mesh or the model (see :func:`check_mesh`).

    Example:
        >>> import funcshard as fs
        >>> from funcshard.models.llama import Config
        >>> cfg = Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> specs = param_specs(cfg, fs.make_mesh({"fsdp": 2, "tp": 2}, backend="sim"))
        >>> specs["embed"], specs["layers"]["wq"], specs["layers"]["wo"]  # fsdp: rows, minor to tp
        (P(('tp', 'fsdp'), None), P(None, ('tp', 'fsdp'), None), P(None, 'fsdp', 'tp'))
    """
    return specs_for(cfg, model_plan(cfg, mesh, plan), mesh)  # the parameters are replicated over dp and cp


def batch_spec(mesh: Any, plan: ParallelPlan | None = None) -> P:
    """The spec of a ``[batch, seq]`` token tensor: batch over the data axes (``dp``, ``fsdp``) present,
    the sequence over ``cp`` (context parallelism, contiguous blocks) when there is one.

    Args:
        mesh: the mesh the batch is laid out on.
        plan: the parallel plan; ``None``: each role played by the mesh axis of its own name.

    Returns:
        The ``P`` spec of a ``[batch, seq]`` tensor.

    Example:
        >>> import funcshard as fs
        >>> from funcshard.models import plan_from_mesh
        >>> batch_spec(fs.make_mesh({"dp": 2, "tp": 2}, backend="sim"))
        P('dp', None)
        >>> batch_spec(fs.make_mesh({"dp": 2, "fsdp": 2, "cp": 2}, backend="sim"))
        P(('dp', 'fsdp'), 'cp')
        >>> mesh = fs.make_mesh({"data": 2, "seq": 2}, backend="sim")
        >>> batch_spec(mesh, plan_from_mesh(mesh, {"dp": "data", "cp": "seq"}))
        P('data', 'seq')
    """
    if plan is None:
        plan = ParallelPlan(**_default_roles(mesh))
    else:
        plan.check_mesh(mesh, "llama.batch_spec")
    return plan.to_mesh(BATCH)
