"""Layer counts that the virtual stages do not divide (issue #31) in the generic pipeline: ``chunk_layers`` splits
``L`` layers over the ``p v`` virtual stages as ``torch.tensor_split`` does, in virtual-stage order (earlier ones
one layer more; a virtual stage may get none), ``to_chunks(..., n_layers=L)`` moves each stage's
``tensor_split`` block to its chunks (looped and V placements) and ``from_chunks`` back, and
``run(..., n_layers=L)`` runs them, an empty virtual stage as the identity: the toy model's loss and every
layer's gradient equal the plain model's (sim with check_vma on and off, one V case with an empty last virtual
stage under dist), and wrong leading dims are one-line errors."""

from __future__ import annotations

import pytest
import torch
from _pipeline_toy import MB, D, _data, _layer, _mse, _reference

import funcshard as fs
from funcshard import P
from funcshard.pipeline import by_name, chunk_layers, from_chunks, interleaved_1f1b, one_f_one_b, run, to_chunks, zbv


def _layers_of(sched, n_layers: int) -> list[list[int]]:
    """Each stage's layers in chunk order, from tensor_split over the virtual stages and the placement."""
    blocks = [b.tolist() for b in torch.tensor_split(torch.arange(n_layers), sched.n_virtual_stages)]
    return [[i for vs in row for i in blocks[vs]] for row in sched.placement]


def test_chunk_layers_split_like_tensor_split() -> None:
    assert chunk_layers(interleaved_1f1b(2, 4, 2), 7) == ((2, 2), (2, 1))  # virtual stages 2, 2, 2, 1
    assert chunk_layers(interleaved_1f1b(4, 8, 2), 7) == ((1, 1), (1, 1), (1, 1), (1, 0))  # 8th empty
    assert chunk_layers(zbv(4, 8), 7) == ((1, 0), (1, 1), (1, 1), (1, 1))  # V: stage 0 holds 0 and 7
    assert chunk_layers(one_f_one_b(8, 16), 126) == ((16,),) * 6 + ((15,),) * 2  # 405B
    got = chunk_layers(interleaved_1f1b(8, 16, 2), 126)  # 16 virtual stages: the first 14 take 8, the last 2 take 7
    sizes = {vs: got[s][c] for s in range(8) for c, vs in enumerate(interleaved_1f1b(8, 16, 2).placement[s])}
    assert [sizes[vs] for vs in range(16)] == [8] * 14 + [7] * 2
    with pytest.raises(fs.ShardingError, match=r"n_layers=-1"):
        chunk_layers(zbv(2, 4), -1)


MOVES = [
    (name, p, n)
    for name in ("1f1b", "interleaved", "looped_bfs", "zbv", "dualpipev")
    for p, n in ((2, 5), (4, 7), (4, 11))
]


@pytest.mark.parametrize(("name", "p", "n"), MOVES, ids=[f"{a}-p{b}-L{c}" for a, b, c in MOVES])
def test_to_chunks_uneven_and_back(name: str, p: int, n: int) -> None:
    """Natural order (tensor_split over the stages, spec P("pp")) -> each stage's chunks, and back."""
    sched = by_name(name, p, 2 * p)
    layers = torch.arange(float(n)).repeat_interleave(3).reshape(n, 3)  # row i holds layer i
    mesh = fs.make_mesh({"pp": p}, backend="sim")

    def there_and_back(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = to_chunks(w, sched, n_layers=n)  # [rows of this stage's chunks, 3]
        padded = torch.cat([c[:, 0], c.new_full((n - c.shape[0],), -1.0)])  # [n]: the chunks' layers, -1 after
        return padded[None], from_chunks(c, sched, n_layers=n)

    f = fs.shard_map(there_and_back, mesh=mesh, in_specs=(P("pp"),), out_specs=(P("pp"), P("pp")))
    chunks, back = f(layers)
    got = fs.device_get(chunks)  # [p, n]
    for s, want in enumerate(_layers_of(sched, n)):
        assert got[s].tolist() == [float(i) for i in want] + [-1.0] * (n - len(want)), s
    assert torch.equal(fs.device_get(back), layers)


def _uneven_body(mesh: fs.Mesh, name: str, n: int, m: int, check_vma: bool) -> str:
    p = mesh.shape["pp"]
    sched = by_name(name, p, m)
    w1, w2, x, t = _data(n, m * MB)
    ref_loss, ref_g1, ref_g2 = _reference(w1, w2, x, t)

    def layers(params, h):  # a chunk of k >= 1 layers: [k, D, H], [k, H, D]
        for i in range(params[0].shape[0]):
            h = _layer((params[0][i], params[1][i]), h)
        return h

    def step(params, xs, ts):
        chunks = to_chunks(params, sched, n_layers=n)  # [this stage's tensor_split block] -> [its chunks' layers]
        loss, grads = run(sched, layers, chunks, xs, targets=ts, loss_fn=_mse, n_layers=n)
        return loss, from_chunks(grads, sched, n_layers=n)  # -> natural order

    f = fs.shard_map(step, mesh=mesh, in_specs=(P("pp"), P(), P()), out_specs=(P(), P("pp")), check_vma=check_vma)
    loss, (g1, g2) = f((w1, w2), x.reshape(m, MB, D), t.reshape(m, MB, D))
    torch.testing.assert_close(fs.device_get(loss).reshape(()), ref_loss, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(fs.device_get(g1), ref_g1, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(fs.device_get(g2), ref_g2, rtol=1e-5, atol=1e-12)
    return "ok"


RUNS = [  # (schedule, pp, layers): empty virtual stages where the layers are fewer than p v
    ("interleaved", 2, 3),
    ("interleaved", 2, 7),
    ("interleaved", 4, 7),
    ("interleaved", 4, 5),
    ("looped_bfs", 4, 6),
    ("interleaved_zb", 4, 7),  # B / W split, the last virtual stage empty
    ("zbv", 2, 3),  # V: the last virtual stage (on stage 0) empty, the loss taken right after the turn
    ("zbv", 4, 7),
    ("zbv", 4, 9),
    ("dualpipev", 2, 5),
    ("1f1b", 4, 7),
    ("gpipe", 2, 3),
]


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize(("name", "p", "n"), RUNS, ids=[f"{a}-p{b}-L{c}" for a, b, c in RUNS])
def test_uneven_chunks_match_plain_model_sim(name: str, p: int, n: int, check_vma: bool) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _uneven_body, {"pp": p}, name, n, 2 * p, check_vma) == ["ok"]


@pytest.mark.dist
def test_uneven_zbv_with_an_empty_virtual_stage_dist() -> None:
    from _dist_pool import run_body

    assert set(run_body("dist", _uneven_body, {"pp": 2}, "zbv", 3, 4, True)) == {"ok"}


def test_uneven_leading_dims_are_one_line_errors() -> None:
    sched = interleaved_1f1b(2, 4, 2)
    mesh = fs.make_mesh({"pp": 2}, backend="sim")
    w = torch.zeros(7, 3)
    f = fs.shard_map(lambda a: to_chunks(a, sched, n_layers=8), mesh=mesh, in_specs=(P("pp"),), out_specs=P("pp"))
    with pytest.raises(fs.ShardingError, match=r"leaf <root> has local shape \(3, 3\) on stage 1; expected .* of 4 "):
        f(w)  # 8 layers would be 4 + 4: stage 1's block of 3 is wrong (stage 0's 4 happens to fit)

    def bad_run(a, xs):
        return run(sched, lambda p, h: h @ p[0], a, xs, loss_fn=lambda y: y.sum(), n_layers=7)

    g = fs.shard_map(bad_run, mesh=mesh, in_specs=(P("pp"), P()), out_specs=(P(), P("pp")))
    with pytest.raises(fs.ShardingError, match=r"with n_layers=7 expected a leading dim of 4, .* \(2, 2\)"):
        g(torch.zeros(6, 3, 3), torch.zeros(4, 2, 3))  # 3 rows a stage, where stage 0's chunks hold 2 + 2
    for n_layers in (None, 7):  # both forms check the axis first, also with one chunk per stage
        h = fs.shard_map(
            lambda a, n=n_layers: to_chunks(a, one_f_one_b(4, 4), n_layers=n),
            mesh=mesh,
            in_specs=(P("pp"),),
            out_specs=P("pp"),
        )
        with pytest.raises(fs.ShardingError, match=r"to_chunks: mesh axis 'pp' has size 2 .* n_stages=4; build"):
            h(torch.zeros(8, 3))
