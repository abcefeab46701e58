"""Mixed precision as a policy: which dtype each kind of value is kept, computed, reduced and returned in.

:class:`Precision` is FSDP2's ``MixedPrecisionPolicy`` and jmp's ``Policy`` for funcshard, pure data that the
ops (``ops.fsdp_gather``), the models (``llama.Config(precision=...)``) and the optimisers read:

- ``param_dtype``: what the parameters are stored in: the master weights the optimiser updates, and its
  moments (float32 by default);
- ``compute_dtype``: what the weights are cast to for the forward and backward, and what FSDP all-gathers
  (bfloat16 by default: half the bytes of float32 on the wire);
- ``reduce_dtype``: what gradients are summed in over the data axes (the reduce-scatter of FSDP, the
  all-reduce of DDP); float32 by default, as FSDP2 advises; ``bfloat16`` halves those bytes too;
- ``output_dtype``: what the model's outputs (the logits) are returned in (float32 by default).

The loss, the softmax statistics of attention (its log-sum-exp), RMSNorm's statistics and RoPE are always
computed in float32 whatever the policy, as in every bf16 recipe.

Example:
    >>> import torch, funcshard as fs
    >>> policy = fs.Precision(compute_dtype="bf16")
    >>> policy
    Precision(param=float32, compute=bfloat16, reduce=float32, output=float32)
    >>> policy.cast_to_compute({"w": torch.ones(2)})["w"].dtype
    torch.bfloat16
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optree
import torch

from ..errors import ConfigError

__all__ = ["Precision", "as_dtype"]

PyTree = Any

_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "f32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "f16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "f64": torch.float64,
    "double": torch.float64,
}


def as_dtype(value: torch.dtype | str, what: str = "dtype") -> torch.dtype:
    """A floating torch dtype from a dtype or its name (``"bf16"``, ``"bfloat16"``, ``"float32"``, ...).

    Raises:
        ConfigError: not a floating dtype or a name of one.

    Example:
        >>> as_dtype("bf16"), as_dtype(torch.float16)
        (torch.bfloat16, torch.float16)
    """
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        if name not in _NAMES:
            raise ConfigError(f"Precision: {what}={value!r} is not a dtype name; use one of {sorted(set(_NAMES))}.")
        return _NAMES[name]
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ConfigError(
            f"Precision: {what}={value!r} must be a floating torch dtype (torch.float32, torch.bfloat16, "
            f"torch.float16, torch.float64) or its name."
        )
    return value


def _short(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


@dataclass(frozen=True, init=False)
class Precision:
    """A mixed-precision policy: parameter, compute, gradient-reduction and output dtypes.

    Args:
        param_dtype: dtype of the stored parameters (the optimiser's master weights and moments).
        compute_dtype: dtype the weights are cast to for the computation; FSDP gathers in it.
        reduce_dtype: dtype the gradients are summed in over the data axes (DDP, FSDP, HSDP); ``None``: the
            ``param_dtype``.
        output_dtype: dtype of the model's outputs; ``None``: the ``param_dtype``.

    Each may be a ``torch.dtype`` or a name (``"bf16"``, ``"bfloat16"``, ``"fp32"``, ``"float16"``...).

    Raises:
        ConfigError: a value that is not a floating dtype.

    Example:
        >>> import torch, funcshard as fs
        >>> fs.Precision(torch.float32, torch.bfloat16, torch.bfloat16)  # bf16 gradient reductions too
        Precision(param=float32, compute=bfloat16, reduce=bfloat16, output=float32)
        >>> fs.Precision.parse("params=float32,compute=bfloat16,output=float32")  # jmp's policy string
        Precision(param=float32, compute=bfloat16, reduce=float32, output=float32)
    """

    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    output_dtype: torch.dtype

    def __init__(
        self,
        param_dtype: torch.dtype | str = torch.float32,
        compute_dtype: torch.dtype | str = torch.bfloat16,
        reduce_dtype: torch.dtype | str | None = None,
        output_dtype: torch.dtype | str | None = None,
    ) -> None:
        param = as_dtype(param_dtype, "param_dtype")
        object.__setattr__(self, "param_dtype", param)
        object.__setattr__(self, "compute_dtype", as_dtype(compute_dtype, "compute_dtype"))
        object.__setattr__(self, "reduce_dtype", param if reduce_dtype is None else as_dtype(reduce_dtype, "reduce"))
        object.__setattr__(self, "output_dtype", param if output_dtype is None else as_dtype(output_dtype, "output"))

    def __repr__(self) -> str:
        return (
            f"Precision(param={_short(self.param_dtype)}, compute={_short(self.compute_dtype)}, "
            f"reduce={_short(self.reduce_dtype)}, output={_short(self.output_dtype)})"
        )

    def __str__(self) -> str:  # jmp's policy string, read back by parse()
        return (
            f"params={_short(self.param_dtype)},compute={_short(self.compute_dtype)},"
            f"reduce={_short(self.reduce_dtype)},output={_short(self.output_dtype)}"
        )

    @classmethod
    def parse(cls, text: str) -> Precision:
        """A policy from jmp's string form ``"params=float32,compute=bfloat16,output=float32"`` (or its short
        keys ``"p=f32,c=bf16,o=f32"``; also ``reduce=`` / ``r=``; a missing key takes the constructor's default,
        where jmp's output would follow compute), or a single dtype name for a plain
        policy (``"float32"``: everything float32; ``"bf16"``: float32 parameters, bf16 compute).

        Raises:
            ConfigError: an unknown key or dtype name.

        Example:
            >>> Precision.parse("bf16")
            Precision(param=float32, compute=bfloat16, reduce=float32, output=float32)
        """
        text = text.strip()
        if "=" not in text:
            dt = as_dtype(text, "precision")
            return cls(torch.float32 if dt != torch.float64 else dt, dt)
        keys = {"params": "param_dtype", "param": "param_dtype", "compute": "compute_dtype"}
        keys |= {"reduce": "reduce_dtype", "output": "output_dtype"}
        keys |= {"p": "param_dtype", "c": "compute_dtype", "r": "reduce_dtype", "o": "output_dtype"}  # jmp's short keys
        kw: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            k, _, v = part.partition("=")
            if k.strip() not in keys:
                raise ConfigError(f"Precision.parse: unknown key {k.strip()!r} in {text!r}; use {sorted(keys)}.")
            kw[keys[k.strip()]] = v.strip()
        return cls(**kw)

    @property
    def is_mixed(self) -> bool:
        """True where some dtype differs from the parameters' (a cast happens somewhere)."""
        p = self.param_dtype
        return (self.compute_dtype, self.reduce_dtype, self.output_dtype) != (p, p, p)

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """Every floating tensor of ``tree`` in ``param_dtype`` (e.g. a fresh init in float32 as the masters).

        Example:
            >>> Precision(torch.float32).cast_to_param({"w": torch.ones(2, dtype=torch.bfloat16)})["w"].dtype
            torch.float32
        """
        return _cast(tree, self.param_dtype)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Every floating tensor of ``tree`` in ``compute_dtype`` (differentiable: the gradient comes back in
        the input's dtype)."""
        return _cast(tree, self.compute_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        """Every floating tensor of ``tree`` in ``output_dtype``."""
        return _cast(tree, self.output_dtype)


def _cast(tree: PyTree, dtype: torch.dtype) -> PyTree:
    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return optree.tree_map(one, tree)
