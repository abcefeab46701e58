"""The Mixtral configuration: the Llama's fields and the mixture of experts'."""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

from ...extend import ConfigError
from ..llama.config import Config as LlamaConfig

__all__ = ["PRESETS", "Config"]


@dataclass(frozen=True)
class Config(LlamaConfig):
    """Sizes of a Mixtral-style decoder: the Llama's (:class:`funcshard.models.llama.Config`, every field and
    check) with a sparse mixture of experts in place of each layer's MLP.

    Args:
        n_experts: experts per layer (SwiGLU MLPs of hidden size ``ffn_dim`` each).
        experts_per_token: experts each token is routed to (top-k).
        router_aux_loss_coef: weight of the load-balancing loss added to the language-model loss (Hugging Face's
            ``router_aux_loss_coef``; Mixtral 8x7B's 0.02).
        norm_topk_prob: renormalise each token's top-k routing weights to sum to 1 (Mixtral: always; Qwen3-MoE's
            ``norm_topk_prob``).

    The other fields are the Llama's (``ffn_dim`` is each expert's hidden size); a Qwen3-MoE sets the Llama's
    ``qk_norm=True`` (each head's q and k RMSNormed) and ``head_size`` (its ``head_dim``). ``sequence_parallel`` is not
    supported yet: a ``ConfigError``.

    Example:
        >>> cfg = Config(vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16,
        ...              n_experts=4, experts_per_token=2)
        >>> cfg.head_dim, cfg.n_experts, f"{cfg.num_params():,}", f"{cfg.active_params():,}"
        (8, 4, '63,904', '39,328')
    """

    MODEL: ClassVar[str] = "mixtral"

    _: KW_ONLY
    n_experts: int = 8
    experts_per_token: int = 2
    router_aux_loss_coef: float = 0.02
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_experts", "experts_per_token"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"mixtral.Config: {name} must be a positive int, found {v!r}.")
        if self.experts_per_token > self.n_experts:
            raise ConfigError(
                f"mixtral.Config: experts_per_token={self.experts_per_token} is more than n_experts={self.n_experts}; "
                f"route each token to at most n_experts experts."
            )
        c = self.router_aux_loss_coef
        if not isinstance(c, int | float) or isinstance(c, bool) or not math.isfinite(c) or c < 0:
            raise ConfigError(f"mixtral.Config: router_aux_loss_coef must be a finite number >= 0, found {c!r}.")
        if not isinstance(self.norm_topk_prob, bool):
            raise ConfigError(f"mixtral.Config: norm_topk_prob must be True or False, found {self.norm_topk_prob!r}.")
        if self.sequence_parallel:
            raise ConfigError(
                "mixtral.Config: sequence_parallel=True is not supported by the Mixtral yet (its experts take the "
                "whole sequence); set it to False (tp still splits attention and the experts' hidden dim)."
            )

    def _expert_params(self, experts: int) -> int:
        """Parameters of ``experts`` experts of one layer."""
        return experts * 3 * self.dim * self.ffn_dim

    def num_params(self) -> int:
        """Number of parameters (every expert).

        Example:
            >>> f"{Config.preset('mixtral-8x7b').num_params():,}", f"{Config.preset('qwen3-30b-a3b').num_params():,}"
            ('46,702,792,704', '30,532,122,624')
        """
        d, v = self.dim, self.vocab_size
        per_layer = 2 * d + self.attention_params() + self.n_experts * d
        per_layer += self._expert_params(self.n_experts)
        return v * d * (1 if self.tie_embeddings else 2) + d + self.n_layers * per_layer

    def active_params(self) -> int:
        """Parameters a token uses: :meth:`num_params` with ``experts_per_token`` experts a layer, not all.

        Example:
            >>> [f"{Config.preset(n).active_params():,}" for n in ("mixtral-8x7b", "qwen3-30b-a3b")]
            ['12,879,925,248', '3,353,032,704']
        """
        unused = self._expert_params(self.n_experts) - self._expert_params(self.experts_per_token)
        return self.num_params() - self.n_layers * unused

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 x the active parameters + attention (PaLM's estimate)."""
        n = self.active_params() - self.vocab_size * self.dim * (0 if self.tie_embeddings else 1)
        return 6.0 * n + 12.0 * self.n_layers * self.n_heads * self.head_dim * seq_len


_MIXTRAL = {"rope_theta": 1e6, "norm_eps": 1e-5, "n_experts": 8, "experts_per_token": 2}
_QWEN3_MOE = {
    "vocab_size": 151936, "n_kv_heads": 4, "head_size": 128, "qk_norm": True, "max_seq_len": 40960,
    "rope_theta": 1e6, "norm_eps": 1e-6, "n_experts": 128, "experts_per_token": 8, "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
}  # fmt: skip

#: name -> the config's fields (Mistral AI's published shapes, as the Hugging Face config.json of each model)
_PRESETS: dict[str, dict[str, Any]] = {
    "debug": {
        "vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
        "max_seq_len": 64, "rope_theta": 1e6, "n_experts": 4, "experts_per_token": 2,
    },
    "mixtral-8x7b": {
        **_MIXTRAL, "vocab_size": 32000, "dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8,
        "ffn_dim": 14336, "max_seq_len": 32768, "router_aux_loss_coef": 0.02,
    },
    "mixtral-8x22b": {
        **_MIXTRAL, "vocab_size": 32768, "dim": 6144, "n_layers": 56, "n_heads": 48, "n_kv_heads": 8,
        "ffn_dim": 16384, "max_seq_len": 65536, "router_aux_loss_coef": 0.001,
    },
    # Qwen3-MoE (Alibaba's config.json): q/k norms, head size 128 at any width, 128 experts, top-8, renormalised
    "qwen3-30b-a3b": {
        **_QWEN3_MOE, "dim": 2048, "n_layers": 48, "n_heads": 32, "ffn_dim": 768,
    },
    "qwen3-235b-a22b": {
        **_QWEN3_MOE, "dim": 4096, "n_layers": 94, "n_heads": 64, "ffn_dim": 1536,
    },
}  # fmt: skip

#: the names :meth:`Config.preset` knows: ``"debug"`` (a tiny model for tests), ``"mixtral-8x7b"``,
#: ``"mixtral-8x22b"``, ``"qwen3-30b-a3b"``, ``"qwen3-235b-a22b"``
PRESETS: tuple[str, ...] = tuple(_PRESETS)
Config.PRESETS, Config.PRESET_FIELDS = PRESETS, _PRESETS
