"""The Llama configuration."""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass

from ...extend import ConfigError, Precision, ShardingError
from ...pipeline.schedules import SCHEDULE_NAMES
from ..rope_scaling import RopeScaling

__all__ = ["Config"]


@dataclass(frozen=True)
class Config:
    """Sizes of a Llama-3 style decoder.

    Args:
        vocab_size: tokens in the vocabulary (256 for byte-level text).
        dim: model width.
        n_layers: decoder layers (stored stacked on a leading layer dim).
        n_heads: query heads; ``dim`` must be divisible by it.
        n_kv_heads: key/value heads (grouped-query attention); divides ``n_heads``.
        ffn_dim: SwiGLU hidden size.
        max_seq_len: longest sequence RoPE is prepared for.
        rope_theta: RoPE base.
        rope_scaling: Llama 3.1's scaling of the RoPE frequencies (transformers' ``rope_type: "llama3"``): a
            :class:`~funcshard.models.rope_scaling.RopeScaling` or a dict of its fields; ``None``: plain RoPE.
        norm_eps: RMSNorm epsilon.
        tie_embeddings: use the embedding table as the output head.
        sequence_parallel: with a ``tp`` axis, keep activations split along the sequence between blocks.
        init_std: standard deviation of the weight init.
        pp_schedule: with a ``pp`` axis, the pipeline schedule, a name of
            :data:`funcshard.pipeline.SCHEDULE_NAMES` (``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb"``,
            ``"zbv"``, ``"dualpipev"``, ``"interleaved_zb"``, ``"looped_bfs"``; the interleaved and V ones run
            two layer chunks per stage).
        pp_microbatches: with a ``pp`` axis, microbatches per step (the local batch is split into them);
            ``None``: twice the ``pp`` size.
        remat: rematerialisation of each decoder layer (``fs.remat``): ``"none"``, ``"full"`` (recompute the
            layer in the backward from its input) or ``"selective"`` (keep the weight matmuls' and attention's
            outputs, recompute the rest); the same numbers, less activation memory.
        reshard_after_forward: with an ``fsdp`` axis, free each layer's gathered weights after its forward and
            gather them again for its backward (FSDP2's default: one more bucketed all-gather per layer; the
            numbers are bitwise the same). With ``remat`` ``"full"`` or ``"selective"`` the gather sits inside the
            layer's remat region and is replayed with its recomputation; with ``remat="none"`` the layer runs in
            :func:`funcshard.ops.fsdp.reshard_after_forward`, whose saved-tensor hooks drop the (views of the)
            gathered weights autograd saves and gather them again at the layer's backward (the previous layer's
            regather prefetched meanwhile): at most two layers' full weights alive at a time. False: they are
            kept from the forward to the backward (no extra all-gather). Without an ``fsdp`` axis it does nothing.
        precision: mixed precision (``fs.Precision``, or its string form: ``"bf16"``,
            ``"params=float32,compute=bfloat16"``): parameters initialised and kept in its ``param_dtype``, the
            weights cast to its ``compute_dtype`` for the computation (FSDP gathers them in it), the gradients
            reduced over the data axes in its ``reduce_dtype`` and the logits returned in its
            ``output_dtype``; the loss, the softmax statistics and RMSNorm stay float32. ``None``: everything
            in the parameters' dtype.

    Example:
        >>> Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32).head_dim
        16
    """

    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 704
    max_seq_len: int = 256
    _: KW_ONLY
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    sequence_parallel: bool = False
    init_std: float = 0.02
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    remat: str = "none"
    reshard_after_forward: bool = True
    precision: Precision | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # read back from a checkpoint's metadata (dataclasses.asdict)
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(
                f"llama.Config: rope_scaling must be a RopeScaling, a dict of its fields or None, found "
                f"{self.rope_scaling!r}."
            )
        if isinstance(self.precision, str):
            object.__setattr__(self, "precision", Precision.parse(self.precision))
        elif isinstance(self.precision, dict):  # read back from a checkpoint's metadata (dataclasses.asdict)
            object.__setattr__(self, "precision", Precision(**self.precision))
        elif self.precision is not None and not isinstance(self.precision, Precision):
            raise ConfigError(
                f"llama.Config: precision must be an fs.Precision, its string form or None, found {self.precision!r}."
            )
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ShardingError(f"llama.Config: {name} must be a positive int, found {v!r}.")
        if self.dim % self.n_heads:
            raise ShardingError(f"llama.Config: dim {self.dim} is not divisible by n_heads {self.n_heads}.")
        if self.n_heads % self.n_kv_heads:
            raise ShardingError(
                f"llama.Config: n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}."
            )
        if self.pp_schedule not in SCHEDULE_NAMES:
            raise ConfigError(
                f"llama.Config: pp_schedule={self.pp_schedule!r} is not a schedule; use one of {SCHEDULE_NAMES}."
            )
        if self.remat not in ("none", "full", "selective"):
            raise ConfigError(f"llama.Config: remat={self.remat!r}; use 'none', 'full' or 'selective'.")
        m = self.pp_microbatches
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ConfigError(f"llama.Config: pp_microbatches must be a positive int or None, found {m!r}.")
        if (self.dim // self.n_heads) % 2:
            raise ShardingError(f"llama.Config: the head dim {self.dim // self.n_heads} must be even for RoPE.")
        for name, low in (("rope_theta", 0.0), ("norm_eps", None), ("init_std", None)):  # > 0, or >= 0 (None)
            v = getattr(self, name)
            real = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            if not real or (v <= low if low is not None else v < 0):
                want = "a finite number > 0" if low is not None else "a finite number >= 0"
                raise ConfigError(f"llama.Config: {name} must be {want}, found {v!r}.")
        for name in ("tie_embeddings", "sequence_parallel", "reshard_after_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"llama.Config: {name} must be True or False, found {getattr(self, name)!r}.")

    def microbatches(self, pp: int) -> int:
        """The microbatches per step on a ``pp`` axis of size ``pp``: ``pp_microbatches``, or ``2 * pp``.

        Example:
            >>> Config(pp_microbatches=None).microbatches(4), Config(pp_microbatches=3).microbatches(4)
            (8, 3)
        """
        return 2 * pp if self.pp_microbatches is None else self.pp_microbatches

    @property
    def head_dim(self) -> int:
        """``dim // n_heads``."""
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Number of parameters."""
        d, f, v, hd = self.dim, self.ffn_dim, self.vocab_size, self.head_dim
        per_layer = 2 * d + d * d * 2 + 2 * d * self.n_kv_heads * hd + 3 * d * f
        return v * d * (1 if self.tie_embeddings else 2) + d + self.n_layers * per_layer

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 x params + attention (PaLM's estimate)."""
        n = self.num_params() - self.vocab_size * self.dim * (0 if self.tie_embeddings else 1)
        return 6.0 * n + 12.0 * self.n_layers * self.dim * seq_len
