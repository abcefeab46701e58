"""``shard_map(..., compile=...)``: a compiled Llama train step equals the eager one under dist, in one graph.

The compiler here is ``aot_eager`` (torch.compile's graph capture and AOTAutograd, without inductor's code
generation), so the tests stay within a minute on two CPU cores; ``bench/compile.py`` runs inductor and reports
the speedup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import optree
import pytest
import torch
from _dist_pool import run_body

import funcshard as fs
from funcshard import P, optim
from funcshard.models import llama

pytestmark = pytest.mark.counters

CFG = llama.Config(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=32, max_seq_len=8)
COMPILE = {"backend": "aot_eager"}


def _train(
    mesh: fs.Mesh, compile: bool | dict, donate: tuple[int, ...] = (), cfg: llama.Config = CFG
) -> tuple[list[float], list, dict]:
    """Three AdamW steps of the Llama: the losses, the final params (full), the communication of the last step."""
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    opt = optim.adamw(1e-2, b2=0.95, weight_decay=0.1)
    sspecs = opt.state_specs(specs)

    def step_fn(p, s, x, y):
        loss, g = llama.value_and_grad(p, x, y, cfg)
        p, s = opt.update(g, s, p)
        return loss, p, s

    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (4, 8), generator=gen) for _ in range(2))
    p = fs.shard_map(lambda k: llama.init(k, cfg), mesh=mesh, in_specs=(P(),), out_specs=specs)(fs.random.key(0))
    s = fs.shard_map(opt.init, mesh=mesh, in_specs=(specs,), out_specs=sspecs)(p)
    step = fs.shard_map(
        step_fn,
        mesh=mesh,
        in_specs=(specs, sspecs, bs, bs),
        out_specs=(P(), specs, sspecs),
        donate=donate,
        compile=compile,
    )
    losses = []
    for _ in range(3):
        with fs.comm_stats() as stats:
            loss, p, s = step(p, s, x, y)
        losses.append(float(fs.device_get(loss)))
    comm = {(name, axis): stats.calls(name, axis) for name in ("psum", "pmax") for axis in mesh.axis_names}
    return losses, [fs.device_get(t) for t in optree.tree_leaves(p)], comm


@contextlib.contextmanager
def _recorded() -> Iterator[list]:
    """The graphs ``shard_map(..., compile=...)`` records meanwhile (``compile.recorded_hook``)."""
    import funcshard._src.shard_map.compile as fs_compile

    graphs: list = []
    fs_compile.recorded_hook = graphs.append
    try:
        yield graphs
    finally:
        fs_compile.recorded_hook = None


def _compiled_vs_eager(mesh: fs.Mesh, donate: tuple[int, ...]) -> dict:
    from torch._dynamo.utils import counters

    eager = _train(mesh, False)
    torch._dynamo.reset()
    counters.clear()
    with _recorded() as graphs:
        compiled = _train(mesh, COMPILE, donate)
    return {
        "eager": eager,
        "compiled": compiled,
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
        "fused": sum(str(n.target).startswith("funcshard.adamw_fused_") for gm in graphs for n in gm.graph.nodes),
    }


@pytest.mark.dist
@pytest.mark.parametrize(("shape", "donate"), [({"dp": 2}, ()), ({"tp": 2}, (0, 1))], ids=["dp2", "tp2-donated"])
def test_compiled_train_step_equals_eager_under_dist(shape: dict[str, int], donate: tuple[int, ...]) -> None:
    for r in run_body("dist", _compiled_vs_eager, shape, donate):
        (e_loss, e_params, e_comm), (c_loss, c_params, c_comm) = r["eager"], r["compiled"]
        torch.testing.assert_close(torch.tensor(c_loss), torch.tensor(e_loss), rtol=1e-5, atol=0)
        for a, b in zip(c_params, e_params, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert c_comm == e_comm  # the collectives recorded at the trace are counted at every compiled call
        assert r["graph_breaks"] == 0 and r["graphs"] == 1  # the whole step, forward + backward + AdamW: one graph
        # donated params and moments: AdamW is the fused kernel, one op of the graph writing them in place
        assert r["fused"] == (1 if donate else 0), r["fused"]


def _collectives(mesh: fs.Mesh) -> list[list[torch.Tensor]]:
    """Every collective, forward and backward, compiled and eager (a ppermute that leaves a device without a
    block, too)."""

    def body(x, w):
        def loss(x, w):
            h = fs.all_gather(x * w, "a", dim=0, tiled=True)  # [2, 4] -> [4, 4]
            h = fs.psum_scatter(h.sin(), "a", dim=1, tiled=True)  # [4, 4] -> [4, 2]
            h = fs.all_to_all(h, "a", 0, 1, tiled=True)  # [4, 2] -> [2, 4]
            h = fs.ppermute(h, "a", [(0, 1), (1, 0)]) + fs.ppermute(h, "a", [(0, 1)])  # [2, 4] -> [2, 4]
            return fs.psum((h * fs.pmax(h, "a")).sum(), "a")

        return fs.value_and_grad(loss, argnums=(0, 1))(x, w)

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 4, generator=gen), torch.randn(2, 8, generator=gen)
    specs = (P("a"), P(None, "a"))
    outs = []
    for compile in (False, COMPILE):
        f = fs.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), specs), compile=compile)
        outs.append([fs.device_get(t) for t in optree.tree_leaves(f(x, w))])
    return outs


@pytest.mark.dist
def test_every_collective_compiles_under_dist() -> None:
    for eager, compiled in run_body("dist", _collectives, {"a": 2}):
        for c, e in zip(compiled, eager, strict=True):
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)


def _value_read(mesh: fs.Mesh) -> str:
    def f(x):
        if x.sum() > 0:  # a Python branch on a value: frozen in a recorded graph
            return x * 2
        return x

    g = fs.shard_map(f, mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"), compile=COMPILE)
    with pytest.raises(fs.ShardingError, match=r"reads the value of a tensor.*test_compile_one_graph\.py") as e:
        g(torch.ones(4))
    return str(e.value)


@pytest.mark.dist
def test_value_read_in_a_compiled_body_is_refused_under_dist() -> None:
    for msg in run_body("dist", _value_read, {"dp": 2}):
        assert "if x.sum() > 0" in msg and "torch.where" in msg


def test_compile_under_sim_runs_eagerly_with_one_warning() -> None:
    mesh = fs.make_mesh({"dp": 2}, backend="sim")
    f = fs.shard_map(lambda x: fs.psum(x * 2, "dp"), mesh=mesh, in_specs=(P("dp"),), out_specs=P(), compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [fs.device_get(f(torch.arange(4.0))) for _ in range(2)]
    assert len([w for w in caught if "compile= is ignored" in str(w.message)]) == 1
    assert "threads" in str(caught[0].message)
    for out in outs:
        torch.testing.assert_close(out, torch.tensor([4.0, 8.0]))


def test_compile_option_is_checked() -> None:
    mesh = fs.make_mesh({"dp": 2}, backend="sim")
    with pytest.raises(fs.ShardingError, match=r"torch\.compile options"):
        fs.shard_map(lambda x: x, mesh=mesh, in_specs=(P(),), out_specs=P(), compile="yes")
    with pytest.raises(fs.ShardingError, match=r"torch\.compile options"):
        fs.shard_map(lambda x: x, mesh=mesh, in_specs=(P(),), out_specs=P(), compile={"bakend": "inductor"})


def _recorded_writes(mesh: fs.Mesh) -> dict:
    """The Llama step of two stacked layers (dp=2) recorded for compile=: the ops that write into memory kept from
    call to call (``out=`` stacks and cats: the eager path's gradient buckets and stacked-gradient buffers), and
    whether its losses and params equal the eager step's."""
    cfg = dataclasses.replace(CFG, n_layers=2)  # stacked [2, ...] layer leaves
    with _recorded() as graphs:
        eager, compiled = _train(mesh, False, cfg=cfg), _train(mesh, COMPILE, cfg=cfg)
    (gm,) = graphs
    writes = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "out" in str(n.target)})
    close = all(torch.allclose(c, e, rtol=1e-5, atol=1e-7) for c, e in zip(compiled[1], eager[1], strict=True))
    return {"writes": writes, "close": close and torch.allclose(torch.tensor(compiled[0]), torch.tensor(eager[0]))}


@pytest.mark.dist
def test_recorded_step_writes_no_kept_buffer() -> None:
    # recorded into a graph, a write into a slice of a kept buffer becomes a copy of all of it (a functional
    # scatter): inductor's kernel for the 17.9M Llama's layer gradients took 405-440 ms a step (bench/compile.py)
    for r in run_body("dist", _recorded_writes, {"dp": 2}):
        assert r["close"] and r["writes"] == [], r


# ---------------------------------------------------------------- torch.compile meeting shard_map


def _tp_step(mesh: fs.Mesh, wrap_body: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A TP MLP's loss and gradients by ``fs.value_and_grad`` in a check_vma shard_map: x replicated meets the
    column-parallel w1, so its gradient needs the pvary that check_vma inserts (a psum over tp backward)."""

    def loss_fn(x, w1, w2):
        return (fs.psum(torch.tanh(x @ w1.T) @ w2.T, "tp") ** 2).mean()  # [b, d] @ [d, h/tp] @ [h/tp, d]

    def body(x, w1, w2):
        return fs.value_and_grad(loss_fn, argnums=(0, 1, 2))(x, w1, w2)

    if wrap_body:
        body = torch.compile(body, backend="aot_eager")
    specs = (P(), P("tp", None), P(None, "tp"))
    step = fs.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), specs))
    gen = torch.Generator().manual_seed(1)
    x, w1, w2 = torch.randn(4, 6, generator=gen), torch.randn(8, 6, generator=gen), torch.randn(6, 8, generator=gen)

    def train(x, w1, w2):  # torch ops around the shard_map'd call, as a train step has
        loss, grads = step(x * 1.0, w1, w2)
        return loss, grads

    if not wrap_body:
        train = torch.compile(train, backend="aot_eager")
    loss, grads = train(x, w1, w2)
    return fs.device_get(loss), [fs.device_get(g) for g in grads]


def _reference() -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    ts = [t.requires_grad_(True) for t in (torch.randn(4, 6, generator=gen), torch.randn(8, 6, generator=gen))]
    ts.append(torch.randn(6, 8, generator=gen).requires_grad_(True))
    x, w1, w2 = ts
    loss = ((torch.tanh(x @ w1.T) @ w2.T) ** 2).mean()
    return loss.detach(), list(torch.autograd.grad(loss, ts))


def _compile_around(mesh: fs.Mesh) -> tuple[torch.Tensor, list[torch.Tensor], str, int]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grads = _tp_step(mesh, wrap_body=False)
        loss, grads = _tp_step(mesh, wrap_body=False)  # (another shard_map: told again, once)
    told = sum("torch.compile runs it eagerly" in str(w.message) for w in caught)
    f = fs.shard_map(lambda x: fs.psum(x, "tp"), mesh=mesh, in_specs=(P("tp"),), out_specs=P())
    # the graph break's reason (what fullgraph=True raises; explain, not a failing fullgraph compile: after one,
    # dynamo holds an extra reference to every call's arguments in this process, which turns psum's in-place sum
    # of a temporary off for the tests that follow)
    explained = torch._dynamo.explain(lambda x: f(x + 1))(torch.ones(4))
    message = " ".join(str(r.reason) for r in explained.break_reasons)
    return loss, grads, message, told


def test_torch_compile_around_a_shard_map_runs_it_eagerly(backend: str) -> None:
    """``torch.compile(train_step)`` around a shard_map'd call: the call is a graph break that runs eagerly (no
    internal dynamo error tracing the devices and tags), the numbers those of the unsharded model; the break's
    reason (what ``fullgraph=True`` raises) names ``shard_map(..., compile=True)``; under dist (where ``compile=``
    compiles the body) one warning per shard_map'd function says so."""
    ref_loss, ref_grads = _reference()
    results = run_body(backend, _compile_around, {"tp": 2})
    for loss, grads, message, told in results:
        assert told == (2 if backend == "dist" else 0), told
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
        assert "shard_map" in message and "compile=True" in message, message


def _compiled_body(mesh: fs.Mesh) -> tuple[torch.Tensor, list[torch.Tensor], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grads = _tp_step(mesh, wrap_body=True)
    return loss, grads, [str(w.message) for w in caught if "torch.compile'd" in str(w.message)]


def test_torch_compiled_body_under_check_vma_runs_eagerly_with_one_warning(backend: str) -> None:
    """``shard_map(torch.compile(body))`` with check_vma on: dynamo cannot trace the tracking's tags, so the body
    runs eagerly with one warning naming ``compile=``; the gradient of the replicated x (which needs check_vma's
    pvary) equals the unsharded model's."""
    ref_loss, ref_grads = _reference()
    results = run_body(backend, _compiled_body, {"tp": 2})
    for loss, grads, warned in results:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
        assert len(warned) == 1 and "compile=True" in warned[0], warned


SCALE = 1.0  # a module global the compiled body below reads
OFFSET = torch.zeros(2)  # a module global tensor it reads (a constant of the recorded graph)


def _changing_values(mesh: fs.Mesh) -> dict[str, Any]:
    global SCALE, OFFSET
    from funcshard._src.shard_map import compile as _compile

    recorded: list[int] = []
    _compile.recorded_hook = lambda gm: recorded.append(1)
    k = 2.0

    def body(x):
        return fs.psum(x * k * SCALE + OFFSET, "dp")  # [n/dp] -> [n/dp], summed over dp

    step = fs.shard_map(body, mesh=mesh, in_specs=(P("dp"),), out_specs=P(), compile=COMPILE)
    x = torch.arange(4.0)
    outs, wants = [], []

    def call() -> None:
        outs.append(fs.device_get(step(x)))
        wants.append((x[:2] + x[2:]) * k * SCALE + 2 * OFFSET)  # the eager value of the values now

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
            k = 3.0  # the closure cell changes
            call()
            SCALE = 5.0  # the global number changes
            call()
            OFFSET = torch.ones(2)  # the global tensor is rebound
            call()
            k, SCALE, OFFSET = 2.0, 1.0, torch.zeros(2)  # the first numbers, a new tensor: recorded again
            call()
            call()  # nothing changed: the last graph
    finally:
        _compile.recorded_hook = None
        SCALE, OFFSET = 1.0, torch.zeros(2)
    warned = [str(w.message) for w in caught if "changed since it was recorded" in str(w.message)]
    return {"outs": outs, "wants": wants, "recorded": len(recorded), "warned": warned}


@pytest.mark.dist
def test_compiled_body_is_recorded_again_when_a_python_value_it_reads_changes() -> None:
    """A number the compiled body reads from its closure or a module global (a learning rate, a flag), or a global
    tensor rebound to another, is not frozen silently: a changed value records the body again (one graph per
    value), with one warning naming the variable; the results are the eager ones."""
    for r in run_body("dist", _changing_values, {"dp": 2}):
        for out, want in zip(r["outs"], r["wants"], strict=True):
            assert torch.equal(out, want), (r["outs"], r["wants"])
        assert r["recorded"] == 5, r
        assert len(r["warned"]) == 1 and "k (closed over by" in r["warned"][0], r["warned"]


def _mlp_loss(params: dict, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    h = torch.tanh(x @ params["layers"]["w1"].T + params["layers"]["b1"])  # [b, d] @ [d, h] -> [b, h]
    out = h @ params["head"]["w"].T  # [b, h] @ [h, 1] -> [b, 1]
    return (out**2).mean(), {"mean": out.mean(), "n": x.shape[0]}


@pytest.mark.parametrize("has_aux", [False, True])
def test_torch_compile_of_value_and_grad_on_a_nested_dict(has_aux: bool) -> None:
    """``torch.compile(fs.value_and_grad(f))`` on nested-dict params, one device, no shard_map: the value, aux and
    gradients equal eager's (it raised ``ValueError: length mismatch`` in dynamo's optree polyfill: the
    plain-autograd path's graph breaks left a tree structure made before a break to unflatten after it)."""
    gen = torch.Generator().manual_seed(0)
    params = {
        "layers": {"w1": torch.randn(5, 3, generator=gen), "b1": torch.randn(5, generator=gen)},
        "head": {"w": torch.randn(1, 5, generator=gen)},
    }
    x = torch.randn(4, 3, generator=gen)
    f = _mlp_loss if has_aux else (lambda p, x: _mlp_loss(p, x)[0])
    vag = fs.value_and_grad(f, has_aux=has_aux)
    want_value, want_grads = vag(params, x)
    torch._dynamo.reset()
    got_value, got_grads = torch.compile(vag, backend="aot_eager")(params, x)
    if has_aux:
        (got_value, got_aux), (want_value, want_aux) = got_value, want_value
        assert got_aux["n"] == want_aux["n"] == 4
        torch.testing.assert_close(got_aux["mean"], want_aux["mean"])
    torch.testing.assert_close(got_value, want_value)
    assert optree.tree_structure(got_grads) == optree.tree_structure(want_grads)
    for g, w in zip(optree.tree_leaves(got_grads), optree.tree_leaves(want_grads), strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("which", ["adamw", "clip+adamw", "sgd"])
def test_torch_compile_of_a_one_device_train_step(which: str) -> None:
    """``torch.compile`` of a one-device train step (``fs.value_and_grad`` + an ``fs.optim`` update on plain
    tensors): three steps' losses and params equal eager's (rtol 1e-5). AdamW took its fused in-place kernel on
    copies made outside the graph (aot's functionalization: INTERNAL ASSERT 'mutating a non-functional tensor');
    under dynamo it now takes the functional path."""
    opt = {
        "adamw": lambda: optim.adamw(1e-2, weight_decay=0.1),
        "clip+adamw": lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2)),
        "sgd": lambda: optim.sgd(1e-2),
    }[which]()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, generator=gen)

    def init() -> dict:
        g = torch.Generator().manual_seed(1)
        return {
            "layers": {"w1": torch.randn(5, 3, generator=g), "b1": torch.randn(5, generator=g)},
            "head": {"w": torch.randn(1, 5, generator=g)},
        }

    def step(p: dict, s: Any) -> tuple[torch.Tensor, dict, Any]:
        loss, g = fs.value_and_grad(lambda p: _mlp_loss(p, x)[0])(p)
        p, s = opt.update(g, s, p)
        return loss, p, s

    results = []
    torch._dynamo.reset()
    for f in (step, torch.compile(step, backend="aot_eager")):
        p = init()
        s = opt.init(p)
        losses = []
        for _ in range(3):
            loss, p, s = f(p, s)
            losses.append(float(loss))
        results.append((losses, optree.tree_leaves(p)))
    (want_losses, want_p), (got_losses, got_p) = results
    assert got_losses == pytest.approx(want_losses, rel=1e-5)
    for g, w in zip(got_p, want_p, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
