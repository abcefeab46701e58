"""Composed programs on random uneven meshes and sizes (API §4-§6, §10, §14), under ``sim``, against one device.

- A random chain of 2-3 layers (a column-parallel matmul, a row-parallel matmul closed by ``psum`` or by an uneven
  ``psum_scatter``, an ``all_gather`` of the features, ``tanh``) on a batch split over some axes and features split
  over others: the loss and the gradients of every input (``fs.value_and_grad`` inside shard_map) equal plain torch
  on the unsharded tensors.
- ``fs.random`` draws on random uneven specs equal the same slices of the unsharded draw, bit for bit.
- A tiny Llama with a random vocabulary, batch and sequence (sequence parallel or not) on a random dp (or fsdp) x
  tp mesh: loss and gradients equal the single-device ones (few examples: it is the slow one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from _uneven_strategies import fixed, meshes, shapes, specs
from hypothesis import given
from hypothesis import strategies as st

import funcshard as fs
from funcshard import P
from funcshard.models import llama

#: layer kinds, by whether they take (and give) the features split over the tp axes
TAKES_SPLIT = {"col": False, "row_psum": True, "row_scatter": True, "gather": True, "tanh": None}
GIVES_SPLIT = {"col": True, "row_psum": False, "row_scatter": True, "gather": False}


@dataclass(frozen=True)
class Chain:
    mesh_shape: dict[str, int]
    batch_axes: tuple[str, ...]
    tp: tuple[str, ...]
    split_in: bool  # the input's features split over tp
    layers: tuple[tuple[str, int], ...]  # (kind, output features: for the matmuls)
    batch: int
    features: int
    seed: int


@st.composite
def chains(draw: st.DrawFn) -> Chain:
    """A mesh, the axes of the batch and of the features (disjoint, either may be empty) and 2-3 layers that fit."""
    mesh_shape = draw(meshes())
    order = draw(st.permutations(tuple(mesh_shape)))
    k = draw(st.sampled_from([n for n in (1, 2, 0, 3) if n <= len(order)]))  # mostly some tp axes
    tp, rest = tuple(order[:k]), order[k:]
    batch_axes = tuple(rest[: draw(st.sampled_from([n for n in (1, 0, 2) if n <= len(rest)]))])
    split = split_in = draw(st.booleans())
    layers = []
    for _ in range(draw(st.integers(2, 3))):
        kind = draw(st.sampled_from([k for k, s in TAKES_SPLIT.items() if s == split] + ["tanh"]))
        layers.append((kind, draw(st.integers(1, 9))))
        split = GIVES_SPLIT.get(kind, split)
    return Chain(
        mesh_shape,
        batch_axes,
        tp,
        split_in,
        tuple(layers),
        draw(st.integers(1, 9)),
        draw(st.integers(1, 9)),
        draw(st.integers(0, 2**16)),
    )


def _weights(c: Chain) -> tuple[list[torch.Tensor], list[P]]:
    """The matmuls' weights [f_in, f_out] and their specs (columns or rows over tp)."""
    g = torch.Generator().manual_seed(c.seed)
    ws, ss, f = [], [], c.features
    tp = c.tp or None
    for kind, out in c.layers:
        if kind in ("col", "row_psum", "row_scatter"):
            ws.append(torch.randn(f, out, generator=g, dtype=torch.float64) / f**0.5)
            ss.append(P(None, tp) if kind == "col" else P(tp, None))
            f = out
    return ws, ss


def _reference(c: Chain, x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """The chain on the unsharded tensors: ``[batch, features] -> [batch, f_out]``."""
    ws = list(ws)
    for kind, _ in c.layers:
        if kind == "tanh":
            x = torch.tanh(x)
        elif kind != "gather":
            x = x @ ws.pop(0)
    return x


def _local(c: Chain, x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """The chain on one device's blocks."""
    ws, tp = list(ws), c.tp
    for kind, _ in c.layers:
        if kind == "tanh":
            x = torch.tanh(x)
        elif kind == "col" or not tp:  # (no tp axes: the matmuls alone)
            x = x if kind == "gather" else x @ ws.pop(0)  # [b, f] @ [f, o/tp] -> [b, o/tp]
        elif kind == "gather":
            x = fs.all_gather(x, tp, dim=1, tiled=True)  # [b, f/tp] -> [b, f]
        elif kind == "row_psum":
            x = fs.psum(x @ ws.pop(0), tp)  # [b, f/tp] @ [f/tp, o] -> [b, o] (partial sums) -> [b, o]
        else:
            x = fs.psum_scatter(x @ ws.pop(0), tp, dim=1, tiled=True)  # [b, f/tp] @ [f/tp, o] -> [b, o/tp]
    return x


@fixed(80)
@given(chains())
def test_random_chain_value_and_grad(c: Chain) -> None:
    mesh = fs.make_mesh(c.mesh_shape, backend="sim")
    g = torch.Generator().manual_seed(c.seed + 1)
    x = torch.randn(c.batch, c.features, generator=g, dtype=torch.float64)
    ws, w_specs = _weights(c)
    split = c.split_in
    for kind, _ in c.layers:
        split = GIVES_SPLIT.get(kind, split)
    r = torch.randn(_reference(c, x, ws).shape, generator=g, dtype=torch.float64)
    bat, tp = c.batch_axes or None, c.tp or None
    x_spec, r_spec = P(bat, tp if c.split_in else None), P(bat, tp if split else None)

    def loss(x: torch.Tensor, ws: list[torch.Tensor], r: torch.Tensor) -> torch.Tensor:
        total = (_local(c, x, ws) * r).sum()  # [] this device's share
        total = fs.psum(total, c.batch_axes) if c.batch_axes else total
        if not c.tp:
            return total
        return fs.psum(total, c.tp) if split else fs.pmean(total, c.tp)  # (the same value on each tp device)

    def step(x: torch.Tensor, ws: list[torch.Tensor], r: torch.Tensor) -> tuple:
        return fs.value_and_grad(loss, argnums=(0, 1))(x, ws, r)

    f = fs.shard_map(step, mesh=mesh, in_specs=(x_spec, w_specs, r_spec), out_specs=(P(), (x_spec, w_specs)))
    value, (gx, gws) = f(x, ws, r)
    xr, wr = x.clone().requires_grad_(True), [w.clone().requires_grad_(True) for w in ws]
    want = (_reference(c, xr, wr) * r).sum()
    want_grads = torch.autograd.grad(want, [xr, *wr])
    torch.testing.assert_close(fs.device_get(value), want.detach(), rtol=1e-10, atol=1e-10)
    for got, ref in zip([gx, *gws], want_grads, strict=True):
        torch.testing.assert_close(fs.device_get(got), ref, rtol=1e-10, atol=1e-10)


@st.composite
def draws(draw: st.DrawFn) -> tuple[dict[str, int], tuple[int, ...], P, str, int, torch.dtype]:
    mesh_shape = draw(meshes())
    shape = draw(shapes(max_rank=3))
    return (
        mesh_shape,
        shape,
        draw(specs(mesh_shape, len(shape))),
        draw(st.sampled_from(["uniform", "normal"])),
        draw(st.integers(0, 2**31 - 1)),
        draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64])),
    )


@fixed(60)
@given(draws())
def test_random_draws_equal_the_unsharded_draw(d: tuple) -> None:
    mesh_shape, shape, spec, kind, seed, dtype = d
    mesh = fs.make_mesh(mesh_shape, backend="sim")
    draw = getattr(fs.random, kind)
    key = fs.random.fold_in(fs.random.key(seed), 3)
    got = fs.shard_map(lambda k: draw(k, shape, dtype, spec=spec), mesh=mesh, in_specs=(P(),), out_specs=spec)(key)
    assert got.shape == shape
    assert torch.equal(fs.device_get(got), draw(key, shape, dtype)), (shape, spec)


@st.composite
def llama_cases(draw: st.DrawFn) -> tuple[dict[str, int], int, int, int, bool, bool]:
    """A dp (or fsdp) x tp mesh (tp dividing the 4 heads), a vocabulary, a batch and a sequence the mesh rarely
    divides (smaller than the axes too), check_vma, and sequence parallelism."""
    tp = draw(st.sampled_from([2, 4, 1]))
    data = draw(st.sampled_from(["dp", "fsdp"]))  # (fsdp must divide the model dim, 16: a clear error otherwise)
    dp = draw(st.sampled_from([d for d in ((3, 2, 1) if data == "dp" else (2, 4, 1)) if d * tp <= 8]))
    names = draw(st.permutations([data, "tp"]))
    mesh_shape = {n: {data: dp, "tp": tp}[n] for n in names}
    sizes = [draw(st.integers(1, 40)), draw(st.integers(1, 5)), draw(st.integers(1, 7))]
    return mesh_shape, *sizes, draw(st.booleans()), draw(st.booleans())


@fixed(5)
@given(llama_cases())
def test_tiny_llama_uneven_vs_single_device(case: tuple) -> None:
    mesh_shape, vocab, batch, seq, check_vma, sp = case
    mesh = fs.make_mesh(mesh_shape, backend="sim")
    cfg = llama.Config(
        vocab_size=vocab, dim=16, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=24, max_seq_len=8, sequence_parallel=sp
    )
    params = llama.init(fs.random.key(vocab), cfg)
    g = torch.Generator().manual_seed(batch * 10 + seq)
    tok = torch.randint(0, vocab, (batch, seq), generator=g)
    tgt = torch.randint(0, vocab, (batch, seq), generator=g)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, cfg))(params)
    specs_, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)

    def step(p: dict, t: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return fs.value_and_grad(lambda p: llama.loss(p, t, y, cfg))(p)

    f = fs.shard_map(step, mesh=mesh, in_specs=(specs_, bs, bs), out_specs=(P(), specs_), check_vma=check_vma)
    loss, grads = f(fs.device_put(params, mesh, specs_), tok, tgt)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    got = fs.pytree.leaves_with_path(fs.device_get(grads))
    for (path, a), (_, b) in zip(got, fs.pytree.leaves_with_path(ref_grads), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=path)
