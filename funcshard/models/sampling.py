"""Choosing the next token from (vocab-parallel) logits: greedy, or sampled with ``fs.random``.

Model-agnostic: :func:`next_token` takes the logits of the last position, ``[b, V]`` on one device or this
device's ``[b, V/tp]`` block of a vocab-parallel head inside ``shard_map``, and returns the same token ids on
every device of the ``tp`` axis, equal to those of the unsharded logits:

- greedy: the exact arg-max of the full row without gathering it: each device's maximum and its first index,
  an all-reduce max of the values, then an all-reduce min of the global indices of the devices that hold it,
  so ties go to the lowest index, as ``torch.argmax`` breaks them on the full row;
- sampled: the rows are gathered over ``tp`` (``[b, V]``, one all-gather a token; then a max of the ``[b]``
  ids, which agree, to make them invariant over ``tp``) and every device draws the same token from them:
  temperature, then top-k, then top-p (Hugging Face's order and rules), then an inverse-CDF draw
  ``u = fs.random.uniform(fold_in(key, step), (batch,))[row]`` (counter-based, so the draw of a row does not
  depend on the mesh, and a single prompt draws what the train job's sampler drew).

Example:
    >>> import torch
    >>> logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    >>> next_token(logits, SamplingOptions(), step=0).tolist()  # ties: the first maximum, as torch.argmax
    [1]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import lax
from .. import random as fsr
from ..extend import ConfigError, axis_index_int

__all__ = ["SamplingOptions", "filter_logits", "next_token"]


@dataclass(frozen=True)
class SamplingOptions:
    """How the next token is chosen.

    Attributes:
        temperature: 0: greedy (arg-max); > 0: sample from ``softmax(logits / temperature)``.
        key: the ``fs.random`` key of the draws (needed when ``temperature > 0``).
        top_k: keep the ``top_k`` most likely tokens (None: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p`` (None: all).
        batch: the global number of rows (each row's draw is entry ``row`` of a ``[batch]`` draw).

    Example:
        >>> SamplingOptions(temperature=0.8, key=fsr.key(0), top_k=40).greedy
        False
    """

    temperature: float = 0.0
    key: torch.Tensor | None = None
    top_k: int | None = None
    top_p: float | None = None
    batch: int = 1

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not (t >= 0 and t < float("inf")):
            raise ConfigError(f"generate: temperature must be a finite number >= 0, found {t!r}.")
        if t > 0 and self.key is None:
            raise ConfigError("generate: temperature > 0 samples and needs key=fs.random.key(seed).")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"generate: top_k must be a positive int or None, found {k!r}.")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1):
            raise ConfigError(f"generate: top_p must be a number in (0, 1] or None, found {p!r}.")

    @property
    def greedy(self) -> bool:
        """True where the next token is the arg-max (``temperature == 0``)."""
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """``logits [b, V]`` with the tokens outside the top-k and then the top-p set at ``-inf`` (Hugging Face's
    ``TopKLogitsWarper`` and ``TopPLogitsWarper``: at least one token kept).

    Example:
        >>> filter_logits(torch.tensor([[1.0, 3.0, 2.0]]), 2, None)
        tensor([[-inf, 3., 2.]])
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [b, 1]: the k-th largest
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ascending, order = torch.sort(logits, dim=-1)  # [b, V]
        mass = ascending.softmax(dim=-1).cumsum(dim=-1)  # [b, V]
        drop = mass <= 1 - top_p
        drop[..., -1] = False  # the most likely token stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def _vocab_start(vocab: int, n: int, r: int) -> int:
    """The first vocabulary row of block ``r`` of ``n`` (``torch.tensor_split``'s uneven blocks)."""
    return r * (vocab // n) + min(r, vocab % n)


def _argmax(logits: torch.Tensor, axis: str | None, vocab: int) -> torch.Tensor:
    """The arg-max of each full row of vocab-parallel ``logits [b, V/tp]``: ``[b]`` int64, the same on every
    device of ``axis``, ties to the lowest index."""
    if axis is None:
        return logits.argmax(dim=-1)  # [b, V] -> [b]
    local_max, local_arg = logits.max(dim=-1)  # [b, V/tp] -> [b], [b] (first maximum of this block)
    top = lax.pmax(local_max, axis)  # [b] -> [b]: all-reduce max over tp
    start = _vocab_start(vocab, lax.axis_size(axis), axis_index_int(axis))
    mine = torch.where(local_max == top, local_arg + start, vocab)  # [b]: my global index where I hold the max
    return lax.pmin(mine, axis)  # [b] -> [b]: all-reduce min over tp: the first maximum of the full row


def next_token(
    logits: torch.Tensor,
    opts: SamplingOptions,
    *,
    step: int,
    rows: Sequence[int] | range | None = None,
    axis: str | None = None,
    vocab: int | None = None,
) -> torch.Tensor:
    """The next token of each row: ``[b]`` int64, identical on every device of ``axis``.

    Args:
        logits: ``[b, V]`` (``[b, V/tp]``: a block of the vocab-parallel head's logits, when ``axis`` is set).
        opts: greedy or sampled, and how.
        step: the index of the generated token (0 for the first): the draws are ``fold_in(key, step)``'s.
        rows: the global indices of these rows (their draws); default ``range(b)``.
        axis: the mesh axis the vocabulary is split over (``tp``), or None.
        vocab: the full vocabulary size (default: ``logits.shape[-1]`` times the axis size).

    Returns:
        ``[b]`` token ids.

    Example:
        >>> logits = torch.randn(2, 16)
        >>> opts = SamplingOptions(temperature=1.0, key=fsr.key(0), batch=2)
        >>> torch.equal(next_token(logits, opts, step=3), next_token(logits, opts, step=3))
        True
    """
    if vocab is None:
        vocab = logits.shape[-1] * (1 if axis is None else lax.axis_size(axis))
    if opts.greedy:
        return _argmax(logits, axis, vocab)
    if axis is not None:
        logits = lax.all_gather(logits, axis, dim=-1, tiled=True)  # [b, V/tp] -> [b, V]
    rows = range(logits.shape[0]) if rows is None else rows
    scaled = filter_logits(logits.float() / opts.temperature, opts.top_k, opts.top_p)  # [b, V]
    cdf = F.softmax(scaled, dim=-1).cumsum(dim=-1)  # [b, V]
    u = fsr.uniform(fsr.fold_in(opts.key, step), (opts.batch,))[list(rows)]  # [b]: each row's draw
    pick = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1), right=True)  # [b, 1]
    pick = pick.squeeze(-1).clamp(max=vocab - 1)  # [b]
    # every device drew the same token from the same gathered row; a max over [b] ids says so (invariant over tp)
    return pick if axis is None else lax.pmax(pick, axis)  # [b] -> [b]
