"""One transformer block, written once for every mesh: RMSNorm, attention with column-parallel q/k/v and a
row-parallel output projection, and an MLP (SwiGLU or GELU) column- then row-parallel.

Every op takes its axis from a :class:`~funcshard.models.ParallelPlan`: ``plan.tp`` for the Megatron linears
(``gather_dim`` / ``scatter_dim`` under sequence parallelism), ``plan.cp`` for attention over a split sequence,
``plan.fsdp`` and ``plan.replica_axes`` for the parameters. A role that is off gives ``None``, which the ops of
:mod:`funcshard.ops` take as plain local math, so there is no second, unsharded copy of the block: called with
``ParallelPlan()`` on full tensors it is the single-device block. The Llama (:mod:`funcshard.models.llama`) and
the test block (:mod:`funcshard.models.block`) are both this function.

Example:
    >>> import torch
    >>> from funcshard.models import ParallelPlan
    >>> d, f = 16, 32
    >>> p = {n: torch.ones(d) for n in ("attn_norm", "mlp_norm")}
    >>> p |= {n: torch.randn(d, d) / 4 for n in ("wq", "wk", "wv", "wo")}
    >>> p |= {"w1": torch.randn(f, d) / 4, "w3": torch.randn(f, d) / 4, "w2": torch.randn(d, f) / 6}
    >>> transformer_block(torch.randn(2, 8, d), p, ParallelPlan(), head_dim=4, norm_eps=1e-5).shape
    torch.Size([2, 8, 16])
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from .. import lax
from ..extend import (
    ConfigError,
    Precision,
    block_sizes,
    checkpoint_name,
    find_vma,
    one_op,
    remat_policies,
    set_vma,
    split_invariant,
    transforms_active,
)
from ..extend import (
    remat as rematerialize,
)
from ..extend import (
    tracing as _tracing,
)
from ..ops import (
    column_parallel_linear,
    fsdp_gather,
    layout_positions,
    ring_attention,
    row_parallel_linear,
    zigzag_merge,
    zigzag_split,
)
from .plan import ParallelPlan
from .rope_scaling import RopeScaling

__all__ = [
    "MLPS",
    "REMAT",
    "FeedForward",
    "causal_attention",
    "cp_positions",
    "cp_sizes",
    "from_cp_layout",
    "kv_weights",
    "rms_norm",
    "rope",
    "to_cp_layout",
    "transformer_block",
    "use_params",
]

PyTree = Any


@one_op  # one dispatch through the vma mode, not one per op inside (plain local math)
def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


#: a feed-forward in place of the block's MLP: ``ffn(h, p, plan) -> (y, aux)`` (``transformer_block(ffn=...)``)
FeedForward = Callable[[torch.Tensor, dict[str, torch.Tensor], ParallelPlan], tuple[torch.Tensor, Any]]

# MLP kind -> (the column-parallel weights, the activation applied to their outputs); "w2" is the row-parallel one
MLPS: dict[str, tuple[tuple[str, ...], Callable[..., torch.Tensor]]] = {
    "swiglu": (("w1", "w3"), _swiglu),
    "gelu": (("w1",), F.gelu),
}


# rematerialisation of a block (``transformer_block(..., remat=...)``, the Llama's ``Config.remat``) -> its policy:
# "full" keeps only the block's inputs; "selective" also keeps the weight matmuls' outputs and the attention output
# (named "attn_out") and recomputes the attention core (scores, softmax: the large, cheap part), as Megatron's
# selective recomputation does
REMAT = {
    "none": None,
    "full": remat_policies.nothing_saveable,
    "selective": remat_policies.save_from_both_policies(
        remat_policies.dots_with_no_batch_dims_saveable, remat_policies.save_only_these_names("attn_out")
    ),
}


@one_op  # one dispatch through the vma mode, not one per op inside (plain local math)
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 and returned in ``x``'s dtype, times ``w``.

    Example:
        >>> x = torch.tensor([[3.0, 4.0]])
        >>> rms_norm(x, torch.ones(2), 0.0)  # x / sqrt(mean(x^2)) = x / sqrt(12.5)
        tensor([[0.8485, 1.1314]])
    """
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope_table(
    s: int,
    hd: int,
    theta: float,
    offset: int | torch.Tensor,
    device: torch.device,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's ``cos`` and ``sin`` at positions ``offset .. offset+s-1`` (or at the ``[s]`` positions ``offset``):
    each ``[1, s, 1, hd/2]`` float32; the frequencies scaled by ``scaling`` (Llama 3.1's) when given."""
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd)  # [hd/2]
    if scaling is not None:
        inv = scaling.inv_freq(inv)  # [hd/2]
    if isinstance(offset, torch.Tensor) and offset.dim() == 1:  # [s]: the positions themselves (cp's zigzag)
        pos = offset.to(device=device, dtype=torch.float32)
    else:
        pos = torch.arange(s, dtype=torch.float32, device=device) + offset  # [s]: this device's positions
    ang = pos[:, None] * inv  # [s, 1] * [hd/2] -> [s, hd/2]
    return ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]  # [1, s, 1, hd/2]


#: (s, hd, theta, scaling, offset, device) -> RoPE's (cos, sin): computed once, not twice in each layer of each step
#: (the 13.2M Llama's 16 rope calls a step issued ~220 ops through the vma mode for the same two tables)
_ROPE_TABLES: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
_ROPE_TABLES_MAX = 64  # distinct shapes kept (a sweep over many sequence lengths starts over past this)


def _rope_cached(
    x: torch.Tensor, s: int, hd: int, theta: float, offset: int | torch.Tensor, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_rope_table`, kept from call to call where it is a plain constant: a Python ``int`` offset (not
    cp's traced position), a plain tensor ``x`` and no transform, graph capture or fake / proxy mode around
    (they get the table computed in place, as before). The kept table is made with every mode off (a plain
    untagged tensor: invariant), outside inference mode (it may be saved for a later backward). Same numbers."""
    if (
        type(offset) is not int
        or type(x) is not torch.Tensor
        or transforms_active()
        or torch.compiler.is_compiling()
        or torch.is_inference_mode_enabled()
        or _tracing()
        or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
        or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None
    ):
        return _rope_table(s, hd, theta, offset, x.device, scaling)
    key = (s, hd, float(theta), scaling, offset, x.device)
    hit = _ROPE_TABLES.get(key)
    if hit is None:
        with torch._C.DisableTorchFunction(), _disable_current_modes(), torch.no_grad():
            hit = _rope_table(s, hd, theta, offset, x.device, scaling)
        if len(_ROPE_TABLES) >= _ROPE_TABLES_MAX:
            _ROPE_TABLES.clear()
        _ROPE_TABLES[key] = hit
    # handed out as views with their own tag, x's (none: invariant): where x varies (inside shard_map), each of
    # rope's four products has operands of one tag (an invariant constant beside a varying operand takes the vma
    # mode's mixed path, ~17 Python calls an op); the tables need no gradient, so no pvary is owed. An own tag
    # also keeps the mode from looking through a view to the kept table. The same numbers
    axes = find_vma(x) or frozenset()  # (untagged, or an empty Audited set: a plain empty one)
    with torch._C.DisableTorchFunction():
        cos, sin = (t.view_as(t) for t in hit)  # [1, s, 1, hd/2] each, views
    return set_vma(cos, axes), set_vma(sin, axes)


@one_op  # one dispatch through the vma mode, not one per op inside (plain local math)
def rope(
    x: torch.Tensor, theta: float, offset: int | torch.Tensor = 0, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """Rotary embedding of ``x [b, s, heads, hd]`` at positions ``offset .. offset+s-1`` (rotate-half form), or
    at the ``[s]`` positions of a 1-dim ``offset`` (a context-parallel device's, :func:`cp_positions`), its
    frequencies scaled by ``scaling`` (Llama 3.1's, :class:`~funcshard.models.rope_scaling.RopeScaling`).
    The angle tables are computed once per shape and kept (see :func:`_rope_cached`); the numbers are those of
    computing them at each call.

    Example:
        >>> x = torch.randn(1, 4, 2, 8)
        >>> torch.allclose(rope(x, 10000.0)[:, 0], x[:, 0])  # position 0 is not rotated
        True
    """
    s, hd = x.shape[1], x.shape[-1]
    scaled = () if scaling is None else (scaling,)  # (plain RoPE: the five-argument call tests stand in for)
    cos, sin = _rope_cached(x, s, hd, theta, offset, *scaled)  # [1, s, 1, hd/2] each
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)  # float32 at least
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def use_params(
    p: PyTree,
    specs: PyTree,
    plan: ParallelPlan,
    precision: Precision | None = None,
    *,
    prefetch: bool = False,
    experts: Collection[str] = (),
) -> PyTree:
    """Parameters as the computation needs them: gathered over ``plan.fsdp`` (ZeRO-3), and varying over the
    replica axes (``dp``, ``ep``, ``cp``), so their gradients are summed there (one bucketed all-reduce); under
    mixed precision in its compute dtype (gathered in it, gradients reduced in its reduce dtype). With neither
    role on and no precision, ``p`` itself.

    Args:
        p: a tree of local parameter blocks.
        specs: their spec tree (only read when ``plan.fsdp`` is on).
        plan: the parallel plan.
        precision: the mixed-precision policy (``fs.Precision``), or None.
        prefetch: issue the gathers now and return a function giving the tree (``fsdp_gather(prefetch=True)``).
        experts: keys of the dict ``p`` that belong to a mixture-of-experts layer (its experts' weights and its
            router), made varying over :attr:`~funcshard.models.ParallelPlan.expert_replica_axes` only: ``ep``
            splits the experts (their gradients are whole on each device) and the MoE layer makes its router
            varying over ``ep`` itself (:func:`funcshard.ops.moe.moe_ffn`). Gathered apart from the others.

    Returns:
        The tree with the ``fsdp`` axis gathered out of every leaf.

    Example:
        >>> p = {"w": torch.randn(4, 3)}
        >>> use_params(p, None, ParallelPlan()) is p
        True
    """
    if experts and plan.expert_replica_axes != plan.replica_axes:
        return _use_experts_apart(p, specs, plan, precision, experts, prefetch)
    # [.., s/fsdp, ..] -> [.., s, ..]
    return fsdp_gather(
        p, specs, axis=plan.fsdp, replicate_axis=plan.replica_axes, precision=precision, prefetch=prefetch
    )


def kv_weights(
    wk: torch.Tensor, wv: torch.Tensor, plan: ParallelPlan, head_dim: int, kv_shared: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """This device's key and value weights: ``wk`` and ``wv`` themselves (split by heads over ``plan.tp``), or,
    with ``kv_shared > 1`` (``tp`` larger than the kv heads: ``wk`` / ``wv`` hold every kv head, replicated over
    tp), the rows of kv head ``axis_index(tp) // kv_shared``, the head this device's query heads group with (as
    torchtitan and Megatron replicate kv heads). The replicated weights are made varying over tp first
    (``pvary``: identity forward, psum backward), so their gradient is the sum of every tp device's head
    gradient, that of the unsharded model, with ``check_vma`` on or off.

    Args:
        wk: ``[kv_heads(/tp) * hd, d]`` local block of the key weight (``[n_kv_heads * hd, d]`` with ``kv_shared``).
        wv: the value weight, as ``wk``.
        plan: the parallel plan.
        head_dim: the attention head size.
        kv_shared: the tp devices that share each kv head (``llama.sharding.kv_shared``); 1: split by heads.

    Returns:
        ``(wk, wv)``, each ``[kv_heads/tp * hd, d]`` (``[hd, d]`` with ``kv_shared``), varying over tp.

    Example:
        >>> import funcshard as fs
        >>> plan = ParallelPlan(tp="tp", mesh_shape=(("tp", 4),))
        >>> w = torch.arange(8.0).reshape(8, 1)  # 2 kv heads of 4 rows, replicated over tp=4
        >>> f = fs.shard_map(lambda w: kv_weights(w, w, plan, head_dim=4, kv_shared=2)[0],
        ...                  mesh=fs.make_mesh({"tp": 4}, backend="sim"), in_specs=(fs.P(),), out_specs=fs.P("tp"))
        >>> fs.device_get(f(w)).flatten().int().tolist()  # devices 0, 1: head 0; devices 2, 3: head 1
        [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]
        >>> kv_weights(w, w, ParallelPlan(), head_dim=4)[0] is w  # split by heads (or unsharded): as they are
        True
    """
    if kv_shared == 1 or plan.tp is None:
        return wk, wv
    wk, wv = lax.pvary([wk, wv], plan.tp)  # identity forward; backward: one all-reduce of both gradients over tp
    g = lax.axis_index(plan.tp) // kv_shared  # [] varying over tp: this device's kv head
    rows = g * head_dim + torch.arange(head_dim, device=wk.device)  # [hd]: the head's rows
    return wk.index_select(0, rows), wv.index_select(0, rows)  # [n_kv * hd, d] -> [hd, d] each


def _use_experts_apart(
    p: dict[str, Any],
    specs: dict[str, Any],
    plan: ParallelPlan,
    precision: Precision | None,
    experts: Collection[str],
    prefetch: bool,
) -> Any:
    """:func:`use_params` of a dict holding a MoE layer's weights (``experts``: their keys): those gathered varying
    over the expert replica axes, the rest over the replica axes; the dict in ``p``'s key order."""
    rest = [k for k in p if k not in experts]
    groups = [([k for k in p if k in experts], plan.expert_replica_axes), (rest, plan.replica_axes)]
    parts = [
        fsdp_gather(  # [.., s/fsdp, ..] -> [.., s, ..]
            {k: p[k] for k in keys},
            {k: specs[k] for k in keys} if isinstance(specs, dict) else specs,
            axis=plan.fsdp,
            replicate_axis=replicas,
            precision=precision,
            prefetch=prefetch,
        )
        for keys, replicas in groups
        if keys
    ]

    def merged() -> dict[str, Any]:
        done = {k: v for part in parts for k, v in (part() if prefetch else part).items()}
        return {k: done[k] for k in p}

    return merged if prefetch else merged()


def _vary(x: torch.Tensor, axis: str | None) -> torch.Tensor:
    """``pvary`` over ``axis`` (identity forward, psum backward); ``x`` itself when ``axis`` is None."""
    return x if axis is None else lax.pvary(x, axis)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ParallelPlan, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Causal grouped-query attention on ``[b, heads, s, hd]``; with a ``cp`` axis the sequence is split over
    it in ``plan.cp_layout`` (zigzag by default: chunks ``i`` and ``2n-1-i`` of ``2n`` on device ``i``, the
    causal work balanced) and k/v go around the ring. The one place the block calls attention.

    Args:
        q: ``[b, heads, s(/cp), hd]`` queries (``s/cp``: this device's positions in ``plan.cp_layout``).
        k: ``[b, kv_heads, s(/cp), hd]`` keys.
        v: ``[b, kv_heads, s(/cp), hd]`` values.
        plan: the parallel plan.
        sizes: every cp device's local length, if known (:func:`cp_sizes`); default learnt by the ring.

    Returns:
        ``[b, heads, s(/cp), hd]``.

    Example:
        >>> q, kv = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16)
        >>> causal_attention(q, kv, kv, ParallelPlan()).shape
        torch.Size([2, 4, 8, 16])
    """
    # [b, h, s(/cp), hd] x 2 x [b, hkv, s(/cp), hd] -> [b, h, s(/cp), hd]
    return ring_attention(q, k, v, axis=plan.cp, causal=True, layout=plan.cp_layout, sizes=sizes)


def cp_sizes(s: int, plan: ParallelPlan) -> tuple[int, ...] | None:
    """Every ``cp`` device's local sequence length (``torch.tensor_split``'s blocks; this device's is ``s``),
    learnt from the devices only in a call with an uneven argument; None without ``cp``.

    Example:
        >>> cp_sizes(8, ParallelPlan()) is None
        True
    """
    return None if plan.cp is None else tuple(block_sizes(s, plan.cp))


def cp_positions(sizes: Sequence[int] | None, plan: ParallelPlan) -> int | torch.Tensor:
    """This device's global sequence positions, ``[L_i]`` int64 varying over ``cp``, where the devices hold
    ``sizes`` positions laid out by ``plan.cp_layout`` (:func:`funcshard.ops.layout_positions`); 0 (the
    offset of the whole sequence) without ``cp``. What RoPE is given.

    Example:
        >>> cp_positions(None, ParallelPlan())
        0
    """
    if plan.cp is None or sizes is None:
        return 0
    return layout_positions(sizes, lax.axis_index(plan.cp), plan.cp_layout)  # [L_i]: chunks i and 2n-1-i (zigzag)


def to_cp_layout(x: torch.Tensor, plan: ParallelPlan, dim: int = 1) -> torch.Tensor:
    """This device's block of ``x`` along ``dim`` in ``plan.cp_layout``, from its contiguous block
    (``torch.tensor_split``'s): token ids and targets entering a model. Zigzag: the ids all-gathered over ``cp``
    (``[b, L_i] -> [b, s]``, int32 on the wire: ``4 b s (n-1)/n`` bytes received per device), then this device's
    chunks ``i`` and ``2n-1-i`` sliced (no communication); the same length ``L_i``, so no padding. Contiguous,
    or no ``cp``: ``x`` itself.

    Example:
        >>> t = torch.arange(8).view(1, 8)
        >>> to_cp_layout(t, ParallelPlan()) is t
        True
    """
    if plan.cp is None or plan.cp_layout == "contiguous":
        return x
    wire = x.to(torch.int32) if x.dtype == torch.int64 else x  # ids: half the bytes of int64
    full = lax.all_gather_invariant(wire, plan.cp, dim=dim, tiled=True)  # [.., L_i, ..] -> [.., s, ..]
    return zigzag_split(full, plan.cp, dim=dim).to(x.dtype)  # [.., s, ..] -> [.., L_i, ..]: chunks i, 2n-1-i


def from_cp_layout(x: torch.Tensor, plan: ParallelPlan, dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`to_cp_layout` for values (hidden states, logits): this device's contiguous block
    along ``dim`` from its block in ``plan.cp_layout``. Zigzag: an all-gather over ``cp`` put in order
    (``[b, L_i, f] -> [b, s, f]``: ``b s f (n-1)/n`` elements received per device), then this device's
    ``torch.tensor_split`` block (backward: an all-gather of the cotangent blocks, then this device's chunks).

    Example:
        >>> h = torch.randn(1, 8, 4)
        >>> from_cp_layout(h, ParallelPlan()) is h
        True
    """
    if plan.cp is None or plan.cp_layout == "contiguous":
        return x
    full = zigzag_merge(x, plan.cp, dim=dim)  # [.., L_i, ..] -> [.., s, ..] in order, invariant over cp
    return split_invariant(full, plan.cp, dim=dim)  # [.., s, ..] -> [.., L_i, ..]: the contiguous block


def transformer_block(
    x: torch.Tensor,
    p: dict[str, torch.Tensor],
    plan: ParallelPlan,
    *,
    head_dim: int,
    norm_eps: float,
    rope_theta: float | None = None,
    rope_scaling: RopeScaling | None = None,
    mlp: str = "swiglu",
    remat: str = "none",
    gather: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ffn: FeedForward | None = None,
    kv_shared: int = 1,
) -> Any:
    """A pre-norm transformer block on its (gathered) parameters, for any plan.

    Args:
        x: ``[b, s, d]`` hidden states (``[b, s/tp, d]`` under sequence parallelism, ``s/cp`` positions
            with a ``cp`` axis).
        p: ``attn_norm``, ``wq``, ``wk``, ``wv``, ``wo``, ``mlp_norm``, ``w2`` and the MLP's column weights
            (``w1``, ``w3`` for SwiGLU; ``w1`` for GELU), ``F.linear`` layout, local blocks of their specs; with
            ``q_norm`` and ``k_norm`` (``[head_dim]``, Qwen3) each head's queries and keys are RMSNormed before RoPE.
        plan: the parallel plan (``ParallelPlan()``: the unsharded block).
        head_dim: the attention head size (q/k/v features are ``heads * head_dim``).
        norm_eps: RMSNorm's epsilon.
        rope_theta: the RoPE base; ``None``: no rotary embedding.
        rope_scaling: Llama 3.1's scaling of the RoPE frequencies, or ``None`` (plain RoPE).
        mlp: a kind of :data:`MLPS`: ``"swiglu"`` or ``"gelu"``.
        remat: a key of :data:`REMAT`: ``"none"`` keeps the activations for the backward, ``"full"`` recomputes
            the block in the backward from its input (``fs.remat``, ``nothing_saveable``), ``"selective"`` keeps
            the weight matmuls' outputs and the attention output and recomputes the rest. Same numbers either way.
        gather: FSDP's reshard-after-forward, with ``remat="full"`` or ``"selective"``: ``p`` are the sharded
            blocks and ``gather`` (e.g. ``use_params``) gathers them inside the block's rematerialised region, so
            the gathered weights are freed once the block's forward is done and gathered again when the block is
            recomputed for its backward (the weights are never saved: they are no matmul output).
        ffn: another feed-forward in place of the MLP (a mixture of experts): ``ffn(h, p, plan) -> (y, aux)`` on
            the normed hidden states ``h`` (``[b, s(/tp), d]``, as ``x``), ``y`` added to the residual; the
            block then returns ``(output, aux)``. ``p`` holds its weights beside the attention's.
        kv_shared: the tp devices that share each kv head: 1 (``wk`` / ``wv`` split by heads over tp), or, where
            tp exceeds the kv heads, ``tp // n_kv_heads`` (``wk`` / ``wv`` replicated over tp: see
            :func:`kv_weights`).

    Returns:
        The block's output, the shape of ``x``; ``(output, aux)`` with ``ffn``.

    Raises:
        ConfigError: an unknown ``mlp`` or ``remat``.

    Example:
        >>> # y = transformer_block(x, layer_params, plan, head_dim=64, norm_eps=1e-5, rope_theta=5e5, remat="full")
    """
    if mlp not in MLPS:
        raise ConfigError(f"transformer_block: unknown mlp {mlp!r}; use one of {sorted(MLPS)}.")
    if remat not in REMAT:
        raise ConfigError(f"transformer_block: unknown remat {remat!r}; use one of {sorted(REMAT)}.")

    def block(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        if gather is not None:
            p = gather(p)  # [.., s/fsdp, ..] -> [.., s, ..], again in the backward's recomputation
        rope_kw = {"rope_theta": rope_theta, "rope_scaling": rope_scaling}
        kw = {"mlp": mlp, "ffn": ffn, "kv_shared": kv_shared}
        return _block(x, p, plan, head_dim=head_dim, norm_eps=norm_eps, **rope_kw, **kw)

    policy = REMAT[remat]
    if gather is not None and policy is None:
        raise ConfigError(
            "transformer_block: gather= (reshard-after-forward) needs remat='full' or 'selective': the weights are "
            "gathered again when the block is recomputed."
        )
    return block(x, p) if policy is None else rematerialize(block, policy)(x, p)  # (recomputed in the backward)


def _block(
    x: torch.Tensor,
    p: dict[str, torch.Tensor],
    plan: ParallelPlan,
    *,
    head_dim: int,
    norm_eps: float,
    rope_theta: float | None,
    rope_scaling: RopeScaling | None,
    mlp: str,
    ffn: FeedForward | None = None,
    kv_shared: int = 1,
) -> Any:
    up_names, act = MLPS[mlp]
    sp = 1 if plan.sp else None  # the sequence dim of x under sequence parallelism
    # replicated norm weights meet sequence shards under SP: their gradients are summed over tp
    attn_norm, mlp_norm = _vary(p["attn_norm"], plan.sp_axis), _vary(p["mlp_norm"], plan.sp_axis)
    h = rms_norm(x, attn_norm, norm_eps)  # [b, s(/tp), d]
    wk, wv = kv_weights(p["wk"], p["wv"], plan, head_dim, kv_shared)  # this device's kv heads
    qkv = column_parallel_linear(h, [p["wq"], wk, wv], axis=plan.tp, gather_dim=sp)  # -> [b, s, h*hd(/tp)]
    b, s = qkv[0].shape[:2]
    # -> [b, s, heads(/tp), hd]: the view unflatten makes (without Tensor.unflatten's Python wrapper); the head
    # count spelled out, not -1, which a device's empty block (a batch smaller than dp) leaves ambiguous
    q, k, v = (t.view(b, s, t.shape[-1] // head_dim, head_dim) for t in qkv)
    if "q_norm" in p:  # Qwen3: RMSNorm of each head's q and k; the weights meet tp's heads (gradients summed)
        q = rms_norm(q, _vary(p["q_norm"], plan.tp), norm_eps)  # [b, s, heads(/tp), hd]
        k = rms_norm(k, _vary(p["k_norm"], plan.tp), norm_eps)  # [b, s, kv_heads(/tp), hd]
    sizes = cp_sizes(s, plan)  # every cp device's length (exchanged only when the sequence is split unevenly)
    if rope_theta is not None:
        pos = cp_positions(sizes, plan)  # this device's positions: 0 .. s-1, or its cp chunks'
        q, k = rope(q, rope_theta, pos, rope_scaling), rope(k, rope_theta, pos, rope_scaling)
    o = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), plan, sizes)  # [b,h(/tp),s,hd]
    o = checkpoint_name(o.transpose(1, 2).reshape(b, s, o.shape[1] * o.shape[3]), "attn_out")  # [b, s, h(/tp)*hd]
    x = x + row_parallel_linear(o, p["wo"], axis=plan.tp, scatter_dim=sp)  # [b, s, h*hd(/tp)] -> [b, s(/tp), d]
    h = rms_norm(x, mlp_norm, norm_eps)  # [b, s(/tp), d]
    if ffn is not None:  # the model's own feed-forward (a mixture of experts) and what it reports
        y, aux = ffn(h, p, plan)  # [b, s(/tp), d] -> [b, s(/tp), d]
        return x + y, aux
    up = column_parallel_linear(h, [p[n] for n in up_names], axis=plan.tp, gather_dim=sp)  # -> [b, s, f(/tp)] each
    return x + row_parallel_linear(act(*up), p["w2"], axis=plan.tp, scatter_dim=sp)  # [b, s, f(/tp)] -> [b, s(/tp), d]
