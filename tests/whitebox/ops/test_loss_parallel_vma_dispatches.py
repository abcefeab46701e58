"""The loss-parallel ops through the vma mode: their local math is a few ``_vma.one_op`` dispatches, same numbers.

``vocab_parallel_embedding`` and ``vocab_parallel_cross_entropy`` run their local math between the collectives as
``one_op`` functions, and their id checks with torch functions off. Inside ``shard_map(check_vma=True)`` the
mode then sees a handful of dispatches, not one per op; the loss, the gradients and the tags are those of the
same functions run op by op (the ``one_op`` functions' ``__wrapped__``), bitwise, and the unsharded
``F.embedding`` + ``F.cross_entropy``'s to float tolerance. Sim and dist.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import P
from funcshard._src.collectives import vma as _vma
from funcshard.ops import tp, vocab_parallel_cross_entropy, vocab_parallel_embedding

pytestmark = pytest.mark.counters

B, S, D, V = 2, 6, 8, 16
_ONE_OPS = ("_float_and_max", "_exp_sum_and_target", "_cross_entropy_from_sums", "_embedding_slice")


def _body(mesh: fs.Mesh) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    table, head = torch.randn(V, D, generator=gen), torch.randn(V, D, generator=gen)
    ids = torch.randint(0, V, (B, S), generator=gen)
    labels = torch.randint(0, V, (B, S), generator=gen)
    labels[0, :2] = -100
    real = _vma.VmaMode.__torch_function__
    where = threading.local()  # (sim's devices are threads of this process)
    seen: list[int] = []
    tags: list[Any] = []

    def counted(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(where, "count", None) is not None:
            where.count += 1
        return real(self, func, types, args, kwargs)

    def loss(table: torch.Tensor, head: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        where.count = 0
        try:
            h = vocab_parallel_embedding(ids, table)  # [b, s] -> [b, s, d], invariant over tp
            logits = F.linear(h, head)  # [b, s, d] @ [d, V/tp] -> [b, s, V/tp]
            out = vocab_parallel_cross_entropy(logits, labels)  # -> [], invariant over tp
        finally:
            seen.append(where.count)
            where.count = None
        tags.append((_vma.get_vma(h), _vma.get_vma(logits), _vma.get_vma(out)))
        return out

    step = fs.shard_map(
        fs.value_and_grad(loss, argnums=(0, 1)),
        mesh=mesh,
        in_specs=(P("tp", None), P("tp", None), P(), P()),
        out_specs=(P(), (P("tp", None), P("tp", None))),
    )
    results: dict[str, Any] = {}
    counts: dict[str, list[int]] = {}
    found: dict[str, list[Any]] = {}
    originals = {name: getattr(tp, name) for name in _ONE_OPS}
    for name in ("one_op", "plain"):
        seen.clear()
        tags.clear()
        if name == "plain":  # the same functions op by op through the mode
            for fn_name, fn in originals.items():
                setattr(tp, fn_name, fn.__wrapped__)
        _vma.VmaMode.__torch_function__ = counted  # type: ignore[method-assign]
        try:
            val, (g_table, g_head) = step(table, head, ids, labels)
        finally:
            _vma.VmaMode.__torch_function__ = real  # type: ignore[method-assign]
            for fn_name, fn in originals.items():
                setattr(tp, fn_name, fn)
        results[name] = [fs.device_get(t) for t in (val, g_table, g_head)]
        counts[name], found[name] = list(seen), list(tags)

    def ref(table: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(F.embedding(ids, table), head).flatten(0, 1), labels.flatten())

    want = [ref(table, head), *torch.autograd.grad(ref(table.requires_grad_(), head.requires_grad_()), (table, head))]
    return {
        "bitwise": all(torch.equal(a, b) for a, b in zip(results["one_op"], results["plain"], strict=True)),
        "close": all(torch.allclose(a, b, atol=1e-6) for a, b in zip(results["one_op"], want, strict=True)),
        "counts": counts,
        "tags": found,
    }


@pytest.mark.parametrize("n", [2])
def test_loss_parallel_ops_are_few_dispatches_with_the_same_numbers_and_tags(run, backend, n: int) -> None:
    tp_axis = frozenset({"tp"})
    for r in run(_body, {"tp": n}):
        assert r["close"], r
        assert r["bitwise"], r  # the one_op functions give the op-by-op numbers
        # h invariant (the psum'd lookup), the logits varying (the sharded head), the loss invariant (the psum'd sums)
        assert r["tags"]["one_op"] == r["tags"]["plain"], r
        assert all(t == (frozenset(), tp_axis, frozenset()) for t in r["tags"]["one_op"]), r
        # one count per device's forward: the one_op path sees a handful, op by op ~40 (each op and shape read)
        assert all(c <= 10 for c in r["counts"]["one_op"]), r
        assert all(c >= 30 for c in r["counts"]["plain"]), r


def test_out_of_vocabulary_ids_still_raise_with_torch_functions_off() -> None:
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    table, ids = torch.randn(V, D), torch.full((B, S), V)  # every id one past the vocabulary
    step = fs.shard_map(vocab_parallel_embedding, mesh=mesh, in_specs=(P(), P("tp", None)), out_specs=P())
    with pytest.raises(fs.ShardingError, match=f"ids contain {V}, outside"):
        step(ids, table)
    logits, labels = torch.randn(B, S, V), torch.full((B, S), V + 3)
    step = fs.shard_map(vocab_parallel_cross_entropy, mesh=mesh, in_specs=(P(None, None, "tp"), P()), out_specs=P())
    with pytest.raises(fs.ShardingError, match=f"labels contain {V + 3}, outside .* ignore index"):
        step(logits, labels)


def test_the_counter_sees_a_collective_free_region_once() -> None:
    """The counting above is live: a one_op called inside check_vma's mode is one dispatch, its __wrapped__ several."""
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    real = _vma.VmaMode.__torch_function__
    seen: collections.Counter[str] = collections.Counter()

    def counted(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        seen[getattr(func, "__name__", "?")] += 1
        return real(self, func, types, args, kwargs)

    def f(both: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return tp._cross_entropy_from_sums(both, labels, -100, "mean") + tp._cross_entropy_from_sums.__wrapped__(
            both, labels, -100, "mean"
        )

    _vma.VmaMode.__torch_function__ = counted  # type: ignore[method-assign]
    try:
        fs.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P())(
            torch.rand(B, S, 2) + 1, torch.zeros(B, S).long()
        )
    finally:
        _vma.VmaMode.__torch_function__ = real  # type: ignore[method-assign]
    assert seen["_cross_entropy_from_sums"] == 2, seen  # once per device
    assert seen["log"] == 2 and seen["where"] == 2, seen  # the wrapped one: op by op
