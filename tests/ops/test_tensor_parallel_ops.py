"""Tensor / sequence / loss-parallel ops, forward and backward, against the unsharded torch functions.

Every case runs on tp=2 and tp=4, under sim (check_vma on and off) and under dist (gloo workers).
The backward check differentiates sum(output * r) inside shard_map with torch.autograd.grad and compares
each argument's gradient with the one of the unsharded computation.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import P
from funcshard.ops import (
    column_parallel_linear,
    row_parallel_linear,
    sequence_gather,
    sequence_scatter,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)

B, S, D, H, V = 2, 8, 8, 16, 32


def _rand(*shape, seed):
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed))


def _labels():
    lab = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(5))
    lab[0, :3] = -100
    return lab


# name -> (args, in_specs, out_spec, local fn, reference fn); args that are float tensors get gradients
def _cases():
    x, xs = _rand(B, S, D, seed=1), _rand(B, S, D, seed=1)
    w, b = _rand(H, D, seed=2), _rand(H, seed=3)
    wk = _rand(H, D, seed=4)
    w2, b2 = _rand(D, H, seed=6), _rand(D, seed=7)
    h = _rand(B, S, H, seed=8)
    table = _rand(V, D, seed=9)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(10))
    logits = _rand(B, S, V, seed=11) * 3
    return {
        "column": ((x, w, b), (P(), P("tp"), P("tp")), P(None, None, "tp"), column_parallel_linear, F.linear),
        "column_sp": (
            (xs, w, b),
            (P(None, "tp"), P("tp"), P("tp")),
            P(None, None, "tp"),
            lambda x, w, b: column_parallel_linear(x, w, b, gather_dim=1),
            F.linear,
        ),
        "column_fused": (
            (x, w, wk),
            (P(), P("tp"), P("tp")),
            P(None, None, "tp"),
            lambda x, w, wk: torch.cat(column_parallel_linear(x, [w, wk]), -1),
            None,  # reference built below (the local concat interleaves per device)
        ),
        "row": ((h, w2, b2), (P(None, None, "tp"), P(None, "tp"), P()), P(), row_parallel_linear, F.linear),
        "row_sp": (
            (h, w2, b2),
            (P(None, None, "tp"), P(None, "tp"), P()),
            P(None, "tp"),
            lambda h, w, b: row_parallel_linear(h, w, b, scatter_dim=1),
            F.linear,
        ),
        "embedding": (
            (ids, table),
            (P(), P("tp")),
            P(),
            vocab_parallel_embedding,
            lambda i, t: F.embedding(i, t),
        ),
        "embedding_sp": (
            (ids, table),
            (P(), P("tp")),
            P(None, "tp"),
            lambda i, t: vocab_parallel_embedding(i, t, scatter_dim=1),
            lambda i, t: F.embedding(i, t),
        ),
        "cross_entropy": (
            (logits, _labels()),
            (P(None, None, "tp"), P()),
            P(),
            vocab_parallel_cross_entropy,
            lambda lg, lab: F.cross_entropy(lg.reshape(-1, V), lab.reshape(-1), ignore_index=-100),
        ),
        "cross_entropy_none": (
            (logits, _labels()),
            (P(None, None, "tp"), P()),
            P(),
            lambda lg, lab: vocab_parallel_cross_entropy(lg, lab, reduction="none"),
            lambda lg, lab: F.cross_entropy(
                lg.reshape(-1, V), lab.reshape(-1), ignore_index=-100, reduction="none"
            ).reshape(B, S),
        ),
        "sequence_gather": ((xs,), (P(None, "tp"),), P(None, None, "tp"), None, None),
        "sequence_scatter": ((x,), (P(),), P(None, "tp"), lambda x: sequence_scatter(x, "tp", 1), lambda x: x),
    }


def _op_body(mesh: fs.Mesh, name: str, check_vma: bool) -> str:
    args, in_specs, out_spec, fn, ref = _cases()[name]
    n = mesh.shape["tp"]
    if name == "sequence_gather":
        # each device gathers the whole sequence, then keeps a different feature block: a varying use
        def fn(x):
            return sequence_gather(x, "tp", 1).unflatten(-1, (n, -1))[..., fs.axis_index("tp"), :]

        def ref(x):
            return x

    if name == "column_fused":

        def ref(x, w, wk):
            q, k = F.linear(x, w), F.linear(x, wk)
            blocks = [torch.cat([qb, kb], -1) for qb, kb in zip(q.chunk(n, -1), k.chunk(n, -1))]
            return torch.cat(blocks, -1)

    diff = [i for i, a in enumerate(args) if a.is_floating_point()]
    out_ref_args = [a.clone().requires_grad_(i in diff) for i, a in enumerate(args)]
    out_ref = ref(*out_ref_args)
    r = _rand(*out_ref.shape, seed=99)
    (out_ref * r).sum().backward()

    def inner(r_local, *local):
        local = [a.detach().requires_grad_(True) if i in diff else a for i, a in enumerate(local)]
        out = fn(*local)
        loss = (out * r_local).sum()
        if out_spec.axes:
            loss = fs.psum(loss, out_spec.axes)
        grads = torch.autograd.grad(loss, [local[i] for i in diff])
        return out, list(grads)

    f = fs.shard_map(
        inner,
        mesh=mesh,
        in_specs=(out_spec, *in_specs),
        out_specs=(out_spec, [in_specs[i] for i in diff]),
        check_vma=check_vma,
    )
    out, grads = f(r, *args)
    torch.testing.assert_close(fs.device_get(out), out_ref.detach(), rtol=1e-5, atol=1e-5)
    for i, g in zip(diff, grads):
        assert g.spec == in_specs[i]
        torch.testing.assert_close(fs.device_get(g), out_ref_args[i].grad, rtol=1e-5, atol=1e-5, msg=f"{name} arg {i}")
    return "ok"


NAMES = sorted(_cases())


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("name", NAMES)
def test_tp_op_sim(name: str, check_vma: bool, tp: int) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _op_body, {"tp": tp}, name, check_vma) == ["ok"]


def _all_ops_body(mesh: fs.Mesh) -> str:
    for name in NAMES:
        for check_vma in (True, False):
            _op_body(mesh, name, check_vma)
    return "ok"


@pytest.mark.dist
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_ops_dist(tp: int) -> None:
    from _dist_pool import run_body

    assert set(run_body("dist", _all_ops_body, {"tp": tp})) == {"ok"}


def test_cross_entropy_never_gathers_vocab() -> None:
    mesh = fs.make_mesh({"tp": 4}, backend="sim")
    logits = _rand(B, S, V, seed=1)
    with fs.comm_stats() as st:
        fs.shard_map(
            lambda lg, lab: vocab_parallel_cross_entropy(lg, lab),
            mesh=mesh,
            in_specs=(P(None, None, "tp"), P()),
            out_specs=P(),
        )(logits, _labels())
    assert st.calls("all_gather") == 0 and st.calls("all_to_all") == 0
    assert st.bytes() == B * S * 4 + 2 * B * S * 4  # pmax of [b, s] and one psum of [b, s, 2], float32


def test_labels_out_of_range() -> None:
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    bad = _labels()
    bad[1, 1] = V
    with pytest.raises(fs.ShardingError, match=f"labels contain {V}, outside \\[0, {V}\\)"):
        fs.shard_map(vocab_parallel_cross_entropy, mesh=mesh, in_specs=(P(None, None, "tp"), P()), out_specs=P())(
            _rand(B, S, V, seed=1), bad
        )


def test_vocab_not_divisible_splits_unevenly() -> None:
    """A vocabulary of 30 on tp=4: blocks of 8, 8, 7, 7 rows (torch.tensor_split's), forward and backward."""
    mesh = fs.make_mesh({"tp": 4}, backend="sim")
    ids = torch.tensor([[0, 7, 8, 15], [16, 22, 23, 29]])
    table = torch.randn(30, 4, requires_grad=True)
    out = fs.shard_map(vocab_parallel_embedding, mesh=mesh, in_specs=(P(), P("tp")), out_specs=P())(ids, table)
    want = F.embedding(ids, table)
    assert torch.allclose(fs.device_get(out), want)
    g = torch.randn(2, 4, 4)
    (got,) = torch.autograd.grad(fs.device_get(out), table, g)
    (ref,) = torch.autograd.grad(want, table, g)
    assert torch.allclose(got, ref)
    logits = torch.randn(2, 3, 30, requires_grad=True)
    labels = torch.tensor([[0, 8, 29], [15, 16, -100]])
    loss = fs.shard_map(vocab_parallel_cross_entropy, mesh=mesh, in_specs=(P(None, None, "tp"), P()), out_specs=P())
    got_loss = fs.device_get(loss(logits, labels))
    ref_loss = F.cross_entropy(logits.reshape(-1, 30), labels.reshape(-1))
    assert torch.allclose(got_loss, ref_loss)
    assert torch.allclose(torch.autograd.grad(got_loss, logits)[0], torch.autograd.grad(ref_loss, logits)[0])
