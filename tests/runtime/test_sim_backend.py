"""The simulated backend's failure handling, varying-axes tracking, and communication accounting."""

from __future__ import annotations

import time

import pytest
import torch

import funcshard as fs
from funcshard import P


class Boom(RuntimeError):
    pass


def test_device_exception_ends_call_fast() -> None:
    mesh = fs.make_mesh({"dp": 2, "tp": 4}, backend="sim")

    def f(x):
        if fs.axis_index("tp") == 3 and fs.axis_index("dp") == 1:
            raise Boom("device 7 failed")
        return fs.psum(fs.psum(x, "tp"), "dp")  # the others wait here for device 7

    t0 = time.monotonic()
    with pytest.raises(Boom, match="device 7 failed"):
        fs.shard_map(f, mesh=mesh, in_specs=(P("dp"),), out_specs=P())(torch.ones(4))
    assert time.monotonic() - t0 < 5


def test_exception_in_backward_ends_call() -> None:
    mesh = fs.make_mesh({"tp": 2}, backend="sim")

    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            raise Boom("backward failed")

    def f(x):
        x = x.detach().requires_grad_(True)
        y = fs.psum(Bad.apply(x).sum(), "tp")
        return torch.autograd.grad(y, x)[0]

    t0 = time.monotonic()
    with pytest.raises(Boom):
        fs.shard_map(f, mesh=mesh, in_specs=(P("tp"),), out_specs=P("tp"))(torch.ones(4))
    assert time.monotonic() - t0 < 5


def test_mesh_reusable_after_failure() -> None:
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    with pytest.raises(Boom):
        fs.shard_map(lambda x: (_ for _ in ()).throw(Boom("x")), mesh=mesh, in_specs=(P(),), out_specs=P())(
            torch.ones(1)
        )
    out = fs.shard_map(lambda x: fs.psum(x, "tp"), mesh=mesh, in_specs=(P("tp"),), out_specs=P())(torch.ones(2))
    assert fs.device_get(out).item() == 2


def test_auto_pvary_gives_full_batch_gradient() -> None:
    """A weight replicated over dp, used with a dp-sharded batch, gets the full-batch gradient."""
    mesh = fs.make_mesh({"dp": 4}, backend="sim")
    w = torch.randn(3)
    x = torch.randn(8, 3)

    def f(w, x):
        return torch.func.grad(lambda w: fs.psum((x @ w).sum(), "dp"))(w)

    g = fs.device_get(fs.shard_map(f, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P())(w, x))
    torch.testing.assert_close(g, x.sum(0))


def test_without_vma_pvary_is_needed() -> None:
    """check_vma=False without pvary: each device has only its batch's gradient (the check catches it)."""
    mesh = fs.make_mesh({"dp": 4}, backend="sim")
    w, x = torch.randn(3), torch.randn(8, 3)

    def f(w, x):
        return torch.func.grad(lambda w: fs.psum((x @ w).sum(), "dp"))(w)

    with pytest.raises(fs.ShardingError, match="'dp'"):
        fs.shard_map(f, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P(), check_vma=False)(w, x)

    def g(w, x):
        return torch.func.grad(lambda w: fs.psum((x @ fs.pvary(w, "dp")).sum(), "dp"))(w)

    out = fs.shard_map(g, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P(), check_vma=False)(w, x)
    torch.testing.assert_close(fs.device_get(out), x.sum(0))


def test_psum_of_invariant_counts_copies() -> None:
    mesh = fs.make_mesh({"tp": 4}, backend="sim")

    def f(x):
        x = x.detach().requires_grad_(True)
        y = fs.psum(x, "tp")  # x is the same on every device: the sum is 4 x
        (g,) = torch.autograd.grad(y.sum(), x)
        return y, g, fs.psum(1, "tp")

    y, g, n = fs.shard_map(f, mesh=mesh, in_specs=(P(),), out_specs=(P(), P(), P()))(torch.ones(2))
    assert torch.equal(fs.device_get(y), torch.full((2,), 4.0))
    assert torch.equal(fs.device_get(g), torch.full((2,), 4.0))
    assert n == 4


def _stats_body(mesh: fs.Mesh) -> dict:
    x = torch.randn(8, 4)

    def f(x):
        x = x.detach().requires_grad_(True)
        y = fs.all_gather(x, "tp", dim=0, tiled=True)  # [2, 4] -> [8, 4]
        z = fs.psum(y.sum(), "tp")
        (g,) = torch.autograd.grad(z, x)  # backward: psum_scatter of [8, 4]
        return g

    with fs.comm_stats() as st:
        fs.shard_map(f, mesh=mesh, in_specs=(P("tp"),), out_specs=P("tp"))(x)
    return {
        "ag": (st.calls("all_gather", "tp"), st.bytes("all_gather", "tp")),
        "rs": (st.calls("psum_scatter"), st.bytes("psum_scatter")),
        "ps": st.calls("psum", "tp"),
        "total": st.bytes(),
        "table": st.table(),
    }


def test_comm_stats(run) -> None:
    for r in run(_stats_body, {"tp": 4}):
        assert r["ag"] == (1, 2 * 4 * 4)
        assert r["rs"] == (1, 8 * 4 * 4)
        assert r["ps"] == 1
        assert r["total"] == 2 * 4 * 4 + 8 * 4 * 4 + 4
        assert "all_gather" in r["table"] and "psum_scatter" in r["table"]


def test_prints_and_python_control_flow_work_per_device(capsys) -> None:
    mesh = fs.make_mesh({"tp": 2}, backend="sim")

    def f(x):
        print(f"device {fs.axis_index('tp')} holds {x.tolist()}")
        return x

    fs.shard_map(f, mesh=mesh, in_specs=(P("tp"),), out_specs=P("tp"))(torch.tensor([1.0, 2.0]))
    out = capsys.readouterr().out
    assert "device 0 holds [1.0]" in out and "device 1 holds [2.0]" in out


def test_varying_value_out_of_torch_func_is_caught() -> None:
    """torch.func.grad_and_value hands back the inner tensors: their tags survive, so the check works."""
    mesh = fs.make_mesh({"dp": 2}, backend="sim")

    def f(w, x):
        _, loss = torch.func.grad_and_value(lambda w: (x @ w).sum())(w)  # loss still varies over dp
        return loss

    with pytest.raises(fs.ShardingError, match="varies over axis 'dp'"):
        fs.shard_map(f, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P())(torch.ones(3), torch.ones(4, 3))


def _bucket_body(mesh: fs.Mesh) -> str:
    """pvary of a tree: one all-reduce for all its gradients, equal to per-leaf pvary."""
    ws = {"a": torch.randn(3, 2), "b": torch.randn(5), "c": torch.randn(2, 2, dtype=torch.float64)}
    x = torch.randn(8, 3)

    def loss(p, x):
        return fs.psum((x @ p["a"]).sum() * p["b"].sum() + p["c"].sum().float(), "dp")

    def bucketed(p, x):
        return torch.func.grad(lambda p: loss(fs.pvary(p, "dp"), x))(p)

    def per_leaf(p, x):
        return torch.func.grad(lambda p: loss({k: fs.pvary(v, "dp") for k, v in p.items()}, x))(p)

    specs = (P(), P("dp"))
    with fs.comm_stats() as st:
        g1 = fs.shard_map(bucketed, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(ws, x)
    assert st.calls("psum", "dp") == 1 + 1 + 1  # the loss, one float32 bucket, one float64 bucket
    assert st.bytes("psum", "dp") == 4 + (6 + 5) * 4 + 4 * 8
    g2 = fs.shard_map(per_leaf, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(ws, x)
    for k in ws:
        torch.testing.assert_close(fs.device_get(g1[k]), fs.device_get(g2[k]))
    return "ok"


def test_pvary_tree_is_bucketed(run) -> None:
    assert set(run(_bucket_body, {"dp": 2})) == {"ok"}
