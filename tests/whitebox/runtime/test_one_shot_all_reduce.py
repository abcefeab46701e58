"""A small all-reduce under ``"dist"`` is a one-shot all-reduce: every process gathers every copy and reduces them
itself, in the group's logical order (half the exchanges of gloo's reduce-scatter + all-gather: the latency of a
small activation's or a loss's sum). It must give the sim backend's bits (sim reduces in the same order), the same
bits on every process, for sums, maxima and minima, integer and float, a non-contiguous operand and a group whose
logical order is not torch's rank order; above ``_ONE_SHOT_BYTES`` (or with it 0) the ring all-reduce runs, and the
numbers agree to rounding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard import P

pytestmark = pytest.mark.counters


def _values() -> torch.Tensor:
    # four copies whose float32 sum depends on the order: ((1e8 + 1) - 1e8) + 1 = 1 in logical order, others give 0 or 2
    return torch.tensor([[1e8, 1.0, -1e8, 1.0], [3.0, 1e-8, 7.0, -3.0], [-0.0, 0.0, -0.0, -0.0]])


def _body(mesh: fs.Mesh, limit: int | None) -> dict[str, Any]:
    from funcshard._src.runtime.backends import dist as dist_backend

    calls = []
    one_shot, old_limit = dist_backend._one_shot, dist_backend._ONE_SHOT_BYTES

    def counted(*a: Any) -> torch.Tensor:
        calls.append(1)
        return one_shot(*a)

    dist_backend._one_shot = counted
    if limit is not None:
        dist_backend._ONE_SHOT_BYTES = limit
    try:
        v = _values()

        def f(v: torch.Tensor) -> dict[str, torch.Tensor]:
            i = fs.axis_index(("b", "a"))  # the logical index over ("b", "a"): b major, a torch's minor rank order
            x = v[:, i].contiguous()  # [3]: this device's copy
            wide = torch.stack([x, x]).t()  # [3, 2], a non-contiguous view
            n = torch.tensor([i * 7 - 9, -i, 2**40 + i])  # int64
            return {
                "sum": fs.psum(x, ("b", "a")),  # [3] -> [3]
                "sum_wide": fs.psum(wide, ("b", "a")),  # [3, 2] -> [3, 2]
                "max": fs.pmax(x, ("b", "a")),
                "min": fs.pmin(x, ("b", "a")),
                "int_sum": fs.psum(n, ("b", "a")),
                "int_max": fs.pmax(n, ("b", "a")),
                "sum_a": fs.psum(x, "a"),  # a group of two
                "empty": fs.psum(x[:0].reshape(0, 3), ("b", "a")),  # [0, 3]: nothing to gather
                "scalar": fs.psum(x.sum(), ("b", "a")),  # [] -> []
                "bf16": fs.psum(x.to(torch.bfloat16), ("b", "a")),  # summed in bfloat16, as sim does
                "f16": fs.psum((x / 1e8).to(torch.float16), ("b", "a")),
            }

        specs = {
            k: P("b") if k == "sum_a" else P()
            for k in ("sum", "sum_wide", "max", "min", "int_sum", "int_max", "sum_a", "empty", "scalar", "bf16", "f16")
        }
        out = fs.shard_map(f, mesh=mesh, in_specs=P(), out_specs=specs, check_vma=False)(v)
        got = {k: fs.device_get(t) for k, t in out.items()}
        return {"got": got, "one_shot_calls": len(calls)}
    finally:
        dist_backend._one_shot, dist_backend._ONE_SHOT_BYTES = one_shot, old_limit


@pytest.mark.dist
def test_one_shot_sum_gives_the_sim_bits_on_every_process() -> None:
    from _dist_pool import run_body

    want = run_body("sim", _body, {"a": 2, "b": 2}, None)[0]["got"]
    assert want["sum"][0].item() == 1.0  # (the logical order's value: the check below can tell orders apart)
    results = run_body("dist", _body, {"a": 2, "b": 2}, None)
    for r in results:
        # each of the 10 small reductions went one-shot (and the check of the replicated outputs' fingerprints)
        assert r["one_shot_calls"] >= 10
        for k, w in want.items():
            assert torch.equal(r["got"][k], w), k
            assert r["got"][k].dtype == w.dtype, k
        assert str(r["got"]["sum"][2].item()) == str(want["sum"][2].item())  # -0.0 + 0.0 ...: the sign bit too


@pytest.mark.dist
def test_ring_above_the_limit_agrees_to_rounding() -> None:
    from _dist_pool import run_body

    want = run_body("sim", _body, {"a": 2, "b": 2}, None)[0]["got"]
    results = run_body("dist", _body, {"a": 2, "b": 2}, 0)  # a limit of 0 bytes: never one-shot
    for r in results:
        assert r["one_shot_calls"] == 0
        for k, w in want.items():
            if k not in ("max", "min", "int_sum", "int_max", "empty"):  # float sums: the ring's own order
                torch.testing.assert_close(r["got"][k], w, atol=2.0, rtol=1e-2)
            else:
                assert torch.equal(r["got"][k], w), k
