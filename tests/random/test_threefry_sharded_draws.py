"""fs.random: Threefry known answers, keys, and draws whose sharded blocks are bitwise slices of the whole."""

from __future__ import annotations

import functools

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard import random as fsr

M32 = 0xFFFFFFFF
SHAPE = (1024, 512)
SMALL = (256, 512)  # the further dtypes and draws: same coverage of layouts, less time
KEY = fsr.key(1234)
MESHES = {"tp4": {"tp": 4}, "dp2tp2": {"dp": 2, "tp": 2}, "a2b4": {"a": 2, "b": 4}}
CASES = [
    ("tp4", P("tp")),
    ("tp4", P(None, "tp")),
    ("dp2tp2", P("dp", "tp")),
    ("dp2tp2", P("tp", "dp")),
    ("dp2tp2", P(("dp", "tp"))),
    ("dp2tp2", P(None, "dp")),  # replicated over tp
    ("a2b4", P(None, ("a", "b"))),
    ("a2b4", P("b", "a")),
    ("a2b4", P(("b", "a"), None)),
]


@functools.cache
def _mesh(name: str) -> fs.Mesh:
    return fs.make_mesh(MESHES[name], backend="sim")


def _sharded(mesh: fs.Mesh, spec: P, draw, key: torch.Tensor = KEY) -> torch.Tensor:
    """Each device draws only its block of the global value; the blocks are then assembled."""
    f = fs.shard_map(lambda k: draw(k, spec=spec), mesh=mesh, in_specs=(P(),), out_specs=spec)
    return fs.device_get(f(key))


# --- bitwise mesh independence ---------------------------------------------------------------------------


@pytest.mark.parametrize(("mesh", "spec"), CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_sharded_normal_is_bitwise_slice(mesh: str, spec: P) -> None:
    draw = functools.partial(fsr.normal, shape=SHAPE)
    assert torch.equal(_sharded(_mesh(mesh), spec, draw), fsr.normal(KEY, SHAPE))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("mesh", "spec"), [("dp2tp2", P("tp", "dp")), ("a2b4", P(None, ("a", "b")))])
def test_sharded_normal_dtypes(mesh: str, spec: P, dtype: torch.dtype) -> None:
    draw = functools.partial(fsr.normal, shape=SMALL, dtype=dtype)
    out = _sharded(_mesh(mesh), spec, draw)
    assert out.dtype == dtype
    assert torch.equal(out, fsr.normal(KEY, SMALL, dtype))


@pytest.mark.parametrize(
    "name",
    ["uniform", "uniform64", "uniform_range", "bernoulli", "randint", "bits"],
)
@pytest.mark.parametrize(("mesh", "spec"), [("tp4", P(None, "tp")), ("a2b4", P("b", "a"))])
def test_sharded_other_draws(mesh: str, spec: P, name: str) -> None:
    draws = {
        "uniform": lambda k, spec=None: fsr.uniform(k, SMALL, spec=spec),
        "uniform64": lambda k, spec=None: fsr.uniform(k, SMALL, torch.float64, spec=spec),
        "uniform_range": lambda k, spec=None: fsr.uniform(k, SMALL, low=-0.3, high=2.5, spec=spec),
        "bernoulli": lambda k, spec=None: fsr.bernoulli(k, 0.3, SMALL, spec=spec),
        "randint": lambda k, spec=None: fsr.randint(k, SMALL, -5, 1000, dtype=torch.int32, spec=spec),
        "bits": lambda k, spec=None: fsr.bits(k, SMALL, spec=spec),
    }
    draw = draws[name]
    assert torch.equal(_sharded(_mesh(mesh), spec, draw), draw(KEY))


def _dist_body(mesh: fs.Mesh) -> str:
    key = fsr.key(7)
    for spec in (P("dp", "tp"), P(None, ("tp", "dp")), P("tp")):
        got = _sharded(mesh, spec, functools.partial(fsr.normal, shape=(256, 64)), key)
        assert torch.equal(got, fsr.normal(key, (256, 64))), spec
    return "ok"


def test_sharded_draw_dist(run) -> None:
    assert set(run(_dist_body, {"dp": 2, "tp": 2})) == {"ok"}


def test_sharded_draw_varies_over_spec_axes() -> None:
    """A block drawn with spec P('tp') varies over tp, so returning it as replicated is refused."""
    f = fs.shard_map(lambda k: fsr.normal(k, (8,), spec=P("tp")), mesh=_mesh("tp4"), in_specs=(P(),), out_specs=P())
    with pytest.raises(fs.ShardingError, match="tp"):
        f(KEY)


def test_per_device_keys_via_fold_in() -> None:
    """fold_in of the axis index gives each device its own stream (e.g. dropout masks)."""
    mesh = _mesh("tp4")
    f = fs.shard_map(
        lambda k: fsr.uniform(fsr.fold_in(k, fs.axis_index("tp")), (1, 5)),
        mesh=mesh,
        in_specs=(P(),),
        out_specs=P("tp"),
    )
    out = fs.device_get(f(KEY))
    for i in range(4):
        assert torch.equal(out[i : i + 1], fsr.uniform(fsr.fold_in(KEY, i), (1, 5)))


# --- Threefry and keys -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "ctr", "want"),
    [  # Random123 known-answer tests for threefry2x32_20 (also those of jax.random)
        ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
        ((M32, M32), (M32, M32), (0x1CB996FC, 0xBB002BE7)),
        ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
    ],
)
def test_threefry_known_answers(key, ctr, want) -> None:
    c0 = torch.tensor([ctr[0]] * 3)  # a batch of identical counters is vectorised the same way
    c1 = torch.tensor([ctr[1]] * 3)
    x0, x1 = fsr.threefry2x32(torch.tensor(key), c0, c1)
    assert x0.tolist() == [want[0]] * 3
    assert x1.tolist() == [want[1]] * 3


def test_key_words() -> None:
    assert fsr.key(0).tolist() == [0, 0]
    assert fsr.key(5).tolist() == [0, 5]
    assert fsr.key(2**32 + 5).tolist() == [1, 5]
    assert fsr.key(2**64 - 1).tolist() == [M32, M32]
    assert fsr.key(-1).tolist() == [M32, M32]  # two's complement, as JAX
    assert fsr.key(0).dtype == torch.int64


def test_split_rows_equal_fold_in() -> None:
    keys = fsr.split(KEY, 1000)
    assert keys.shape == (1000, 2) and keys.dtype == torch.int64
    for i in (0, 1, 2, 17, 999):
        assert torch.equal(keys[i], fsr.fold_in(KEY, i))
    assert len({tuple(k) for k in keys.tolist()}) == 1000
    assert bool(((keys >= 0) & (keys <= M32)).all())
    assert torch.equal(fsr.split(KEY, 4), fsr.split(KEY, 1000)[:4])
    assert fsr.split(KEY).shape == (2, 2)
    assert not torch.equal(fsr.fold_in(KEY, 3), fsr.fold_in(fsr.key(1235), 3))


def test_value_depends_only_on_key_and_linear_index() -> None:
    k = fsr.key(3)
    assert torch.equal(fsr.normal(k, (2, 3)), fsr.normal(k, (2, 3)))
    assert torch.equal(fsr.normal(k, (6,)), fsr.normal(k, (2, 3)).flatten())
    assert torch.equal(fsr.normal(k, (2, 3)), fsr.normal(k, (4, 3))[:2])
    assert torch.equal(fsr.uniform(k, (5, 1, 4)).flatten(), fsr.uniform(k, 20))
    assert fsr.normal(k, ()).shape == () and fsr.normal(k, (0, 3)).shape == (0, 3)
    assert not torch.equal(fsr.normal(k, (8,)), fsr.normal(fsr.key(4), (8,)))
    b = fsr.bits(k, (100,))  # JAX's float construction: 23 random mantissa bits under the exponent of 1.0
    assert torch.equal(fsr.uniform(k, (100,)), ((b >> 9) | 0x3F800000).to(torch.int32).view(torch.float32) - 1)
    assert torch.equal(fsr.bernoulli(k, 0.3, (100,)), fsr.uniform(k, (100,)) < 0.3)


# --- statistics --------------------------------------------------------------------------------------------


def test_normal_statistics() -> None:
    z = fsr.normal(fsr.key(0), (100_000,), torch.float64)
    assert abs(float(z.mean())) < 0.015
    assert abs(float(z.std()) - 1.0) < 0.015
    assert abs(float((z.abs() < 1).double().mean()) - 0.6827) < 0.01
    assert abs(float((z**3).mean())) < 0.05  # symmetric
    assert abs(float((z**4).mean()) - 3.0) < 0.1  # normal kurtosis


def test_uniform_bernoulli_randint_statistics() -> None:
    k = fsr.key(1)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        u = fsr.uniform(k, (100_000,), dtype).double()
        assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
        assert abs(float(u.mean()) - 0.5) < 0.01
    v = fsr.uniform(k, (100_000,), low=-2.0, high=3.0)
    assert float(v.min()) >= -2.0 and float(v.max()) < 3.0 and abs(float(v.mean()) - 0.5) < 0.05
    assert abs(float(fsr.bernoulli(k, 0.3, (100_000,)).double().mean()) - 0.3) < 0.01
    assert fsr.bernoulli(k, 0.3, (4,)).dtype == torch.bool
    assert not bool(fsr.bernoulli(k, 0.0, (1000,)).any())
    assert bool(fsr.bernoulli(k, 1.0, (1000,)).all())
    r = fsr.randint(k, (100_000,), -3, 7)
    assert r.dtype == torch.int64
    counts = torch.bincount(r + 3, minlength=10)
    assert counts.numel() == 10 and int(counts.min()) > 9_500 and int(counts.max()) < 10_500
    assert fsr.randint(k, (10,), 0, 100, dtype=torch.int8).dtype == torch.int8


# --- the float transforms, built from basic IEEE ops ------------------------------------------------------


def test_erfinv32_accuracy() -> None:
    """Giles' float32 polynomial (XLA's) against float64 erfinv: within its published accuracy."""
    x = torch.linspace(-0.999999, 0.999999, 100_001)
    got, want = fsr._erfinv32(x).double(), torch.erfinv(x.double())
    assert float(((got - want).abs() / want.abs().clamp_min(1e-30)).max()) < 1e-5  # the approximation's own error


# --- errors ------------------------------------------------------------------------------------------------

K = fsr.key(0)
BAD = {
    "negative_shape": (lambda: fsr.normal(K, (-1, 3)), "shape"),
    "non_int_shape": (lambda: fsr.uniform(K, (2.5,)), "shape"),
    "int32_key": (lambda: fsr.normal(torch.zeros(2, dtype=torch.int32), (3,)), "int64"),
    "key_shape": (lambda: fsr.split(torch.zeros(3, dtype=torch.int64), 2), r"\[2\]"),
    "key_not_tensor": (lambda: fsr.fold_in((0, 0), 1), "int64"),
    "key_word_range": (lambda: fsr.bits(torch.tensor([-1, 0]), (3,)), "2\\*\\*32"),
    "p_above_1": (lambda: fsr.bernoulli(K, 1.5, (3,)), "p must"),
    "p_below_0": (lambda: fsr.bernoulli(K, -0.1, (3,)), "p must"),
    "randint_empty": (lambda: fsr.randint(K, (3,), 5, 5), "low < high"),
    "randint_span": (lambda: fsr.randint(K, (3,), 0, 2**32), "2\\*\\*31"),
    "randint_dtype": (lambda: fsr.randint(K, (3,), 0, 300, dtype=torch.int8), "int8"),
    "randint_float": (lambda: fsr.randint(K, (3,), 0, 3, dtype=torch.float32), "integer"),
    "uniform_range": (lambda: fsr.uniform(K, (3,), low=1.0, high=1.0), "low < high"),
    "uniform_int": (lambda: fsr.uniform(K, (3,), torch.int64), "floating"),
    "seed_too_big": (lambda: fsr.key(2**64), "64 bits"),
    "split_negative": (lambda: fsr.split(K, -1), "n must"),
    "fold_in_negative": (lambda: fsr.fold_in(K, -1), "2\\*\\*63"),
    "spec_outside": (lambda: fsr.normal(K, (4,), spec=P("tp")), "only applies inside fs.shard_map"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_raise(case: str) -> None:
    fn, match = BAD[case]
    # a bad key, shape, dtype or range is a ConfigError; a spec that does not fit is a ShardingError
    with pytest.raises(fs.ShardingError if case == "spec_outside" else fs.ConfigError, match=match):
        fn()


@pytest.mark.parametrize(("spec", "match"), [(P("xx"), "does not have"), (P(None, None, "tp"), "entries")])
def test_bad_spec_inside_shard_map(spec: P, match: str) -> None:
    f = fs.shard_map(lambda k: fsr.normal(k, (6, 4), spec=spec), mesh=_mesh("tp4"), in_specs=(P(),), out_specs=P())
    with pytest.raises(fs.ShardingError, match=match):
        f(K)
