"""The vma mode's fast paths and ``_vma.one_op`` give the tags and gradients of the op-by-op tracking.

``one_op(fn)``: ``fn`` dispatched once through the vma mode (its ops inside not seen), its result tagged with the
union of its operands' axes, an invariant operand that requires grad made varying (``Pvary``: its gradient summed)
and an invariant constant passed as it is; numbers bitwise those of the undecorated function, sim and dist. The
handler's own fast paths (an untagged operand read inline, a varying value meeting constants in one loop) keep
the union of views of tagged tensors and of mixed varying / invariant operands.
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

pytestmark = pytest.mark.counters


def _norm(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w * c  # [b, d]


_norm_op = _vma.one_op(_norm)


def _one_op_body(mesh: fs.Mesh) -> dict[str, Any]:
    seen: dict[str, list[collections.Counter[str]]] = {"plain": [], "one_op": []}
    tags: dict[str, Any] = {}
    c = torch.linspace(0.5, 1.5, 3)  # a constant: invariant, no gradient
    where = threading.local()  # .counts: the Counter of the norm call this device thread is in, if any
    real = _vma.VmaMode.__torch_function__

    def counted(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        counts = getattr(where, "counts", None)
        if counts is not None:
            counts[getattr(func, "__name__", str(func))] += 1
        return real(self, func, types, args, kwargs)

    def make_loss(norm: Any, name: str) -> Any:
        def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            where.counts = collections.Counter()
            try:
                y = norm(x, w, c, 1e-6)  # x varying over dp, w invariant (requires grad), c constant
            finally:
                seen[name].append(where.counts)
                where.counts = None
            tags[name] = (_vma.get_vma(y), _vma.find_vma(c), _vma.get_vma(w))
            return fs.psum((y**2).sum(), "dp")

        return loss

    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(3, generator=gen), torch.randn(4, 3, generator=gen)
    out = {}
    _vma.VmaMode.__torch_function__ = counted  # type: ignore[method-assign]  # (once: sim's device threads share it)
    try:
        for name, norm in (("plain", _norm), ("one_op", _norm_op)):
            step = fs.shard_map(
                lambda w, x, norm=norm, name=name: fs.value_and_grad(make_loss(norm, name))(w, x),
                mesh=mesh,
                in_specs=(P(), P("dp")),
                out_specs=(P(), P()),
            )
            v, g = step(w, x)
            out[name] = (fs.device_get(v), fs.device_get(g))
    finally:
        _vma.VmaMode.__torch_function__ = real  # type: ignore[method-assign]
    ref_g, ref_v = torch.func.grad_and_value(lambda w: (_norm(x, w, c, 1e-6) ** 2).sum())(w)
    return {
        "bitwise": all(torch.equal(a, b) for a, b in zip(out["plain"], out["one_op"], strict=True)),
        "close": torch.allclose(out["one_op"][0], ref_v) and torch.allclose(out["one_op"][1], ref_g),
        "tags": tags,
        "plain_rsqrt": sorted(cnt["rsqrt"] for cnt in seen["plain"]),  # one entry per device call
        "one_op_seen": [dict(cnt) for cnt in seen["one_op"]],
        "outside": torch.equal(_norm_op(x, w, c, 1e-6), _norm(x, w, c, 1e-6)),
    }


def test_one_op_is_one_dispatch_with_the_same_tags_and_gradients(run, backend) -> None:
    for r in run(_one_op_body, {"dp": 2}):
        assert r["bitwise"], r  # value and w's gradient: the same numbers as the op-by-op tracking
        assert r["close"], r  # w's gradient summed over dp (its Pvary inserted), as the unsharded function's
        dp = frozenset({"dp"})
        # the result varies over dp, the constant keeps no tag, w stays invariant (a widened copy met x)
        assert r["tags"]["plain"] == (dp, None, frozenset()) and r["tags"]["one_op"] == r["tags"]["plain"], r
        n_dev = 2 if backend == "sim" else 1  # sim runs both devices in this process
        assert r["plain_rsqrt"] == [1] * n_dev, r  # op by op: each op seen by the mode
        assert r["one_op_seen"] == [{"_norm": 1}] * n_dev, r  # one_op: one dispatch, no op inside seen
        assert r["outside"], r  # outside shard_map: the function itself


def _fast_paths_body(mesh: fs.Mesh) -> dict[str, Any]:
    tags: dict[str, Any] = {}
    c = torch.linspace(0.5, 1.5, 3)  # a constant

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            xv = x[:, :2]  # a view of the varying x made unseen by the mode: untagged, its base carries the tag
        tags["view"] = _vma.find_vma(xv) is not None and "_fs_vma" not in xv.__dict__
        tags["view * c"] = _vma.get_vma(xv * c[:2])  # [b, 2]: the untagged view's tag found through its base
        tags["c * x"] = _vma.get_vma(c * x)  # a constant first, the varying value second
        tags["where"] = _vma.get_vma(torch.where(c > 1.0, x, c))  # three operands, two invariant
        y = torch.add(x, w) * c  # [b, 3]: the invariant w (requires grad) made varying, its gradient summed
        tags["x + w"] = _vma.get_vma(y)
        tags["c"] = _vma.find_vma(c)
        return fs.psum((y**2).sum() + (xv * c[:2]).sum(), "dp")

    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(3, generator=gen), torch.randn(4, 3, generator=gen)
    step = fs.shard_map(lambda w, x: fs.value_and_grad(loss)(w, x), mesh=mesh, in_specs=(P(), P("dp")), out_specs=P())
    v, g = step(w, x)
    ref_g, ref_v = torch.func.grad_and_value(lambda w: (((x + w) * c) ** 2).sum() + (x[:, :2] * c[:2]).sum())(w)
    return {"tags": tags, "close": torch.allclose(fs.device_get(v), ref_v) and torch.allclose(fs.device_get(g), ref_g)}


def test_fast_paths_keep_the_union(run, backend) -> None:
    for r in run(_fast_paths_body, {"dp": 2}):
        assert r["close"], r  # w's gradient summed over dp: without its Pvary it would be one device's share
        t, dp = r["tags"], frozenset({"dp"})
        assert t["view"], r
        assert t["view * c"] == dp and t["c * x"] == dp and t["where"] == dp and t["x + w"] == dp, r
        assert t["c"] is None, r  # the constant keeps no tag


def _audit_body(mesh: fs.Mesh) -> dict[str, Any]:
    c = torch.linspace(0.5, 1.5, 3)

    def f(x: torch.Tensor) -> torch.Tensor:
        return _norm_op(x, torch.ones(3), c, 1e-6)  # check_vma=False: the function itself, op by op

    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    y = fs.shard_map(f, mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"), check_vma=False)(x)
    return {"equal": torch.equal(fs.device_get(y), _norm(x, torch.ones(3), c, 1e-6))}


def test_one_op_without_tracking(run, backend) -> None:
    for r in run(_audit_body, {"dp": 2}):
        assert r["equal"], r


def _base_body(mesh: fs.Mesh) -> dict[str, Any]:
    base = torch.arange(4.0)  # a constant (kept across calls): untagged, invariant

    def f(x: torch.Tensor) -> torch.Tensor:
        v = base.view(2, 2)
        _vma.set_vma(v, frozenset({"dp"}))  # a view given its own tag (as rope's kept tables' views are)
        seen = v._base  # a read, not an op: the constant as it is
        return x + (seen is base) + (_vma.find_vma(base) is None)

    x = torch.zeros(4, 2)
    y = fs.shard_map(f, mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))(x)
    return {"equal": torch.equal(fs.device_get(y), x + 2), "base_tag": _vma.find_vma(base)}


def test_base_read_leaves_the_viewed_tensor_untagged(run, backend) -> None:
    for r in run(_base_body, {"dp": 2}):
        assert r["equal"] and r["base_tag"] is None, r  # (was: the view's read retagged the constant {dp})
