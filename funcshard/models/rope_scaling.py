"""Llama 3.1's RoPE frequency scaling (transformers' ``rope_type: "llama3"``), for long-context Llama models.

RoPE rotates each pair of head features at a frequency ``theta ** (-2i / head_dim)``. Llama 3.1, 3.2 and 3.3
divide the low frequencies (wavelength above ``original_max_position_embeddings / low_freq_factor``) by
``factor``, keep the high ones (wavelength below ``original_max_position_embeddings / high_freq_factor``) and
blend linearly in between. :meth:`RopeScaling.inv_freq` is transformers' ``_compute_llama3_parameters``, op for
op in float32, so the tables (and the logits) equal transformers' bit for bit.

Example:
    >>> import torch
    >>> s = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    >>> inv = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    >>> scaled = s.inv_freq(inv)
    >>> bool(scaled[0] == inv[0]), bool(torch.isclose(scaled[-1], inv[-1] / 8))  # high kept, low divided
    (True, True)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..extend import ConfigError

__all__ = ["RopeScaling"]


@dataclass(frozen=True)
class RopeScaling:
    """The ``"llama3"`` RoPE scaling of transformers' Llama config (``rope_scaling`` / ``rope_parameters``).

    Args:
        factor: how much the low frequencies are divided by (8 for Llama 3.1, 32 for Llama 3.2), > 0.
        low_freq_factor: wavelengths above ``original_max_position_embeddings / low_freq_factor`` are scaled.
        high_freq_factor: wavelengths below ``original_max_position_embeddings / high_freq_factor`` are kept;
            greater than ``low_freq_factor``.
        original_max_position_embeddings: the context length the model was pre-trained with (8192).

    Raises:
        ConfigError: a field that is not a positive number, or ``high_freq_factor <= low_freq_factor``.

    Example:
        >>> RopeScaling.from_dict({"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        ...                        "original_max_position_embeddings": 8192}).factor
        32.0
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"RopeScaling: {name} must be a positive number, found {v!r}.")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                f"RopeScaling: high_freq_factor ({self.high_freq_factor}) must be greater than low_freq_factor "
                f"({self.low_freq_factor}); the frequencies between them are blended."
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RopeScaling:
        """The scaling of a mapping with the four fields (``dataclasses.asdict``'s or transformers' keys; others,
        such as ``rope_type`` and ``rope_theta``, are ignored); ConfigError naming a missing field."""
        names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [n for n in names if d.get(n) is None]
        if missing:
            raise ConfigError(f"RopeScaling: the 'llama3' scaling needs {list(names)}; missing {missing}.")
        return cls(**{n: d[n] for n in names})

    def inv_freq(self, inv: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies of the plain ones ``inv`` (``[hd/2]``, float32), as transformers'
        ``_compute_llama3_parameters``."""
        old = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / inv  # [hd/2]
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)  # the low frequencies divided
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)  # [hd/2]
