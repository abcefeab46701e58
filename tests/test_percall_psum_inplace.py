"""``fs.psum`` of a temporary sums it in its own buffer (no copy), and never a tensor someone else can see.

``psum(h @ z, "tp")`` hands over a matmul's output that nothing else holds: under ``"dist"`` it is summed in place
(as ``lax.psum_owned`` does for the ops' own temporaries). Anything else is copied first, as before: a value the
caller keeps a name for, one a backward saved (as an output, ``exp``'s result, or as an input of a later op), a view.
Temporaries under ``lax.INPLACE_MIN_BYTES`` are copied (cheaper there): these tests lower it to 0. Each case below
reads the operand (or a gradient computed from it) after the sum: it would be the summed value if the sum went in
place, so these tests fail without the checks, under ``"dist"``; ``"sim"`` copies every time (its
backend has no in-place sum), and runs the same bodies for the same numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

import funcshard as fs
from funcshard import P


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, generator=gen), torch.randn(3, 4, generator=gen), torch.randn(4, 5, generator=gen)


def _aliases_body(mesh: fs.Mesh) -> dict[str, Any]:
    with _any_size():
        return _aliases(mesh)


@contextlib.contextmanager
def _any_size() -> Iterator[None]:
    """Every temporary summed in place, however small (these tests' tensors are below ``INPLACE_MIN_BYTES``)."""
    from funcshard._src.collectives import lax

    size, lax.INPLACE_MIN_BYTES = lax.INPLACE_MIN_BYTES, 0
    try:
        yield
    finally:
        lax.INPLACE_MIN_BYTES = size


def _aliases(mesh: fs.Mesh) -> dict[str, Any]:
    x, w, z = _data()
    seen: dict[str, Any] = {}

    def body(x: torch.Tensor, w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = fs.pvary(x, "tp") @ w  # [2, 3] @ [3, 4/tp] -> [2, 4/tp]
        y = h @ z  # [2, 4/tp] @ [4/tp, 5] -> [2, 5], this device's partial sum
        kept = y.clone()
        out = fs.psum(y, "tp")  # y is the caller's: summed into a copy
        seen["named"] = torch.equal(y, kept)
        v = h @ z  # [2, 5], a view of it taken below: the view's base shares the storage
        kept = v.clone()
        flat = v.view(-1)
        del v
        fs.psum(flat, "tp")
        seen["view"] = torch.equal(flat.view(2, 5), kept)
        ptr: list[int] = []
        temp = fs.psum(_remember(h @ z, ptr), "tp")  # a temporary: in place under dist
        seen["same"] = torch.equal(temp, out)
        seen["in_place"] = temp.data_ptr() == ptr[0]
        return out

    f = fs.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "tp"), P("tp")), out_specs=P(), check_vma=False)
    out = fs.device_get(f(x, w, z))
    return {**seen, "value": torch.allclose(out, x @ w @ z, atol=1e-6)}


def _remember(t: torch.Tensor, ptr: list[int]) -> torch.Tensor:
    ptr.append(t.data_ptr())
    return t


def test_psum_sums_a_temporary_in_place_and_never_a_named_value(run, backend) -> None:
    for r in run(_aliases_body, {"tp": 2}):
        assert r["named"] and r["view"], r  # the caller's value and a view's storage kept
        assert r["value"] and r["same"], r
        assert r["in_place"] == (backend == "dist"), r  # (sim's backend copies)


def _saved_body(mesh: fs.Mesh, check_vma: bool) -> dict[str, Any]:
    with _any_size():
        return _saved(mesh, check_vma)


def _saved(mesh: fs.Mesh, check_vma: bool) -> dict[str, Any]:
    x, w, z = _data(1)
    v = torch.randn(2, 5, generator=torch.Generator().manual_seed(2))

    def loss(w: torch.Tensor, z: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not check_vma:  # (check_vma inserts these pvarys itself)
            v = fs.pvary(v, "tp")
        h = fs.pvary(x, "tp") @ w if not check_vma else x @ w  # [2, 3] @ [3, 4/tp] -> [2, 4/tp]
        # exp saves its result for the backward (an output of the op): summed in place, the gradient would be wrong
        a = fs.psum(torch.exp(h @ z), "tp")  # [2, 4/tp] @ [4/tp, 5] -> [2, 5]
        # a later op saved the partial product as its input (mul's backward reads it for v's gradient)
        parts = [h @ z]  # [2, 5]
        b = (parts[0] * v).sum()
        c = fs.psum(parts.pop(), "tp")  # [2, 5] -> [2, 5]: its only Python reference is psum's
        return (a**2).sum() + fs.psum(b, "tp") + (c**2).sum()

    def body(w: torch.Tensor, z: torch.Tensor, v: torch.Tensor) -> Any:
        return fs.value_and_grad(loss, argnums=(0, 1, 2))(w, z, v)

    specs = (P(None, "tp"), P("tp"), P())
    f = fs.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), specs), check_vma=check_vma)
    value, grads = f(w, z, v)
    rw, rz, rv = (t.clone().requires_grad_() for t in (w, z, v))
    # the reference: the partial products per device, summed explicitly
    n = 2
    parts = [x @ rw[:, k * 2 : (k + 1) * 2] @ rz[k * 2 : (k + 1) * 2] for k in range(n)]
    ref = (sum(torch.exp(p) for p in parts) ** 2).sum() + sum((p * rv).sum() for p in parts) + (sum(parts) ** 2).sum()
    ref_grads = torch.autograd.grad(ref, (rw, rz, rv))
    got = [fs.device_get(g) for g in grads]
    return {
        "value": torch.allclose(fs.device_get(value), ref.detach(), rtol=1e-5),
        "grads": all(torch.allclose(g, r, rtol=1e-4, atol=1e-5) for g, r in zip(got, ref_grads, strict=True)),
    }


def test_psum_keeps_a_value_a_backward_saved(run) -> None:
    for check_vma in (False, True):
        for r in run(_saved_body, {"tp": 2}, check_vma):
            assert r["value"] and r["grads"], (check_vma, r)
