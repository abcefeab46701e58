"""``fs.random`` against ``jax.random`` itself (threefry, partitionable, JAX's defaults): bit for bit for keys,
split, fold_in, bits, uniform, bernoulli, randint and normal. Skipped without jax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard import random as fsr

pytestmark = pytest.mark.oracle

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

SEEDS = [0, 7, 1234, 2**31 + 9, 2**32 - 1]


@pytest.fixture(autouse=True)
def _jax_defaults():
    """JAX's default configuration (x64 off), whatever another test module set."""
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    yield
    jax.config.update("jax_enable_x64", prev)


FLOATS = [
    (torch.float32, "float32", np.int32),
    (torch.float16, "float16", np.int16),
    (torch.bfloat16, "bfloat16", np.int16),
]


def _bits_of(x: torch.Tensor, view: type) -> np.ndarray:
    """The raw bits of a float tensor (bfloat16 has no numpy dtype: go through int16)."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().astype(np.int64)
    return x.numpy().view(view).astype(np.int64)


def _jax_bits(a: object, view: type) -> np.ndarray:
    return np.asarray(a).view(view).astype(np.int64)


def _jkey(seed: int) -> object:
    return jax.random.key(seed)


def _kd(k: object) -> np.ndarray:
    return np.asarray(jax.random.key_data(k)).astype(np.int64)


@pytest.mark.parametrize("seed", SEEDS)
def test_keys_split_fold_in(seed: int) -> None:
    k, jk = fsr.key(seed), _jkey(seed)
    assert np.array_equal(k.numpy(), _kd(jk))
    assert np.array_equal(fsr.split(k, 7).numpy(), _kd(jax.random.split(jk, 7)))
    for i in (0, 1, 5, 2**31 + 3, 2**32 - 1):
        assert np.array_equal(fsr.fold_in(k, i).numpy(), _kd(jax.random.fold_in(jk, i)))


@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 3, 4), ()])
def test_bits(shape: tuple[int, ...]) -> None:
    k, jk = fsr.key(42), _jkey(42)
    want = np.asarray(jax.random.bits(jk, shape, jnp.uint32)).astype(np.int64)
    assert np.array_equal(fsr.bits(k, shape).numpy(), want)


@pytest.mark.parametrize(("dtype", "jdt", "view"), FLOATS)
@pytest.mark.parametrize(("low", "high"), [(0.0, 1.0), (-1.7, 3.3), (2.0, 2.5), (-1e-3, 1e4)])
def test_uniform_bitwise(dtype: torch.dtype, jdt: str, view: type, low: float, high: float) -> None:
    got = fsr.uniform(fsr.key(3), (4, 513), dtype, low=low, high=high)
    want = jax.random.uniform(_jkey(3), (4, 513), getattr(jnp, jdt), low, high)
    assert np.array_equal(_bits_of(got, view), _jax_bits(want, view))


@pytest.mark.parametrize("p", [0.0, 0.3, 0.5, 0.999, 1.0])
def test_bernoulli_bitwise(p: float) -> None:
    got = fsr.bernoulli(fsr.key(5), p, (2000,))
    assert np.array_equal(got.numpy(), np.asarray(jax.random.bernoulli(_jkey(5), p, (2000,))))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize(("low", "high"), [(0, 10), (-5, 100), (0, 50_000), (-(2**31), 0), (7, 8)])
def test_randint_bitwise(dtype: torch.dtype, low: int, high: int) -> None:
    info = torch.iinfo(dtype)
    if low < info.min or high - 1 > info.max:
        pytest.skip("range does not fit the dtype")
    got = fsr.randint(fsr.key(9), (3, 333), low, high, dtype=dtype)
    want = np.asarray(jax.random.randint(_jkey(9), (3, 333), low, high, jnp.int32))
    assert got.dtype == dtype and np.array_equal(got.numpy().astype(np.int64), want.astype(np.int64))


# every float dtype on one draw, float32 also on a second key and a shape of a few million elements
NORMAL_CASES = [(*f, 11, (200_000,)) for f in FLOATS] + [(torch.float32, "float32", np.int32, 2**32 - 1, (1500, 1401))]


@pytest.mark.parametrize(("dtype", "jdt", "view", "seed", "shape"), NORMAL_CASES)
def test_normal_bitwise(dtype: torch.dtype, jdt: str, view: type, seed: int, shape: tuple[int, ...]) -> None:
    """Bit for bit, float32 included: our erfinv replays XLA's CPU float32 code op for op (its own log1p,
    every multiply-add fused); float16 / bfloat16 round that float32 result, as XLA does."""
    got = fsr.normal(fsr.key(seed), shape, dtype)
    want = jax.random.normal(_jkey(seed), shape, getattr(jnp, jdt))
    assert np.array_equal(_bits_of(got, view), _jax_bits(want, view))


def test_under_x64() -> None:
    """With jax_enable_x64: 64-bit seeds (JAX drops their high word without it), uniform float64 bit for bit,
    normal float64 within 1e-12 (XLA's float64 erfinv is a different polynomial from torch's)."""
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        for seed in (2**32 + 5, 12345678901, 2**63 - 1):
            assert np.array_equal(fsr.key(seed).numpy(), _kd(_jkey(seed)))
        jk = _jkey(13)
        u = fsr.uniform(fsr.key(13), (3, 999), torch.float64, low=-1.7, high=3.3)
        assert np.array_equal(u.numpy(), np.asarray(jax.random.uniform(jk, (3, 999), jnp.float64, -1.7, 3.3)))
        z = fsr.normal(fsr.key(13), (50_000,), torch.float64)
        zj = np.asarray(jax.random.normal(jk, (50_000,), jnp.float64))
        assert np.abs(z.numpy() - zj).max() < 1e-12
    finally:
        jax.config.update("jax_enable_x64", prev)


def test_sharded_draw_equals_jax() -> None:
    """A block drawn inside shard_map is that slice of JAX's unsharded draw."""
    mesh = fs.make_mesh({"a": 2, "b": 2}, backend="sim")
    f = fs.shard_map(
        lambda k: fsr.uniform(k, (8, 6), spec=P("a", "b")), mesh=mesh, in_specs=(P(),), out_specs=P("a", "b")
    )
    got = fs.device_get(f(fsr.key(17)))
    assert np.array_equal(got.numpy(), np.asarray(jax.random.uniform(_jkey(17), (8, 6))))
