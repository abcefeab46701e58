"""Parallel plans: which mesh axis plays which parallel role, validated once from the mesh.

A model does not look for axes named ``"tp"`` or ``"dp"``; it is handed a :class:`ParallelPlan` and calls every
op with the axis of the role the op serves (``column_parallel_linear(x, w, axis=plan.tp)``), ``None`` where
that role is off, which the ops of :mod:`funcshard.ops` take as plain local math. So one model body serves
every mesh, and the axes may have any names. As torchtitan's ``ParallelDims``, the plan is checked once, when
built by :func:`plan_from_mesh`, not at every op.

Roles:

- ``dp``: data parallelism, parameters replicated (DDP): the batch is split, gradients are summed.
- ``fsdp``: fully sharded data parallelism (ZeRO-3): the batch is split, parameters are sharded and gathered
  before use; with ``dp`` as well, HSDP (``dp`` the replicas of the sharded group).
- ``tp``: tensor parallelism (Megatron column / row-parallel linears, vocab-parallel embedding and loss);
  ``sp`` (a flag, not an axis) adds sequence parallelism over the same axis.
- ``cp``: context parallelism, the sequence split over the axis (ring attention).
- ``pp``: pipeline parallelism, the layers split in stages over the axis (for models that run a pipeline).
- ``ep``: expert parallelism (mixture-of-experts models): the experts are split over the axis, and, as in
  torchtitan, the batch is split over it too, so for every parameter that is not an expert it is one more data
  axis (the batch split, the gradients summed). A model without experts (the Llama) runs it as a data axis.

Example:
    >>> import funcshard as fs
    >>> mesh = fs.make_mesh({"data": 2, "model": 2}, backend="sim")
    >>> plan = plan_from_mesh(mesh, {"dp": "data", "tp": "model"})
    >>> plan.tp, plan.size("tp"), plan.fsdp
    ('model', 2, None)
    >>> plan.to_mesh(fs.P("tp", "fsdp"))  # a spec written with role names, on this mesh
    P('model', None)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..extend import ConfigError, logical_to_mesh

__all__ = ["ROLES", "ParallelPlan", "plan_from_mesh"]

ROLES = ("dp", "fsdp", "tp", "cp", "pp", "ep")
CP_LAYOUTS = ("zigzag", "contiguous")  # ring attention's layouts (funcshard.ops.ring_attention)

PyTree = Any


def _mesh_shape(mesh: Any) -> dict[str, int]:
    """``{axis: size}`` of a mesh (or of a plain mapping), in the mesh's axis order."""
    return dict(mesh) if isinstance(mesh, Mapping) else dict(mesh.shape)


def _format_shape(shape: Mapping[str, int]) -> str:
    return "{" + ", ".join(f"'{a}': {n}" for a, n in shape.items()) + "}"


@dataclass(frozen=True)
class ParallelPlan:
    """Which mesh axis plays each parallel role (``None``: the role is off), and the mesh's axis sizes.

    Build it with :func:`plan_from_mesh`, which validates it; ``ParallelPlan()`` (every role off) is the plain
    single-device model. Frozen and hashable, so models cache what they derive from it.

    Attributes:
        dp: the data-parallel (replicated parameters) axis.
        fsdp: the fully-sharded data-parallel axis.
        tp: the tensor-parallel axis.
        cp: the context-parallel (sequence) axis.
        pp: the pipeline axis.
        ep: the expert-parallel axis (experts split over it; a data axis for everything else).
        sp: sequence parallelism over the ``tp`` axis between blocks.
        mesh_shape: ``((axis, size), ...)`` of the mesh the plan was built for.
        cp_layout: how a model lays the sequence out over ``cp`` inside: ``"zigzag"`` (the default: device ``i``
            holds chunks ``i`` and ``2n-1-i`` of ``2n``, the causal attention work balanced) or ``"contiguous"``
            (chunk ``i`` of ``n``). Either way the model's inputs and outputs are split contiguously.

    Example:
        >>> plan = ParallelPlan(dp="data", tp="model", mesh_shape=(("data", 2), ("model", 2)))
        >>> plan.data_axes, plan.replica_axes, plan.roles
        (('data',), ('data',), {'dp': 'data', 'tp': 'model'})
        >>> ParallelPlan().roles  # every role off: local math
        {}
    """

    dp: str | None = None
    fsdp: str | None = None
    tp: str | None = None
    cp: str | None = None
    pp: str | None = None
    ep: str | None = None
    sp: bool = False
    mesh_shape: tuple[tuple[str, int], ...] = ()
    cp_layout: str = "zigzag"

    @property
    def roles(self) -> dict[str, str]:
        """``{role: axis}`` of the roles that are on, in :data:`ROLES` order."""
        return {r: a for r in ROLES if (a := getattr(self, r)) is not None}

    def axis(self, role: str) -> str | None:
        """The axis playing ``role`` (one of :data:`ROLES`), or ``None``.

        Example:
            >>> ParallelPlan(tp="model", mesh_shape=(("model", 2),)).axis("tp")
            'model'
        """
        if role not in ROLES:
            raise ConfigError(f"ParallelPlan.axis: unknown role {role!r}; the roles are {ROLES}.")
        return getattr(self, role)

    def size(self, role: str) -> int:
        """The size of the axis playing ``role``; 1 when the role is off.

        Example:
            >>> ParallelPlan(tp="model", mesh_shape=(("model", 4),)).size("tp"), ParallelPlan().size("tp")
            (4, 1)
        """
        axis = self.axis(role)
        if axis is None:
            return 1
        sizes = dict(self.mesh_shape)
        if axis not in sizes:
            raise ConfigError(
                f"ParallelPlan.size: role {role!r} is played by axis {axis!r}, but the plan's mesh_shape "
                f"{self.mesh_shape} lacks it; build plans with plan_from_mesh(mesh, roles)."
            )
        return sizes[axis]

    @property
    def sp_axis(self) -> str | None:
        """The axis the sequence is split over between blocks (the ``tp`` axis under ``sp``), or ``None``."""
        return self.tp if self.sp else None

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes the batch dim is split over (``dp``, ``fsdp``, then ``ep``), major to minor."""
        return tuple(a for a in (self.dp, self.fsdp, self.ep) if a is not None)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes the tokens are split over (batch or sequence: ``dp``, ``fsdp``, ``ep``, ``cp``): a loss is
        summed over them."""
        return tuple(a for a in (self.dp, self.fsdp, self.ep, self.cp) if a is not None)

    @property
    def replica_axes(self) -> tuple[str, ...] | None:
        """The axes the (non-expert) parameters are replicated over while the data varies (``dp``, ``ep``,
        ``cp``): their gradients are summed over them. ``None`` when there are none.

        Example:
            >>> ParallelPlan(dp="dp", ep="ep", mesh_shape=(("dp", 2), ("ep", 2))).replica_axes
            ('dp', 'ep')
        """
        axes = tuple(a for a in (self.dp, self.ep, self.cp) if a is not None)
        return axes or None

    @property
    def expert_replica_axes(self) -> tuple[str, ...] | None:
        """The axes the experts' weights are replicated over while the data varies: :attr:`replica_axes` less
        ``ep``, which splits the experts (each device's experts see the tokens of every ``ep`` device, brought
        by the all-to-all, so their gradients are whole there). ``None`` when there are none.

        Example:
            >>> ParallelPlan(dp="dp", ep="ep", mesh_shape=(("dp", 2), ("ep", 2))).expert_replica_axes
            ('dp',)
        """
        axes = tuple(a for a in (self.dp, self.cp) if a is not None)
        return axes or None

    def logical_rules(self) -> list[tuple[str, str | None]]:
        """``(role, axis)`` for every role (``None`` when off): rules for :func:`funcshard.logical_to_mesh`
        that turn specs written with role names into specs over this mesh's axes.

        Example:
            >>> ParallelPlan(tp="model", mesh_shape=(("model", 2),)).logical_rules()
            [('dp', None), ('fsdp', None), ('tp', 'model'), ('cp', None), ('pp', None), ('ep', None)]
        """
        return [(r, getattr(self, r)) for r in ROLES]

    def to_mesh(self, logical_specs: PyTree) -> PyTree:
        """A spec (or spec tree) written with role names as axis names, over this mesh's axes: each role
        replaced by its axis, roles that are off dropped (replicated).

        Example:
            >>> from funcshard import P
            >>> ParallelPlan(fsdp="shard", mesh_shape=(("shard", 4),)).to_mesh(P(None, "tp", "fsdp"))
            P(None, None, 'shard')
        """
        return logical_to_mesh(logical_specs, self.logical_rules())

    def check_mesh(self, mesh: Any, fn: str) -> None:
        """Raise ``ConfigError`` unless the plan was built for a mesh of ``mesh``'s axes and sizes.

        Example:
            >>> import funcshard as fs
            >>> plan = plan_from_mesh(fs.make_mesh({"tp": 2}, backend="sim"))
            >>> plan.check_mesh(fs.make_mesh({"tp": 4}, backend="sim"), "llama")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            funcshard._src.errors.ConfigError: llama: the plan was built for mesh {'tp': 2}, not {'tp': 4}; ...
        """
        shape = _mesh_shape(mesh)
        if tuple(shape.items()) != self.mesh_shape:
            raise ConfigError(
                f"{fn}: the plan was built for mesh {_format_shape(dict(self.mesh_shape))}, not "
                f"{_format_shape(shape)}; build it for this mesh with plan_from_mesh(mesh, roles)."
            )


def _check_roles(roles: Any, shape: Mapping[str, int]) -> dict[str, str]:
    """``{role: axis}`` of the roles that are on, or a ConfigError naming the role or axis and the fix."""
    if not isinstance(roles, Mapping):
        raise ConfigError(
            f"plan_from_mesh: roles must be a mapping role -> mesh axis name, found {type(roles).__name__}; "
            f"write e.g. roles={{'dp': 'data', 'tp': 'model'}}."
        )
    out: dict[str, str] = {}
    for role, axis in roles.items():
        if role not in ROLES:
            raise ConfigError(f"plan_from_mesh: unknown role {role!r}; the roles are {ROLES}.")
        if axis is None:
            continue
        if not isinstance(axis, str):
            raise ConfigError(
                f"plan_from_mesh: role {role!r} maps to {axis!r}; a role is played by one mesh axis, named by "
                f"a string (or None for off). To split the data over two axes, give one 'dp', the other 'fsdp'."
            )
        if axis not in shape:
            raise ConfigError(
                f"plan_from_mesh: role {role!r} maps to axis {axis!r}, which mesh {_format_shape(shape)} does "
                f"not have; use one of {list(shape)} (or None to turn {role!r} off)."
            )
        other = next((r for r, a in out.items() if a == axis), None)
        if other is not None:
            raise ConfigError(
                f"plan_from_mesh: axis {axis!r} is given two roles, {other!r} and {role!r}; each mesh axis plays "
                f"one role. Add an axis to the mesh for one of them, or map it to None."
            )
        out[role] = axis
    return out


def plan_from_mesh(
    mesh: Any,
    roles: Mapping[str, str | None] | None = None,
    *,
    sequence_parallel: bool = False,
    cp_layout: str = "zigzag",
) -> ParallelPlan:
    """The parallel plan of ``mesh``: which axis plays each role, checked once.

    Args:
        mesh: an ``fs.Mesh`` (or a ``{axis: size}`` mapping).
        roles: ``{role: axis name}`` for the roles of :data:`ROLES` (``dp``, ``fsdp``, ``tp``, ``cp``,
            ``pp``, ``ep``); roles left out, or mapped to ``None``, are off. Default: the default names, each role
            played by the mesh axis of the same name, if the mesh has one.
        sequence_parallel: split the sequence over the ``tp`` axis between blocks (Megatron's SP).
        cp_layout: the sequence layout over ``cp`` inside the model (:attr:`ParallelPlan.cp_layout`):
            ``"zigzag"`` (balanced causal work) or ``"contiguous"``.

    Returns:
        A validated :class:`ParallelPlan`.

    Raises:
        ConfigError: an unknown role, an axis the mesh lacks, one axis for two roles, a mesh axis of size
            above 1 that no role uses (axes of size 1 may be left out), ``sequence_parallel`` without a
            ``tp`` role, or an unknown ``cp_layout``; each message names the role or axis and the fix.

    Example:
        >>> import funcshard as fs
        >>> plan = plan_from_mesh(fs.make_mesh({"dp": 2, "tp": 2}, backend="sim"), sequence_parallel=True)
        >>> plan.roles, plan.sp, plan.mesh_shape, plan.cp_layout
        ({'dp': 'dp', 'tp': 'tp'}, True, (('dp', 2), ('tp', 2)), 'zigzag')
        >>> plan_from_mesh(fs.make_mesh({"data": 2, "model": 2}, backend="sim"), {"dp": "data"})
        Traceback (most recent call last):
        ...
        funcshard._src.errors.ConfigError: plan_from_mesh: mesh axis 'model' (size 2) plays no role; ...
    """
    shape = _mesh_shape(mesh)
    used = _check_roles({r: r for r in ROLES if r in shape} if roles is None else roles, shape)
    idle = [a for a, n in shape.items() if n > 1 and a not in used.values()]
    if idle:
        hint = {**used, next((r for r in ROLES if r not in used), "dp"): idle[0]}
        raise ConfigError(
            f"plan_from_mesh: mesh axis {idle[0]!r} (size {shape[idle[0]]}) plays no role; give it one, e.g. "
            f"roles={hint}, or leave it out of the mesh. The roles are {ROLES}."
        )
    if sequence_parallel and "tp" not in used:
        raise ConfigError(
            "plan_from_mesh: sequence_parallel=True splits the sequence over the 'tp' axis, but no axis plays "
            "'tp'; map 'tp' to a mesh axis, or set sequence_parallel=False."
        )
    if cp_layout not in CP_LAYOUTS:
        raise ConfigError(f"plan_from_mesh: unknown cp_layout {cp_layout!r}; use one of {CP_LAYOUTS}.")
    return ParallelPlan(**used, sp=sequence_parallel, mesh_shape=tuple(shape.items()), cp_layout=cp_layout)
