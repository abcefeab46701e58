"""What a ``shard_map`` call no longer redoes per call (counted, not timed): one executor per mesh (made again
only when torch.distributed was restarted under it), and under ``dist`` a replicated full tensor argument is
handed over as it is (no slicing per call), while a sharded one is still cut to this process's block. The
numbers equal the unsharded function's."""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard import P

pytestmark = pytest.mark.counters


def _calls_body(mesh: fs.Mesh) -> dict:
    from funcshard._src.shard_map.executor import executor_for
    from funcshard._src.shard_map.io import InputCache

    x = torch.arange(12.0).reshape(4, 3)
    cache = InputCache()
    inputs = cache.prepare("f", mesh, (P(), P("dp")), (x, x))
    blocks_rep, blocks_cut = inputs.blocks[0][0], inputs.blocks[1][0]
    same = all(b is x for b in blocks_rep.values()) if mesh.backend == "dist" else None
    cut = [tuple(b.shape) for b in blocks_cut.values()]
    f = fs.shard_map(lambda a, b: (a.mul_(2), b + 1), mesh=mesh, in_specs=(P(), P("dp")), out_specs=(P(), P("dp")))
    outs = [f(x, x) for _ in range(3)]
    equal = all(
        torch.equal(fs.device_get(a), x * 2) and torch.equal(fs.device_get(b), x + 1) for a, b in outs
    ) and torch.equal(x, torch.arange(12.0).reshape(4, 3))  # the caller's tensor untouched by the in-place mul_
    return {"one_executor": executor_for(mesh) is executor_for(mesh), "same": same, "cut": cut, "equal": equal}


def test_executor_once_per_mesh_and_replicated_tensors_passed_whole(run, backend) -> None:
    for r in run(_calls_body, {"dp": 2}):
        assert r["one_executor"] and r["equal"], r
        if backend == "dist":
            assert r["same"] is True and r["cut"] == [(2, 3)], r  # this process's block only
        else:
            assert r["cut"] == [(2, 3), (2, 3)], r  # every simulated device's block


def test_value_and_grad_bookkeeping_bypasses_the_vma_mode(monkeypatch) -> None:
    """Inside ``shard_map(check_vma=True)``, ``fs.value_and_grad`` adds nothing to what the vma mode sees of ``f``:
    its own reads (requires_grad, dtypes, a view's base, detach, zeros, the grad-mode switches), its call of the
    autograd engine (the gradients are tagged by it, the backward runs with the mode off the stack, as when the
    mode dispatches ``torch.autograd.grad``) and shard_map's check of its outputs skip the mode."""
    from funcshard._src.collectives.vma import VmaMode

    seen: list[str] = []
    plain = VmaMode.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):
        seen.append(getattr(func, "__name__", str(func)))
        return plain(self, func, types, args, kwargs)

    monkeypatch.setattr(VmaMode, "__torch_function__", counted)
    mesh = fs.make_mesh({"dp": 1}, backend="sim")

    def f(w, x):
        return (x @ w).pow(2).mean()  # [b, d] @ [d, h] -> [b, h]

    w, x = torch.randn(3, 2), torch.randn(4, 3)
    alone = fs.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    both = fs.shard_map(lambda w, x: fs.value_and_grad(f)(w, x), mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()))
    alone(w, x)
    n_alone, seen[:] = len(seen), []
    value, grad = both(w, x)
    assert len(seen) == n_alone and "grad" not in seen, seen
    torch.testing.assert_close(fs.device_get(grad), 2 * x.T @ (x @ w) / (x @ w).numel())
    torch.testing.assert_close(fs.device_get(value), f(w, x))
