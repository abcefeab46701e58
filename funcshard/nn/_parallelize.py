"""``parallelize``: a module sharded over a mesh by a tensor-parallel plan, data axes and FSDP."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import lax
from ..extend import ConfigError, P, ShardingError, maybe_current
from ..ops import vocab_parallel_cross_entropy
from ._instances import Instances, module_state, tied_names
from ._plan import Layout, default_plan, fsdp_unit_paths, layout, resolve_plan, tie_styles
from ._styles import CallState, Gathers, Holder, Unit, install

__all__ = ["Parallelized", "causal_lm_loss", "parallelize"]


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_axis: str | None = None,
    data_axes: tuple[str, ...] = (),
    shift: bool = True,
) -> torch.Tensor:
    """Hugging Face's causal-LM loss (labels shifted left inside, ``-100`` ignored, the mean over the tokens) over
    the whole global batch: this device's summed cross-entropy divided by the global count of labelled tokens,
    summed over ``data_axes``; the vocabulary sharded over ``vocab_axis`` is never gathered.

    Args:
        logits: ``[b, s, V]`` (``[b, s, V/tp]`` with ``vocab_axis``).
        labels: ``[b, s]`` the input ids (or -100), as given to a Hugging Face ``...ForCausalLM``.
        vocab_axis: the axis the vocabulary dim of ``logits`` is split over, or None.
        data_axes: the axes the batch is split over.
        shift: ``labels`` are the inputs (Hugging Face's ``labels=``), shifted left here; False: they are the
            targets already (``targets[:, t]`` is the token after ``tokens[:, t]``).

    Returns:
        A 0-dim float32 tensor, invariant over ``data_axes`` and ``vocab_axis``.

    Example:
        >>> logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
        >>> ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1))
        >>> torch.allclose(causal_lm_loss(logits, labels), ref)
        True
    """
    targets = labels
    if shift:
        pad = labels.new_full((*labels.shape[:-1], 1), -100)
        targets = torch.cat([labels[..., 1:], pad], dim=-1)  # [b, s]: the next token, -100 after the last
    total = vocab_parallel_cross_entropy(logits, targets, axis=vocab_axis, reduction="sum")  # [b, s, V(/tp)] -> []
    count = (targets != -100).sum().to(torch.float32)  # [] (this shard's labelled tokens)
    if data_axes:
        count = lax.psum(count, data_axes)  # [] -> [], the global count
    mean = total / count.clamp(min=1)  # [] (this shard's part of the global mean)
    return lax.psum(mean, data_axes) if data_axes else mean  # [] -> [], summed over the batch shards


def _head_path(module: nn.Module) -> str:
    """The path of a Hugging Face model's output head (``get_output_embeddings``)."""
    get = getattr(module, "get_output_embeddings", None)
    head = get() if callable(get) else None
    for path, mod in module.named_modules():
        if head is not None and mod is head:
            return path
    raise ConfigError(
        f"parallelize: loss_parallel=True shards the output head, but the {type(module).__name__} has none "
        f"(get_output_embeddings()); give its head 'colwise' in the plan and compute the loss with "
        f"funcshard.ops.vocab_parallel_cross_entropy."
    )


class Parallelized:
    """The function :func:`parallelize` returns: ``fn(params, *args, **kwargs)`` inside ``shard_map``.

    Attributes:
        layout: the styles, specs and gradient-sum axes the plan gives on the mesh.
        batch_spec: the spec of an argument whose dim 0 is the batch (split over ``dp`` and ``fsdp``).
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Any,
        lay: Layout,
        *,
        loss_parallel: bool,
        check_state: bool,
        fsdp_units: list[str] | tuple[str, ...] | None = None,
        reshard_after_forward: bool = False,
    ) -> None:
        self.module, self.mesh_shape, self.layout = module, dict(mesh.shape), lay
        self._unit_paths = fsdp_unit_paths(module, fsdp_units) if lay.fsdp is not None else [""]
        self._reshard = reshard_after_forward
        self.batch_spec = lay.batch_spec
        self._alias = tied_names(module)
        self._holders: dict[int, Holder] = {}
        self._instances = Instances(module, self._prepare, check_state=check_state)
        self._lm = callable(getattr(module, "get_output_embeddings", None))
        self._vocab_axis = lay.tp if loss_parallel else None
        self._groups = self._replica_groups()
        self._buffers = {n: t for n, t in module_state(module).items() if n not in lay.replicas}

    def _replica_groups(self) -> dict[tuple[str, ...], list[str]]:
        """The parameters made varying at the start of a call, by axes: those not gathered over ``fsdp``."""
        groups: dict[tuple[str, ...], list[str]] = {}
        for name, reps in self.layout.replicas.items():
            gathered = self.layout.fsdp is not None and self.layout.fsdp in self.layout.specs[name].axes
            if reps and not gathered:
                groups.setdefault(reps, []).append(name)
        return groups

    def _prepare(self, inst: nn.Module) -> None:
        """Install the styles and the FSDP units on a new working copy."""
        lay = self.layout
        gathers = None
        if lay.fsdp is not None:
            gathers = Gathers(lay.fsdp, reshard=self._reshard, root=inst)
            mods = dict(inst.named_modules())
            roots = self._unit_paths
            for path, mod in inst.named_modules():
                # the innermost unit holding the submodule (the root, "", holds every one)
                home = max((r for r in roots if not r or path == r or path.startswith(r + ".")), key=len)
                for attr, _ in mod.named_parameters(prefix="", recurse=False):
                    full = f"{path}.{attr}" if path else attr
                    name = self._alias.get(full, full)
                    if lay.fsdp in lay.specs[name].axes:
                        unit = gathers.units.setdefault(mods[home], Unit(home))
                        unit.add(name, lay.specs[name], lay.replicas[name], mod, attr)
        holder = self._holders[id(inst)] = Holder(gathers)
        install(inst, lay.styles, lay.tp, holder)

    def _check_call(self) -> None:
        ctx = maybe_current()
        if ctx is None:
            raise ShardingError(
                "parallelize's fn: called outside shard_map; call it inside fs.shard_map(fn, mesh=mesh, "
                "in_specs=(specs, fn.batch_spec, ...), out_specs=...), with the params and specs parallelize returned."
            )
        if dict(ctx.mesh.shape) != self.mesh_shape:
            raise ShardingError(
                f"parallelize's fn: built for the mesh {self.mesh_shape}, called inside shard_map over "
                f"{dict(ctx.mesh.shape)}; parallelize the module for that mesh."
            )

    def __call__(self, params: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        """The module's outputs on this device's shards (see :func:`parallelize`)."""
        self._check_call()
        inst = self._instances.get()
        inst.train(self.module.training)
        labels = kwargs.pop("labels", None) if self._lm else None
        if self._buffers:  # no gradient into a buffer (the module's own where the tree has none)
            params = {**params, **{n: params[n].detach() if n in params else b for n, b in self._buffers.items()}}
        for axes, names in self._groups.items():  # identity forward; backward: one psum of the group over axes
            varied = lax.pvary({n: params[n] for n in names}, axes)
            params = {**params, **varied}
        holder = self._holders[id(inst)]
        state = holder.state = CallState(holder.gathers)
        before = self._instances.snapshot(inst)
        try:
            out = torch.func.functional_call(inst, params, args, kwargs)
        finally:
            state.close()
            holder.state = None
        self._instances.check(inst, before, "parallelize's fn")
        if labels is not None:
            loss = causal_lm_loss(out.logits, labels, vocab_axis=self._vocab_axis, data_axes=self.layout.data_axes)
            out["loss"] = loss
        return out


def parallelize(
    module: nn.Module,
    mesh: Any,
    plan: dict[str, str] | None = None,
    *,
    loss_parallel: bool = False,
    check_state: bool = True,
    fsdp_units: list[str] | tuple[str, ...] | None = None,
    reshard_after_forward: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, P], Parallelized]:
    """The module sharded over ``mesh``: its parameters, their specs, and the function to run in ``shard_map``.

    ``fn(params, *args, **kwargs)`` (``params`` may leave out the buffers: the module's own are used), called
    inside ``fs.shard_map(..., in_specs=(specs, ...))`` with the batch of each argument split over the data axes
    (``fn.batch_spec``), returns what the unsharded module returns for this device's part of the batch, and its
    gradients are the unsharded module's: over ``tp`` each planned submodule runs its style on local shards
    (``colwise``: the output features split, ``rowwise``: the input features split, then one ``psum`` over ``tp``;
    ``vocab``: an embedding's rows; ``*_rep``: a replicated output or input; ``replicated_with_grad_allreduce`` /
    ``sequence_parallel``: the gradient summed over ``tp``); head counts follow the local shard (Hugging Face's
    attention reshapes with ``-1`` heads). ``dp`` and ``fsdp`` split the batch; ``fsdp`` also splits dim 0 of every
    parameter, gathered per FSDP unit in one flat bucket just before it runs (the next unit's gather in flight
    meanwhile) and reduce-scattered in the backward, one bucket per unit: FSDP2's ``fully_shard`` per layer.

    For a Hugging Face causal LM, a ``labels=`` argument gives ``out.loss``: the mean over the whole global batch,
    as the unsharded model's loss, invariant over every axis. With ``loss_parallel=True`` the output head is
    ``colwise`` (the vocabulary split over ``tp``): ``out.logits`` is this device's ``[b, s, V/tp]`` block and the
    loss never gathers the vocabulary.

    Args:
        module: a ``torch.nn.Module`` (never changed: each device runs a copy, see :func:`functionalize`).
        mesh: an ``fs.Mesh`` whose axes are among ``dp``, ``fsdp``, ``tp``.
        plan: ``{path pattern: style}``; ``None`` reads the module's ``config.base_model_tp_plan`` (Hugging Face).
        loss_parallel: split the output head's vocabulary over ``tp`` and compute the loss on it sharded.
        check_state: refuse a call that changes a plain attribute of a submodule (Python-side state).
        fsdp_units: with an ``fsdp`` axis, the submodules gathered as one unit each: path patterns (as the plan's)
            or class names; ``None``: the Hugging Face ``_no_split_modules`` (the decoder layers), else the root's
            children. The parameters no unit holds (embedding, final norm, head) form the root's unit.
        reshard_after_forward: with ``fsdp``, free each unit's gathered weights (the root's kept) after its forward
            and gather them again for its backward (FSDP2's ``reshard_after_forward=True``: one more all-gather per
            unit, less memory). False: kept for the backward.

    Returns:
        ``(params, specs, fn)``: the full parameters and buffers by dotted name, their specs, and ``fn``.

    Raises:
        ConfigError: a plan pattern naming no submodule, an unknown style, or one that does not fit the submodule;
            an ``fsdp_units`` entry naming no submodule.
        ShardingError: an unknown mesh axis, a dim its axes do not divide, a head split by ``tp``.

    Example:
        >>> import torch, funcshard as fs
        >>> from funcshard import P
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        >>> mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
        >>> params, specs, fn = fs.nn.parallelize(mlp, mesh, {"0": "colwise", "2": "rowwise"})
        >>> specs["0.weight"], specs["2.weight"], fn.batch_spec
        (P('tp'), P(None, 'tp'), P('dp'))
        >>> f = fs.shard_map(fn, mesh=mesh, in_specs=(specs, fn.batch_spec), out_specs=fn.batch_spec)
        >>> x = torch.randn(6, 4)
        >>> torch.allclose(fs.device_get(f(params, x)), mlp(x), atol=1e-6)
        True
    """
    if not isinstance(module, nn.Module):
        raise ConfigError(f"parallelize: expected a torch.nn.Module, found {type(module).__name__}.")
    styles = resolve_plan(module, default_plan(module) if plan is None else plan)
    if loss_parallel and "tp" in mesh.shape:
        styles[_head_path(module)] = "colwise"
    styles = tie_styles(module, styles)
    lay = layout(module, mesh, styles)
    lp = loss_parallel and lay.tp is not None
    fsdp: dict[str, Any] = {"fsdp_units": fsdp_units, "reshard_after_forward": reshard_after_forward}
    fn = Parallelized(module, mesh, lay, loss_parallel=lp, check_state=check_state, **fsdp)
    params = module_state(module)
    specs = {name: lay.specs.get(name, P()) for name in params}
    return params, specs, fn
