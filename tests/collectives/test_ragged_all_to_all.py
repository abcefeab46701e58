"""``fs.lax.ragged_all_to_all``: rows sent to each peer in counts that differ per peer and per device.

Each exchange is checked forward and backward (the gradient of a weighted sum of the outputs with respect to ``x``
on every device) against a torch reference that computes who sends what on the full tensors, under sim and under
dist (gloo) with the same body: uneven counts, empty sends, a device that receives nothing, rows left unsent at
the end of ``x``, axis sizes 2 and 4, an exchange over one axis of a 2-axis mesh and over a tuple of axes out of
mesh order. Beside them: JAX's ``jax.lax.ragged_all_to_all`` as an oracle (where XLA runs it), the bytes and calls
``fs.comm_stats`` records, the counts' checks, and the abstract backend's shapes and counts.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import funcshard as fs
from funcshard import P

NMAX = 4  # rows of x on each device (the rows after sum(send_sizes) are not sent)
OMAX = 8  # rows of each device's output block, the received rows padded with zeros
F = 3  # features of a row

# name -> (mesh shape, the exchange's axis, send_sizes of each device in rank order (logical order of its group))
CASES: dict[str, tuple[dict[str, int], str | tuple[str, ...], list[list[int]]]] = {
    # device 0 receives nothing and keeps nothing; both leave rows unsent
    "ep2": ({"ep": 2}, "ep", [[0, 3], [0, 2]]),
    # device 2 receives nothing; uneven counts, zeros, every device's own share differs
    "ep4": ({"ep": 4}, "ep", [[1, 0, 0, 2], [3, 1, 0, 0], [0, 0, 0, 1], [2, 1, 0, 1]]),
    # over ep only: each dp row is its own group (dp=1: ep=0 sends nothing, ep=1 receives nothing)
    "dp_ep": ({"dp": 2, "ep": 2}, "ep", [[2, 1], [0, 3], [0, 0], [4, 0]]),
    # over (b, a), out of mesh order: logical index j is (b = j // 2, a = j % 2), rank a * 2 + b
    "tuple_axes": ({"a": 2, "b": 2}, ("b", "a"), [[1, 0, 2, 1], [0, 0, 0, 3], [2, 2, 0, 0], [1, 1, 1, 1]]),
}
DIST_CASES = ["ep2", "ep4", "tuple_axes"]


def _group(shape: dict[str, int], axis: str | tuple[str, ...], rank: int) -> tuple[list[int], int]:
    """The ranks of ``rank``'s group over ``axis`` (logical order: row-major over the named axes) and its index."""
    axes = (axis,) if isinstance(axis, str) else axis
    names = list(shape)
    coords, rem = {}, rank
    for a in reversed(names):
        coords[a], rem = rem % shape[a], rem // shape[a]
    members = []
    for j in range(math.prod(shape[a] for a in axes)):
        c, rem = dict(coords), j
        for a in reversed(axes):
            c[a], rem = rem % shape[a], rem // shape[a]
        members.append(sum(c[a] * math.prod(shape[b] for b in names[k + 1 :]) for k, a in enumerate(names)))
    return members, members.index(rank)


def _counts(case: str, rank: int) -> tuple[list[int], list[int], int]:
    """``rank``'s send_sizes and recv_sizes in ``case``, and its index in its group."""
    shape, axis, sends = CASES[case]
    members, i = _group(shape, axis, rank)
    return sends[rank], [sends[m][i] for m in members], i


def _pad(y: torch.Tensor) -> torch.Tensor:
    return torch.cat([y, y.new_zeros(OMAX - y.shape[0], *y.shape[1:])])


def _my_rank(shape: dict[str, int]) -> int:
    """This device's rank, from its coordinates (inside shard_map)."""
    rank = 0
    for a in shape:
        rank = rank * shape[a] + int(fs.axis_index(a))
    return rank


def _local(x: torch.Tensor, case: str) -> torch.Tensor:
    shape, axis, _ = CASES[case]
    send, recv, _ = _counts(case, _my_rank(shape))
    y = fs.lax.ragged_all_to_all(x, torch.tensor(send), recv, axis)  # [NMAX, F] -> [sum(recv), F]
    assert y.shape == (sum(recv), F)
    return _pad(y)


def _reference(x: torch.Tensor, case: str) -> torch.Tensor:
    """Who sends what, computed on the full tensor: device r's block is rows ``r * NMAX ...``."""
    shape, axis, sends = CASES[case]
    blocks = x.split(NMAX)
    outs = []
    for r in range(len(sends)):
        members, i = _group(shape, axis, r)
        parts = [blocks[m][sum(sends[m][:i]) : sum(sends[m][: i + 1])] for m in members]
        outs.append(_pad(torch.cat(parts)))
    return torch.cat(outs)


def _spec(mesh: fs.Mesh) -> P:
    return P(tuple(mesh.axis_names))  # dim 0 over every axis: device r holds block r


def _held(mesh: fs.Mesh, shape: tuple[int, ...]) -> torch.Tensor:
    """The flat indices of the block this process holds (under sim: all of it)."""
    index = torch.arange(math.prod(shape)).reshape(shape)
    if mesh.backend == "sim":
        return index.flatten()
    return fs.device_put(index, mesh, _spec(mesh)).local.flatten()


def _exchange_body(mesh: fs.Mesh, case: str) -> str:
    x = torch.randn(mesh.size * NMAX, F, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    f = fs.shard_map(lambda v: _local(v, case), mesh=mesh, in_specs=(_spec(mesh),), out_specs=_spec(mesh))
    xr = x.clone().requires_grad_(True)
    want = _reference(xr, case)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (want * w).sum().backward()

    xg = x.clone().requires_grad_(True)
    got = fs.device_get(f(xg))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    (got * w).sum().backward()
    held = _held(mesh, tuple(x.shape))
    torch.testing.assert_close(xg.grad.flatten()[held], xr.grad.flatten()[held], rtol=1e-12, atol=1e-12)
    return "ok"


@pytest.mark.parametrize("case", sorted(CASES))
def test_exchange_forward_and_backward_vs_reference_sim(case: str) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _exchange_body, CASES[case][0], case) == ["ok"]


@pytest.mark.dist
@pytest.mark.parametrize("case", DIST_CASES)
def test_exchange_forward_and_backward_vs_reference_dist(case: str) -> None:
    from _dist_pool import run_body

    assert set(run_body("dist", _exchange_body, CASES[case][0], case)) == {"ok"}


def _transforms_body(mesh: fs.Mesh) -> str:
    """jvp, vmap and torch.func.grad through the exchange, and an invariant x (pvary'd: its gradient summed)."""
    case = "ep4"
    x = torch.randn(4 * NMAX, F, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def body(v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y, t = torch.func.jvp(lambda u: _local(u, case), (v,), (2 * v,))
        yb = torch.vmap(lambda u: _local(u, case), in_dims=1, out_dims=1)(torch.stack([v, -v], 1))
        g = torch.func.grad(lambda u: (_local(u, case) ** 2).sum())(v)
        return y, t, yb, g

    spec = _spec(mesh)
    y, t, yb, g = (fs.device_get(o) for o in fs.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=(spec,) * 4)(x))
    want = _reference(x, case)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    torch.testing.assert_close(t, 2 * want, rtol=0, atol=0)
    torch.testing.assert_close(yb, torch.stack([want, -want], 1), rtol=0, atol=0)
    xr = x.clone().requires_grad_(True)
    (_reference(xr, case) ** 2).sum().backward()
    torch.testing.assert_close(g, xr.grad, rtol=1e-12, atol=1e-12)

    # an x invariant over ep: every device sends rows of its own copy; the gradient sums the copies
    xi = x[:NMAX].clone().requires_grad_(True)
    f = fs.shard_map(lambda v: _local(v, case), mesh=mesh, in_specs=(P(),), out_specs=spec)
    (fs.device_get(f(xi)) ** 2).sum().backward()
    xr = x[:NMAX].clone().requires_grad_(True)
    (_reference(xr.repeat(4, 1), case) ** 2).sum().backward()
    torch.testing.assert_close(xi.grad, xr.grad, rtol=1e-12, atol=1e-12)
    return "ok"


def test_jvp_vmap_grad_and_invariant_operand_sim() -> None:
    from _dist_pool import run_body

    assert run_body("sim", _transforms_body, {"ep": 4}) == ["ok"]


# --------------------------------------------------------------------------------------------------------
# JAX's ragged_all_to_all as the oracle
# --------------------------------------------------------------------------------------------------------


def _jax_exchange(x: torch.Tensor, case: str) -> torch.Tensor | str:
    """``jax.lax.ragged_all_to_all`` in ``jax.shard_map`` on ``case``'s counts (one axis), its outputs padded as
    ours; a string (the reason) where XLA does not run it here."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec

    _, axis, sends = CASES[case]
    n = len(sends)
    if len(jax.devices()) < n:
        return f"JAX sees {len(jax.devices())} devices, needs {n}"
    mesh = jax.make_mesh((n,), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
    table = np.asarray(sends, dtype=np.int32)  # [n, n]: rows from i to j

    def body(v: jax.Array, send: jax.Array) -> jax.Array:
        me = jax.lax.axis_index(axis)
        everyone = jnp.asarray(table)
        recv = everyone[:, me]
        in_off = jnp.cumsum(send[0]) - send[0]
        out_off = (jnp.cumsum(everyone, axis=0) - everyone)[me]  # where my rows land in each peer's output
        out = jnp.zeros((OMAX, v.shape[1]), v.dtype)
        return jax.lax.ragged_all_to_all(v, out, in_off, send[0], out_off, recv, axis_name=axis)

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(PartitionSpec(axis), PartitionSpec(axis)), out_specs=PartitionSpec(axis)
    )
    try:
        got = f(jnp.asarray(x.numpy()), jnp.asarray(table))
        return torch.from_numpy(np.asarray(got).copy())
    except Exception as e:  # XLA:CPU has no ragged-all-to-all: the reason is the skip's
        text = str(e)
        if "ragged" in text.lower() and ("not supported" in text or "UNIMPLEMENTED" in text):
            return f"JAX {jax.__version__} does not run ragged_all_to_all on {jax.devices()[0].platform}: {text[:200]}"
        raise


@pytest.mark.oracle
@pytest.mark.parametrize("case", ["ep2", "ep4"])
def test_exchange_vs_jax_ragged_all_to_all(case: str) -> None:
    pytest.importorskip("jax")
    x = torch.randn(len(CASES[case][2]) * NMAX, F, generator=torch.Generator().manual_seed(0))
    want = _jax_exchange(x, case)
    if isinstance(want, str):
        pytest.skip(want)
    mesh = fs.make_mesh(CASES[case][0], backend="sim")
    got = fs.shard_map(lambda v: _local(v, case), mesh=mesh, in_specs=(_spec(mesh),), out_specs=_spec(mesh))(x)
    torch.testing.assert_close(fs.device_get(got), want, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------------
# comm_stats, counts exchanged for the caller, the checks, the abstract backend
# --------------------------------------------------------------------------------------------------------


@pytest.mark.counters
def test_comm_stats_counts_bytes_sent_to_other_devices() -> None:
    """Per device: one call forward and one backward; forward bytes are the rows sent to the others (not its own
    share), backward bytes the rows it received from the others (sent back)."""
    case = "ep4"
    mesh = fs.make_mesh({"ep": 4}, backend="sim")
    f = fs.shard_map(lambda v: _local(v, case), mesh=mesh, in_specs=(P("ep"),), out_specs=P("ep"))
    x = torch.randn(4 * NMAX, F, dtype=torch.float64, requires_grad=True)
    with fs.comm_stats() as stats:
        fs.device_get(f(x)).sum().backward()
    row = F * 8
    for r in range(4):
        send, recv, i = _counts(case, r)
        assert stats.calls("ragged_all_to_all", "ep", device=r) == 2
        assert stats.bytes("ragged_all_to_all", "ep", device=r) == ((sum(send) - send[i]) + (sum(recv) - recv[i])) * row
        assert stats.bytes(device=r) == stats.bytes("ragged_all_to_all", device=r)  # nothing else was sent


@pytest.mark.counters
def test_uniform_routing_moves_n_minus_one_over_n_of_the_rows() -> None:
    """MoE dispatch with uniform routing: tokens x k rows of dim d move (ep - 1) / ep of them (one call)."""
    ep, tokens, k, d = 4, 8, 2, 16
    mesh = fs.make_mesh({"ep": ep}, backend="sim")
    each = [tokens * k // ep] * ep
    f = fs.shard_map(
        lambda v: fs.lax.ragged_all_to_all(v, each, each, "ep"), mesh=mesh, in_specs=(P("ep"),), out_specs=P("ep")
    )
    with fs.comm_stats() as stats:
        f(torch.randn(ep * tokens * k, d, dtype=torch.bfloat16))
    assert stats.calls("ragged_all_to_all", "ep") == 1
    assert stats.bytes("ragged_all_to_all", "ep") == tokens * k * d * 2 * (ep - 1) // ep


def test_recv_sizes_none_exchanges_the_counts() -> None:
    case = "ep4"
    mesh = fs.make_mesh({"ep": 4}, backend="sim")

    def body(v: torch.Tensor) -> torch.Tensor:
        send, _, _ = _counts(case, int(fs.axis_index("ep")))
        return _pad(fs.lax.ragged_all_to_all(v, torch.tensor(send), None, "ep"))

    x = torch.randn(4 * NMAX, F)
    with fs.comm_stats() as stats:
        got = fs.shard_map(body, mesh=mesh, in_specs=(P("ep"),), out_specs=P("ep"))(x)
    torch.testing.assert_close(fs.device_get(got), _reference(x, case), rtol=0, atol=0)
    assert stats.calls("all_to_all", "ep") == 1 and stats.calls("ragged_all_to_all", "ep") == 1


def _mismatch_body(mesh: fs.Mesh) -> str:
    """Device 1 expects 3 rows from device 0, which sends it 2: every device raises the same ShardingError (under
    dist the counts are checked with FUNCSHARD_AUDIT=1)."""

    def body(v: torch.Tensor) -> torch.Tensor:
        me = int(fs.axis_index("ep"))
        send, recv = [[1, 2], [0, 3]][me], [[1, 0], [3, 3]][me]
        return _pad(fs.lax.ragged_all_to_all(v, send, recv, "ep"))

    f = fs.shard_map(body, mesh=mesh, in_specs=(P("ep"),), out_specs=P("ep"))
    old = os.environ.get("FUNCSHARD_AUDIT")
    os.environ["FUNCSHARD_AUDIT"] = "1"
    try:
        f(torch.randn(2 * NMAX, F))
    except fs.ShardingError as e:
        return str(e)
    finally:
        if old is None:
            del os.environ["FUNCSHARD_AUDIT"]
        else:
            os.environ["FUNCSHARD_AUDIT"] = old
    return "no error"


def test_mismatched_recv_sizes_raise(run) -> None:
    for msg in run(_mismatch_body, {"ep": 2}):
        assert "ragged_all_to_all over ('ep',)" in msg, msg
        assert "device (ep=1) (index 1) expects recv_sizes[0] = 3 rows from device (ep=0)" in msg, msg
        assert "send_sizes[1] = 2" in msg and "recv_sizes=[3, 3]" in msg and "fs.all_to_all" in msg, msg


@pytest.mark.parametrize(
    ("send", "match"),
    [
        ([1, 1, 1], r"send_sizes must be 2 non-negative row counts.*found \[1, 1, 1\]"),
        (torch.tensor([1.0, 1.0]), r"send_sizes must be 2 .*found 'a torch.float32 tensor of shape \(2,\)'"),
        (torch.ones(2, 1, dtype=torch.int64), r"send_sizes must be 2 .*shape \(2, 1\)"),
        ([2, -1], r"send_sizes must be 2 non-negative"),
        ([4, 1], r"sends send_sizes=\[4, 1\] \(sum 5\) rows of a value of shape \(4, 3\).*at least sum\(send_sizes\)"),
        (torch.empty(2, dtype=torch.int64, device="meta"), r"must hold values \(meta tensors are only for an abstract"),
    ],
)
def test_bad_counts_raise(send: object, match: str) -> None:
    mesh = fs.make_mesh({"ep": 2}, backend="sim")
    f = fs.shard_map(
        lambda v: fs.lax.ragged_all_to_all(v, send, [0, 0], "ep")[:0], mesh=mesh, in_specs=(P("ep"),), out_specs=P("ep")
    )
    with pytest.raises(fs.ShardingError, match=match):
        f(torch.randn(2 * NMAX, F))


def test_outside_shard_map_and_unknown_axis_raise() -> None:
    with pytest.raises(fs.ShardingError, match="ragged_all_to_all"):
        fs.ragged_all_to_all(torch.ones(2, 1), [1, 1], [1, 1], "ep")
    mesh = fs.make_mesh({"ep": 2}, backend="sim")
    f = fs.shard_map(
        lambda v: fs.lax.ragged_all_to_all(v, [1, 1], [1, 1], "tp"), mesh=mesh, in_specs=(P("ep"),), out_specs=P("ep")
    )
    with pytest.raises(fs.ShardingError, match="tp"):
        f(torch.ones(4, 1))


@pytest.mark.counters
def test_abstract_mesh_shapes_and_counted_bytes() -> None:
    """Counts in meta tensors: balanced routing (N rows back, (n-1)/n of them counted); known counts: their sum."""
    mesh = fs.make_mesh({"dp": 2, "ep": 4}, backend="abstract")
    meta = torch.empty(4, dtype=torch.int64, device="meta")

    def unknown(v: torch.Tensor) -> torch.Tensor:
        return fs.lax.ragged_all_to_all(v, meta, meta, "ep")

    def known(v: torch.Tensor) -> torch.Tensor:
        return fs.lax.ragged_all_to_all(v, [1, 2, 3, 4], [5, 5, 5, 5], "ep")

    x = fs.ShapeDtype((2 * 4 * 16, 32), torch.bfloat16)  # 16 rows a device
    with fs.comm_stats() as stats:
        y = fs.shard_map(unknown, mesh=mesh, in_specs=(P(("dp", "ep")),), out_specs=P(("dp", "ep")))(x)
    assert tuple(y.shape) == (2 * 4 * 16, 32)
    assert stats.calls("ragged_all_to_all", "ep") == 1
    assert stats.bytes("ragged_all_to_all", "ep") == 16 * 32 * 2 * 3 // 4
    with fs.comm_stats() as stats:
        y = fs.shard_map(known, mesh=mesh, in_specs=(P(("dp", "ep")),), out_specs=P(("dp", "ep")))(x)
    assert tuple(y.shape) == (2 * 4 * 20, 32)
    assert stats.bytes("ragged_all_to_all", "ep") == (10 - 1) * 32 * 2  # device 0 keeps its 1 row


def test_result_varies_over_the_axis() -> None:
    """The vma rule: the result varies over the axis (and over what x varies over), as all_to_all's; returned with
    a spec that omits the axis it raises, naming it."""
    mesh = fs.make_mesh({"dp": 2, "ep": 2}, backend="sim")
    f = fs.shard_map(
        lambda v: fs.lax.ragged_all_to_all(v, [1, 1], [1, 1], "ep"), mesh=mesh, in_specs=(P(),), out_specs=P()
    )
    with pytest.raises(fs.ShardingError, match="ep"):
        f(torch.ones(2, 3))
    g = fs.shard_map(
        lambda v: fs.lax.ragged_all_to_all(v, [1, 1], [1, 1], "ep"), mesh=mesh, in_specs=(P("dp"),), out_specs=P("ep")
    )
    with pytest.raises(fs.ShardingError, match="dp"):
        g(torch.ones(4, 3))


@pytest.mark.counters
@pytest.mark.parametrize("save_collectives", [False, True])
def test_under_remat(save_collectives: bool) -> None:
    """fs.remat recomputes through the exchange (again, or from its kept result): the same gradient."""
    case = "ep4"
    mesh = fs.make_mesh({"ep": 4}, backend="sim")
    x = torch.randn(4 * NMAX, F, dtype=torch.float64)

    def loss(v: torch.Tensor, remat: bool) -> torch.Tensor:
        def f(u: torch.Tensor) -> torch.Tensor:
            return torch.sin(_local(u, case)) ** 2

        g = fs.remat(f, save_collectives=save_collectives) if remat else f
        return fs.psum(g(v).sum(), "ep")

    grads, calls = [], []
    for remat in (False, True):
        step = fs.shard_map(lambda v, remat=remat: loss(v, remat), mesh=mesh, in_specs=(P("ep"),), out_specs=P())
        xg = x.clone().requires_grad_(True)
        with fs.comm_stats() as stats:
            fs.device_get(step(xg)).sum().backward()
        grads.append(xg.grad)
        calls.append(stats.calls("ragged_all_to_all", "ep"))
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    assert calls[0] == 2
    if not save_collectives:  # the recomputation exchanges again
        assert calls[1] == 3
