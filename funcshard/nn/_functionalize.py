"""``functionalize``: a ``torch.nn.Module`` as a parameter tree and a pure function of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..extend import ConfigError
from ._instances import Instances, module_state

__all__ = ["functionalize"]


def functionalize(module: nn.Module, *, check_state: bool = True) -> tuple[dict[str, torch.Tensor], Callable[..., Any]]:
    """The module's parameters and buffers as a tree, and a pure function of them (``torch.func.functional_call``).

    ``params`` is ``{dotted name: tensor}`` (``"model.layers.0.self_attn.q_proj.weight"``), parameters then
    buffers, a tied (shared) tensor once, under the first name the module gives it; the tensors share the
    module's storage (detached, no copy). ``fn(params, *args, **kwargs)`` returns what ``module(*args, **kwargs)``
    returns, computed with the tensors of ``params`` (a tree of the same names: new values, gradients' tracers,
    local shards inside ``shard_map``). ``fn`` never touches ``module``: it runs a copy whose own tensors live on
    the meta device, one per device under ``shard_map`` (the sim backend's devices are threads), so it is usable
    with ``fs.value_and_grad``, ``fs.remat``, ``torch.func`` and inside ``fs.shard_map`` (``compile=True`` too).

    Args:
        module: any ``torch.nn.Module`` (a Hugging Face model too). Its mode (``train()`` / ``eval()``) at the
            time of the call is the copy's.
        check_state: refuse a call that sets or changes a plain attribute (number, string, bool, None) of a
            submodule: Python-side state, which a pure function cannot carry.

    Returns:
        ``(params, fn)``.

    Raises:
        ConfigError: ``module`` is not a ``torch.nn.Module``; at call time, Python-side state (see ``check_state``).

    Example:
        >>> import torch, funcshard as fs
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> params, fn = fs.nn.functionalize(mlp)
        >>> sorted(params)
        ['0.bias', '0.weight', '2.bias', '2.weight']
        >>> x = torch.randn(3, 4)
        >>> torch.equal(fn(params, x), mlp(x))
        True
        >>> loss, grads = fs.value_and_grad(lambda p: fn(p, x).square().sum())(params)
        >>> grads["0.weight"].shape
        torch.Size([8, 4])
    """
    if not isinstance(module, nn.Module):
        raise ConfigError(f"functionalize: expected a torch.nn.Module, found {type(module).__name__}.")
    params = module_state(module)
    instances = Instances(module, check_state=check_state)

    def fn(params: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        inst = instances.get()
        inst.train(module.training)
        before = instances.snapshot(inst)
        out = torch.func.functional_call(inst, params, args, kwargs)
        instances.check(inst, before, "functionalize's fn")
        return out

    fn.__doc__ = f"``{type(module).__name__}(*args, **kwargs)`` as a pure function of its parameters and buffers."
    return params, fn
