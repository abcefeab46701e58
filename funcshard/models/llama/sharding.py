"""How the Llama's parameters and batches are laid out over whatever mesh axes exist.

Rules (t5x / MaxText style, regex on the leaf path): vocab and the output features of q/k/v/gate/up are
split over ``tp`` (column-parallel), the input features of o/down over ``tp`` (row-parallel); the other
weight dim, and the norms, over ``fsdp``. The batch dim goes over ``dp`` and ``fsdp``, the sequence over
``cp``. Axes the mesh does not have are dropped, so one rule set serves every mesh.

Example:
    >>> import funcshard as fs
    >>> from funcshard.models.llama import Config
    >>> cfg = Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    >>> param_specs(cfg, fs.make_mesh({"dp": 2, "tp": 2}, backend="sim"))["layers"]["wq"]
    P(None, 'tp', None)
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _rules
from ..._errors import ShardingError
from ..._spec import P
from .config import Config

__all__ = ["RULES", "batch_spec", "check_mesh", "param_shapes", "param_specs"]

BATCH_AXES = ("dp", "fsdp")
KNOWN_AXES = ("dp", "fsdp", "tp", "cp")

RULES = [
    (r"embed", P("tp", "fsdp")),
    (r"head", P("tp", "fsdp")),
    (r"norm", P("fsdp")),
    (r"layers/(attn|mlp)_norm", P(None, "fsdp")),
    (r"layers/(wq|wk|wv|w1|w3)", P(None, "tp", "fsdp")),
    (r"layers/(wo|w2)", P(None, "fsdp", "tp")),
]


def param_shapes(cfg: Config) -> dict[str, Any]:
    """The parameter tree's shapes (``torch.Size`` leaves); layers stacked on a leading dim.

    Args:
        cfg: the model config.

    Returns:
        ``{"embed", "layers": {...}, "norm"}`` (and ``"head"`` unless ``cfg.tie_embeddings``) of ``torch.Size``.

    Example:
        >>> from funcshard.models.llama import Config
        >>> cfg = Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> shapes = param_shapes(cfg)
        >>> shapes["embed"], shapes["layers"]["wk"]  # [vocab, dim], [n_layers, n_kv_heads * head_dim, dim]
        (torch.Size([256, 64]), torch.Size([2, 32, 64]))
    """
    d, f, v, n, hd = cfg.dim, cfg.ffn_dim, cfg.vocab_size, cfg.n_layers, cfg.head_dim
    kv = cfg.n_kv_heads * hd
    layers = {
        "attn_norm": (n, d),
        "wq": (n, cfg.n_heads * hd, d),
        "wk": (n, kv, d),
        "wv": (n, kv, d),
        "wo": (n, d, cfg.n_heads * hd),
        "mlp_norm": (n, d),
        "w1": (n, f, d),
        "w3": (n, f, d),
        "w2": (n, d, f),
    }
    tree: dict[str, Any] = {"embed": (v, d), "layers": layers, "norm": (d,)}
    if not cfg.tie_embeddings:
        tree["head"] = (v, d)
    return {
        k: ({a: torch.Size(b) for a, b in val.items()} if isinstance(val, dict) else torch.Size(val))
        for k, val in tree.items()
    }


def check_mesh(cfg: Config, mesh: Any) -> None:
    """Raise a one-line ``ShardingError`` saying what to change when the model cannot use ``mesh``.

    Args:
        cfg: the model config.
        mesh: the mesh to check (its axes among ``dp``, ``fsdp``, ``tp``, ``cp``).

    Raises:
        ShardingError: an axis the model does not use, or a size that does not divide the model.

    Example:
        >>> import funcshard as fs
        >>> from funcshard.models.llama import Config
        >>> cfg = Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> check_mesh(cfg, fs.make_mesh({"dp": 2, "tp": 2}, backend="sim"))  # fits: returns None
        >>> check_mesh(cfg, fs.make_mesh({"tp": 8}, backend="sim"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        funcshard._errors.ShardingError: llama: n_heads=4 is not divisible by tp=8; choose tp dividing n_heads ...
    """
    shape = mesh.shape
    unknown = [a for a in mesh.axis_names if a not in KNOWN_AXES and shape[a] > 1]
    if unknown:
        raise ShardingError(
            f"llama: the mesh has axis {unknown[0]!r} of size {shape[unknown[0]]}, which the Llama does not use; "
            f"use the axes {list(KNOWN_AXES)} (e.g. --mesh dp=2,tp=2)."
        )
    tp = shape.get("tp", 1)
    for what, n in (
        ("n_heads", cfg.n_heads),
        ("n_kv_heads", cfg.n_kv_heads),
        ("vocab_size", cfg.vocab_size),
        ("ffn_dim", cfg.ffn_dim),
    ):
        if n % tp:
            raise ShardingError(
                f"llama: {what}={n} is not divisible by tp={tp}; choose tp dividing {what} (or change {what})."
            )
    fsdp = shape.get("fsdp", 1)
    if cfg.dim % fsdp:
        raise ShardingError(f"llama: dim={cfg.dim} is not divisible by fsdp={fsdp}; choose fsdp dividing dim.")


def param_specs(cfg: Config, mesh: Any) -> dict[str, Any]:
    """The spec tree of the parameters on ``mesh`` (only the axes the mesh has).

    Args:
        cfg: the model config.
        mesh: the mesh the parameters are laid out on.

    Returns:
        A tree of ``P`` specs with the structure of ``param_shapes(cfg)``.

    Raises:
        ShardingError: the mesh has an axis the model cannot use, or a size that does not divide the model.

    Example:
        >>> import funcshard as fs
        >>> from funcshard.models.llama import Config
        >>> cfg = Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> specs = param_specs(cfg, fs.make_mesh({"fsdp": 2, "tp": 2}, backend="sim"))
        >>> specs["embed"], specs["layers"]["wo"]
        (P('tp', 'fsdp'), P(None, 'fsdp', 'tp'))
    """
    check_mesh(cfg, mesh)  # the parameters are replicated over cp
    return _rules.spec_rules(param_shapes(cfg), RULES, default=None, mesh=mesh, drop_missing_axes=True)


def batch_spec(mesh: Any) -> P:
    """The spec of a ``[batch, seq]`` token tensor: batch over the data axes (``dp``, ``fsdp``) present,
    the sequence over ``cp`` (context parallelism, contiguous blocks) when the mesh has it.

    Args:
        mesh: the mesh the batch is laid out on.

    Returns:
        The ``P`` spec of a ``[batch, seq]`` tensor.

    Example:
        >>> import funcshard as fs
        >>> batch_spec(fs.make_mesh({"dp": 2, "tp": 2}, backend="sim"))
        P('dp', None)
        >>> batch_spec(fs.make_mesh({"dp": 2, "fsdp": 2, "cp": 2}, backend="sim"))
        P(('dp', 'fsdp'), 'cp')
    """
    axes = tuple(a for a in BATCH_AXES if a in mesh.shape)
    return P(axes if len(axes) > 1 else axes[0] if axes else None, "cp" if "cp" in mesh.shape else None)
