"""Audit of the state a training run keeps: ``fs.Array`` / ``device_put`` / ``device_get`` / ``reshard``,
``fs.random``, ``funcshard.checkpoint`` and the DTensor hand-off, on what the other tests do not reach (0-dim,
empty, bool / int8 / bfloat16 / complex and non-contiguous values, specs over two axes, odd shapes, damage
that only one process sees, values kept across a donated call).

Oracles: ``jax.sharding.NamedSharding`` (the block each device holds after ``jax.device_put``, 8 host
devices) and ``jax.random`` (threefry, JAX's defaults; x64 on and off) for blocks and streams, the unsharded
tensor (every device's shard against its slice, not only the assembled value) for resharding and
checkpoints, and torch's ``DTensor.full_tensor`` for the hand-off. Bodies that communicate run under
``sim`` and under ``dist`` (gloo workers).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _blocks import shard_slices

import funcshard as fs
from funcshard import P, checkpoint
from funcshard import random as fsr
from funcshard.checkpoint import CheckpointError

pytestmark = pytest.mark.oracle

MESH = {"dp": 2, "tp": 2}


def _jax() -> Any:
    """jax with 8 host devices (conftest asks XLA for them before jax's first import), or skip."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    jax = pytest.importorskip("jax")
    if len(jax.devices()) < 8:
        pytest.skip("jax was imported before XLA_FLAGS asked for 8 host devices")
    return jax


@pytest.fixture
def jax_x64():
    """``set(flag)`` switches jax_enable_x64; the previous setting comes back after the test."""
    jax = _jax()
    prev = jax.config.jax_enable_x64

    def set_x64(flag: bool) -> Any:
        jax.config.update("jax_enable_x64", flag)
        return jax

    yield set_x64
    jax.config.update("jax_enable_x64", prev)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (torch.equal has no complex32 kernel)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def _check_shards(a: fs.Array, full: torch.Tensor, what: object = "") -> None:
    """Every shard this process holds is exactly its block of ``full`` (dtype and bits)."""
    for c, t in a.shards.items():
        sl = shard_slices(a.shape, a.spec, a.mesh.shape, dict(zip(a.mesh.axis_names, c, strict=True)))
        assert _same_bits(t, full[sl]), (what, c, a.spec)


# -- Arrays: device_put / device_get / reshard ---------------------------------------------------------------


def test_device_put_blocks_match_jax_named_sharding() -> None:
    """Each device's block after ``fs.device_put`` is the block ``jax.device_put`` gives the device at the same
    mesh coordinates, for specs over two axes (in and out of mesh order) and replicated dims."""
    jax = _jax()
    from jax.sharding import NamedSharding, PartitionSpec

    shape = {"dp": 2, "tp": 4}
    mesh = fs.make_mesh(shape, backend="sim")
    jmesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8, 16, 3)
    specs = [P(), P("dp"), P(None, "tp"), P("tp", "dp"), P(("dp", "tp")), P(None, ("tp", "dp")), P(("tp", "dp"))]
    for spec in specs:
        a = fs.device_put(x, mesh, spec)
        ja = jax.device_put(x.numpy(), NamedSharding(jmesh, PartitionSpec(*spec)))
        pos = {d.id: tuple(int(i) for i in np.argwhere(jmesh.devices == d)[0]) for d in jmesh.devices.flat}
        for shard in ja.addressable_shards:
            got = a.shards[pos[shard.device.id]]
            assert np.array_equal(got.numpy(), np.asarray(shard.data)), (spec, pos[shard.device.id])


def _copy_body(mesh: fs.Mesh) -> list[list[float]]:
    make = fs.shard_map(lambda v: v * 1.0, mesh=mesh, in_specs=(P(),), out_specs=P())
    step = fs.shard_map(lambda v: v.add_(100.0), mesh=mesh, in_specs=(P(),), out_specs=P(), donate=0)
    y = make(torch.arange(4.0))  # a fresh (owned) replicated output, as a step's params
    snap = fs.device_get(y)
    z = step(y)  # donated: written in place
    w = fs.device_put(torch.arange(4.0), mesh, P())
    got = fs.device_get(w)
    got.zero_()  # the caller's own tensor: the Array keeps its value
    y2 = make(torch.arange(4.0))
    moved = fs.reshard(y2, P("tp"))  # (held) a resharded copy is not written by a step y2 is donated to
    step(y2)
    assert fs.device_get(moved).tolist() == [0.0, 1.0, 2.0, 3.0]
    return [snap.tolist(), fs.device_get(z).tolist(), fs.device_get(w).tolist()]


def test_device_get_is_a_copy(run) -> None:
    """``device_get`` of a replicated Array returned one device's own buffer: a value read before a donated
    step (which writes in place) changed with it, [0, 1, 2, 3] -> [100, 101, 102, 103], under sim and dist;
    and zeroing the result zeroed the Array. JAX's device_get is a copy; so is ours now."""
    for snap, after, kept in run(_copy_body, MESH):
        assert snap == [0.0, 1.0, 2.0, 3.0]
        assert after == [100.0, 101.0, 102.0, 103.0]
        assert kept == [0.0, 1.0, 2.0, 3.0]


def _refilled_buffer_body(mesh: fs.Mesh) -> dict[str, list[float]]:
    out = {}
    for spec in (P(), P("dp"), P(("dp", "tp"))):
        buf = torch.zeros(8)
        batches = []
        for i in range(3):  # one buffer refilled per batch, each batch put on the mesh
            buf.fill_(float(i))
            batches.append(fs.device_put(buf, mesh, spec))
        for b in batches:
            for c, t in b.shards.items():
                assert t.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr(), (spec, c)
        out[str(spec)] = [fs.device_get(b)[0].item() for b in batches]
    return out


def test_device_put_does_not_alias_the_callers_tensor(run) -> None:
    """Three batches put from one refilled buffer: under sim every shard was a view of the buffer, so all
    three read [2, 2, 2]; under dist replicated blocks were views and sharded ones copies ([2, 2, 2] for P(),
    [0, 1, 2] for P('dp')): the numbers depended on the backend and the spec. JAX's device_put copies: [0, 1,
    2] everywhere now."""
    for got in run(_refilled_buffer_body, MESH):
        assert got == {s: [0.0, 1.0, 2.0] for s in ("P()", "P('dp')", "P(('dp', 'tp'))")}, got


def test_device_put_still_differentiable() -> None:
    """The private copy keeps the graph: a gradient through device_put / device_get reaches the input."""
    mesh = fs.make_mesh(MESH, backend="sim")
    x = torch.arange(8.0, requires_grad=True)
    (fs.device_get(fs.device_put(x, mesh, P("tp"))) * torch.arange(8.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(8.0))
    # under torch.func (wrappers without a storage to compare), too
    g = torch.func.grad(lambda v: fs.device_get(fs.device_put(v, mesh, P("tp"))).pow(2).sum())(torch.arange(8.0))
    assert torch.equal(g, 2 * torch.arange(8.0))


def test_device_get_is_a_copy_over_axes_of_size_one() -> None:
    """A spec whose axes all have size 1 is one block too: device_get copies it."""
    mesh = fs.make_mesh({"dp": 1, "tp": 4}, backend="sim")
    make = fs.shard_map(lambda v: v * 1.0, mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))
    step = fs.shard_map(lambda v: v.mul_(0.0), mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"), donate=0)
    y = make(torch.arange(1.0, 5.0))
    snap = fs.device_get(y)
    step(y)
    assert snap.tolist() == [1.0, 2.0, 3.0, 4.0]
    sharded = fs.device_put(torch.arange(8.0), mesh, P("tp"))
    got = fs.device_get(sharded)
    got.zero_()
    assert fs.device_get(sharded).tolist() == list(range(8))


def _values() -> dict[str, torch.Tensor]:
    base = torch.arange(64).reshape(8, 8)
    return {
        "f32_t": (base.float() - 20.5).t(),  # non-contiguous
        "bf16": (base - 30).bfloat16(),
        "bool": base % 3 == 0,
        "i8": (base - 32).to(torch.int8),
        "c64": torch.complex(base.float(), -base.float() / 3),
        "zero_d": torch.tensor(-2.5),
        "empty": torch.zeros(0, 8),
    }


SPECS_2D = [P(), P("dp", "tp"), P("tp", "dp"), P(("dp", "tp")), P(None, ("tp", "dp")), P("tp")]


def _wire_values() -> dict[str, torch.Tensor]:
    """Dtypes gloo does not move (int16 / uint16 token ids, uint32, uint64): moved as their bytes."""
    base = torch.arange(64).reshape(8, 8)
    return {
        "i16": (base * 517 - 9000).to(torch.int16),
        "u16": (base * 1021).to(torch.uint16),
        "u32": (base * 2**25 + 7).to(torch.uint32),
        "u64": (base * 2**57 + 3).to(torch.uint64),
    }


def _reshard_body(mesh: fs.Mesh) -> int:
    n = 0
    for name, x in {**_values(), **_wire_values()}.items():
        specs = [P()] if x.dim() == 0 else SPECS_2D
        for src in specs:
            a = fs.device_put(x, mesh, src)
            _check_shards(a, x, (name, src))
            for dst in specs:
                b = fs.reshard(a, dst)
                assert b.spec == dst and b.shape == tuple(x.shape) and b.dtype == x.dtype
                _check_shards(b, x, (name, src, dst))
                assert _same_bits(fs.device_get(b), x), (name, src, dst)
                n += 1
    return n


def test_reshard_edge_values(run) -> None:
    """0-dim, empty, bool, int8, bfloat16, complex and non-contiguous values through every pair of layouts
    (specs over two axes, in and out of mesh order): every shard is bitwise its slice, under sim and dist.
    int16 and uint16 / 32 / 64 raised gloo's "RuntimeError: Invalid scalar type" under dist (sim moved them):
    a batch of uint16 token ids could not be resharded or device_get; they move as bytes now."""
    counts = run(_reshard_body, MESH)
    assert len(set(counts)) == 1 and counts[0] == 10 * 36 + 1


@pytest.mark.parametrize(
    ("spec", "shape", "match"),
    [
        (P("tp", "tp"), (8, 8), r"at 'layer/w': spec P\('tp', 'tp'\).*uses axis 'tp' twice"),
        (P("pp"), (8,), r"at 'layer/w'.*names axis 'pp', which the mesh does not have; use one of \['dp', 'tp'\]"),
        (P(None, None, "tp"), (8, 8), r"at 'layer/w'.*3 entries but the value has only 2 dims"),
    ],
)
def test_bad_specs_name_path_shape_spec_axis(spec: P, shape: tuple[int, ...], match: str) -> None:
    """device_put and reshard refuse a spec that does not fit, naming the leaf path, shape, spec, axis, fix (a dim
    its axes do not divide fits: it is split unevenly, tests/arrays/test_uneven_layout.py)."""
    mesh = fs.make_mesh({"dp": 2, "tp": 4}, backend="sim")
    with pytest.raises(fs.ShardingError, match="device_put " + match):
        fs.device_put({"layer": {"w": torch.zeros(shape)}}, mesh, spec)
    tree = fs.device_put({"layer": {"w": torch.zeros(shape)}}, mesh, P())
    with pytest.raises(fs.ShardingError, match="reshard " + match):
        fs.reshard(tree, spec)


# -- fs.random against jax.random ------------------------------------------------------------------------------


def _bits(x: Any) -> np.ndarray:
    """The raw bits of a torch or JAX float array, as int64 (bfloat16 through its 16 bits)."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().astype(np.int64)
        x = x.numpy()
    a = np.asarray(x)
    return a.view(f"i{a.dtype.itemsize}").astype(np.int64) if a.dtype.kind == "f" or a.dtype.itemsize == 2 else a


FLOATS = [(torch.float32, "float32"), (torch.float16, "float16"), (torch.bfloat16, "bfloat16")]
SHAPES = [(), (7,), (3, 5, 7), (0, 3)]


@pytest.mark.slow
def test_random_odd_shapes_and_keys_match_jax(jax_x64) -> None:
    """Shapes (), odd and empty ones, every 16/32-bit float dtype, split into 1, 5 and a shape of keys,
    fold_in up to 2**32 - 1: bit for bit JAX's (x64 off, its default)."""
    jax = jax_x64(False)
    jnp = jax.numpy
    kd = lambda k: np.asarray(jax.random.key_data(k)).astype(np.int64)  # noqa: E731
    for seed in (2**31 + 7,):
        k, jk = fsr.key(seed), jax.random.key(seed)
        for n in (1, 5, (2, 3), ()):
            assert np.array_equal(fsr.split(k, n).numpy(), kd(jax.random.split(jk, n))), (seed, n)
        for i in (0, 3, 2**31, 2**32 - 1):
            assert np.array_equal(fsr.fold_in(k, i).numpy(), kd(jax.random.fold_in(jk, i))), (seed, i)
        for dt, jdt in FLOATS:
            for shape in SHAPES:
                u = fsr.uniform(k, shape, dt, -3.0, 0.5)
                ju = jax.random.uniform(jk, shape, getattr(jnp, jdt), -3.0, 0.5)
                assert u.shape == shape and np.array_equal(_bits(u), _bits(ju)), (seed, dt, shape)
                z = fsr.normal(k, shape, dt)
                assert np.array_equal(_bits(z), _bits(jax.random.normal(jk, shape, getattr(jnp, jdt)))), (dt, shape)
            p = torch.linspace(0, 1, 37).to(dt)
            jp = jnp.asarray(np.linspace(0, 1, 37)).astype(getattr(jnp, jdt))
            assert np.array_equal(fsr.bernoulli(k, p).numpy(), np.asarray(jax.random.bernoulli(jk, jp))), dt
        assert np.array_equal(fsr.bernoulli(k, 0.5).numpy(), np.asarray(jax.random.bernoulli(jk, 0.5)))


def test_random_float64_and_keys_under_x64(jax_x64) -> None:
    """With jax_enable_x64: negative and 64-bit seeds, float64 uniform bit for bit on odd shapes and bounds,
    float64 normal within 1e-12 (its documented bound), a float64 p for bernoulli."""
    jax = jax_x64(True)
    jnp = jax.numpy
    kd = lambda k: np.asarray(jax.random.key_data(k)).astype(np.int64)  # noqa: E731
    for seed in (-1, -(2**63), 2**40 + 3):
        assert np.array_equal(fsr.key(seed).numpy(), kd(jax.random.key(seed))), seed
    k, jk = fsr.key(11), jax.random.key(11)
    for shape in SHAPES:
        u = fsr.uniform(k, shape, torch.float64, -1e3, 7.25)
        assert np.array_equal(u.numpy(), np.asarray(jax.random.uniform(jk, shape, jnp.float64, -1e3, 7.25)))
        z = fsr.normal(k, shape, torch.float64).numpy()
        zj = np.asarray(jax.random.normal(jk, shape, jnp.float64))
        assert z.shape == zj.shape and (z.size == 0 or np.abs(z - zj).max() < 1e-12), shape
    p = torch.linspace(0, 1, 41, dtype=torch.float64)
    assert np.array_equal(fsr.bernoulli(k, p).numpy(), np.asarray(jax.random.bernoulli(jk, jnp.asarray(p.numpy()))))


def test_fold_in_out_of_range_is_a_clear_error() -> None:
    """JAX refuses a negative Python int (OverflowError); so do we, with the range and the fix."""
    for i in (-1, -(2**40), 2**63):
        with pytest.raises(fs.ConfigError, match=r"fold_in: i must lie in \[0, 2\*\*63\)"):
            fsr.fold_in(fsr.key(0), i)
    with pytest.raises(fs.ConfigError, match=r"0-dim integer tensor"):
        fsr.fold_in(fsr.key(0), torch.tensor(1.0))


def test_bounds_that_are_not_numbers_are_clear_errors() -> None:
    """JAX takes array bounds (broadcast); ours are numbers. A vector minval raised torch's ValueError 'only one
    element tensors can be converted to Python scalars', a list p a TypeError from float(); now ConfigErrors
    with the fix. One-element tensors and numpy scalars are numbers and draw as JAX does."""
    k = fsr.key(0)
    with pytest.raises(fs.ConfigError, match=r"uniform: minval must be a number.*shape \(2,\).*low \+ u \*"):
        fsr.uniform(k, (2,), torch.float32, torch.tensor([0.0, 1.0]), 2.0)
    with pytest.raises(fs.ConfigError, match=r"uniform: maxval must be a number.*'2'"):
        fsr.uniform(k, (2,), torch.float32, 0.0, "2")
    with pytest.raises(fs.ConfigError, match=r"bernoulli: p must be a number.*\[0.1, 0.2\].*torch.tensor\(p\)"):
        fsr.bernoulli(k, [0.1, 0.2], (2,))
    want = fsr.uniform(k, (5,), torch.float32, 0.5, 2.0)
    assert torch.equal(fsr.uniform(k, (5,), torch.float32, torch.tensor([0.5]), np.float32(2.0)), want)
    assert torch.equal(fsr.bernoulli(k, np.float64(0.3), (9,)), fsr.bernoulli(k, 0.3, (9,)))


def test_bernoulli_spec_refuses_a_local_block_of_p() -> None:
    """With ``spec=``, p is the global probabilities. A device's own block of p (an input sharded P('tp'),
    shape (1, 4) of a global (4, 4)) was broadcast to the global shape (8, 4) as if it were the whole p, and
    each device drew with its own row, silently; now a ShardingError naming the axis. A replicated p still
    gives the slices of the unsharded draw."""
    mesh = fs.make_mesh({"tp": 4}, backend="sim")
    k, p = fsr.key(0), torch.linspace(0.05, 0.95, 16).reshape(4, 4)

    def draw(key: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return fsr.bernoulli(key, q, (8, 4), spec=P("tp"))

    local = fs.shard_map(draw, mesh=mesh, in_specs=(P(), P("tp")), out_specs=P("tp"))
    with pytest.raises(fs.ShardingError, match=r"bernoulli: with spec=P\('tp'\).*varies over \['tp'\].*spec P\(\)"):
        local(k, p)
    whole = fs.shard_map(draw, mesh=mesh, in_specs=(P(), P()), out_specs=P("tp"))
    assert torch.equal(fs.device_get(whole(k, p[:1])), fsr.bernoulli(k, p[:1], (8, 4)))


def test_sharded_draws_are_slices_of_jax_draws(jax_x64) -> None:
    """Inside shard_map, ``spec=`` blocks over two axes (in and out of mesh order) of 3-dim draws are the
    slices of JAX's unsharded draw: uniform and normal (float32, bfloat16), bernoulli with a tensor p."""
    jax = jax_x64(False)
    jnp = jax.numpy
    mesh = fs.make_mesh({"dp": 2, "tp": 4}, backend="sim")
    k, jk = fsr.key(21), jax.random.key(21)
    shape = (8, 4, 3)
    p = torch.linspace(0.05, 0.95, 3)
    draws = {
        "uniform": (lambda key, spec: fsr.uniform(key, shape, spec=spec), jax.random.uniform(jk, shape)),
        "normal_bf16": (
            lambda key, spec: fsr.normal(key, shape, torch.bfloat16, spec=spec),
            jax.random.normal(jk, shape, jnp.bfloat16),
        ),
        "bernoulli_p": (
            lambda key, spec: fsr.bernoulli(key, p, shape, spec=spec),
            jax.random.bernoulli(jk, jnp.asarray(p.numpy()), shape),
        ),
    }
    for spec in (P(("dp", "tp")), P(("tp", "dp")), P("tp", "dp"), P(None, "tp")):
        for name, (draw, want) in draws.items():
            f = fs.shard_map(
                lambda key, draw=draw, spec=spec: draw(key, spec), mesh=mesh, in_specs=(P(),), out_specs=spec
            )
            got = f(k)
            full = torch.from_numpy(_bits(want).copy())
            for c, t in got.shards.items():
                sl = shard_slices(shape, spec, mesh.shape, dict(zip(mesh.axis_names, c, strict=True)))
                assert np.array_equal(_bits(t), full[sl].numpy()), (name, spec, c)


# -- checkpoints -------------------------------------------------------------------------------------------------


def test_checkpoint_edge_values_reshard_to_other_meshes(tmp_path: Path) -> None:
    """Saved on dp=2,tp=2 (0-dim, empty, bool, int8, bfloat16, complex, non-contiguous leaves, specs over two
    axes), loaded on tp=4, on one device and on dp=2,tp=2 with other specs: every shard is its slice."""
    mesh = fs.make_mesh(MESH, backend="sim")
    vals = _values()
    save_specs = {
        k: P() if v.dim() == 0 else P(("dp", "tp")) if k != "bool" else P("tp", "dp") for k, v in vals.items()
    }
    checkpoint.save(tmp_path / "ck", {"params": fs.device_put(vals, mesh, save_specs), "step": 4}, step=4)
    targets = [
        (fs.make_mesh({"tp": 4}, backend="sim"), lambda v: P(None, "tp") if v.dim() else P()),
        (fs.make_mesh({"x": 1}, backend="sim"), lambda v: P()),
        (mesh, lambda v: P("tp", "dp") if v.dim() else P()),
    ]
    for target, spec_of in targets:
        like = {
            "params": {k: fs.device_put(torch.zeros_like(v), target, spec_of(v)) for k, v in vals.items()},
            "step": 0,
        }
        out = checkpoint.load(tmp_path / "ck", like)
        assert out["step"] == 4
        for k, v in vals.items():
            assert out["params"][k].spec == spec_of(v) and out["params"][k].mesh == target
            _check_shards(out["params"][k], v, (k, target))


def test_checkpoint_wrong_like_names_the_leaf(tmp_path: Path) -> None:
    """A like of another dtype (bf16 for f32: no silent cast), shape, or tree: errors naming the leaf."""
    mesh = fs.make_mesh(MESH, backend="sim")
    w = fs.device_put(torch.arange(16.0).reshape(4, 4), mesh, P("dp", "tp"))
    checkpoint.save(tmp_path / "ck", {"layers": [{"w": w}]})
    bf16 = {"layers": [{"w": fs.device_put(torch.zeros(4, 4, dtype=torch.bfloat16), mesh, P("tp"))}]}
    with pytest.raises(
        CheckpointError,
        match=r"leaf 'layers/0/w' was saved with shape \(4, 4\) and dtype torch.float32.*torch.bfloat16",
    ):
        checkpoint.load(tmp_path / "ck", bf16)
    with pytest.raises(CheckpointError, match=r"leaf 'layers/0/w'.*`like` has shape \(4, 2\)"):
        checkpoint.load(tmp_path / "ck", {"layers": [{"w": fs.device_put(torch.zeros(4, 2), mesh, P())}]})
    with pytest.raises(CheckpointError, match=r"leaf 'layers/1/w' of `like` is not in the checkpoint"):
        checkpoint.load(tmp_path / "ck", {"layers": [{"w": w}, {"w": w}]})
    with pytest.raises(CheckpointError, match=r"leaves that `like` lacks: \['layers/0/w'\]"):
        checkpoint.load(tmp_path / "ck", {"layers": []})


def test_latest_finds_a_step_left_at_old(tmp_path: Path) -> None:
    """A re-save of step 8 killed between its two renames leaves step 8's previous checkpoint at
    ``step_00000008.old``, where ``load(step_path(root, 8))`` finds it; ``list_steps`` / ``latest`` left it
    out, so a resume went back to step 4 (or, with no older step, started over)."""
    mesh = fs.make_mesh(MESH, backend="sim")
    for step in (4, 8):
        tree = {"w": fs.device_put(torch.full((4, 4), float(step)), mesh, P("dp", "tp")), "step": step}
        checkpoint.save(checkpoint.step_path(tmp_path, step), tree, step=step)
    eight = Path(checkpoint.step_path(tmp_path, 8))
    os.rename(eight, eight.with_name(eight.name + ".old"))  # the state a kill between the renames leaves
    assert checkpoint.list_steps(tmp_path) == [4, 8]
    assert checkpoint.latest(tmp_path) == str(eight)
    out = checkpoint.load(checkpoint.latest(tmp_path), {"w": fs.device_put(torch.zeros(4, 4), mesh, P()), "step": 0})
    assert out["step"] == 8 and torch.equal(fs.device_get(out["w"]), torch.full((4, 4), 8.0))


def test_empty_directory_over_a_half_swapped_save_keeps_the_previous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save killed between its renames leaves the previous checkpoint at ``ck.old``; a script that then makes
    ``ck`` (``os.makedirs(path, exist_ok=True)``) hid it: load said "no funcshard.json", and the next save took
    ``ck`` for the newer one and deleted ``ck.old`` before its own swap, so a save failing there lost every
    copy. Now load finds ``ck.old`` and a failed save keeps it."""
    mesh = fs.make_mesh(MESH, backend="sim")
    ck = tmp_path / "ck"
    checkpoint.save(ck, {"w": fs.device_put(torch.ones(4, 4), mesh, P("tp"))}, step=1)
    os.rename(ck, tmp_path / "ck.old")  # killed between the renames
    ck.mkdir()
    like = {"w": fs.device_put(torch.zeros(4, 4), mesh, P())}
    assert torch.equal(fs.device_get(checkpoint.load(ck, like)["w"]), torch.ones(4, 4))
    real = os.rename

    def rename(src: Any, dst: Any) -> None:
        if ".tmp-" in Path(src).name:
            raise OSError("killed during the swap (injected)")
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="injected"):
        checkpoint.save(ck, {"w": fs.device_put(torch.zeros(4, 4), mesh, P("tp"))}, step=2)
    monkeypatch.undo()
    assert checkpoint.info(ck)["step"] == 1
    assert torch.equal(fs.device_get(checkpoint.load(ck, like)["w"]), torch.ones(4, 4))
    checkpoint.save(ck, {"w": fs.device_put(torch.full((4, 4), 3.0), mesh, P("tp"))}, step=3)
    assert sorted(os.listdir(tmp_path)) == ["ck"] and checkpoint.info(ck)["step"] == 3


def _one_rank_dies_body(mesh: fs.Mesh, path: str) -> tuple[str, float, int]:
    import torch.distributed as dist

    checkpoint.save(path, {"w": fs.device_put(torch.ones(8, 8), mesh, P("dp", "tp"))}, step=1)
    planner = checkpoint._dcp()[1]
    real = planner.resolve_data

    def dies(self: Any, item: Any) -> Any:
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 died mid-write (injected)")
        return real(self, item)

    planner.resolve_data = dies
    try:
        with pytest.raises(CheckpointError, match=r"rank 1: RuntimeError: rank 1 died mid-write.*previous checkpoint"):
            checkpoint.save(path, {"w": fs.device_put(torch.zeros(8, 8), mesh, P("tp"))}, step=2)
    finally:
        planner.resolve_data = real
    out = checkpoint.load(path, {"w": fs.device_put(torch.zeros(8, 8), mesh, P(None, "dp"))})
    return sorted(os.listdir(Path(path).parent)), float(fs.device_get(out["w"]).sum()), checkpoint.info(path)["step"]


@pytest.mark.dist
def test_dist_save_dying_on_one_rank_keeps_previous(tmp_path: Path) -> None:
    """One process's write raising mid-save: every process raises (naming that rank and the cause), the
    previous checkpoint loads on every process, no temp directory is left."""
    from _dist_pool import run_body

    for names, total, step in run_body("dist", _one_rank_dies_body, MESH, str(tmp_path / "ck")):
        assert names == ["ck"] and total == 64.0 and step == 1


def _damaged_load_body(mesh: fs.Mesh, path: str) -> tuple[str, str]:
    like = {"w": fs.device_put(torch.zeros(8), mesh, P("tp"))}
    try:
        checkpoint.load(path, like)
    except CheckpointError as e:
        return "CheckpointError", str(e)
    return "loaded", ""


@pytest.mark.dist
def test_dist_load_damage_seen_by_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    """A block whose bytes changed after the save, read only by the tp=1 ranks: those raised the checksum
    error while the tp=0 ranks entered DCP's collective read and waited out the 60 s timeout, then reported
    'reading the tensor data failed (... Timed out ...)'. Now the processes agree first: every rank raises at
    once, naming the damaged file."""
    from _dist_pool import run_body

    sim = fs.make_mesh({"tp": 2}, backend="sim")
    checkpoint.save(tmp_path / "ck", {"w": fs.device_put(torch.arange(100.0, 108.0), sim, P("tp"))})
    f = next((tmp_path / "ck").glob("*.distcp"))
    data = f.read_bytes()
    at = data.find(struct.pack("<f", 106.0))  # in the block at (4,): the tp=1 devices read it
    assert at > 0
    with open(f, "r+b") as fh:
        fh.seek(at)
        fh.write(struct.pack("<f", 0.5))
    got = run_body("dist", _damaged_load_body, MESH, str(tmp_path / "ck"))
    for rank, (kind, msg) in enumerate(got):
        assert kind == "CheckpointError", (rank, kind)
        assert "fails its checksum" in msg and str(f) in msg and "leaf 'w'" in msg, (rank, msg)
    assert "rank 1 found the checkpoint damaged" in got[0][1], got[0][1]


# -- DTensor hand-off --------------------------------------------------------------------------------------------


# DTensor splits a dim over several mesh dims in mesh order only
DTENSOR_SPECS = [P(), P("dp", "tp"), P(("dp", "tp")), P(None, "tp")]


def _dtensor_body(mesh: fs.Mesh) -> int:
    from torch.distributed.tensor import Replicate, Shard

    n = 0
    for name, x in _values().items():
        for spec in [P()] if x.dim() == 0 else DTENSOR_SPECS:
            a = fs.device_put(x, mesh, spec)
            dt = fs.to_dtensor(a)
            assert dt.shape == x.shape and dt.dtype == x.dtype
            assert torch.equal(dt.full_tensor(), x), (name, spec)
            back = fs.from_dtensor(dt)
            assert back.spec == spec
            _check_shards(back, x, (name, spec))
            if x.dim() == 2 and x.dtype != torch.bool:
                moved = fs.from_dtensor(dt.redistribute(dt.device_mesh, [Shard(1), Replicate()]))
                assert moved.spec == P(None, "dp")
                _check_shards(moved, x, (name, spec, "moved"))
            n += 1
    return n


def _dtensor_mesh_arg_body(mesh: fs.Mesh) -> list[str]:
    dt = fs.to_dtensor(fs.device_put(torch.arange(8.0), mesh, P("tp")))
    msgs = []
    for wrong in (fs.make_mesh(MESH, backend="sim"), dt.device_mesh):
        with pytest.raises(fs.ShardingError) as e:
            fs.from_dtensor(dt, wrong)
        msgs.append(str(e.value))
    assert torch.equal(fs.device_get(fs.from_dtensor(dt, mesh)), torch.arange(8.0))
    return msgs


@pytest.mark.dist
def test_from_dtensor_mesh_argument_checked() -> None:
    """``from_dtensor(dt, mesh)`` with a 'sim' mesh of the right shape built an Array holding one device's
    shard on a mesh whose Arrays hold every device's (device_get: KeyError (1,)); with torch's DeviceMesh it
    raised TypeError 'cannot convert dictionary update sequence element #0'. Both are ShardingErrors now."""
    from _dist_pool import run_body

    for sim_msg, dm_msg in run_body("dist", _dtensor_mesh_arg_body, MESH):
        assert "mesh must be a 'dist' fs.Mesh" in sim_msg and "found a 'sim' fs.Mesh" in sim_msg, sim_msg
        assert "found a DeviceMesh" in dm_msg and "omit mesh=" in dm_msg, dm_msg


@pytest.mark.dist
def test_dtensor_edge_values_dist() -> None:
    """to_dtensor / from_dtensor of 0-dim, empty, bool, int8, bfloat16, complex and non-contiguous values:
    DTensor's full_tensor is the value, and a DTensor redistributed by torch comes back as its slices."""
    from _dist_pool import run_body

    assert set(run_body("dist", _dtensor_body, MESH)) == {6 * 4 + 1}


def test_saving_a_meta_leaf_names_it(tmp_path: Path) -> None:
    """A leaf on the meta device (shapes only) is refused before anything is written, naming the leaf (DCP's
    own error, 'Cannot copy out of meta tensor', named none); a previous checkpoint stays readable."""
    mesh = fs.make_mesh({"dp": 2}, backend="sim")
    good = {"w": fs.device_put(torch.arange(4.0), mesh, P("dp"))}
    checkpoint.save(tmp_path / "ck", good)
    for bad in (
        {"w": fs.device_put(torch.empty(4, device="meta"), mesh, P("dp"))},
        {"w": torch.empty(4, device="meta")},
    ):
        with pytest.raises(checkpoint.CheckpointError, match=r"leaf .*w.* lives on the meta device"):
            checkpoint.save(tmp_path / "ck", bad)
    back = checkpoint.load(tmp_path / "ck", good)
    assert torch.equal(fs.device_get(back["w"]), torch.arange(4.0))
