"""A transformer block (RMSNorm, causal multi-head attention, GELU MLP) as pure functions, shardable with
TP, TP+SP, FSDP, FSDP+TP and HSDP. The tests, the communication benchmark and the notebooks use it to
compare each parallel style with the unsharded block and with the communication theory.

A mode is a name for a parallel plan on a fixed 4-device mesh (:func:`plan_for`): the block itself is
:func:`funcshard.models.transformer.transformer_block`, the Llama's decoder layer, with a GELU MLP and no
RoPE. There is no second copy of it here.

Example:
    >>> import torch, funcshard as fs
    >>> cfg = BlockConfig(dim=16, heads=4, ffn=32)
    >>> p = init(cfg, seed=0)
    >>> x = torch.randn(2, 8, 16)
    >>> mesh = fs.make_mesh({"tp": 2}, backend="sim")
    >>> f = fs.shard_map(lambda p, x: loss(p, x, cfg, "tp"), mesh=mesh,
    ...                  in_specs=(param_specs("tp"), batch_spec("tp")), out_specs=fs.P())
    >>> torch.allclose(fs.device_get(f(p, x)), loss(p, x, cfg, None), atol=1e-6)
    True
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import lax
from ..extend import P, ShardingError
from .plan import ParallelPlan, plan_from_mesh
from .transformer import transformer_block, use_params

__all__ = [
    "MODES",
    "BlockConfig",
    "batch_spec",
    "comm_theory",
    "forward",
    "init",
    "loss",
    "mesh_shape",
    "param_specs",
    "plan_for",
]

MODES = ("tp", "tp_sp", "fsdp", "fsdp_tp", "hsdp")
_NAMES = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w1", "w2")
_EPS = 1e-6  # RMSNorm's epsilon
# the parameters' layouts in role names: column-parallel, row-parallel, norms
_LOGICAL = {"col": P("tp", "fsdp"), "row": P("fsdp", "tp"), "norm": P("fsdp")}
_KIND = {"attn_norm": "norm", "wq": "col", "wk": "col", "wv": "col", "wo": "row", "mlp_norm": "norm"}
_KIND |= {"w1": "col", "w2": "row"}


@dataclass(frozen=True)
class BlockConfig:
    """Sizes of the block: model dim, attention heads (head dim = dim / heads), MLP hidden size.

    Example:
        >>> BlockConfig(dim=16, heads=4, ffn=32)
        BlockConfig(dim=16, heads=4, ffn=32)
    """

    dim: int = 64
    heads: int = 4
    ffn: int = 256


def init(cfg: BlockConfig, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters, F.linear layout ``[out, in]``.

    Args:
        cfg: the block's sizes.
        seed: seeds the ``torch.Generator`` the weights are drawn from.

    Returns:
        ``{"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w1", "w2"}`` as full tensors.

    Example:
        >>> p = init(BlockConfig(dim=16, heads=4, ffn=32), seed=0)
        >>> p["w1"].shape, p["w2"].shape  # [ffn, dim], [dim, ffn]
        (torch.Size([32, 16]), torch.Size([16, 32]))
    """
    g = torch.Generator().manual_seed(seed)
    d, f = cfg.dim, cfg.ffn

    def w(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i, generator=g) / i**0.5

    return {
        "attn_norm": 1 + 0.1 * torch.randn(d, generator=g),
        "wq": w(d, d),
        "wk": w(d, d),
        "wv": w(d, d),
        "wo": w(d, d),
        "mlp_norm": 1 + 0.1 * torch.randn(d, generator=g),
        "w1": w(f, d),
        "w2": w(d, f),
    }


def mesh_shape(mode: str) -> dict[str, int]:
    """The 4-device mesh each mode is shown on.

    Args:
        mode: one of :data:`MODES`.

    Returns:
        ``{axis: size}`` for ``fs.make_mesh``.

    Raises:
        ShardingError: an unknown mode.

    Example:
        >>> mesh_shape("fsdp_tp")
        {'fsdp': 2, 'tp': 2}
    """
    return {
        "tp": {"tp": 4},
        "tp_sp": {"tp": 4},
        "fsdp": {"fsdp": 4},
        "fsdp_tp": {"fsdp": 2, "tp": 2},
        "hsdp": {"dp": 2, "fsdp": 2},
    }[_check(mode)]


def _check(mode: str | None) -> str | None:
    if mode is not None and mode not in MODES:
        raise ShardingError(f"block: unknown parallel mode {mode!r}; use one of {MODES} or None (unsharded).")
    return mode


@functools.lru_cache(maxsize=len(MODES) + 1)
def plan_for(mode: str | None) -> ParallelPlan:
    """The parallel plan a mode names, on the mesh of :func:`mesh_shape` (``ParallelPlan()`` for None).

    Args:
        mode: one of :data:`MODES`, or None (unsharded).

    Returns:
        The validated plan: ``tp`` on axis ``"tp"`` (with ``sp`` for ``"tp_sp"``), ``fsdp`` on ``"fsdp"``,
        ``dp`` on ``"dp"`` (HSDP's replicas).

    Raises:
        ShardingError: an unknown mode.

    Example:
        >>> plan = plan_for("hsdp")
        >>> plan.dp, plan.fsdp, plan.tp
        ('dp', 'fsdp', None)
    """
    if _check(mode) is None:
        return ParallelPlan()
    return plan_from_mesh(mesh_shape(mode), sequence_parallel=mode == "tp_sp")


def param_specs(mode: str | None) -> dict[str, P]:
    """The parameters' layout for ``mode``: column-parallel q/k/v/w1, row-parallel o/w2 under TP; the
    other weight dim (and the norms) over ``fsdp`` under FSDP.

    Args:
        mode: one of :data:`MODES`, or None (unsharded: specs with no mesh axes).

    Returns:
        One ``P`` spec per parameter name of :func:`init`.

    Raises:
        ShardingError: an unknown mode.

    Example:
        >>> specs = param_specs("fsdp_tp")
        >>> specs["wq"], specs["wo"]  # column-parallel, row-parallel
        (P('tp', 'fsdp'), P('fsdp', 'tp'))
    """
    return dict(_param_specs(mode))


@functools.lru_cache(maxsize=len(MODES) + 1)
def _param_specs(mode: str | None) -> dict[str, P]:
    kinds = plan_for(mode).to_mesh(_LOGICAL)  # role names -> the mode's axes
    return {name: kinds[kind] for name, kind in _KIND.items()}


def batch_spec(mode: str | None) -> P:
    """The layout of a ``[batch, seq, dim]`` input: batch over the data axes, seq over tp under SP.

    Args:
        mode: one of :data:`MODES`, or None (unsharded).

    Returns:
        The ``P`` spec of the input.

    Raises:
        ShardingError: an unknown mode.

    Example:
        >>> batch_spec("tp_sp"), batch_spec("hsdp")
        (P(None, 'tp'), P(('dp', 'fsdp')))
    """
    plan = plan_for(mode)
    batch = plan.batch_axes
    entries = [batch if len(batch) > 1 else batch[0] if batch else None, plan.sp_axis]  # [batch, seq]
    while entries and entries[-1] is None:  # written as short as it reads: P() when replicated
        entries.pop()
    return P(*entries)


def forward(p: dict[str, torch.Tensor], x: torch.Tensor, cfg: BlockConfig, mode: str | None) -> torch.Tensor:
    """The block on local shards (inside shard_map) or, with ``mode=None``, on full tensors.

    Args:
        p: the parameters of :func:`init` (local blocks of :func:`param_specs` inside shard_map).
        x: ``[batch, seq, dim]`` input (local block of :func:`batch_spec` inside shard_map).
        cfg: the block's sizes.
        mode: the parallel mode the shard_map's mesh and specs follow, or None (full tensors).

    Returns:
        The block's output, laid out like ``x``.

    Example:
        >>> import torch
        >>> cfg = BlockConfig(dim=16, heads=4, ffn=32)
        >>> forward(init(cfg), torch.randn(2, 8, 16), cfg, None).shape
        torch.Size([2, 8, 16])
    """
    plan = plan_for(mode)
    p = use_params(p, _param_specs(mode), plan)  # FSDP: [.., d/fsdp, ..] -> [.., d, ..]; HSDP: varying over dp
    return transformer_block(x, p, plan, head_dim=cfg.dim // cfg.heads, norm_eps=_EPS, mlp="gelu")  # [b, s(/tp), d]


def loss(p: dict[str, torch.Tensor], x: torch.Tensor, cfg: BlockConfig, mode: str | None) -> torch.Tensor:
    """Mean of the block's output squared over the global batch (invariant over every mesh axis).

    Args:
        p: the parameters of :func:`init` (local blocks of :func:`param_specs` inside shard_map).
        x: ``[batch, seq, dim]`` input (local block of :func:`batch_spec` inside shard_map).
        cfg: the block's sizes.
        mode: the parallel mode the shard_map's mesh and specs follow, or None (full tensors).

    Returns:
        A 0-dim tensor, the same on every device.

    Example:
        >>> import torch, funcshard as fs
        >>> cfg = BlockConfig(dim=16, heads=4, ffn=32)
        >>> p, x = init(cfg), torch.randn(4, 8, 16)
        >>> mesh = fs.make_mesh(mesh_shape("fsdp"), backend="sim")
        >>> f = fs.shard_map(lambda p, x: loss(p, x, cfg, "fsdp"), mesh=mesh,
        ...                  in_specs=(param_specs("fsdp"), batch_spec("fsdp")), out_specs=fs.P())
        >>> torch.allclose(fs.device_get(f(p, x)), loss(p, x, cfg, None), atol=1e-6)
        True
    """
    plan = plan_for(mode)
    local = forward(p, x, cfg, mode).pow(2).mean()  # [b, s(/tp), d] -> []
    spread = plan.data_axes + ((plan.sp_axis,) if plan.sp_axis else ())  # the axes x is split over
    return lax.pmean(local, spread) if spread else local  # [] -> [], over the shards of x


def comm_theory(
    cfg: BlockConfig, mode: str, *, batch: int, seq: int, itemsize: int = 4
) -> dict[tuple[str, str], tuple[int, int]]:
    """The minimum communication of one forward + backward of :func:`loss`, per device:
    ``{(collective, axis): (calls, bytes)}`` with bytes counted as ``fs.comm_stats`` does (the input
    payload on one device).

    - TP: Megatron's two all-reduces of the ``b*s*d`` activation forward (attention and MLP outputs) and
      two backward (their inputs' gradients).
    - TP+SP: each all-reduce becomes an all-gather (payload ``b*s/tp*d``) and a reduce-scatter (payload
      ``b*s*d``), forward and backward; the replicated norm weights' gradients are all-reduced over tp.
    - FSDP: one all-gather per parameter forward (payload: the shard) and one reduce-scatter per parameter
      backward (payload: the full parameter); HSDP adds one bucketed all-reduce of the gradient shards over
      ``dp``.

    Args:
        cfg: the block's sizes.
        mode: one of :data:`MODES` (on the mesh of :func:`mesh_shape`).
        batch: global batch size.
        seq: sequence length.
        itemsize: bytes per element.

    Returns:
        ``{(collective, axis): (calls, bytes)}`` for one device.

    Example:
        >>> comm_theory(BlockConfig(dim=16, heads=4, ffn=32), "tp", batch=2, seq=8)  # 4 x (2*8*16 floats)
        {('psum', 'tp'): (4, 4096)}
    """
    shape = mesh_shape(mode)
    d, f = cfg.dim, cfg.ffn
    sizes = {
        "attn_norm": d,
        "wq": d * d,
        "wk": d * d,
        "wv": d * d,
        "wo": d * d,
        "mlp_norm": d,
        "w1": f * d,
        "w2": d * f,
    }
    out: dict[tuple[str, str], tuple[int, int]] = {}

    def add(name: str, axis: str, calls: int, elems: int) -> None:
        c, b = out.get((name, axis), (0, 0))
        out[(name, axis)] = (c + calls, b + calls * elems * itemsize)

    tp = shape.get("tp", 1)
    data = shape.get("fsdp", 1) * shape.get("dp", 1)
    act = (batch // data) * seq * d  # activation elements on one device
    if mode == "tp":
        add("psum", "tp", 4, act)
    if mode == "fsdp_tp":
        add("psum", "tp", 4, act)
    if mode == "tp_sp":
        add("all_gather", "tp", 4, act // tp)
        add("psum_scatter", "tp", 4, act)
        add("psum", "tp", 2, d)  # the two norm weights' gradients
        add("pmean", "tp", 1, 1)
    if mode in ("fsdp", "fsdp_tp", "hsdp"):
        n = shape["fsdp"]
        shards = 0
        buckets: dict[bool, int] = {}  # one collective per bucket: the leaves that vary over the same axes
        for name in _NAMES:
            norm = name in ("attn_norm", "mlp_norm")
            full = sizes[name] // (tp if not norm else 1)
            key = norm and mode == "fsdp_tp"  # the norms are replicated over tp, the rest sharded
            buckets[key] = buckets.get(key, 0) + full
            shards += full // n
        for full in buckets.values():
            add("all_gather", "fsdp", 1, full // n)
            add("psum_scatter", "fsdp", 1, full)
        if mode == "hsdp":
            add("psum", "dp", 1, shards)  # one bucketed all-reduce of every gradient shard
        if mode == "hsdp":
            out[("pmean", "dp,fsdp")] = (1, itemsize)
        else:
            add("pmean", "fsdp", 1, 1)
    return out
