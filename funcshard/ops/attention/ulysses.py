"""Ulysses attention (DeepSpeed-Ulysses context parallelism): trade the sequence split for a head split.

q, k and v arrive sharded along the sequence over a mesh axis; one all-to-all each turns them into
head-sharded, full-sequence tensors; every device runs ordinary attention on its heads; one all-to-all brings
the output back to the sequence split. Four all-to-alls forward (q, k, v, out) and four backward (each
all-to-all's transpose is the reverse all-to-all); each moves ``(n-1)/n`` of its input.

The sequence layout is contiguous: device ``i`` holds chunk ``i`` of ``n``. Data in the zigzag layout of
:mod:`funcshard.ops.attention.ring` must be put back in order first (:func:`funcshard.ops.zigzag_merge` then a plain
split, or lay it out with an ordinary spec and no zigzag permutation).

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> from funcshard.ops import attention, ulysses_attention
    >>> mesh = fs.make_mesh({"cp": 2}, backend="sim")
    >>> q = k = v = torch.randn(1, 2, 8, 4)  # [b, h, s, d]
    >>> f = fs.shard_map(ulysses_attention, mesh=mesh, in_specs=(P(None, None, "cp"),) * 3,
    ...                  out_specs=P(None, None, "cp"))
    >>> torch.allclose(fs.device_get(f(q, k, v)), attention(q, k, v, causal=True), atol=1e-5)
    True
"""

from __future__ import annotations

import torch

from ... import lax
from ...extend import ShardingError
from .local import attention

__all__ = ["ulysses_attention"]


def _kv_repeat(h: int, hkv: int, n: int) -> int:
    """The smallest factor ``r`` dividing ``h / hkv`` with ``hkv * r`` divisible by ``n`` (1 when it already is)."""
    group = h // hkv
    return next(r for r in range(1, group + 1) if group % r == 0 and (hkv * r) % n == 0)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    axis: str | None = "cp",
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention over a sequence sharded (contiguously) on ``axis``, computed head-parallel.

    Forward: all-to-all of q, k and v from sequence-sharded ``[b, h, s/n, d]`` to head-sharded
    ``[b, h/n, s, d]``, local :func:`attention` over the whole sequence, all-to-all of the output back.
    Backward: the reverse all-to-alls. With grouped-query attention whose k/v heads are not divisible by
    ``n``, each k/v head is repeated (the fewest times that makes them divisible) before the all-to-all.

    Args:
        q: ``[b, h, s/n, d]`` this device's queries (chunk ``i`` of ``n``).
        k: ``[b, hkv, s/n, d]`` this device's keys (``h`` a multiple of ``hkv``).
        v: ``[b, hkv, s/n, d]`` this device's values.
        axis: the context-parallel mesh axis; ``None``: the sequence is not split, plain :func:`attention`.
        causal: mask each query's future positions.
        scale: score scale, default ``1/sqrt(d)``.

    Returns:
        ``[b, h, s/n, d]`` this device's rows of the attention output, varying over ``axis``.

    Raises:
        ShardingError: ``h`` not divisible by the axis size, or shapes that do not fit.

    Example:
        >>> # inside shard_map over {"cp": 4}, q/k/v with spec P(None, None, "cp"):
        >>> # out = ulysses_attention(q, k, v, axis="cp")  # [b, h, s/4, d] -> [b, h, s/4, d]
        >>> q = k = v = torch.randn(1, 2, 8, 4)
        >>> torch.equal(ulysses_attention(q, k, v, axis=None), attention(q, k, v, causal=True))  # no axis: local
        True
    """
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ShardingError(
            f"ulysses_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit: need local "
            f"sequence shards [b, h, s/n, d] for q and [b, hkv, s/n, d] for k and v."
        )
    h, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or h % hkv:
        raise ShardingError(
            f"ulysses_attention: q has {h} heads and k/v {hkv}; q heads must be a multiple of k/v heads (GQA)."
        )
    if axis is None:
        return attention(q, k, v, causal=causal, scale=scale)  # [b, h, s, d] x [b, hkv, s, d] -> [b, h, s, d]
    n = lax.axis_size(axis)
    if h % n:
        raise ShardingError(
            f"ulysses_attention: q has {h} heads, not divisible by the size {n} of axis {axis!r}; Ulysses splits "
            f"the heads over the axis. Use an axis size that divides {h}, or ring_attention."
        )
    r = _kv_repeat(h, hkv, n)
    if r > 1:
        k = k.repeat_interleave(r, dim=1)  # [b, hkv, s/n, d] -> [b, hkv*r, s/n, d]
        v = v.repeat_interleave(r, dim=1)  # [b, hkv, s/n, d] -> [b, hkv*r, s/n, d]
    q = lax.all_to_all(q, axis, split_dim=1, concat_dim=2)  # [b, h, s/n, d] -> [b, h/n, s, d]
    k = lax.all_to_all(k, axis, split_dim=1, concat_dim=2)  # [b, hkv', s/n, d] -> [b, hkv'/n, s, d]
    v = lax.all_to_all(v, axis, split_dim=1, concat_dim=2)  # [b, hkv', s/n, d] -> [b, hkv'/n, s, d]
    out = attention(q, k, v, causal=causal, scale=scale)  # [b, h/n, s, d] x [b, hkv'/n, s, d] -> [b, h/n, s, d]
    return lax.all_to_all(out, axis, split_dim=2, concat_dim=1)  # [b, h/n, s, d] -> [b, h, s/n, d]
