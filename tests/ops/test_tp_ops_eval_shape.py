"""The vocabulary-parallel ops under ``fs.eval_shape``: their id checks skip meta ids (no values to read), so a
``shard_map``'d embedding and cross-entropy give their shapes; real out-of-range ids are still refused."""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.ops import vocab_parallel_cross_entropy, vocab_parallel_embedding


def test_vocab_parallel_ops_on_meta_ids() -> None:
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    embed = fs.shard_map(
        lambda ids, table: vocab_parallel_embedding(ids, table, axis="tp"),
        mesh=mesh,
        in_specs=(P(), P("tp", None)),
        out_specs=P(),
    )
    ids, table = fs.ShapeDtype((2, 5), torch.int64), fs.ShapeDtype((6, 8), torch.float32)
    assert fs.eval_shape(embed, ids, table) == fs.ShapeDtype((2, 5, 8))  # [b, s] -> [b, s, d]
    ce = fs.shard_map(
        lambda logits, labels: vocab_parallel_cross_entropy(logits, labels, axis="tp"),
        mesh=mesh,
        in_specs=(P(None, None, "tp"), P()),
        out_specs=P(),
    )
    assert fs.eval_shape(ce, fs.ShapeDtype((2, 5, 6)), ids) == fs.ShapeDtype(())
    with pytest.raises(fs.ShardingError, match="ids contain 6"):  # real ids are still checked
        embed(torch.tensor([[0, 6]]), torch.randn(6, 8))
