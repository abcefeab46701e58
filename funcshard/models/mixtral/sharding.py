"""How the Mixtral's parameters and batches are laid out over the axes of a parallel plan.

The Llama's rules (:mod:`funcshard.models.llama.sharding`) for attention, embedding, norms and head, and for each
layer's mixture of experts: the experts' dim over ``ep`` (device ``r`` holds experts ``[r E/ep, (r+1) E/ep)``),
their hidden dim over ``tp`` as the Llama's MLP (``w1`` / ``w3`` column-parallel, ``w2`` row-parallel), ``fsdp``
on the rows as elsewhere; the router ``[E, d]`` replicated but over ``fsdp`` (its rows, or its columns where
``fsdp`` does not divide ``E``). The stacked layer dim goes over ``pp``. The batch goes over ``dp``, ``fsdp`` and
``ep`` (``ep`` is a data axis for everything that is not an expert), the sequence over ``cp``.

Example:
    >>> import funcshard as fs
    >>> from funcshard.models.mixtral import Config
    >>> cfg = Config(vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16,
    ...              n_experts=4)
    >>> specs = param_specs(cfg, fs.make_mesh({"ep": 2, "tp": 2}, backend="sim"))
    >>> specs["layers"]["w1"], specs["layers"]["w2"], specs["layers"]["router"], specs["layers"]["wq"]
    (P(None, 'ep', 'tp', None), P(None, 'ep', None, 'tp'), P(None, None, None), P(None, 'tp', None))
    >>> batch_spec(fs.make_mesh({"dp": 2, "ep": 2}, backend="sim"))
    P(('dp', 'ep'), None)
"""

from __future__ import annotations

from typing import Any

import torch

from ...extend import P, ShardingError
from ..llama import sharding as llama_sharding
from ..plan import ParallelPlan
from .config import Config

__all__ = ["EXPERTS", "RULES", "batch_spec", "model_plan", "param_shapes", "param_specs", "specs_for"]

#: the leaves of a layer that belong to its mixture of experts (gathered apart: ``use_params(experts=...)``)
EXPERTS = frozenset({"router", "w1", "w3", "w2"})

# the experts' rules in role names, in front of the Llama's (the first match wins)
RULES = [
    (r"layers/router", P("pp", "fsdp", None)),
    (r"layers/(w1|w3)", P("pp", "ep", ("tp", "fsdp"), None)),
    (r"layers/w2", P("pp", "ep", "fsdp", "tp")),
    *llama_sharding.RULES,
]
# where ``tp x fsdp`` (``fsdp`` for the router) does not divide the rule's split dim: ``fsdp`` on the other one
INNER = {
    **llama_sharding.INNER,
    "layers/router": P("pp", None, "fsdp"),
    "layers/(w1|w3)": P("pp", "ep", "tp", "fsdp"),
}


def param_shapes(cfg: Config) -> dict[str, Any]:
    """The parameter tree's shapes (``torch.Size`` leaves); layers stacked on a leading dim.

    The Llama's (:func:`funcshard.models.llama.sharding.param_shapes`) with each layer's MLP replaced by its
    experts: ``router [n_layers, E, d]``, ``w1`` / ``w3`` ``[n_layers, E, ffn, d]``, ``w2 [n_layers, E, d, ffn]``.

    Example:
        >>> cfg = Config(vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16,
        ...              n_experts=4)
        >>> shapes = param_shapes(cfg)["layers"]
        >>> shapes["router"], shapes["w1"], shapes["w2"]
        (torch.Size([2, 4, 32]), torch.Size([2, 4, 64, 32]), torch.Size([2, 4, 32, 64]))
    """
    tree = llama_sharding.param_shapes(cfg)
    n, e, d, f = cfg.n_layers, cfg.n_experts, cfg.dim, cfg.ffn_dim
    experts = {
        "router": torch.Size((n, e, d)),
        "w1": torch.Size((n, e, f, d)),
        "w3": torch.Size((n, e, f, d)),
        "w2": torch.Size((n, e, d, f)),
    }
    tree["layers"] = {**{k: v for k, v in tree["layers"].items() if k not in experts}, **experts}
    return tree


def _check_experts(cfg: Config, plan: ParallelPlan) -> None:
    """ShardingError when the ``ep`` size does not divide the experts."""
    ep = plan.size("ep")
    if cfg.n_experts % ep:
        name = "ep" if plan.ep in (None, "ep") else f"ep (axis {plan.ep!r})"
        raise ShardingError(
            f"mixtral: n_experts={cfg.n_experts} is not divisible by ep={ep}; choose {name} dividing n_experts (each "
            f"device holds n_experts / ep experts)."
        )


def model_plan(cfg: Config, mesh: Any, plan: ParallelPlan | None = None) -> ParallelPlan:
    """The checked plan the Mixtral runs with on ``mesh``: the Llama's
    (:func:`funcshard.models.llama.sharding.model_plan`), and ``n_experts`` divisible by the ``ep`` size.

    Raises:
        ShardingError, ConfigError: as the Llama's, and an ``ep`` size that does not divide ``n_experts``.

    Example:
        >>> import funcshard as fs
        >>> cfg = Config(vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16,
        ...              n_experts=4)
        >>> model_plan(cfg, fs.make_mesh({"ep": 8}, backend="sim"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        funcshard._src.errors.ShardingError: mixtral: n_experts=4 is not divisible by ep=8; ...
    """
    plan = llama_sharding.model_plan(cfg, mesh, plan)
    _check_experts(cfg, plan)
    return plan


def specs_for(cfg: Config, plan: ParallelPlan, mesh: Any = None) -> dict[str, Any]:
    """The parameters' spec tree under ``plan`` (checked against each shape on ``mesh`` when given).

    Example:
        >>> from funcshard.models import ParallelPlan
        >>> cfg = Config(vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16,
        ...              n_experts=4)
        >>> plan = ParallelPlan(fsdp="fsdp", ep="ep", mesh_shape=(("fsdp", 2), ("ep", 2)))
        >>> specs_for(cfg, plan)["layers"]["w2"], specs_for(cfg, plan)["layers"]["router"]
        (P(None, 'ep', 'fsdp', None), P(None, 'fsdp', None))
    """
    rules, inner = llama_sharding.kv_rules(cfg, plan, RULES, INNER)  # kv heads replicated where tp exceeds them
    return llama_sharding.rule_specs(param_shapes(cfg), rules, inner, plan, mesh)


def param_specs(cfg: Config, mesh: Any, plan: ParallelPlan | None = None) -> dict[str, Any]:
    """The spec tree of the parameters on ``mesh`` (only the axes the plan gives a role).

    Args:
        cfg: the model config.
        mesh: the mesh the parameters are laid out on.
        plan: the parallel plan (:func:`~funcshard.models.plan_from_mesh`); ``None``: each role played by the
            mesh axis of its own name (``dp``, ``fsdp``, ``tp``, ``cp``, ``pp``, ``ep``).

    Returns:
        A tree of ``P`` specs with the structure of ``param_shapes(cfg)``.

    Raises:
        ShardingError: the mesh has an axis the model cannot use, or a size that does not divide the model.
        ConfigError: a plan that does not fit the mesh or the model.

    Example:
        >>> import funcshard as fs
        >>> cfg = Config(vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16,
        ...              n_experts=4)
        >>> param_specs(cfg, fs.make_mesh({"pp": 2, "ep": 2}, backend="sim"))["layers"]["w3"]
        P('pp', 'ep', None, None)
    """
    return specs_for(cfg, model_plan(cfg, mesh, plan), mesh)


def batch_spec(mesh: Any, plan: ParallelPlan | None = None) -> P:
    """The spec of a ``[batch, seq]`` token tensor: batch over the data axes (``dp``, ``fsdp``, ``ep``) present,
    the sequence over ``cp``; the Llama's (:func:`funcshard.models.llama.batch_spec`).

    Example:
        >>> import funcshard as fs
        >>> batch_spec(fs.make_mesh({"fsdp": 2, "ep": 2, "cp": 2}, backend="sim"))
        P(('fsdp', 'ep'), 'cp')
    """
    return llama_sharding.batch_spec(mesh, plan)
