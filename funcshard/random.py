"""Counter-based random numbers, bit-identical to ``jax.random``, whose value at each global index does not
depend on the mesh.

A key is a plain ``torch.int64`` tensor of shape ``[2]`` holding two uint32 words (``jax.random.key_data``
of a threefry key), so it is an ordinary pytree leaf (pass it into ``shard_map`` with spec ``P()``). The
streams are JAX's with ``jax_threefry_partitionable=True`` (its default from 0.5): element ``i`` of a draw
is Threefry-2x32 (20 rounds) of the key and the 64-bit row-major index ``i``; ``split`` / ``fold_in`` use the
same counters. So ``key``, ``split``, ``fold_in``, ``bits``, ``uniform``, ``bernoulli`` and ``randint`` equal
``jax.random``'s bit for bit, and ``normal`` (``sqrt(2) * erfinv(u)``, as JAX) within a few ulp (XLA's own
``log1p`` differs from a correctly rounded one). Inside ``shard_map`` a draw with ``spec=P(...)`` computes
only this device's block, bitwise equal to that slice of the unsharded draw: a model too large for one device
is initialised shard by shard, identical to an unsharded init. Every transform is elementwise and built from
correctly rounded IEEE ops (no SIMD ``log`` kernel whose last bit could depend on where an element sits).

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P, random as fsr
    >>> k = fsr.key(0)
    >>> mesh = fs.make_mesh({"tp": 2}, backend="sim")
    >>> draw = lambda k: fsr.normal(k, (4, 6), spec=P(None, "tp"))
    >>> f = fs.shard_map(draw, mesh=mesh, in_specs=(P(),), out_specs=P(None, "tp"))
    >>> torch.equal(fs.device_get(f(k)), fsr.normal(k, (4, 6)))
    True
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch

from ._context import maybe_current
from ._errors import ConfigError, ShardingError
from ._spec import P, check_spec, shard_slices
from ._vma import get_vma, set_vma

__all__ = ["bernoulli", "bits", "fold_in", "key", "normal", "randint", "split", "threefry2x32", "uniform"]

_M = 0xFFFFFFFF
_ROT = (13, 15, 26, 6, 17, 29, 16, 24)  # Threefry-2x32 rotation constants (Salmon et al. 2011)
_PARITY = 0x1BD11BDA
_Shape = int | Sequence[int]


def threefry2x32(key: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32, 20 rounds: the block cipher of ``key`` applied to counters ``(c0, c1)``.

    Args:
        key: int64 ``[2]``, two uint32 words.
        c0: int64 tensor with values in ``[0, 2**32)``, the counter's first word.
        c1: int64 tensor of ``c0``'s shape with values in ``[0, 2**32)``, the counter's second word.

    Returns:
        Two int64 tensors of that shape, the output words, each in ``[0, 2**32)``.

    Example:
        >>> z = torch.zeros((), dtype=torch.int64)
        >>> [hex(int(w)) for w in threefry2x32(torch.zeros(2, dtype=torch.int64), z, z)]
        ['0x6b200159', '0x99ba4efe']
    """
    k0, k1 = key[0], key[1]
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    x0 = (c0 + ks[0]) & _M
    x1 = (c1 + ks[1]) & _M
    for i in range(20):
        r = _ROT[i % 8]
        x0 = x0.add_(x1).bitwise_and_(_M)
        hi = x1 >> (32 - r)
        x1 = x1.bitwise_left_shift_(r).bitwise_and_(_M).bitwise_or_(hi).bitwise_xor_(x0)  # rotl(x1, r) ^ x0
        if i % 4 == 3:  # key injection s
            s = (i + 1) // 4
            x0 = x0.add_(ks[s % 3]).bitwise_and_(_M)
            x1 = x1.add_((ks[(s + 1) % 3] + s) & _M).bitwise_and_(_M)
    return x0, x1


def _check_key(k: Any, fn: str) -> torch.Tensor:
    if not isinstance(k, torch.Tensor) or k.dtype != torch.int64 or tuple(k.shape) != (2,):
        found = f"{k.dtype} tensor of shape {tuple(k.shape)}" if isinstance(k, torch.Tensor) else type(k).__name__
        raise ConfigError(
            f"{fn}: key must be an int64 tensor of shape [2] (two uint32 words), found {found}; make one with "
            f"fs.random.key(seed), and pick one of split(key, n)'s rows with keys[i]."
        )
    if bool(((k < 0) | (k > _M)).any()):
        raise ConfigError(
            f"{fn}: key words must lie in [0, 2**32), found {k.tolist()}; make keys with fs.random.key(seed)."
        )
    return k


def _derive(k: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """Keys number ``i`` (int64 ``[n]``, in ``[0, 2**63)``) derived from ``k``: int64 ``[n, 2]``, the two
    Threefry words of counter ``i`` (JAX's partitionable ``split``; ``fold_in`` is the same for one ``i``)."""
    x0, x1 = threefry2x32(k, i >> 32, i & _M)
    return torch.stack([x0, x1], dim=-1)  # 2 x [n] -> [n, 2]


def key(seed: int) -> torch.Tensor:
    """A key from an integer seed of up to 64 bits (negative seeds are taken as two's complement):
    ``jax.random.key_data(jax.random.key(seed))`` (64-bit seeds as JAX with ``jax_enable_x64``; without it
    JAX keeps only a seed's low 32 bits).

    Example:
        >>> key(1)
        tensor([0, 1])
        >>> key(2**32 + 5)
        tensor([1, 5])
    """
    seed = operator.index(seed)
    if not -(2**63) <= seed < 2**64:
        raise ConfigError(f"key: seed must fit in 64 bits, found {seed}; use seed % 2**64.")
    seed &= 2**64 - 1
    return torch.tensor([seed >> 32, seed & _M], dtype=torch.int64)


def split(key: torch.Tensor, n: int = 2) -> torch.Tensor:
    """``n`` new keys, int64 ``[n, 2]``; row ``i`` equals ``fold_in(key, i)``.

    Example:
        >>> k = key(0)
        >>> torch.equal(split(k, 3)[2], fold_in(k, 2))
        True
    """
    k = _check_key(key, "split")
    n = operator.index(n)
    if n < 0:
        raise ConfigError(f"split: n must be >= 0, found {n}.")
    return _derive(k, torch.arange(n, dtype=torch.int64, device=k.device))


def fold_in(key: torch.Tensor, i: int) -> torch.Tensor:
    """The key numbered ``i`` derived from ``key`` (int64 ``[2]``), e.g. one per layer or step.

    Example:
        >>> fold_in(key(0), 7).shape
        torch.Size([2])
    """
    k = _check_key(key, "fold_in")
    i = operator.index(i)
    if not 0 <= i < 2**63:
        raise ConfigError(f"fold_in: i must lie in [0, 2**63), found {i}; fold in i % 2**63 instead.")
    return _derive(k, torch.tensor([i], dtype=torch.int64, device=k.device))[0]


def _check_shape(shape: Any, fn: str) -> tuple[int, ...]:
    try:
        dims = (operator.index(shape),) if not isinstance(shape, (Sequence, torch.Size)) else tuple(shape)
        dims = tuple(operator.index(s) for s in dims)
    except TypeError:
        dims = None
    if dims is None or any(s < 0 for s in dims):
        raise ConfigError(f"{fn}: shape must be a tuple of ints >= 0, found {shape!r}; write e.g. (1024, 512).")
    return dims


def _words(k: Any, shape: Any, spec: P | None, fn: str) -> tuple[torch.Tensor, torch.Tensor, frozenset[str]]:
    """Both Threefry words of every element of this device's block, and the axes the block varies over."""
    k = _check_key(k, fn)
    shape = _check_shape(shape, fn)
    if spec is None:
        block, axes = [slice(0, s) for s in shape], frozenset()
    else:
        ctx = maybe_current()
        if ctx is None:
            raise ShardingError(
                f"{fn}: spec={spec!r} only applies inside fs.shard_map, where it picks this device's block of "
                f"the global shape {shape}; outside shard_map drop spec= to draw the whole value, or lay it "
                f"out with fs.device_put(value, mesh, spec)."
            )
        check_spec(spec, shape, ctx.mesh, fn=fn)
        block = shard_slices(shape, spec, ctx.mesh.shape, ctx.device.coords)
        axes = frozenset(spec.axes)
    if math.prod(shape) >= 2**63:
        raise ConfigError(f"{fn}: shape {shape} has more elements than 2**63 counters can number.")
    # global row-major index of each element of the block: sum over dims of index * stride
    idx = torch.zeros((), dtype=torch.int64, device=k.device)
    stride = 1
    for d in reversed(range(len(shape))):
        pos = torch.arange(block[d].start, block[d].stop, dtype=torch.int64, device=k.device)  # [size_d]
        idx = idx + (pos * stride).view(-1, *([1] * (len(shape) - 1 - d)))  # -> [size_d, ..., size_last]
        stride *= shape[d]
    x0, x1 = threefry2x32(k, idx >> 32, idx & _M)
    return x0, x1, axes


def _finish(out: torch.Tensor, axes: frozenset[str]) -> torch.Tensor:
    """Tag a block drawn with a spec as varying over the spec's axes (as shard_map tags sharded inputs)."""
    return set_vma(out, get_vma(out) | axes) if axes else out


def _float_dtype(dtype: torch.dtype, fn: str) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype not in _FLOAT_BITS:
        raise ConfigError(
            f"{fn}: dtype must be a floating torch dtype (float16, bfloat16, float32, float64), found {dtype!r}."
        )
    return dtype


# per float dtype: the int dtype of its bits, JAX's random bit width, mantissa bits, and the bits of 1.0
_FLOAT_BITS = {
    torch.float32: (torch.int32, 32, 23, 0x3F800000),
    torch.float64: (torch.int64, 64, 52, 0x3FF0000000000000),
    torch.float16: (torch.int16, 16, 10, 0x3C00),
    torch.bfloat16: (torch.int16, 8, 7, 0x3F80),  # JAX draws 8 bits where the mantissa has fewer than 8
}


def _width_bits(x0: torch.Tensor, x1: torch.Tensor, width: int) -> torch.Tensor:
    """JAX's ``random_bits`` of ``width`` 8, 16 or 32 from the Threefry words: ``x0 ^ x1``, truncated."""
    b = x0 ^ x1
    return b if width == 32 else b & ((1 << width) - 1)


def _unit(x0: torch.Tensor, x1: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """JAX's uniform in ``[0, 1)``: random mantissa bits under the exponent of 1.0, minus 1 (exact)."""
    int_dtype, width, nmant, one = _FLOAT_BITS[dtype]
    if width == 64:  # (x0 << 32 | x1) >> 12 without leaving int64
        mant = (x0 << 20) | (x1 >> 12)
    else:
        mant = _width_bits(x0, x1, width) >> (width - nmant)
    return (mant | one).to(int_dtype).view(dtype) - 1.0


def bits(key: torch.Tensor, shape: _Shape, *, spec: P | None = None) -> torch.Tensor:
    """Uniform random uint32 values, held in int64: ``jax.random.bits(key, shape)``.

    Example:
        >>> b = bits(key(0), (3,))
        >>> b.dtype, bool(((b >= 0) & (b < 2**32)).all())
        (torch.int64, True)
    """
    x0, x1, axes = _words(key, shape, spec, "bits")
    return _finish(_width_bits(x0, x1, 32), axes)


def _scale(u: torch.Tensor, low: float, high: float, dtype: torch.dtype) -> torch.Tensor:
    """``max(low, u * (high - low) + low)`` in ``dtype`` as XLA (jaxlib 0.10) computes it: the multiply-add
    fused (one rounding) for float32 / float64, two ops each rounded to ``dtype`` for float16 / bfloat16."""
    lo, hi = torch.tensor(low, dtype=dtype), torch.tensor(high, dtype=dtype)
    span = hi - lo
    if dtype in (torch.float16, torch.bfloat16):
        y = u * span + lo
    elif dtype == torch.float64:  # torch's CPU addcmul fuses (vector and scalar paths alike)
        y = torch.addcmul(lo.expand_as(u), u, span.expand_as(u))
    else:  # float32: the product of two float32 values is exact in float64: one rounding there, one to float32
        y = (u.double() * span.double() + lo.double()).to(dtype)
    return torch.maximum(lo, y)


def uniform(
    key: torch.Tensor,
    shape: _Shape,
    dtype: torch.dtype = torch.float32,
    *,
    low: float = 0.0,
    high: float = 1.0,
    spec: P | None = None,
) -> torch.Tensor:
    """Uniform floats in ``[low, high)``: ``jax.random.uniform(key, shape, dtype, low, high)`` bit for bit.

    ``u`` has as many random bits as ``dtype``'s mantissa (23 for float32, 52 for float64, 7 for bfloat16).

    Example:
        >>> u = uniform(key(0), (1000,), low=-1.0, high=1.0)
        >>> bool((u >= -1).all() and (u < 1).all())
        True
    """
    dtype = _float_dtype(dtype, "uniform")
    if not float(low) < float(high):
        raise ConfigError(f"uniform: need low < high, found low={low}, high={high}.")
    x0, x1, axes = _words(key, shape, spec, "uniform")
    u = _unit(x0, x1, dtype)
    if (low, high) != (0.0, 1.0):
        u = _scale(u, float(low), float(high), dtype)
    return _finish(u, axes)


# log(2) split so that e * _LN2_HI is exact for |e| < 2**11 (fdlibm)
_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10


def _log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of float64 ``x > 0`` from basic IEEE ops only: ``x = m * 2**e``, ``log m = 2 atanh(s)``."""
    m, e = torch.frexp(x)  # m in [0.5, 1)
    low = m < math.sqrt(0.5)
    m = torch.where(low, m * 2.0, m)  # m in [sqrt(1/2), sqrt(2))
    e = (e - low.to(e.dtype)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)  # |s| < 0.1716
    s2 = s * s
    p = torch.full_like(s, 1.0 / 25.0)
    for k in range(11, -1, -1):  # atanh(s) / s = sum s**(2k) / (2k + 1), terms below 1e-18 dropped
        p = p.mul_(s2).add_(1.0 / (2 * k + 1))
    return e * _LN2_HI + (e * _LN2_LO + 2.0 * s * p)


# Giles' single-precision erfinv ("Approximating the erfinv function", 2010), the polynomial XLA evaluates
_ERFINV_W_LT_5 = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                  -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)  # fmt: skip
_ERFINV_W_GE_5 = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
                  -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)  # fmt: skip


def _erfinv32(x: torch.Tensor) -> torch.Tensor:
    """``erfinv`` of float32 ``x`` in (-1, 1) as XLA computes it in float32 (Giles' polynomial, each step
    ``c + p * w`` rounded once as a fused multiply-add), with a correctly rounded ``log1p``."""
    t = (-(x * x)).double()  # exact
    w = torch.where(t.abs() < 2.0**-30, -t, -_log(1.0 + t)).float()  # -log1p(-x**2); 1 + t exact when used
    lt = w < 5.0
    ww = torch.where(lt, w - 2.5, torch.sqrt(w) - 3.0).double()
    p = torch.where(lt, _ERFINV_W_LT_5[0], _ERFINV_W_GE_5[0]).float()
    for c_lt, c_ge in zip(_ERFINV_W_LT_5[1:], _ERFINV_W_GE_5[1:], strict=True):
        c = torch.where(lt, _f32(c_lt), _f32(c_ge))
        p = (c + p.double() * ww).float()  # float32 product exact in float64: one rounding, as an fma
    return p * x


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def normal(
    key: torch.Tensor, shape: _Shape, dtype: torch.dtype = torch.float32, *, spec: P | None = None
) -> torch.Tensor:
    """Standard normal samples: ``sqrt(2) * erfinv(u)`` with ``u`` uniform in ``(-1, 1)``, as
    ``jax.random.normal`` (equal to it within a few ulp; float16 / bfloat16 go through float32 as XLA does).

    Example:
        >>> z = normal(key(0), (100_000,))
        >>> abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1) < 0.02
        True
    """
    dtype = _float_dtype(dtype, "normal")
    x0, x1, axes = _words(key, shape, spec, "normal")
    lo = float(torch.nextafter(torch.tensor(-1.0, dtype=dtype), torch.tensor(0.0, dtype=dtype)))
    u = _scale(_unit(x0, x1, dtype), lo, 1.0, dtype)
    if dtype == torch.float64:
        e = torch.erfinv(u)  # a scalar kernel: one result per element, wherever it sits
    else:
        e = _erfinv32(u.float()).to(dtype)
    return _finish(torch.tensor(math.sqrt(2), dtype=dtype) * e, axes)


def bernoulli(key: torch.Tensor, p: float, shape: _Shape, *, spec: P | None = None) -> torch.Tensor:
    """Bool samples that are True with probability ``p``: ``jax.random.bernoulli(key, p, shape)``
    (``uniform(key, shape) < p`` in float32).

    Example:
        >>> b = bernoulli(key(0), 0.25, (100_000,))
        >>> b.dtype, abs(float(b.float().mean()) - 0.25) < 0.01
        (torch.bool, True)
    """
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ConfigError(f"bernoulli: p must lie in [0, 1], found {p}.")
    x0, x1, axes = _words(key, shape, spec, "bernoulli")
    return _finish(_unit(x0, x1, torch.float32) < torch.tensor(p, dtype=torch.float32), axes)


def randint(
    key: torch.Tensor,
    shape: _Shape,
    low: int,
    high: int,
    *,
    dtype: torch.dtype = torch.int64,
    spec: P | None = None,
) -> torch.Tensor:
    """Integers in ``[low, high)``, ``high - low <= 2**31``: ``jax.random.randint`` bit for bit (JAX draws
    32 bits for every integer dtype up to int32, its default; the values are the same in any torch dtype).

    JAX's method: two draws of 32 bits from ``split(key)``, combined as ``(hi % span) * (2**32 % span) +
    lo % span`` in unsigned 32-bit arithmetic, modulo ``span``; no rejection loop, so every element stays a
    pure function of its index.

    Example:
        >>> r = randint(key(0), (1000,), 3, 7)
        >>> sorted(set(r.tolist()))
        [3, 4, 5, 6]
    """
    low, high = operator.index(low), operator.index(high)
    if not low < high:
        raise ConfigError(f"randint: need low < high, found low={low}, high={high}.")
    if high - low > 2**31:
        raise ConfigError(f"randint: high - low must be <= 2**31, found {high - low}; draw in pieces.")
    if not isinstance(dtype, torch.dtype) or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ConfigError(f"randint: dtype must be an integer torch dtype, found {dtype!r}.")
    info = torch.iinfo(dtype)
    if low < info.min or high - 1 > info.max:
        raise ConfigError(f"randint: [{low}, {high}) does not fit {dtype} ([{info.min}, {info.max}]).")
    nbits = 32
    k1, k2 = split(key, 2)
    h0, h1, axes = _words(k1, shape, spec, "randint")
    l0, l1, _ = _words(k2, shape, spec, "randint")
    mask = (1 << nbits) - 1
    span = high - low
    mult = (2 ** (nbits // 2) % span) ** 2 % span  # 2**nbits % span, as JAX computes it
    off = (((_width_bits(h0, h1, nbits) % span) * mult) & mask) + (_width_bits(l0, l1, nbits) % span)
    off = (off & mask) % span  # the sum wraps at 2**nbits, as unsigned arithmetic does
    return _finish((off + low).to(dtype), axes)
