"""Regressions found by the uneven-dim properties (``tests/properties``), each named for its case, under ``sim``
and ``dist`` with the same body."""

from __future__ import annotations

import torch

import funcshard as fs
from funcshard import P


def _psum_scatter_of_blocks_split_over_its_axis_body(mesh: fs.Mesh) -> str:
    x = torch.arange(3.0).reshape(1, 1, 3)  # dim 2 split over dp: blocks of 2 and 1 columns
    for tiled, dim in ((True, -1), (True, 0), (False, 1)):
        f = fs.shard_map(
            lambda t, tiled=tiled, dim=dim: fs.psum_scatter(t, "dp", dim=dim, tiled=tiled),  # [1, 1, 2 | 1] -> refused
            mesh=mesh,
            in_specs=(P(None, None, "dp"),),
            out_specs=P("dp"),
        )
        try:
            f(x)
        except fs.ShardingError as e:  # was: the blocks padded to one size and summed, a silent wrong answer
            assert "psum_scatter" in str(e) and "[(1, 1, 2), (1, 1, 1)]" in str(e), str(e)
        else:
            raise AssertionError(f"psum_scatter(tiled={tiled}, dim={dim}) of blocks of 2 and 1 columns: no error")
    # blocks that differ only across the groups (split over fsdp) still reduce-scatter over dp
    g = torch.arange(15.0).reshape(5, 3)  # blocks of [5, 2] and [5, 1] over fsdp, the same on both dp devices
    got = fs.shard_map(
        # [5, 3/fsdp] -> [5/dp, 3/fsdp] (the sum of the 2 dp replicas) -> [5/dp, 3]
        lambda t: fs.lax.all_gather_invariant(fs.psum_scatter(t, "dp", dim=0, tiled=True), "fsdp", dim=1, tiled=True),
        mesh=mesh,
        in_specs=(P(None, "fsdp"),),
        out_specs=P("dp"),
    )(g)
    torch.testing.assert_close(fs.device_get(got), g * 2)
    return "ok"


def test_psum_scatter_of_blocks_split_over_its_axis_is_refused(run) -> None:
    assert set(run(_psum_scatter_of_blocks_split_over_its_axis_body, {"dp": 2, "fsdp": 2})) == {"ok"}


def _llama_body(mesh: fs.Mesh, vocab: int, batch: int) -> str:
    """A one-layer Llama's loss and gradients on ``mesh`` against one device (a vocabulary and a batch of its own)."""
    from funcshard.models import llama

    cfg = llama.Config(vocab_size=vocab, dim=16, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=24, max_seq_len=8)
    params = llama.init(fs.random.key(5), cfg)
    g = torch.Generator().manual_seed(12)
    tok, tgt = torch.randint(0, vocab, (batch, 3), generator=g), torch.randint(0, vocab, (batch, 3), generator=g)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, cfg))(params)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)

    def step(p: dict, t: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return fs.value_and_grad(lambda p: llama.loss(p, t, y, cfg))(p)

    f = fs.shard_map(step, mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs))
    loss, grads = f(fs.device_put(params, mesh, specs), tok, tgt)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    got = fs.pytree.leaves_with_path(fs.device_get(grads))
    for (path, a), (_, b) in zip(got, fs.pytree.leaves_with_path(ref_grads), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=path)
    return "ok"


def test_llama_batch_smaller_than_dp(run) -> None:
    # the devices of dp=1 hold a [0, 3] block of tokens (was: view(0, 3, -1, 4) raised on them)
    assert set(run(_llama_body, {"dp": 2, "tp": 2}, 5, 1)) == {"ok"}


def test_llama_vocab_smaller_than_tp(run) -> None:
    # a vocabulary of 3 on tp=4: the last device holds no row of the embedding or the head (was: index_select's,
    # amax's and reshape's errors on the empty blocks)
    assert set(run(_llama_body, {"tp": 4}, 3, 2)) == {"ok"}


def _all_to_all_of_blocks_that_differ_along_split_dim_body(mesh: fs.Mesh) -> str:
    # columns split over dp: blocks of 2 and 1 columns, split along them, their chunks concatenated along the rows
    # [1, 2 | 1] -> refused
    f = fs.shard_map(lambda t: fs.all_to_all(t, "dp", 1, 0), mesh=mesh, in_specs=(P(None, "dp"),), out_specs=P("dp"))
    try:
        f(torch.ones(1, 3))
    except fs.ShardingError as e:  # was torch.cat's RuntimeError "Sizes of tensors must match" on some devices
        assert "all_to_all" in str(e) and "[(1, 2), (1, 1)]" in str(e) and "split_dim 1" in str(e), str(e)
    else:
        raise AssertionError("all_to_all of chunks that arrive in different sizes along split_dim: no error")
    # blocks that differ along concat_dim == split_dim still move (tensor_split's chunks of each)
    x = torch.arange(14.0).reshape(7, 2)  # rows split over dp: blocks of 4 and 3 rows
    g = fs.shard_map(
        # [4 | 3, 2] -> [2 + 2 | 2 + 1, 2] -> [7, 2]
        lambda t: fs.lax.all_gather_invariant(fs.all_to_all(t, "dp", 0, 0), "dp", tiled=True),
        mesh=mesh,
        in_specs=(P("dp"),),
        out_specs=P(),
    )
    chunks = [torch.tensor_split(blk, 2) for blk in torch.tensor_split(x, 2)]  # per source, its 2 chunks
    want = torch.cat([chunks[src][dst] for dst in range(2) for src in range(2)])  # device dst: chunk dst of each source
    torch.testing.assert_close(fs.device_get(g(x)), want)
    return "ok"


def test_all_to_all_of_blocks_that_differ_along_split_dim_is_refused(run) -> None:
    assert set(run(_all_to_all_of_blocks_that_differ_along_split_dim_body, {"dp": 2})) == {"ok"}
