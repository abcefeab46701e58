"""``ops.attention`` and ``ring_attention``'s local path through the vma mode: one dispatch, same tags and gradients.

``attention`` is a ``_vma.one_op``: inside ``shard_map(check_vma=True)`` the mode sees it once (not its shape reads,
``repeat_interleave`` and ``scaled_dot_product_attention``), its results vary over the union of q, k and v's axes, an
invariant k / v that requires grad is made varying (``Pvary``: its gradient summed over the axis) and an untagged
view of a varying tensor is found varying through its base. ``ring_attention``'s shape check reads with torch
functions off. Numbers: those of the function run op by op (bitwise where the Pvary sits where it did), sim and dist.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard._src.collectives import vma as _vma
from funcshard.ops import attention, ring_attention
from funcshard.ops.attention._torch_kernel import attention_torch

pytestmark = pytest.mark.counters

_plain = attention_torch.__wrapped__  # the undecorated torch path: op by op through the mode
B, S, D = 4, 6, 8  # batch (split over dp), sequence, head dim


def _counting() -> tuple[Any, threading.local, Any]:
    """A counting ``__torch_function__`` for the vma mode: names of what it sees while ``where.counts`` is set."""
    where = threading.local()
    real = _vma.VmaMode.__torch_function__

    def counted(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        counts = getattr(where, "counts", None)
        if counts is not None:
            name = getattr(func, "__name__", None) or getattr(getattr(func, "__self__", None), "__name__", str(func))
            counts[name] += 1
        return real(self, func, types, args, kwargs)

    return counted, where, real


def _attention_body(mesh: fs.Mesh, hkv: int, lse: bool) -> dict[str, Any]:
    """q varying over dp (the batch split), k and v invariant and differentiated (their gradients summed over dp),
    the plain function vs the one_op; with ``lse`` also the float32 path returning the log-sum-exp."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, 4, S, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, hkv, S, D, generator=gen, dtype=torch.float64) for _ in range(2))
    r = torch.randn(B, 4, S, D, generator=gen, dtype=torch.float64)
    counted, where, real = _counting()
    seen: dict[str, list[dict[str, int]]] = collections.defaultdict(list)
    tags: dict[str, Any] = {}

    def make_loss(fn: Any, name: str) -> Any:
        def loss(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
            kb, vb = k.expand(q.shape[0], -1, -1, -1), v.expand(q.shape[0], -1, -1, -1)  # [1, ..] -> [b/dp, ..]
            where.counts = collections.Counter()
            try:
                plain = fn(q, kb, vb, causal=True)
                out, s = fn(q, kb, vb, causal=True, return_lse=True) if lse else (plain, plain)
            finally:
                seen[name].append(dict(where.counts))
                where.counts = None
            tags[name] = (_vma.get_vma(plain), _vma.get_vma(out), _vma.get_vma(s), _vma.get_vma(k))
            total = (plain * r).sum()
            return fs.psum(total + (out * r).sum() + s.sum() if lse else total, "dp")

        return loss

    out: dict[str, Any] = {}
    _vma.VmaMode.__torch_function__ = counted  # type: ignore[method-assign]  # (once: sim's device threads share it)
    try:
        for name, fn in (("plain", _plain), ("one_op", attention)):
            step = fs.shard_map(
                lambda k, v, q, r, fn=fn, name=name: fs.value_and_grad(make_loss(fn, name), argnums=(0, 1))(k, v, q, r),
                mesh=mesh,
                in_specs=(P(), P(), P("dp"), P("dp")),
                out_specs=(P(), (P(), P())),
            )
            val, (gk, gv) = step(k, v, q, r)
            out[name] = (fs.device_get(val), fs.device_get(gk), fs.device_get(gv))
    finally:
        _vma.VmaMode.__torch_function__ = real  # type: ignore[method-assign]

    def ref(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kb, vb = k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)
        total = (_plain(q, kb, vb, causal=True) * r).sum()
        if not lse:
            return total
        o, s = _plain(q, kb, vb, causal=True, return_lse=True)
        return total + (o * r).sum() + s.sum()

    ref_v, ref_g = ref(k, v), torch.autograd.grad(ref(k.requires_grad_(), v.requires_grad_()), (k, v))
    got = out["one_op"]
    tol = 1e-5 if lse else 1e-12  # the log-sum-exp path computes in float32
    return {
        "bitwise": all(torch.equal(a, b) for a, b in zip(out["plain"], out["one_op"], strict=True)),
        "close": all(torch.allclose(a, b, rtol=tol, atol=tol) for a, b in zip(got, (ref_v, *ref_g), strict=True)),
        "tags": tags,
        "seen": {n: s for n, s in seen.items()},
        "outside": torch.equal(
            attention(q, k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)),
            _plain(q, k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)),
        ),
        "k_untagged": "_fs_vma" not in k.__dict__ and "_fs_vma" not in v.__dict__,
    }


def test_attention_is_one_dispatch_with_the_tags_and_gradients(run, backend) -> None:
    dp, n_dev = frozenset({"dp"}), 2 if backend == "sim" else 1  # sim runs both devices in this process
    # as many kv heads as q heads, or grouped-query (repeat_interleave inside); with the float32 lse path or not
    for hkv, lse in ((4, False), (2, False), (4, True)):
        for r in run(_attention_body, {"dp": 2}, hkv, lse):
            # k / v's gradients summed over dp (their Pvary inserted), as the unsharded function's: without the
            # Pvary each would be one device's share
            assert r["close"], (hkv, lse, r)
            if hkv == 4 and not lse:  # the Pvary where the op-by-op tracking puts it (at the sdpa): bitwise
                assert r["bitwise"], r
            # every result varies over dp (q does); the invariant k stays invariant (a widened copy met q)
            assert r["tags"]["one_op"] == (dp, dp, dp, frozenset()), r
            assert r["tags"]["plain"] == r["tags"]["one_op"], r
            calls = 2 if lse else 1
            assert r["seen"]["one_op"] == [{"attention": calls}] * n_dev, r  # one dispatch a call, none inside
            assert all(s.get("__get__", 0) >= 4 for s in r["seen"]["plain"]), r  # op by op: its reads seen
            assert r["outside"] and r["k_untagged"], r  # outside shard_map: the function; no tag left on k


def _view_body(mesh: fs.Mesh) -> dict[str, Any]:
    """q an untagged view of a varying tensor (made with torch functions off): found varying through its base."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(B, S, 2, D, generator=gen)
    kv = torch.randn(1, 2, S, D, generator=gen)  # a constant: invariant, no gradient
    seen: dict[str, Any] = {}

    def f(x: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            q = x.transpose(1, 2)  # [b, s, h, d] -> [b, h, s, d], a view the mode did not see: untagged
        seen["q_untagged"] = "_fs_vma" not in q.__dict__
        kb = kv.expand(q.shape[0], -1, -1, -1)
        o = attention(q, kb, kb, causal=True)
        seen["out"] = _vma.get_vma(o)
        seen["kv"] = _vma.find_vma(kv)
        return o.transpose(1, 2)  # [b, h, s, d] -> [b, s, h, d]

    y = fs.shard_map(f, mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))(x)
    want = _plain(x.transpose(1, 2), kv.expand(B, -1, -1, -1), kv.expand(B, -1, -1, -1), causal=True).transpose(1, 2)
    return {"equal": torch.equal(fs.device_get(y), want), **seen, "kv_after": "_fs_vma" in kv.__dict__}


def test_attention_finds_the_tag_through_a_view_and_leaks_none(run, backend) -> None:
    for r in run(_view_body, {"dp": 2}):
        assert r["equal"] and r["q_untagged"], r
        assert r["out"] == frozenset({"dp"}), r  # lost through the view: it would be taken as invariant
        assert r["kv"] is None and not r["kv_after"], r  # the constant never tagged, inside or after


def _ring_local_body(mesh: fs.Mesh) -> dict[str, Any]:
    """ring_attention with no cp axis: its shape check unseen by the mode, attention one dispatch (q varying over
    dp: its heads split; k and v invariant)."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, 2, S, D, generator=gen)  # its 2 heads split over dp: 1 a device
    k, v = (torch.randn(B, 1, S, D, generator=gen) for _ in range(2))  # 1 kv head, replicated (invariant)
    counted, where, real = _counting()
    seen: list[dict[str, int]] = []
    tag: list[Any] = []

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        where.counts = collections.Counter()
        try:
            o = ring_attention(q, k, v, axis=None)
        finally:
            seen.append(dict(where.counts))
            where.counts = None
        tag.append(_vma.get_vma(o))
        return o

    _vma.VmaMode.__torch_function__ = counted  # type: ignore[method-assign]
    try:
        y = fs.shard_map(f, mesh=mesh, in_specs=(P(None, "dp"), P(), P()), out_specs=P(None, "dp"))(q, k, v)
    finally:
        _vma.VmaMode.__torch_function__ = real  # type: ignore[method-assign]
    return {"equal": torch.equal(fs.device_get(y), _plain(q, k, v, causal=True)), "seen": seen, "tags": tag}


def test_ring_attention_local_path_one_dispatch(run, backend) -> None:
    for r in run(_ring_local_body, {"dp": 2}):
        assert r["equal"], r
        n_dev = 2 if backend == "sim" else 1
        assert r["seen"] == [{"attention": 1}] * n_dev, r  # no shape read of the check seen
        assert r["tags"] == [frozenset({"dp"})] * n_dev, r  # the union: q varies over dp, k / v are invariant
