"""Counter-based random numbers, bit-identical to ``jax.random``, whose value at each global index does not
depend on the mesh.

A key is a plain ``torch.int64`` tensor of shape ``[2]`` holding two uint32 words (``jax.random.key_data``
of a threefry key), so it is an ordinary pytree leaf (pass it into ``shard_map`` with spec ``P()``). The
streams are JAX's with ``jax_threefry_partitionable=True`` (its default from 0.5): element ``i`` of a draw
is Threefry-2x32 (20 rounds) of the key and the 64-bit row-major index ``i``; ``split`` / ``fold_in`` use the
same counters. So ``key``, ``split``, ``fold_in``, ``bits``, ``uniform``, ``bernoulli``, ``randint`` and
float16 / bfloat16 / float32 ``normal`` equal ``jax.random``'s (on CPU, jaxlib 0.10, x86 with FMA) bit for bit:
``normal`` (``sqrt(2) * erfinv(u)``, as JAX) replays XLA's float32 ``erfinv`` step by step, its own ``log1p``
and every fused multiply-add included; float64 ``normal`` is within 1e-12. Inside ``shard_map`` a draw with
``spec=P(...)`` computes only this device's block, bitwise equal to that slice of the unsharded draw: a model
too large for one device is initialised shard by shard, identical to an unsharded init. Where the key is a
meta tensor or torch's default device is ``meta`` (``fs.eval_shape``, ``with torch.device("meta")``), a draw
is a meta tensor of its shape and dtype, computed from nothing; keys stay small real tensors there. Every
transform is elementwise and built from correctly rounded IEEE ops (no SIMD ``log`` kernel whose last bit could
depend on where an element sits; an FMA is emulated in float64, torch's float32 ``sqrt`` replaced by float64's).

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

from ._src.collectives.vma import get_vma, set_vma
from ._src.errors import ConfigError, ShardingError
from ._src.runtime.context import maybe_current, note_uneven
from ._src.tree.spec import P, check_spec, shard_slices, uneven_axes

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
    if not k.is_meta and bool(((k < 0) | (k > _M)).any()):  # (a meta key has no words to check)
        raise ConfigError(
            f"{fn}: key words must lie in [0, 2**32), found {k.tolist()}; make keys with fs.random.key(seed)."
        )
    return k


def _derive(k: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """Keys number ``i`` (int64 ``[n]``, in ``[0, 2**63)``) derived from ``k``: int64 ``[n, 2]``, the two
    Threefry words of counter ``i`` (JAX's partitionable ``split``; ``fold_in`` is the same for one ``i``)."""
    if k.is_meta or i.is_meta:  # shapes only: [1, 2] ^ [n, 1] -> [n, 2], meta (k's and i's tags, no cipher run)
        return k.to("meta")[None, :] ^ i.to("meta")[:, None]
    x0, x1 = threefry2x32(k, i >> 32, i & _M)
    return torch.stack([x0, x1], dim=-1)  # 2 x [n] -> [n, 2]


def key(seed: int) -> torch.Tensor:
    """A key from an integer seed of up to 64 bits (negative seeds are taken as 64-bit two's complement):
    ``jax.random.key_data(jax.random.key(seed))`` with ``jax_enable_x64``. Without it JAX's seeds are 32-bit:
    it keeps only a seed's low 32 bits, so it differs for seeds of 2**32 and above and for negative seeds
    (``key(-1)``: ``[2**32 - 1, 2**32 - 1]`` here and with x64, ``[0, 2**32 - 1]`` in JAX's default).

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
    device = "cpu" if _meta_default() else None  # a key is a real tensor, even where draws are shapes only
    return torch.tensor([seed >> 32, seed & _M], dtype=torch.int64, device=device)


def split(key: torch.Tensor, n: int | Sequence[int] = 2) -> torch.Tensor:
    """``n`` new keys, int64 ``[n, 2]``; row ``i`` equals ``fold_in(key, i)``. ``n`` may be a shape, as in
    ``jax.random.split(key, (2, 3))``: keys ``[*n, 2]``, the row-major numbering of ``split(key, prod(n))``.

    Example:
        >>> k = key(0)
        >>> torch.equal(split(k, 3)[2], fold_in(k, 2))
        True
        >>> split(k, (2, 3)).shape
        torch.Size([2, 3, 2])
    """
    k = _check_key(key, "split")
    if isinstance(n, (Sequence, torch.Size)):
        shape = _check_shape(n, "split")
        return _derive(k, torch.arange(math.prod(shape), dtype=torch.int64, device=k.device)).reshape(*shape, 2)
    n = operator.index(n)
    if n < 0:
        raise ConfigError(f"split: n must be >= 0, found {n}.")
    return _derive(k, torch.arange(n, dtype=torch.int64, device=k.device))


def fold_in(key: torch.Tensor, i: int) -> torch.Tensor:
    """The key numbered ``i`` derived from ``key`` (int64 ``[2]``), e.g. one per layer or step.

    ``i`` is an int or a 0-dim integer tensor. Inside ``shard_map``, ``fold_in(key, fs.axis_index("dp"))`` gives
    each device of ``dp`` its own key, which (as in JAX) varies over ``dp``: so do the draws made from it, and
    returning them under an out spec that omits ``dp`` is refused. (``int(fs.axis_index(...))`` gives a plain
    number that carries no axes.)

    Example:
        >>> fold_in(key(0), 7).shape
        torch.Size([2])
    """
    k = _check_key(key, "fold_in")
    if isinstance(i, torch.Tensor):  # e.g. fs.axis_index("dp"): the key varies over what i varies over
        if i.dim() != 0 or i.dtype.is_floating_point or i.dtype.is_complex or i.dtype == torch.bool:
            raise ConfigError(f"fold_in: i must be an int or a 0-dim integer tensor, found a {i.dtype} tensor "
                              f"of shape {tuple(i.shape)}.")  # fmt: skip
        n = None if i.is_meta else int(i)  # (a meta i has no number to check)
        if n is not None and not 0 <= n < 2**63:
            raise ConfigError(f"fold_in: i must lie in [0, 2**63), found {n}; fold in i % 2**63 instead.")
        # computed from the tensor, not from its number: inside shard_map the vma mode tags the key with i's axes
        i = i.to(dtype=torch.int64) if i.is_meta else i.to(device=k.device, dtype=torch.int64)
        return _derive(k, i.reshape(1))[0]  # [] -> [1] -> [1, 2] -> [2]
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
        uneven = uneven_axes(shape, spec, ctx.mesh.shape)
        if uneven:  # tensor_split's block, whose shape differs between devices
            ctx.device.index(uneven)  # (read: on an abstract mesh its devices are run apart by their blocks)
            note_uneven()  # (the call's outputs are assembled from blocks of different shapes)
        block = shard_slices(shape, spec, ctx.mesh.shape, ctx.device.coords)
        axes = frozenset(spec.axes)
    if math.prod(shape) >= 2**63:
        raise ConfigError(f"{fn}: shape {shape} has more elements than 2**63 counters can number.")
    if _abstract(k):  # shapes only: both words a meta tensor of the block's shape, derived from the key (its tags)
        km = k if k.is_meta else k.to("meta")
        w = (km[0] ^ km[1]).expand(tuple(b.stop - b.start for b in block))  # [] -> [*block]
        return w, w, axes
    # global row-major index of each element of the block: sum over dims of index * stride
    idx = torch.zeros((), dtype=torch.int64, device=k.device)
    stride = 1
    for d in reversed(range(len(shape))):
        pos = torch.arange(block[d].start, block[d].stop, dtype=torch.int64, device=k.device)  # [size_d]
        idx = idx + (pos * stride).view(-1, *([1] * (len(shape) - 1 - d)))  # -> [size_d, ..., size_last]
        stride *= shape[d]
    x0, x1 = threefry2x32(k, idx >> 32, idx & _M)
    return x0, x1, axes


def _meta_default() -> bool:
    """Whether torch's default device is ``meta`` (``with torch.device("meta")``, ``fs.eval_shape``)."""
    return torch.get_default_device().type == "meta"


def _abstract(k: torch.Tensor) -> bool:
    """Whether draws from ``k`` are shapes only (meta tensors, nothing computed): ``k`` is a meta tensor, or
    torch's default device is ``meta``."""
    return k.is_meta or _meta_default()


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


def bits(key: torch.Tensor, shape: _Shape = (), *, spec: P | None = None) -> torch.Tensor:
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
    dev = u.device if u.is_meta else None  # (meta draws: bounds beside them on meta)
    lo, hi = torch.tensor(low, dtype=dtype, device=dev), torch.tensor(high, dtype=dtype, device=dev)
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
    shape: _Shape = (),
    dtype: torch.dtype = torch.float32,
    minval: float | None = None,
    maxval: float | None = None,
    *,
    low: float | None = None,
    high: float | None = None,
    spec: P | None = None,
) -> torch.Tensor:
    """Uniform floats in ``[minval, maxval)``: ``jax.random.uniform(key, shape, dtype, minval, maxval)`` bit for
    bit (JAX's signature; ``low`` / ``high`` are the same bounds by keyword, defaults 0 and 1).

    ``u`` has as many random bits as ``dtype``'s mantissa (23 for float32, 52 for float64, 7 for bfloat16).

    Example:
        >>> u = uniform(key(0), (1000,), low=-1.0, high=1.0)
        >>> bool((u >= -1).all() and (u < 1).all())
        True
    """
    dtype = _float_dtype(dtype, "uniform")
    low = _bound("uniform", "minval", minval, "low", low, 0.0)
    high = _bound("uniform", "maxval", maxval, "high", high, 1.0)
    fix = "for bounds that vary by element, draw u = uniform(key, shape) and use low + u * (high - low)"
    low, high = _number("uniform", "minval", low, fix), _number("uniform", "maxval", high, fix)
    if not low < high:
        raise ConfigError(f"uniform: need low < high, found low={low}, high={high}.")
    x0, x1, axes = _words(key, shape, spec, "uniform")
    u = _unit(x0, x1, dtype)
    if (low, high) != (0.0, 1.0):
        u = _scale(u, low, high, dtype)
    return _finish(u, axes)


def _number(fn: str, name: str, v: Any, fix: str) -> float:
    """``v`` (a real number or a one-element tensor) as a float; anything else is a ConfigError, not torch's
    "only one element tensors can be converted to Python scalars"."""
    if isinstance(v, torch.Tensor) and v.is_meta:
        raise ConfigError(f"{fn}: {name} is a meta tensor, which has no value; pass a Python number ({fix}).")
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex():
        return float(v)
    if not isinstance(v, torch.Tensor) and hasattr(v, "__float__"):  # int, float, bool, numpy scalars
        try:
            return float(v)
        except (TypeError, ValueError):
            pass
    found = f"a tensor of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else repr(v)
    raise ConfigError(f"{fn}: {name} must be a number (or a one-element tensor), found {found}; {fix}.")


def _bound(fn: str, jax_name: str, jax_value: Any, name: str, value: Any, default: Any) -> Any:
    """One bound given by its JAX name (``minval``) or by its keyword (``low``), not both; else ``default``."""
    if jax_value is not None and value is not None:
        raise ConfigError(f"{fn}: give the bound as {jax_name}= or {name}=, not both ({jax_value!r}, {value!r}).")
    return default if jax_value is None and value is None else (jax_value if value is None else value)


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def _fma32(a: torch.Tensor, b: torch.Tensor | float, c: torch.Tensor | float) -> torch.Tensor:
    """``a * b + c`` rounded once to float32, as an FMA instruction: ``a`` a tensor and ``b``, ``c`` tensors or
    floats, all holding float32 values (in float32 or float64 tensors).

    The product of two float32 values is exact in float64, and rounding the float64 sum to float32 gives the
    correctly rounded result unless that sum landed exactly on a float32 midpoint (between two float32,
    which the second rounding breaks to even) while the exact sum was not there: those rare elements (a
    sum rounded at most 2**-53 away from a midpoint) move one float64 ulp toward the exact sum (TwoSum's
    error term). Results in float32's normal range (not subnormal), as for every use here."""
    a = a.double()
    b = b if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=torch.float64)
    c = c if isinstance(c, torch.Tensor) else torch.tensor(c, dtype=torch.float64)
    s = torch.addcmul(c, a, b)  # in float64, a * b exact: fused or not, the float64 sum rounds once
    mid = s.view(torch.int64).bitwise_and(0x1FFFFFFF).eq_(0x10000000)  # the 29 bits float32 drops: 1000...0
    if bool(mid.any()):
        i = mid.reshape(-1).nonzero().squeeze(1)
        flat = s.reshape(-1)
        si = flat[i]
        pi = a.expand_as(s).reshape(-1)[i] * b.expand_as(s).reshape(-1)[i].double()
        ci = c.expand_as(s).reshape(-1)[i].double()
        bb = si - pi
        err = (pi - (si - bb)) + (ci - bb)  # exact sum - si (TwoSum)
        nudged = torch.nextafter(si, torch.where(err > 0, math.inf, -math.inf).double())
        s = flat.index_put((i,), torch.where(err == 0, si, nudged)).view_as(s)
    return s.float()


# XLA's CPU float32 log1p (the ``xla.log1p.f32`` intrinsic, jaxlib 0.10): for |t| < sqrt(2) - 1 Cephes'
# log1p, ``t - t**2 / 2 + t**3 * P(t) / Q(t)``, else Eigen's ``plog`` (Cephes logf) of the float32 sum 1 + t
_LOG1P_P = tuple(map(_f32, (4.527e-05, 0.49854103, 6.5787325, 29.911919, 60.94967, 57.112965, 20.039553)))
_LOG1P_Q = tuple(map(_f32, (15.062909, 83.04757, 221.7624, 309.09872, 216.42789, 60.11866)))  # after a 1
_LOGF_P = tuple(map(_f32, (0.070376836, -0.1151461, 0.116769984, -0.12420141, 0.14249323, -0.16668057,
                           0.20000714, -0.24999994, 0.3333333)))  # fmt: skip
_LOGF_LN2_HI, _LOGF_LN2_LO, _SQRT_HALF_F32, _LOG1P_SMALL = map(
    _f32, (0.6933594, -0.00021219444, 0.70710677, 0.41421357)
)


def _logf32(y: torch.Tensor) -> torch.Tensor:
    """``log`` of float32 ``y`` (normal, positive, finite) as XLA's CPU code computes it: Eigen's
    ``plog_float``, every multiply-add fused. ``y = m * 2**e`` with ``m`` in [0.5, 1); below sqrt(1/2),
    ``m -> 2m``; ``z = m - 1``; ``log y = e ln2 + z - z**2/2 + z**3 * P(z)``, P's nine terms in three
    interleaved Horner chains."""
    bits = y.view(torch.int32)
    m = ((bits & -0x7F800001) | 0x3F000000).view(torch.float32)  # the mantissa under the exponent of 0.5
    low = m < _SQRT_HALF_F32
    z = (m - 1.0) + torch.where(low, m, 0.0)  # as XLA: two float32 adds
    e = (((bits >> 23) - 126).float() - low.float()).double()
    z2 = z * z
    z3, zd = (z2 * z).double(), z.double()
    p0, p1, p2, p3, p4, p5, p6, p7, p8 = _LOGF_P
    y0 = _fma32(_fma32(zd, p0, p1), zd, p2)
    y1 = _fma32(_fma32(zd, p3, p4), zd, p5)
    y2 = _fma32(_fma32(zd, p6, p7), zd, p8)
    y0 = _fma32(_fma32(z3, y0, y1), z3, y2)
    r = _fma32(z3, y0, (e * _LOGF_LN2_LO).float())  # the float32 product e * ln2_lo, then fused
    r = (z - z2 * 0.5) + r  # z2 / 2 exact: the fused z - 0.5 * z2 rounds once
    return e.float() * _LOGF_LN2_HI + r  # e * ln2_hi exact (ln2_hi has 11 bits): the fused add rounds once


def _log1p32(t: torch.Tensor) -> torch.Tensor:
    """``log1p`` of float32 ``t`` in (-1, 0] bit for bit as XLA's CPU backend (x86 with FMA, jaxlib 0.10)
    computes it (XLA evaluates both branches and selects; here each element takes only its own)."""
    small = t.abs() < _LOG1P_SMALL
    out = torch.empty_like(t)
    out[~small] = _logf32(t[~small] + 1.0)
    t = t[small]
    td = t.double()
    q = t + _LOG1P_Q[0]  # Q(t) = 1 * t + Q0 + ...: Horner from the leading 1
    for c in _LOG1P_Q[1:]:
        q = _fma32(td, q, c)
    p = torch.full_like(t, _LOG1P_P[0])
    for c in _LOG1P_P[1:]:
        p = _fma32(td, p, c)
    t2 = t * t
    out[small] = t + ((t * t2) * (p / q) - t2 * 0.5)  # t2 / 2 exact: the fused (-0.5 * t2 + ...) rounds once
    return out


# Giles' single-precision erfinv ("Approximating the erfinv function", 2010), the polynomial XLA evaluates
_ERFINV_W_LT_5 = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                  -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)  # fmt: skip
_ERFINV_W_GE_5 = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
                  -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)  # fmt: skip


def _erfinv32(x: torch.Tensor) -> torch.Tensor:
    """``erfinv`` of float32 ``x`` in (-1, 1) bit for bit as XLA's CPU backend computes it in float32.

    jaxlib 0.10 lowers ``erf_inv`` to ``t = x * -x`` (one rounding), ``w = -log1p(t)`` with XLA's own float32
    ``log1p`` (:func:`_log1p32`), then Giles' polynomial in ``w - 2.5`` (``w < 5``) or ``sqrt(w) - 3``, times
    ``x``; LLVM, compiling for a host with FMA, fuses every multiply-add of the Horner chain (and of the
    ``log1p``) into one ``vfmadd``. Replayed here op for op, each FMA with :func:`_fma32`, ``sqrt`` through
    float64 (correctly rounded; torch's float32 CPU ``sqrt`` is not: it differs in the last bit for ~15% of
    inputs). Measured: equal to XLA's bits for each of the 2**23 values ``normal`` can feed it."""
    w = -_log1p32(x * -x)
    lt = w < 5.0
    ww = torch.where(lt, w - 2.5, torch.sqrt(w.double()).float() - 3.0).double()
    p = torch.where(lt, _f32(_ERFINV_W_LT_5[0]), _f32(_ERFINV_W_GE_5[0]))
    for c_lt, c_ge in zip(_ERFINV_W_LT_5[1:], _ERFINV_W_GE_5[1:], strict=True):
        c = torch.where(lt, torch.tensor(_f32(c_lt), dtype=torch.float64), _f32(c_ge))
        p = _fma32(ww, p, c)
    return p * x


def normal(
    key: torch.Tensor, shape: _Shape = (), dtype: torch.dtype = torch.float32, *, spec: P | None = None
) -> torch.Tensor:
    """Standard normal samples: ``sqrt(2) * erfinv(u)`` with ``u`` uniform in ``(-1, 1)``, as
    ``jax.random.normal``. float32, float16 and bfloat16 equal it bit for bit on CPU (jaxlib 0.10, x86 with
    FMA; measured for every one of the 2**23 float32 draws and on millions of float16 / bfloat16 ones): XLA
    evaluates ``erfinv`` in float32 (float16 / bfloat16 converted up, the result rounded down), which
    :func:`_erfinv32` reproduces op for op. float64 is within 1e-12 (torch's float64 ``erfinv`` is not
    XLA's polynomial).

    Example:
        >>> z = normal(key(0), (100_000,))
        >>> abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1) < 0.02
        True
    """
    dtype = _float_dtype(dtype, "normal")
    x0, x1, axes = _words(key, shape, spec, "normal")
    minus_one, zero = torch.tensor(-1.0, dtype=dtype, device="cpu"), torch.tensor(0.0, dtype=dtype, device="cpu")
    lo = float(torch.nextafter(minus_one, zero))  # the float above -1 (a real number, even where draws are meta)
    u = _scale(_unit(x0, x1, dtype), lo, 1.0, dtype)
    if u.is_meta:  # shapes only: erfinv's data-dependent steps skipped (u has the result's shape and dtype)
        return _finish(u, axes)
    if dtype == torch.float64:
        e = torch.erfinv(u)  # a scalar kernel: one result per element, wherever it sits
    else:
        e = _erfinv32(u.float()).to(dtype)
    return _finish(torch.tensor(math.sqrt(2), dtype=dtype) * e, axes)


def bernoulli(
    key: torch.Tensor, p: float | torch.Tensor = 0.5, shape: _Shape | None = None, *, spec: P | None = None
) -> torch.Tensor:
    """Bool samples that are True with probability ``p``: ``jax.random.bernoulli(key, p, shape)``
    (``uniform(key, shape, dtype) < p``). ``p`` is a number (``dtype`` float32; ``shape=None``: one value) or a
    floating tensor of the global shape or broadcastable to it (``dtype`` its own, as JAX draws in ``p``'s dtype;
    ``shape=None``: ``p.shape``), the same on every device; with ``spec`` each device compares its block.

    Example:
        >>> b = bernoulli(key(0), 0.25, (100_000,))
        >>> b.dtype, abs(float(b.float().mean()) - 0.25) < 0.01
        (torch.bool, True)
        >>> bernoulli(key(0), torch.tensor([0.0, 1.0]))
        tensor([False,  True])
    """
    if not isinstance(p, torch.Tensor) or (p.dim() == 0 and not p.is_floating_point()):
        p = _number("bernoulli", "p", p, "for a p per element pass a floating tensor, torch.tensor(p)")
        if not 0.0 <= p <= 1.0:
            raise ConfigError(f"bernoulli: p must lie in [0, 1], found {p}.")
        x0, x1, axes = _words(key, () if shape is None else shape, spec, "bernoulli")
        return _finish(_unit(x0, x1, torch.float32) < torch.tensor(p, dtype=torch.float32), axes)
    if p.dtype not in _FLOAT_BITS:
        raise ConfigError(f"bernoulli: a tensor p must have a floating dtype (as JAX's), found {p.dtype}.")
    shape = tuple(p.shape) if shape is None else _check_shape(shape, "bernoulli")
    try:
        full = p.expand(shape)  # [*p.shape] -> [*shape], broadcast as JAX does
    except RuntimeError:
        raise ConfigError(f"bernoulli: p of shape {tuple(p.shape)} does not broadcast to shape {shape}.") from None
    x0, x1, axes = _words(key, shape, spec, "bernoulli")
    if spec is not None and get_vma(p):
        raise ShardingError(
            f"bernoulli: with spec={spec!r}, p is the global probabilities (shape {tuple(p.shape)} broadcast to "
            f"{shape}), the same on every device, but this p varies over {sorted(get_vma(p))}: a device's own "
            f"block of p would be broadcast as if it were the whole. Pass the whole p into shard_map with spec P(), "
            f"or draw the block itself: bernoulli(key_of_this_device, p_block) without spec=."
        )
    if spec is not None:  # this device's block of p (spec checked by _words)
        ctx = maybe_current()
        full = full[tuple(shard_slices(shape, spec, ctx.mesh.shape, ctx.device.coords))]
    if x0.is_meta and not full.is_meta:  # meta draws: p beside them on meta
        full = full.to("meta")
    return _finish(_unit(x0, x1, p.dtype) < full, axes)


def randint(
    key: torch.Tensor,
    shape: _Shape,
    minval: int | None = None,
    maxval: int | None = None,
    dtype: torch.dtype = torch.int64,
    *,
    low: int | None = None,
    high: int | None = None,
    spec: P | None = None,
) -> torch.Tensor:
    """Integers in ``[minval, maxval)``, ``maxval - minval <= 2**31``: ``jax.random.randint(key, shape, minval,
    maxval)`` bit for bit (JAX draws 32 bits for every integer dtype up to int32, its default; the values are the
    same in any torch dtype, int64 here by default). ``low`` / ``high``: the same bounds by keyword.

    JAX's method: two draws of 32 bits from ``split(key)``, combined as ``(hi % span) * (2**32 % span) +
    lo % span`` in unsigned 32-bit arithmetic, modulo ``span``; no rejection loop, so every element stays a
    pure function of its index.

    Example:
        >>> r = randint(key(0), (1000,), 3, 7)
        >>> sorted(set(r.tolist()))
        [3, 4, 5, 6]
    """
    low = _bound("randint", "minval", minval, "low", low, None)
    high = _bound("randint", "maxval", maxval, "high", high, None)
    if low is None or high is None:
        raise ConfigError("randint: give both bounds, e.g. randint(key, shape, 0, 10) (minval, maxval).")
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
