"""The Llama configuration."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

from ...extend import ConfigError, Precision, ShardingError
from ...pipeline.schedules import SCHEDULE_NAMES
from ..rope_scaling import RopeScaling

__all__ = ["PRESETS", "Config"]


@dataclass(frozen=True)
class Config:
    """Sizes of a Llama-3 style decoder.

    Args:
        vocab_size: tokens in the vocabulary (256 for byte-level text).
        dim: model width.
        n_layers: decoder layers (stored stacked on a leading layer dim).
        n_heads: query heads; ``dim`` must be divisible by it (unless ``head_size`` is given).
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
        head_size: the attention head size when it is not ``dim // n_heads`` (Hugging Face's ``head_dim``: Qwen3's
            128 at any width); ``None`` (the Llama): ``dim // n_heads``. :attr:`head_dim` is the size in use.
        qk_norm: RMSNorm over each head's queries and keys before RoPE (Qwen3's ``q_norm`` / ``k_norm``: layer
            leaves ``q_norm`` and ``k_norm`` ``[n_layers, head_dim]``); False (the Llama): none.
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

    MODEL: ClassVar[str] = "llama"  # how messages name the model
    PRESETS: ClassVar[tuple[str, ...]] = ()  # the names preset() knows (set below the table)
    PRESET_FIELDS: ClassVar[dict[str, dict[str, Any]]] = {}  # name -> the fields of the preset

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
    head_size: int | None = None
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # read back from a checkpoint's metadata (dataclasses.asdict)
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(
                f"{self.MODEL}.Config: rope_scaling must be a RopeScaling, a dict of its fields or None, found "
                f"{self.rope_scaling!r}."
            )
        if isinstance(self.precision, str):
            object.__setattr__(self, "precision", Precision.parse(self.precision))
        elif isinstance(self.precision, dict):  # read back from a checkpoint's metadata (dataclasses.asdict)
            object.__setattr__(self, "precision", Precision(**self.precision))
        elif self.precision is not None and not isinstance(self.precision, Precision):
            raise ConfigError(
                f"{self.MODEL}.Config: precision must be an fs.Precision, its string form or None, found "
                f"{self.precision!r}."
            )
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ShardingError(f"{self.MODEL}.Config: {name} must be a positive int, found {v!r}.")
        hs = self.head_size
        if hs is not None and (not isinstance(hs, int) or isinstance(hs, bool) or hs < 1):
            raise ShardingError(f"{self.MODEL}.Config: head_size must be a positive int or None, found {hs!r}.")
        if hs is None and self.dim % self.n_heads:
            raise ShardingError(f"{self.MODEL}.Config: dim {self.dim} is not divisible by n_heads {self.n_heads}.")
        if self.n_heads % self.n_kv_heads:
            raise ShardingError(
                f"{self.MODEL}.Config: n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}."
            )
        if self.pp_schedule not in SCHEDULE_NAMES:
            raise ConfigError(
                f"{self.MODEL}.Config: pp_schedule={self.pp_schedule!r} is not a schedule; use one of {SCHEDULE_NAMES}."
            )
        if self.remat not in ("none", "full", "selective"):
            raise ConfigError(f"{self.MODEL}.Config: remat={self.remat!r}; use 'none', 'full' or 'selective'.")
        m = self.pp_microbatches
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ConfigError(f"{self.MODEL}.Config: pp_microbatches must be a positive int or None, found {m!r}.")
        if self.head_dim % 2:
            raise ShardingError(f"{self.MODEL}.Config: the head dim {self.head_dim} must be even for RoPE.")
        for name, low in (("rope_theta", 0.0), ("norm_eps", None), ("init_std", None)):  # > 0, or >= 0 (None)
            v = getattr(self, name)
            real = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            if not real or (v <= low if low is not None else v < 0):
                want = "a finite number > 0" if low is not None else "a finite number >= 0"
                raise ConfigError(f"{self.MODEL}.Config: {name} must be {want}, found {v!r}.")
        for name in ("tie_embeddings", "sequence_parallel", "reshard_after_forward", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{self.MODEL}.Config: {name} must be True or False, found {getattr(self, name)!r}.")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Config:
        """The config of a published model (or ``"debug"``, a tiny one for tests), by name.

        ``"llama3-8b"`` and ``"llama3-70b"`` are Llama 3 (context 8192, plain RoPE); ``"llama3-405b"`` is Llama
        3.1 405B and ``"llama3.2-1b"`` Llama 3.2 1B (tied embeddings), both with Llama 3.1's RoPE scaling and a
        context of 131072, as their Hugging Face ``config.json`` say. All have the vocabulary of 128256 tokens,
        RoPE base 500000 and RMSNorm epsilon 1e-5.

        Args:
            name: one of :data:`PRESETS`.
            **overrides: fields to change (``max_seq_len=4096``, ``precision="bf16"``, ...), as
                ``dataclasses.replace``.

        Returns:
            The config.

        Raises:
            ConfigError: ``name`` is not a preset (the message lists them).

        Example:
            >>> cfg = Config.preset("llama3-8b")
            >>> cfg.dim, cfg.n_layers, cfg.ffn_dim, f"{cfg.num_params():,}"
            (4096, 32, 14336, '8,030,261,248')
            >>> Config.preset("llama3-8b", remat="full").remat
            'full'
        """
        fields = cls.PRESET_FIELDS.get(name) if isinstance(name, str) else None
        if fields is None:
            raise ConfigError(
                f"{cls.MODEL}.Config.preset: no preset named {name!r}; the presets are {', '.join(cls.PRESETS)}."
            )
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"{cls.MODEL}.Config.preset: {unknown} are not fields of {cls.MODEL}.Config.")
        return cls(**{**fields, **overrides})

    def microbatches(self, pp: int) -> int:
        """The microbatches per step on a ``pp`` axis of size ``pp``: ``pp_microbatches``, or ``2 * pp``.

        Example:
            >>> Config(pp_microbatches=None).microbatches(4), Config(pp_microbatches=3).microbatches(4)
            (8, 3)
        """
        return 2 * pp if self.pp_microbatches is None else self.pp_microbatches

    @property
    def head_dim(self) -> int:
        """The attention head size: ``head_size``, or ``dim // n_heads``.

        Example:
            >>> Config(dim=64, n_heads=4).head_dim, Config(dim=64, n_heads=4, head_size=24).head_dim
            (16, 24)
        """
        return self.dim // self.n_heads if self.head_size is None else self.head_size

    def attention_params(self) -> int:
        """Parameters of one layer's attention: ``wq``, ``wk``, ``wv``, ``wo`` (and the q/k norms with ``qk_norm``).

        Example:
            >>> Config(dim=64, n_heads=4, n_kv_heads=2).attention_params()  # 2 x 64 x 64 + 2 x 64 x 32
            12288
        """
        d, hd = self.dim, self.head_dim
        return 2 * d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd + (2 * hd if self.qk_norm else 0)

    def num_params(self) -> int:
        """Number of parameters."""
        d, f, v = self.dim, self.ffn_dim, self.vocab_size
        per_layer = 2 * d + self.attention_params() + 3 * d * f
        return v * d * (1 if self.tie_embeddings else 2) + d + self.n_layers * per_layer

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 x params + attention (PaLM's estimate)."""
        n = self.num_params() - self.vocab_size * self.dim * (0 if self.tie_embeddings else 1)
        return 6.0 * n + 12.0 * self.n_layers * self.n_heads * self.head_dim * seq_len


# Llama 3.1's RoPE scaling of the long-context models (their config.json's "rope_scaling", rope_type "llama3")
_LLAMA31_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA3 = {"vocab_size": 128256, "rope_theta": 500000.0, "norm_eps": 1e-5}

#: name -> the config's fields (Meta's published shapes, as the Hugging Face config.json of each model)
_PRESETS: dict[str, dict[str, Any]] = {
    "debug": {
        "vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
        "max_seq_len": 64, "rope_theta": 500000.0,
    },
    "llama3.2-1b": {
        **_LLAMA3, "dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 8192,
        "max_seq_len": 131072, "tie_embeddings": True, "rope_scaling": RopeScaling(factor=32.0, **_LLAMA31_ROPE),
    },
    "llama3-8b": {
        **_LLAMA3, "dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 14336, "max_seq_len": 8192,
    },
    "llama3-70b": {
        **_LLAMA3, "dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8, "ffn_dim": 28672, "max_seq_len": 8192,
    },
    "llama3-405b": {
        **_LLAMA3, "dim": 16384, "n_layers": 126, "n_heads": 128, "n_kv_heads": 8, "ffn_dim": 53248,
        "max_seq_len": 131072, "rope_scaling": RopeScaling(factor=8.0, **_LLAMA31_ROPE),
    },
}  # fmt: skip

#: the names :meth:`Config.preset` knows: ``"debug"`` (a tiny model for tests), ``"llama3.2-1b"``,
#: ``"llama3-8b"``, ``"llama3-70b"``, ``"llama3-405b"``
PRESETS: tuple[str, ...] = tuple(_PRESETS)
Config.PRESETS, Config.PRESET_FIELDS = PRESETS, _PRESETS
