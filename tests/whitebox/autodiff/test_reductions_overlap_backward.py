"""Overlap of the gradient reductions with the backward (issue #11 item 1), as an event order, not a timing.

Under ``dist``, inside ``fs.value_and_grad``, each bucket's gradient all-reduce (DDP) or reduce-scatter (FSDP) is
issued when the backward reaches it and returns at once; it is waited for where its result is first used. So when
the backward computes its last gradient (the input's, below every layer), every layer's reduction has been issued
(and returned a pending result: the call did not wait for it). The numbers are those of the synchronous run,
and no pending value leaves the call. Under FSDP the next layer's all-gather is issued before this layer computes.
"""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.ops import fsdp_gather

pytestmark = pytest.mark.counters


class _Log:
    """Where the marker writes (an object, not a list: a pytree argument may be rebuilt on the way in)."""

    def __init__(self, issued: list) -> None:
        self.issued, self.at_last_grad = issued, None


class _Mark(torch.autograd.Function):
    """Identity; its backward (the last node the backward runs) records what has been issued by then."""

    @staticmethod
    def forward(x, log):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.log = inputs[1]

    @staticmethod
    def backward(ctx, g):
        ctx.log.at_last_grad = len(ctx.log.issued)
        return g, None


def _overlap_body(mesh: fs.Mesh, axis: str) -> dict:
    from funcshard._src.runtime.backends import dist as dist_backend

    issued: list = []
    log = _Log(issued)
    if mesh.backend == "dist":
        dist_backend.issued_hook = issued.append
    n_layers = 3
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(16, 16, generator=gen) / 4 for _ in range(n_layers)]
    x = torch.randn(8, 16, generator=gen)
    spec = P(axis, None) if axis == "fsdp" else P()
    specs = [spec] * n_layers

    def loss(ws, x):
        h = _Mark.apply(x, log)
        for w in ws:  # one gather (fsdp) or one pvary (dp) per layer, as the Llama's use_params
            full = fsdp_gather({"w": w}, {"w": spec}, axis="fsdp")["w"] if axis == "fsdp" else fs.pvary(w, "dp")
            h = torch.tanh(h @ full)  # [b/n, d] @ [d, d] -> [b/n, d]
        return fs.pmean(h.pow(2).mean(), axis)

    step = fs.shard_map(
        lambda ws, x: fs.value_and_grad(loss, argnums=(0, 1))(ws, x),  # x too: its gradient is the last one
        mesh=mesh,
        in_specs=(specs, P(axis)),
        out_specs=(P(), (specs, P(axis))),
    )
    try:
        value, (grads, _) = step(ws, x)
    finally:
        dist_backend.issued_hook = None
    ref_value, ref_grads = fs.value_and_grad(lambda ws: _ref(ws, x))(ws)
    close = torch.allclose(fs.device_get(value), ref_value, rtol=1e-5, atol=1e-6) and all(
        torch.allclose(fs.device_get(g), r, rtol=1e-5, atol=1e-6) for g, r in zip(grads, ref_grads, strict=True)
    )
    plain = all(type(fs.device_get(g)) is torch.Tensor for g in grads)
    pending = all(type(t).__name__ == "AsyncCollectiveTensor" for t in issued)  # returned before done
    return {"issued": len(issued), "at_last_grad": log.at_last_grad, "close": close, "plain": plain, "pending": pending}


def _ref(ws: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = x
    for w in ws:
        h = torch.tanh(h @ w)
    return h.pow(2).mean()


@pytest.mark.parametrize("axis", ["dp", "fsdp"])
def test_gradient_reductions_overlap_the_backward(run, backend, axis) -> None:
    for r in run(_overlap_body, {axis: 2}, axis):
        assert r["close"] and r["plain"], r
        if backend == "dist":
            assert r["issued"] == 3 and r["pending"], r  # one bucket per layer, each returned before it was done
            assert r["at_last_grad"] == 3, r  # all issued before the backward computes its last gradient
        else:
            assert r["issued"] == 0  # sim: synchronous


def _prefetch_body(mesh: fs.Mesh) -> dict:
    import dataclasses

    from funcshard._src.runtime.backends import dist as dist_backend
    from funcshard.models import llama
    from funcshard.models.llama import model as llama_model

    cfg = llama.Config(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
    cfg = dataclasses.replace(cfg, remat="none")  # the gathered weights kept: the forward prefetches
    issued: list = []
    seen: list = []  # at each layer's start: the gathers issued so far
    plain_layer = llama_model.layer

    def layer(x, p, *a, **kw):
        seen.append(len(issued))
        return plain_layer(x, p, *a, **kw)

    params = llama.init(fs.random.key(0), cfg)
    tok = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    step = fs.shard_map(
        lambda p, t, y: llama.value_and_grad(p, t, y, cfg), mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs)
    )
    if mesh.backend == "dist":
        dist_backend.issued_hook = lambda t: issued.append(t) if t.dim() == 1 and len(issued) < 99 else None
    llama_model.layer = layer
    try:
        loss, grads = step(fs.device_put(params, mesh, specs), tok, tok.roll(-1, 1))
    finally:
        llama_model.layer = plain_layer
        dist_backend.issued_hook = None
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tok.roll(-1, 1), cfg))(params)
    close = torch.allclose(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6) and all(
        torch.allclose(g, r, rtol=1e-5, atol=1e-6)
        for (_, g), (_, r) in zip(
            fs.pytree.leaves_with_path(fs.device_get(grads)), fs.pytree.leaves_with_path(ref_grads)
        )
    )
    pending = all(type(t).__name__ == "AsyncCollectiveTensor" for t in issued)
    return {"seen": seen, "close": close, "pending": pending}


def test_fsdp_prefetches_the_next_layer(run, backend) -> None:
    for r in run(_prefetch_body, {"fsdp": 2}):
        assert r["close"], r
        if backend == "dist":
            # at layer i's start the gathers of layers 0..i+1 are issued (the next layer's before this one computes),
            # each returned before it was done
            assert r["seen"] == [2, 3, 3] and r["pending"], r


def test_sink_waits_moves_each_wait_to_its_first_use_and_not_past_a_write() -> None:
    from funcshard._src.shard_map.compile import sink_waits

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    g = torch.fx.Graph()
    x = g.placeholder("x")
    red = g.call_function(c10d.all_reduce.default, (x, "sum", "0"))  # a gradient all-reduce, issued
    wait = g.call_function(c10d.wait_tensor.default, (red,))  # recorded right after it
    mm = g.call_function(aten.mm.default, (x, x))  # compute that does not need it
    use = g.call_function(aten.add.Tensor, (wait, mm))  # its first use
    red2 = g.call_function(c10d.all_reduce.default, (use, "sum", "0"))
    wait2 = g.call_function(c10d.wait_tensor.default, (red2,))
    write = g.call_function(aten.add_.Tensor, (x, 1.0))  # an in-place write: no wait moves past it
    mm2 = g.call_function(aten.mm.default, (x, x))
    g.output((g.call_function(aten.add.Tensor, (wait2, mm2)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert sink_waits(gm) == 1
    order = list(gm.graph.nodes)
    assert order.index(mm) < order.index(wait) == order.index(use) - 1  # the mm runs while the sum travels
    assert order.index(wait2) == order.index(write) - 1  # held before the write (it was already right there)
    assert sink_waits(gm) == 0  # nothing left to move


def _compiled_overlap_body(mesh: fs.Mesh) -> dict:
    import funcshard._src.shard_map.compile as fs_compile

    graphs: list = []
    n_layers = 3
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(16, 16, generator=gen) / 4 for _ in range(n_layers)]
    x = torch.randn(8, 16, generator=gen)

    def loss(ws, x):
        h = x
        for w in ws:  # one pvary per layer: one gradient all-reduce per layer in the backward
            h = torch.tanh(h @ fs.pvary(w, "dp"))  # [b/2, d] @ [d, d] -> [b/2, d]
        return fs.pmean(h.pow(2).mean(), "dp")

    specs = [P()] * n_layers
    outs = []
    fs_compile.recorded_hook = graphs.append
    try:
        for compile in (False, {"backend": "aot_eager"}):
            step = fs.shard_map(
                lambda ws, x: fs.value_and_grad(loss)(ws, x),
                mesh=mesh,
                in_specs=(specs, P("dp")),
                out_specs=(P(), specs),
                compile=compile,
            )
            value, grads = step(ws, x)
            outs.append([fs.device_get(value), *(fs.device_get(g) for g in grads)])
    finally:
        fs_compile.recorded_hook = None
    (gm,) = graphs
    order = list(gm.graph.nodes)
    mms_while_travelling = []  # per gradient all-reduce: the matmuls between it and its wait
    for node in order:
        if node.op == "call_function" and node.target is torch.ops._c10d_functional.all_reduce.default:
            (wait,) = [u for u in node.users if u.target is torch.ops._c10d_functional.wait_tensor.default]
            between = order[order.index(node) + 1 : order.index(wait)]
            mms_while_travelling.append(sum(n.target is torch.ops.aten.mm.default for n in between))
    close = all(torch.allclose(c, e, rtol=1e-5, atol=1e-6) for c, e in zip(outs[1], outs[0], strict=True))
    return {"mms": mms_while_travelling, "close": close}


@pytest.mark.dist
def test_compiled_step_overlaps_its_gradient_reductions_under_dist() -> None:
    from _dist_pool import run_body

    for r in run_body("dist", _compiled_overlap_body, {"dp": 2}):
        assert r["close"], r
        # the loss's pmean (forward, used at once) and the 3 layers' gradient sums (backward, last layer first):
        # layer 3's travels while layers 2 and 1 compute their backward matmuls (2 + 1: x needs no gradient),
        # layer 2's while layer 1's does; layer 1's is the last. As recorded (make_fx waits at once): 0 each.
        assert r["mms"] == [0, 3, 1, 0], r
