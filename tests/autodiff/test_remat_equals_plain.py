"""``fs.remat``: the recomputed function equals the plain one (values and gradients, bitwise in fp32), for each
policy, under torch.autograd, ``fs.value_and_grad`` and ``torch.func``, and inside shard_map with collectives
(psum, all_gather, ppermute) under sim and dist, check_vma on and off; it recomputes, and saves what the policy
says and nothing more."""

from __future__ import annotations

import threading
from typing import Any

import optree
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import funcshard as fs
from funcshard import P

rp = fs.remat_policies
POLICIES = {
    "nothing": rp.nothing_saveable,
    "dots": rp.dots_saveable,
    "dots_no_batch": rp.dots_with_no_batch_dims_saveable,
    "names": rp.save_only_these_names("h"),
    "except_names": rp.save_anything_except_these_names("h"),
    "everything": rp.everything_saveable,
}


def _f(x: torch.Tensor, w: torch.Tensor, calls: list[int] | None = None) -> torch.Tensor:
    if calls is not None:
        calls.append(1)
    h = torch.tanh(x @ w)  # [b, d] @ [d, d] -> [b, d]
    h = fs.checkpoint_name(h * 2, "h")
    return (h @ w.T).sin()  # [b, d] @ [d, d] -> [b, d]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 4, generator=g), torch.randn(4, 4, generator=g)


def _loss(f: Any) -> Any:
    return lambda w, x: f(x, w).pow(2).sum()


@pytest.mark.parametrize("name", list(POLICIES))
def test_equal_to_plain_bitwise(name: str) -> None:
    x, w = _data()
    policy = POLICIES[name]
    ref_v, ref_g = fs.value_and_grad(_loss(_f))(w, x)
    v, g = fs.value_and_grad(_loss(fs.remat(_f, policy)))(w, x)
    assert torch.equal(v, ref_v) and torch.equal(g, ref_g)
    assert torch.equal(torch.func.grad(_loss(fs.remat(_f, policy)))(w, x), ref_g)  # under torch.func
    wr = w.clone().requires_grad_()
    _loss(fs.remat(_f, policy))(wr, x).backward()  # plain torch.autograd
    assert torch.equal(wr.grad, ref_g)


def test_recomputes_and_saves_by_policy() -> None:
    x, w = _data()
    wr = w.clone().requires_grad_()
    expected = {"nothing": 2, "dots": 4, "dots_no_batch": 4, "names": 3}  # inputs (+ 2 matmuls | + "h")
    for name, n_saved in expected.items():
        calls: list[int] = []
        packed: list[torch.Tensor] = []

        def pack(t: torch.Tensor, packed: list[torch.Tensor] = packed) -> torch.Tensor:
            packed.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = fs.remat(lambda x, w, calls=calls: _f(x, w, calls), POLICIES[name])(x, wr)
        assert len(packed) == n_saved, (name, [tuple(t.shape) for t in packed])
        assert len(calls) == 1
        y.sum().backward()
        assert len(calls) == 2, "the backward recomputes f"
    calls = []
    fs.remat(lambda x, w: _f(x, w, calls), rp.everything_saveable)(x, wr).sum().backward()
    assert len(calls) == 1, "everything_saveable recomputes nothing"


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.mm += func.overloadpacket is torch.ops.aten.mm
        return func(*args, **(kwargs or {}))


@pytest.mark.counters
def test_policy_saves_are_replayed_past_autograds_own_detaches() -> None:
    # tanh saves its output for the backward: autograd detaches it in the recomputation (no saved-tensor hook
    # there) but not in the forward (whose hook saves nothing); a replay that numbered those detaches lost its
    # place there and recomputed the second matmul (and everything after it), as full remat would
    x, w = _data()
    wr = w.clone().requires_grad_()
    counter = _CountMatmuls()
    with counter:
        y = fs.remat(_f, rp.dots_saveable)(x, wr)
        forward = counter.mm
        y.sum().backward()
    assert forward == 2
    assert counter.mm - forward == 3, "the backward's own: dL/dw of x @ w, dL/dh and dL/dw of h @ w.T; no recompute"
    ref = w.clone().requires_grad_()
    _f(x, ref).sum().backward()
    assert torch.equal(wr.grad, ref.grad)


def test_higher_derivatives_and_vmap() -> None:
    x, w = (t.double() for t in _data())
    hvp = torch.func.grad(lambda w: torch.func.grad(_loss(fs.remat(_f)))(w, x).sum())(w)
    ref = torch.func.grad(lambda w: torch.func.grad(_loss(_f))(w, x).sum())(w)
    torch.testing.assert_close(hvp, ref)
    wr = w.clone().requires_grad_()
    (g,) = torch.autograd.grad(_loss(fs.remat(_f))(wr, x), wr, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), wr)
    torch.testing.assert_close(h, ref)
    per = torch.func.vmap(lambda x: torch.func.grad(_loss(fs.remat(_f)))(w, x))(x[:, None])
    torch.testing.assert_close(per, torch.func.vmap(lambda x: torch.func.grad(_loss(_f))(w, x))(x[:, None]))


def test_pytrees_and_rng_replayed() -> None:
    x, w = _data()

    def f(inp: dict[str, Any], p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, str]:
        mask = torch.rand_like(inp["x"]) > 0.5  # a random draw: the recomputation must see the same one
        return (inp["x"] * mask) @ p["w"], inp["tag"]

    p = {"w": w.clone().requires_grad_()}
    torch.manual_seed(1)
    y, tag = fs.remat(f)({"x": x, "tag": "keep"}, p)
    y.pow(2).sum().backward()
    torch.manual_seed(1)
    p2 = {"w": w.clone().requires_grad_()}
    y2, _ = f({"x": x, "tag": "keep"}, p2)
    y2.pow(2).sum().backward()
    assert tag == "keep" and torch.equal(y, y2) and torch.equal(p["w"].grad, p2["w"].grad)


def test_errors() -> None:
    x, w = _data()
    wr = w.clone().requires_grad_()
    with pytest.raises(fs.ConfigError, match="not one of its arguments"):
        fs.remat(lambda x: x @ wr)(x.clone().requires_grad_())
    with pytest.raises(fs.ConfigError, match=r"policy must be one of fs\.remat_policies"):
        fs.remat(_f, policy="dots")
    with pytest.raises(fs.ConfigError, match="expected a function"):
        fs.remat(3)
    with pytest.raises(fs.ConfigError, match="non-empty string"):
        rp.save_only_these_names()
    with pytest.raises(fs.ConfigError, match="non-empty string"):
        fs.checkpoint_name(x, "")


# ---------------------------------------------------------------------------------- inside shard_map


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w)  # [b/dp, d] @ [d, f/tp] -> [b/dp, f/tp]
    h = fs.checkpoint_name(h, "h")
    g = fs.all_gather(h, "tp", dim=1, tiled=True)  # [b/dp, f/tp] -> [b/dp, f]
    g = fs.ppermute(g, "dp", [(0, 1), (1, 0)])  # swap the dp halves
    s = fs.psum(h.pow(2).sum(-1, keepdim=True), "tp")  # [b/dp, 1]: psum over tp
    return g * s


def _shard_body(mesh: fs.Mesh, check_vma: bool, policy_name: str, save_collectives: bool) -> list[Any]:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 6, generator=g), torch.randn(6, 4, generator=g)
    calls: dict[int, int] = {}  # per device thread (sim runs the devices as threads of this process)

    def counted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        me = threading.get_ident()
        calls[me] = calls.get(me, 0) + 1
        return _block(x, w)

    def step(w: torch.Tensor, x: torch.Tensor) -> Any:
        blk = fs.remat(counted, POLICIES[policy_name], save_collectives=save_collectives)

        def loss(block: Any) -> Any:
            # without check_vma, by hand what it inserts: w meets the dp-sharded x
            return lambda w: fs.psum(block(x, w if check_vma else fs.pvary(w, "dp")).pow(2).sum(), ("dp", "tp"))

        v0, g0 = fs.value_and_grad(loss(_block))(w)
        v1, g1 = fs.value_and_grad(loss(blk))(w)
        g2 = torch.func.grad(loss(blk))(w)
        return v0, g0, v1, g1, g2, torch.tensor(calls[threading.get_ident()])

    f = fs.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(None, "tp"), P("dp")),
        out_specs=(P(), P(None, "tp")) * 2 + (P(None, "tp"), P()),
        check_vma=check_vma,
    )
    with fs.comm_stats() as stats:
        out = [fs.device_get(o) for o in f(w, x)]
    return [*out, stats.calls("ppermute")]


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
@pytest.mark.parametrize(("policy_name", "save"), [("nothing", False), ("dots", True), ("names", False)])
def test_in_shard_map_with_collectives(run, check_vma: bool, policy_name: str, save: bool) -> None:
    for v0, g0, v1, g1, g2, n_calls, n_ppermute in run(_shard_body, {"dp": 2, "tp": 2}, check_vma, policy_name, save):
        assert torch.equal(v0, v1) and torch.equal(g0, g1) and torch.equal(g0, g2)
        # value_and_grad: forward + recomputation; torch.func.grad inside shard_map: a plain call
        assert int(n_calls) == 3
        # ppermute calls (comm_stats counts a replayed one too): plain 1 + 1 (its backward); remat'd: 1 + 1 + the
        # recomputation's; torch.func.grad: 1 + 1
        assert n_ppermute == 2 + 3 + 2


def _row_parallel_body(mesh: fs.Mesh) -> list[torch.Tensor]:
    from funcshard.ops import row_parallel_linear

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 6, generator=g), torch.randn(4, 6, generator=g)

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # [b/dp, in/tp] @ [in/tp, out] -> psum over tp, summed in the matmul's own buffer (psum_owned under dist)
        return torch.tanh(row_parallel_linear(x, w, axis="tp"))

    def step(w: torch.Tensor, x: torch.Tensor) -> Any:
        def loss(blk: Any) -> Any:
            return lambda w: fs.psum(blk(x, w).pow(2).sum(), "dp")

        return (*fs.value_and_grad(loss(block))(w), *fs.value_and_grad(loss(fs.remat(block, rp.dots_saveable)))(w))

    specs = (P(), P(None, "tp"))
    f = fs.shard_map(step, mesh=mesh, in_specs=(P(None, "tp"), P("dp", "tp")), out_specs=specs * 2)
    return [fs.device_get(o) for o in f(w, x)]


def test_saved_matmul_of_a_row_parallel_sum_is_not_summed_into(run) -> None:
    # the policy saves the matmul's output, which psum_owned would sum into in place (dist): the recomputation
    # must hand back the partial product, not the sum (summed a second time then)
    for v0, g0, v1, g1 in run(_row_parallel_body, {"dp": 2, "tp": 2}):
        assert torch.equal(v0, v1) and torch.equal(g0, g1)


def _outside_body(mesh: fs.Mesh) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 6, generator=g), torch.randn(6, 4, generator=g)

    def loss(block: Any) -> Any:
        return lambda w, x: fs.psum(block(x, w).pow(2).sum(), ("dp", "tp"))

    grads = []
    for block in (_block, fs.remat(_block)):
        wr = w.clone().requires_grad_()
        f = fs.shard_map(loss(block), mesh=mesh, in_specs=(P(None, "tp"), P("dp")), out_specs=P())
        fs.device_get(f(wr, x)).backward() if mesh.backend == "sim" else f(wr, x).local.backward()
        grads.append(wr.grad)
    return grads


def test_differentiated_from_outside_shard_map() -> None:
    from _dist_pool import run_body

    ((plain, remat),) = run_body("sim", _outside_body, {"dp": 2, "tp": 2})
    assert torch.equal(plain, remat)


# ---------------------------------------------------------------------------------- the Llama


def _llama_body(mesh: fs.Mesh, sp: bool) -> list[Any]:
    import dataclasses

    from funcshard.models import llama

    base = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
    base = dataclasses.replace(base, sequence_parallel=sp)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (4, 16), generator=g)
    params = llama.init(fs.random.key(0), base)
    out = []
    for remat in ("none", "full", "selective"):
        cfg = dataclasses.replace(base, remat=remat)
        specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
        step = fs.shard_map(
            lambda p, t, y, cfg=cfg: fs.value_and_grad(llama.loss)(p, t, y, cfg),
            mesh=mesh,
            in_specs=(specs, bs, bs),
            out_specs=(P(), specs),
        )
        out.append(fs.device_get(step(params, tokens, tokens.roll(-1, dims=1))))
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_llama_remat_equals_plain(run, sp: bool) -> None:
    for (v0, g0), *rest in run(_llama_body, {"dp": 2, "tp": 2}, sp):
        for v, g in rest:
            assert torch.equal(v, v0)
            for a, b in zip(optree.tree_leaves(g), optree.tree_leaves(g0), strict=True):
                assert torch.equal(a, b)  # the same ops on the same numbers: bitwise


def test_llama_config_rejects_unknown_remat() -> None:
    from funcshard.models import llama

    with pytest.raises(fs.ConfigError, match="remat='some'"):
        llama.Config(remat="some")
