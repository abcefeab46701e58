"""The Llama's context parallelism in the zigzag layout (its default, ``ParallelPlan.cp_layout``), over even and
uneven sequences: the inputs (tokens, targets) and ``forward``'s logits keep their contiguous ``torch.tensor_split``
blocks over ``cp``; inside, device ``i`` of ``n`` holds chunks ``i`` and ``2n-1-i`` (RoPE at those positions).

Checked against the unsharded model: the loss and every gradient, and ``forward``'s logits, on cp=4 with
sequences of 32 and 30, cp=2 x tp=2 with SP on 15, dp=2 x cp=2 on 15, fsdp=2 x cp=2 on 13, the contiguous layout
for contrast (sim, check_vma on and off), and one case under dist; the pipelined Llama (pp=2 x cp=2) on 15 and
the Mixtral (cp=2 x ep=2) on 13. The balance: each device's attention matmul FLOPs, counted by
``torch.utils.flop_counter`` inside ``shard_map`` during the loss's forward, equal on every device for an even
sequence on cp=4 under zigzag, follow ``ops.ring_work`` (the block plan's query-key pairs, plus the masked half of
the diagonal block the kernel computes anyway), and climb in the contiguous layout's 1 : 2 : 3 : 4 staircase. The
cost: what zigzag adds to the collectives (the ids' all-gathers; ``forward``'s hidden states).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import funcshard as fs
from funcshard import P
from funcshard.models import llama, mixtral, plan_from_mesh
from funcshard.ops import ring_work

CFG = llama.Config(vocab_size=250, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=64, max_seq_len=32)
#: mesh, batch, sequence, sequence parallel, cp layout
CASES = {
    "cp4_seq32": ({"cp": 4}, 2, 32, False, "zigzag"),
    "cp4_seq30": ({"cp": 4}, 2, 30, False, "zigzag"),
    "cp4_seq30_contiguous": ({"cp": 4}, 2, 30, False, "contiguous"),
    "cp2_tp2_sp_seq15": ({"cp": 2, "tp": 2}, 2, 15, True, "zigzag"),
    "dp2_cp2_seq15": ({"dp": 2, "cp": 2}, 3, 15, False, "zigzag"),
    "fsdp2_cp2_seq13": ({"fsdp": 2, "cp": 2}, 2, 13, False, "zigzag"),
}


def _data(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, CFG.vocab_size, (batch, seq), generator=g)
    tgt = torch.randint(0, CFG.vocab_size, (batch, seq), generator=g)
    tgt[0, :3] = -100  # ignored positions count nowhere
    return tok, tgt


def _llama_body(mesh: fs.Mesh, batch: int, seq: int, sp: bool, layout: str, check_vma: bool) -> str:
    cfg = dataclasses.replace(CFG, sequence_parallel=sp)
    params = llama.init(fs.random.key(0), cfg)
    tok, tgt = _data(batch, seq)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, cfg))(params)
    plan = plan_from_mesh(mesh, sequence_parallel=sp, cp_layout=layout)
    specs, bs = llama.param_specs(cfg, mesh, plan), llama.batch_spec(mesh, plan)

    def step(p: dict, t: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return fs.value_and_grad(lambda p: llama.loss(p, t, y, cfg, plan))(p)

    f = fs.shard_map(step, mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs), check_vma=check_vma)
    placed = fs.device_put(params, mesh, specs)
    loss, grads = f(placed, tok, tgt)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    got = fs.pytree.leaves_with_path(fs.device_get(grads))
    for (path, a), (_, r) in zip(got, fs.pytree.leaves_with_path(ref_grads), strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6, msg=path)
    # forward: the logits come back in the tokens' contiguous blocks (vocab-parallel over tp)
    out_spec = P(*bs.entries, "tp" if "tp" in mesh.shape else None)
    fwd = fs.shard_map(lambda p, t: llama.forward(p, t, cfg, plan), mesh=mesh, in_specs=(specs, bs), out_specs=out_spec)
    logits = fs.device_get(fwd(placed, tok))
    torch.testing.assert_close(logits, llama.forward(params, tok, cfg), rtol=1e-5, atol=1e-5)
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_llama_cp_sim(name: str, check_vma: bool) -> None:
    from _dist_pool import run_body

    shape, batch, seq, sp, layout = CASES[name]
    assert run_body("sim", _llama_body, shape, batch, seq, sp, layout, check_vma) == ["ok"]


@pytest.mark.dist
@pytest.mark.parametrize("name", ["dp2_cp2_seq15", "cp4_seq30"])
def test_llama_cp_dist(name: str) -> None:
    from _dist_pool import run_body

    shape, batch, seq, sp, layout = CASES[name]
    assert set(run_body("dist", _llama_body, shape, batch, seq, sp, layout, True)) == {"ok"}


def _pipelined_body(mesh: fs.Mesh, seq: int) -> str:
    cfg = dataclasses.replace(CFG, n_layers=4, pp_microbatches=2, pp_schedule="1f1b")
    params = llama.init(fs.random.key(0), cfg)
    tok, tgt = _data(4, seq)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, cfg))(params)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    f = fs.shard_map(
        lambda p, t, y: llama.value_and_grad(p, t, y, cfg), mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs)
    )
    placed = fs.device_put(params, mesh, specs)
    loss, grads = f(placed, tok, tgt)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    got = fs.pytree.leaves_with_path(fs.device_get(grads))
    for (path, a), (_, r) in zip(got, fs.pytree.leaves_with_path(ref_grads), strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6, msg=path)
    # forward: the stages in turn, the hidden states back in contiguous blocks before the head
    fwd = fs.shard_map(lambda p, t: llama.forward(p, t, cfg), mesh=mesh, in_specs=(specs, bs), out_specs=bs)
    torch.testing.assert_close(fs.device_get(fwd(placed, tok)), llama.forward(params, tok, cfg), rtol=1e-5, atol=1e-5)
    return "ok"


def test_llama_pipelined_cp_uneven_sim() -> None:
    from _dist_pool import run_body

    assert run_body("sim", _pipelined_body, {"pp": 2, "cp": 2}, 15) == ["ok"]


def _mixtral_body(mesh: fs.Mesh, seq: int) -> str:
    """The Mixtral (the Llama's layers with a MoE feed-forward and its router statistics) on the same path:
    loss with its load-balancing term, every gradient and the forward's logits."""
    cfg = mixtral.Config(
        vocab_size=250, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16, n_experts=4,
        router_aux_loss_coef=0.3,
    )  # fmt: skip
    params = mixtral.init(fs.random.key(0), cfg)
    tok, tgt = _data(2, seq)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: mixtral.loss(p, tok, tgt, cfg))(params)
    specs, bs = mixtral.param_specs(cfg, mesh), mixtral.batch_spec(mesh)
    placed = fs.device_put(params, mesh, specs)
    step = lambda p, t, y: mixtral.value_and_grad(p, t, y, cfg)  # noqa: E731
    loss, grads = fs.shard_map(step, mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs))(placed, tok, tgt)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    got = fs.pytree.leaves_with_path(fs.device_get(grads))
    for (path, a), (_, r) in zip(got, fs.pytree.leaves_with_path(ref_grads), strict=True):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-6, msg=path)
    fwd = fs.shard_map(lambda p, t: mixtral.forward(p, t, cfg), mesh=mesh, in_specs=(specs, bs), out_specs=bs)
    torch.testing.assert_close(fs.device_get(fwd(placed, tok)), mixtral.forward(params, tok, cfg), rtol=1e-5, atol=1e-5)
    return "ok"


def test_mixtral_cp_uneven_sim() -> None:
    from _dist_pool import run_body

    assert run_body("sim", _mixtral_body, {"cp": 2, "ep": 2}, 13) == ["ok"]


# --- the causal work per device ---------------------------------------------------------------------------------


def _attention_flops(seq: int, layout: str, check_vma: bool = True) -> list[int]:
    """Each cp=4 device's attention matmul FLOPs (``aten.bmm``: q k^T and p v; the linears are ``mm``) in the
    Llama loss's forward, counted on the device inside ``shard_map``."""
    mesh = fs.make_mesh({"cp": 4}, backend="sim")
    params = llama.init(fs.random.key(0), CFG)
    tok, tgt = _data(2, seq)
    plan = plan_from_mesh(mesh, cp_layout=layout)
    specs, bs = llama.param_specs(CFG, mesh, plan), llama.batch_spec(mesh, plan)

    def body(p: dict, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with FlopCounterMode(display=False) as counter:
            llama.loss(p, t, y, CFG, plan)
        flops = sum(n for op, n in counter.get_flop_counts()["Global"].items() if "bmm" in str(op))
        return torch.full((1,), float(flops), dtype=torch.float64) + 0 * fs.axis_index("cp")  # varies over cp

    f = fs.shard_map(body, mesh=mesh, in_specs=(specs, bs, bs), out_specs=P("cp"), check_vma=check_vma)
    return [int(x) for x in fs.device_get(f(fs.device_put(params, mesh, specs), tok, tgt)).tolist()]


def _predicted(seq: int, layout: str) -> list[int]:
    """``ring_work``'s query-key pairs, plus the masked upper half of the diagonal block (computed, then masked),
    at 2 matmuls x 2 FLOPs x head_dim per pair, for every query head, sequence and layer."""
    sizes = [len(c) for c in torch.tensor_split(torch.arange(seq), 4)]
    pairs = [w + s * (s - 1) // 2 for w, s in zip(ring_work(seq, 4, layout), sizes, strict=True)]
    return [4 * CFG.head_dim * CFG.n_heads * 2 * CFG.n_layers * p for p in pairs]


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_llama_cp4_zigzag_balances_the_causal_work(check_vma: bool) -> None:
    zig = _attention_flops(32, "zigzag", check_vma)
    assert len(set(zig)) == 1 and zig[0] > 0, zig  # every device the same attention work
    assert zig == _predicted(32, "zigzag")
    assert ring_work(32, 4, "zigzag") == [132] * 4
    con = _attention_flops(32, "contiguous", check_vma)  # for contrast: the staircase 1 : 2 : 3 : 4
    assert con == _predicted(32, "contiguous") and [c // con[0] for c in con] == [1, 2, 3, 4]
    assert ring_work(32, 4, "contiguous") == [36, 100, 164, 228]
    assert sum(zig) == sum(con)  # the same work in all, spread evenly


def test_llama_cp4_zigzag_uneven_work() -> None:
    zig = _attention_flops(30, "zigzag")
    assert zig == _predicted(30, "zigzag")
    row = 4 * CFG.head_dim * CFG.n_heads * 2 * CFG.n_layers * 30  # one query row of the whole sequence
    assert max(zig) - min(zig) <= 2 * row, zig  # the pairs within one row, the diagonal's masked half within one
    con = _attention_flops(30, "contiguous")
    assert max(con) - min(con) > 3 * (max(zig) - min(zig)), (con, zig)


def test_unknown_cp_layout() -> None:
    with pytest.raises(fs.ConfigError, match=r"unknown cp_layout 'striped'"):
        plan_from_mesh(fs.make_mesh({"cp": 2}, backend="sim"), cp_layout="striped")


def _comm_rows(seq: int, layout: str, what: str) -> dict[tuple[str, str], tuple[int, int]]:
    """Device 0's collectives (``fs.comm_stats``) in a loss-and-gradient step (``what="step"``) or a forward of the
    Llama on cp=4, batch 2."""
    mesh = fs.make_mesh({"cp": 4}, backend="sim")
    tok, tgt = _data(2, seq)
    plan = plan_from_mesh(mesh, cp_layout=layout)
    specs, bs = llama.param_specs(CFG, mesh, plan), llama.batch_spec(mesh, plan)
    params = fs.device_put(llama.init(fs.random.key(0), CFG), mesh, specs)
    if what == "step":
        f = fs.shard_map(
            lambda p, t, y: fs.value_and_grad(lambda p: llama.loss(p, t, y, CFG, plan))(p),
            mesh=mesh,
            in_specs=(specs, bs, bs),
            out_specs=(P(), specs),
        )
        args = (params, tok, tgt)
    else:
        f = fs.shard_map(lambda p, t: llama.forward(p, t, CFG, plan), mesh=mesh, in_specs=(specs, bs), out_specs=bs)
        args = (params, tok)
    with fs.comm_stats() as st:
        f(*args)
    return st.rows()


@pytest.mark.parametrize("seq", [32, 30])
def test_zigzag_costs_the_ids_gathers(seq: int) -> None:
    """What zigzag adds to the contiguous layout's collectives: in a training step, two all-gathers over cp of
    the int32 ids (tokens, targets: b x 8 positions x 4 bytes each from a device, the longest block); in a forward,
    the tokens' and one of the final hidden states (b x 8 x dim float32) to put them back in order. The ring's
    ppermutes and everything else are the same."""
    b, longest = 2, 8
    for what, extra in (("step", [b * longest * 4] * 2), ("forward", [b * longest * 4, b * longest * CFG.dim * 4])):
        zig, con = _comm_rows(seq, "zigzag", what), _comm_rows(seq, "contiguous", what)
        gathers = ("all_gather", "cp")
        calls, nbytes = zig[gathers][0] - con.get(gathers, (0, 0))[0], zig[gathers][1] - con.get(gathers, (0, 0))[1]
        assert (calls, nbytes) == (len(extra), sum(extra)), (what, zig, con)
        assert {k: v for k, v in zig.items() if k != gathers} == {k: v for k, v in con.items() if k != gathers}
