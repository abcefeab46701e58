"""Gradient buckets of ``fs.pvary`` (issue #11): DDP's flat buckets.

- A bucket's gradients are written ONCE into a fresh flat buffer and, under ``dist``, all-reduced in place
  (no second copy of the bucket), inside ``fs.value_and_grad``'s overlapped backward and outside it.
- ``FUNCSHARD_BUCKET_MB`` cuts a ``pvary`` of many leaves into buckets by DDP's rule (reverse leaf order, a
  bucket closes once it holds the cap): one all-reduce per bucket, each its own backward node.
- The Llama's data-parallel step makes one all-reduce per layer bucket, one for embed / norm / head together
  and one for the loss's (total, count).

Every body runs under ``sim`` and under ``dist`` (gloo) and compares with the unsharded reference.
"""

from __future__ import annotations

import os

import optree
import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard._src.collectives import lax as core_lax
from funcshard.models import llama

pytestmark = pytest.mark.counters

BATCH = 8


def _tree(sizes: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i:02d}": torch.randn(n, generator=g) / n**0.5 for i, n in enumerate(sizes)}


def _loss(ws: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A scalar using every leaf: sum over leaves of tanh(x @ w[:d]) * w.sum()."""
    d = x.shape[1]
    total = x.new_zeros(())
    for w in ws.values():
        total = total + (torch.tanh(x @ w[:d]) * w.sum()).sum()
    return total


def _reference(ws: dict[str, torch.Tensor], x: torch.Tensor) -> dict[str, torch.Tensor]:
    ref = {k: v.clone().requires_grad_(True) for k, v in ws.items()}
    return dict(zip(ref, torch.autograd.grad(_loss(ref, x), list(ref.values())), strict=True))


def _dp_grads(mesh: fs.Mesh, ws: dict[str, torch.Tensor], x: torch.Tensor, profile: bool, cast: bool = False) -> tuple:
    """The dp gradient of ``_loss`` (params pvary'd in one call, after a first leaf ``w00`` pvary'd alone: the
    backward's last node reduces synchronously, the bucket's is overlapped), the number of gradient
    all-reduces, and under ``profile`` the torch ops of the step with their input shapes. ``cast``: the others
    through ``lax.pvary_cast`` (mixed precision's buckets) in float64."""

    def loss(ws: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        first = fs.pvary(ws["w00"], "dp")  # the node made first: its reduction is the backward's last
        rest = {k: v for k, v in ws.items() if k != "w00"}
        if not cast:
            rest = fs.pvary(rest, "dp")  # one pvary call for the others
            return fs.psum(_loss({"w00": first, **rest}, x), "dp")
        rest = core_lax.pvary_cast(rest, "dp", dtype=torch.float64, grad_dtype=torch.float64)
        return fs.psum(_loss({"w00": first.double(), **rest}, x.double()), "dp")

    def step(ws: dict[str, torch.Tensor], x: torch.Tensor) -> tuple:
        if not profile:
            return fs.value_and_grad(loss)(ws, x)
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with prof(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
            out = fs.value_and_grad(loss)(ws, x)
        events.extend((e.name, [list(s) for s in e.input_shapes]) for e in p.events())
        return out

    events: list[tuple[str, list]] = []
    f = fs.shard_map(step, mesh=mesh, in_specs=(P(), P("dp")), out_specs=(P(), P()), check_vma=True)
    with fs.comm_stats() as stats:
        _, grads = f(ws, x)
    calls = stats.calls("psum", "dp", device=stats.devices()[0]) - 2  # less the loss's psum and w00's
    return fs.device_get(grads), calls, events


def _inplace_body(mesh: fs.Mesh) -> tuple[bool, int, int, int, int, int]:
    sizes = [12, 40, 24, 9]
    ws, x = _tree(sizes), torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(1))
    ref = _reference(ws, x)
    profile = mesh.backend == "dist"  # the sim's devices are threads of one process: one profiler at a time
    grads, calls, events = _dp_grads(mesh, ws, x, profile)
    same = all(torch.allclose(grads[k], ref[k], rtol=1e-5, atol=1e-6) for k in ref)
    n = sum(sizes[1:])  # the bucket's elements
    names = [name for name, _ in events]
    cats = names.count("aten::cat")  # (the loss itself concatenates nothing)
    # a copy of the whole bucket: clone / copy_ of an [n] tensor (torch's functional all_reduce clones its input)
    copies = sum(1 for name, shapes in events if name in ("aten::clone", "aten::copy_") and shapes[:1] == [[n]])
    pending = sum(1 for name, shapes in events if name == "_c10d_functional::all_reduce_" and shapes[:1] == [[n]])
    return same, calls, cats, copies, pending, names.count("_c10d_functional::all_reduce")


def test_bucket_is_written_once_and_reduced_in_place(run, backend: str) -> None:
    for same, calls, cats, copies, pending, cloning in run(_inplace_body, {"dp": 2}):
        assert same
        assert calls == 1  # one bucket (25 MiB cap), one all-reduce
        if backend == "dist":
            assert cats == 1  # the gradients are written into the bucket once
            # and the bucket is summed in place, overlapped with the rest of the backward: no copy of it
            assert pending == 1 and cloning == 0 and copies == 0


def _expected_buckets(sizes: list[int], cap: int) -> int:
    """DDP's rule written out: walk the leaves last to first, close a bucket once it holds >= cap bytes."""
    count, held = 0, 0
    for n in reversed(sizes):
        held += 4 * n
        if held >= cap:
            count, held = count + 1, 0
    return count + (held > 0)


def _cap_body(mesh: fs.Mesh, mb: str, cast: bool) -> tuple[bool, int]:
    os.environ["FUNCSHARD_BUCKET_MB"] = mb
    try:
        ws = _tree([3000, 1000, 5000, 2000, 7000, 500])
        x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(1))
        ref = _reference(ws, x)
        grads, calls, _ = _dp_grads(mesh, ws, x, False, cast)
    finally:
        del os.environ["FUNCSHARD_BUCKET_MB"]
    return all(torch.allclose(grads[k], ref[k], rtol=1e-5, atol=1e-6) for k in ref), calls


@pytest.mark.parametrize("cast", [False, True], ids=["pvary", "pvary_cast"])
@pytest.mark.parametrize("mb", ["0.02", "0.04", "0"])
def test_bucket_cap_sets_the_number_of_all_reduces(run, mb: str, cast: bool) -> None:
    sizes = [3000, 1000, 5000, 2000, 7000, 500]
    cap = int(float(mb) * 2**20)
    want = _expected_buckets(sizes[1:], cap) if cap else 1  # (the first leaf is pvary'd alone)
    for same, calls in run(_cap_body, {"dp": 2}, mb, cast):
        assert same
        assert calls == want


def test_bucket_cap_bad_value_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUNCSHARD_BUCKET_MB", "-1")
    with pytest.raises(fs.ConfigError, match="FUNCSHARD_BUCKET_MB"):
        fs.lax.bucket_bytes()


CFG = llama.Config(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _llama_body(mesh: fs.Mesh) -> tuple[bool, bool, int, dict]:
    specs, bs = llama.param_specs(CFG, mesh), llama.batch_spec(mesh)
    params = llama.init(fs.random.key(0), CFG)
    tok = torch.randint(0, CFG.vocab_size, (BATCH, 16), generator=torch.Generator().manual_seed(0))
    tgt = tok.roll(-1, 1)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, CFG))(params)
    f = fs.shard_map(
        lambda p, t, y: llama.value_and_grad(p, t, y, CFG),
        mesh=mesh,
        in_specs=(specs, bs, bs),
        out_specs=(P(), specs),
    )
    with fs.comm_stats() as stats:
        loss, grads = f(fs.device_put(params, mesh, specs), tok, tgt)
    grads = fs.device_get(grads)
    same_loss = torch.allclose(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    flat = zip(optree.tree_leaves(grads), optree.tree_leaves(ref_grads), strict=True)
    same_grads = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in flat)
    dev = stats.devices()[0]
    return same_loss, same_grads, stats.calls("psum", "dp", device=dev), stats.rows(device=dev)


def test_llama_dp_all_reduces_per_step(run) -> None:
    # one bucket per layer (each well under the 25 MiB cap), embed + norm + head in one, and the loss's two sums
    # (the token count before the forward, the mean after: no wait in the forward;
    # tests/whitebox/models/test_loss_sums_pending.py)
    for same_loss, same_grads, calls, rows in run(_llama_body, {"dp": 2}):
        assert same_loss and same_grads
        assert calls == CFG.n_layers + 3, rows


def _row_parallel_body(mesh: fs.Mesh) -> tuple[bool, bool, int, int]:
    from torch.profiler import ProfilerActivity, profile

    from funcshard.ops import row_parallel_linear

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 8, generator=gen), torch.randn(6, 8, generator=gen)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref_y = torch.nn.functional.linear(xr, wr)
    ref_g = torch.autograd.grad((ref_y.sin()).sum(), [xr, wr])
    events: list[tuple[str, list]] = []

    def step(x: torch.Tensor, w: torch.Tensor) -> tuple:
        def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return row_parallel_linear(x, w, axis="tp").sin().sum()  # [5, 8/tp] @ [8/tp, 6] -> [5, 6], summed

        if mesh.backend != "dist":
            return fs.value_and_grad(f, argnums=(0, 1))(x, w)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
            out = fs.value_and_grad(f, argnums=(0, 1))(x, w)
        events.extend((e.name, [list(s) for s in e.input_shapes]) for e in p.events())
        return out

    specs = (P(None, "tp"), P(None, "tp"))
    y, (gx, gw) = fs.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(P(), specs))(x, w)
    same = torch.allclose(fs.device_get(y), ref_y.sin().sum().detach(), rtol=1e-5, atol=1e-5)
    grads = [fs.device_get(gx), fs.device_get(gw)]
    same_g = all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(grads, ref_g, strict=True))
    copies = sum(1 for name, shapes in events if name in ("aten::clone", "aten::copy_") and shapes[:1] == [[5, 6]])
    reduced = sum(1 for name, _ in events if name == "c10d::allreduce_")  # (the profiler gives no list's shapes)
    return same, same_g, copies, reduced


def test_row_parallel_partial_sums_reduced_in_their_own_buffer(run, backend: str) -> None:
    # the matmul's partial sums are summed in place under dist (no copy of them); the numbers are the reference's
    for same, same_g, copies, reduced in run(_row_parallel_body, {"tp": 2}):
        assert same and same_g
        if backend == "dist":
            assert reduced == 1 and copies == 0


def _reuse_body(mesh: fs.Mesh) -> tuple[bool, bool, bool, int, bool]:
    from funcshard._src.collectives.prims import BUCKETS

    BUCKETS.clear()
    ws, x = _tree([12, 40, 24, 9]), torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(1))
    ref = _reference(ws, x)

    def loss(ws: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        first = fs.pvary(ws["w00"], "dp")  # reduced synchronously (the backward's last node)
        rest = fs.pvary({k: v for k, v in ws.items() if k != "w00"}, "dp")  # the bucket (overlapped)
        return fs.psum(_loss({"w00": first, **rest}, x), "dp")

    f = fs.shard_map(fs.value_and_grad(loss), mesh=mesh, in_specs=(P(), P("dp")), out_specs=(P(), P()), check_vma=True)

    def local(grads: dict) -> tuple[int, torch.Tensor]:  # this process's w01 gradient: its storage, its value
        t = grads["w01"].shards[min(grads["w01"].shards)]
        return t.untyped_storage().data_ptr(), t.clone()

    _, g1 = f(ws, x)
    ptr1, val1 = local(g1)
    _, g2 = f(ws, x)  # g1 still held: its bucket must not be written
    ptr2, _ = local(g2)
    kept = torch.equal(local(g1)[1], val1) and ptr2 != ptr1
    del g1, g2
    _, g3 = f(ws, x)  # nothing holds the earlier buckets: one is reused
    ptr3, _ = local(g3)
    same = all(torch.allclose(fs.device_get(g3)[k], ref[k], rtol=1e-5, atol=1e-6) for k in ref)
    same = same and torch.allclose(val1, ref["w01"], rtol=1e-5, atol=1e-6)
    n = sum(v.numel() for k, v in ws.items() if k != "w00")
    made = len(BUCKETS.kept.get((n, torch.float32, torch.device("cpu")), []))  # buffers made in 3 steps
    return same, kept, ptr3 in (ptr1, ptr2), made, mesh.backend == "dist"


def test_bucket_buffers_reused_once_nothing_holds_them(run) -> None:
    # DDP keeps its buckets: a bucket's buffer is reused at a later step (no fresh memory to fault in), never
    # while a gradient handed out from it is still held
    for same, kept, reused, made, dist in run(_reuse_body, {"dp": 2}):
        assert same and kept
        if dist:
            assert reused and made == 2  # step 3 made none: it took step 1's or step 2's
