"""Ahead-of-time analysis of a ``shard_map``'d function, as JAX's ``jit(f).lower(*args).compile()``:
``step.lower(*args)`` runs ``step`` on the abstract twin of its mesh (``backend="abstract"``: meta tensors, one run
per class of devices, nothing allocated) and keeps what each device did: FLOPs as run (forward, backward,
recomputation and optimiser: torch's own FLOP formulas per aten op, ``FlopCounterMode``'s), communication per
axis (as ``fs.comm_stats`` counts a real run) and the peak of live tensor bytes with its parts.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    >>> f = fs.shard_map(lambda w, x: fs.psum(x @ w, "tp"), mesh=mesh, in_specs=(P("tp"), P("dp", "tp")),
    ...                  out_specs=P("dp"))
    >>> cost = f.lower(torch.ones(64, 32), torch.ones(8, 64)).cost_analysis()
    >>> cost["flops"], cost["comm_bytes"], cost["comm_calls"]
    (8192, {'tp': 512}, {'tp': 1})
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..arrays.array import Array, is_array, local_shards
from ..runtime.context import observe_scope
from ..runtime.mesh import Mesh, make_mesh
from ..runtime.stats import comm_stats
from ..tree.shapes import ShapeDtype, to_meta

__all__ = ["Lowered", "abstract_args", "lower"]

PARTS = ("params", "grads", "optimizer_state", "activations", "temporaries")
_INPUT_ROLES = ("params", "optimizer_state")  # the parts an input's role may give it


class _Meter(TorchDispatchMode):
    """Live tensor bytes of one device's run: every new storage an aten op makes counts until it is freed (a
    weakref finaliser); views, in-place and ``out=`` results (an alias in the op's schema) make none. The peak
    is exact; its parts are read from the live storages at the last time the live total grew past 1% over the
    previous reading (so reading them costs O(live) a few hundred times, not at every op)."""

    def __init__(self, flop_formulas: dict[Any, Callable[..., int]]) -> None:
        super().__init__()
        self.formulas = flop_formulas  # aten op packet -> its FLOPs from shapes (torch's FlopCounterMode's)
        self.flops = 0
        self.live = 0
        self.peak = 0
        self.sizes: dict[int, int] = {}  # storage key -> bytes, for the live storages
        # a key is the storage's address, which a later storage may reuse: each storage gets a serial number, and
        # the parts are kept by serial, so a freed storage's part never sticks to the next one at its address
        self.serials: dict[int, int] = {}  # storage key -> serial, for the live storages
        self.kinds: dict[int, str] = {}  # serial -> part, where known (inputs, params, grads, activations)
        self.at_peak: dict[int, int] = {}  # serial -> bytes, of the storages live at the peak
        self._count = 0
        self._read = 0
        self._undo: tuple[int, int, dict[int, int], int] | None = None  # the last growth of the peak, undone
        self._lock = threading.Lock()

    def _freed(self, key: int, n: int, serial: int) -> None:
        with self._lock:
            if self.serials.get(key) == serial:
                del self.serials[key], self.sizes[key]
                self.live -= n

    def add(self, t: torch.Tensor, kind: str | None = None) -> None:
        """Count ``t``'s storage (once) as live, as part ``kind`` where given."""
        storage = t.untyped_storage()
        key, n = storage._cdata, storage.nbytes()
        with self._lock:
            serial = self.serials.get(key)
            if serial is not None:  # already live
                if kind is not None:
                    self.kinds.setdefault(serial, kind)
                return
            serial = self.serials[key] = self._count
            self._count += 1
            if kind is not None:
                self.kinds[serial] = kind
            self.sizes[key] = n
            self.live += n
            if self.live > self.peak:
                self._undo = (serial, self.peak, self.at_peak, self._read)  # (for :meth:`already_held`)
                self.peak = self.live
                if self.live > self._read * 1.01:
                    self.at_peak = {self.serials[k]: size for k, size in self.sizes.items()}
                    self._read = self.live
        weakref.finalize(storage, self._freed, key, n, serial)

    def already_held(self, t: torch.Tensor) -> None:
        """``t``'s storage, just made, stands for memory held already (a kept buffer the real backend writes
        into): its bytes leave the live total, and a peak its making set is taken back."""
        key = t.untyped_storage()._cdata
        with self._lock:
            serial = self.serials.pop(key, None)
            if serial is None:
                return
            self.live -= self.sizes.pop(key)
            undo = self._undo
            if undo is not None and undo[0] == serial:  # the peak was this storage's making
                _, self.peak, self.at_peak, self._read = undo
                self._undo = None

    def mark(self, t: torch.Tensor, kind: str) -> None:
        """``t``'s storage is part ``kind``. An input keeps its role (a weight saved for the backward is still a
        parameter), except that ``"params"`` names which floating inputs are the parameters; params are the
        inputs' own storages: a copy the program makes of them (a cast, a stage's chunk) stays a temporary."""
        serial = self.serials.get(t.untyped_storage()._cdata)
        if serial is None:  # not a storage this device made or was given
            return
        have = self.kinds.get(serial)
        if have in _INPUT_ROLES:
            if kind == "params":
                self.kinds[serial] = kind
        elif kind != "params":
            self.kinds[serial] = kind

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        aliases = _ALIASING.get(func)
        if aliases is None:
            aliases = _ALIASING[func] = any(r.alias_info is not None for r in func._schema.returns)
        out = func(*args, **kwargs) if aliases else _meta_call(func, args, kwargs)
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        if aliases:
            return out
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out

    def parts(self) -> dict[str, int]:
        """The peak and its parts (what no part claims is a temporary)."""
        out = dict.fromkeys(PARTS, 0)
        # no parameters marked (nothing differentiated: a forward, an evaluation): the floating inputs are those
        trained = "params" in self.kinds.values()
        for serial, n in self.at_peak.items():
            kind = self.kinds.get(serial, "temporaries")
            out["params" if kind == "optimizer_state" and not trained else kind] += n
        out["temporaries"] += self.peak - sum(self.at_peak.values())
        return {"peak": self.peak, **out}


#: per aten op: whether its results alias an input (a view, an in-place or out= result)
_ALIASING: dict[Any, bool] = {}
#: (op, the arguments' shapes, strides and dtypes, the other arguments) -> its results' shapes, strides and dtypes:
#: torch's meta kernels are Python (``torch._refs``) and a step repeats the same ops on the same shapes; a new
#: result is made from the cached layout, as ``FakeTensorMode``'s cache does
_META_CACHE: dict[Any, Any] = {}
_META_CACHE_SIZE = 100_000


def _meta_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` of an op whose results are fresh tensors, by its cached result layout where the
    arguments are meta tensors and plain values seen before."""
    try:
        key = (func, _key(args), _key(tuple(sorted(kwargs.items()))))
        hash(key)
    except _Unkeyable:
        return func(*args, **kwargs)
    layout = _META_CACHE.get(key)
    if layout is None:
        out = func(*args, **kwargs)
        if len(_META_CACHE) > _META_CACHE_SIZE:  # (a search over many shapes: start afresh)
            _META_CACHE.clear()
        try:
            _META_CACHE[key] = _layout(out)
        except _Unkeyable:  # (a result that holds values: a real tensor the program reads)
            pass
        return out
    return _rebuild(layout)


class _Unkeyable(Exception):
    pass


def _key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if not x.is_meta or type(x) is not torch.Tensor:
            raise _Unkeyable
        return ("T", tuple(x.shape), x.stride(), x.dtype, x.storage_offset())
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, *(_key(v) for v in x))
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device, torch.layout)):
        return x
    if isinstance(x, torch.memory_format):
        return str(x)
    raise _Unkeyable


def _layout(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        if not out.is_meta:
            raise _Unkeyable
        return ("T", tuple(out.shape), out.stride(), out.dtype)
    if isinstance(out, (tuple, list)):
        return (type(out), [_layout(v) for v in out])
    return ("V", out)


def _rebuild(layout: Any) -> Any:
    if layout[0] == "T":
        return torch.empty_strided(layout[1], layout[2], dtype=layout[3], device="meta")
    if layout[0] == "V":
        return layout[1]
    kind, items = layout
    return kind([_rebuild(v) for v in items])


def _uses(t: torch.Tensor) -> int:
    """How many holders ``t``'s storage has (tensors and views on it)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


#: :func:`_uses` of a tensor that nothing else holds
_ALONE = _uses(torch.empty(1, device="meta"))


class _KeptBuckets:
    """The gradient-bucket pool of a backend that keeps its buckets from step to step (``keeps_buckets``: the dist
    backend's ``BucketPool``), replayed on one device's meta tensors: a bucket takes a kept buffer of its size
    and dtype that nothing holds any more (the real backend writes into it: its bytes are held already), else
    it is kept (its bytes stay live to the end of the step, as the pool's buffer stays allocated)."""

    def __init__(self, meter: _Meter) -> None:
        self.meter = meter
        # (numel, dtype) -> [the kept storage's tensor, the bucket in it now]
        self.kept: dict[tuple[int, torch.dtype], list[list[torch.Tensor]]] = {}

    def take(self, t: torch.Tensor) -> None:
        """``t`` is a gradient bucket just made (``PvaryBucket``'s sum)."""
        slots = self.kept.setdefault((t.numel(), t.dtype), [])
        for slot in slots:
            if _uses(slot[1]) == _ALONE:  # (held only here: its gradients are gone)
                slot[1] = t
                self.meter.already_held(t)
                return
        self.meter.mark(t, "grads")
        slots.append([t, t])


class _Device:
    """What one device (a class's representative) did: FLOPs, communication, memory."""

    def __init__(self, rank: int, kept: bool) -> None:
        self.rank = rank
        from torch.utils.flop_counter import flop_registry  # (imports triton: only when analysing)

        self.meter = _Meter(flop_registry)
        self.buckets = _KeptBuckets(self.meter) if kept else None
        self.saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.is_meta:
            self.meter.mark(t, "activations")
        return t


class _Analysis:
    """The observer of one ``lower`` call (``runtime.context.observe_scope``): one :class:`_Device` per run."""

    def __init__(self, roles: list[str], kept: bool) -> None:
        self.roles = roles  # per argument: the part its tensors are, unless marked otherwise
        self.kept = kept  # the backend analysed for keeps its gradient buckets (``BackendImpl.keeps_buckets``)
        self.devices: dict[int, _Device] = {}
        self.active: _Device | None = None

    def device(self, dev: Any, args: list[list[Any]]) -> Any:
        """The context of device ``dev``'s run on its (owned) blocks ``args``, per argument."""
        d = self.devices[dev.rank] = _Device(dev.rank, self.kept)
        for role, leaves in zip(self.roles, args, strict=True):
            for t in leaves:
                if isinstance(t, torch.Tensor):
                    d.meter.add(t, role)
        return _DeviceRun(self, d)

    def note(self, kind: str, tensors: Any) -> None:
        """The tensors of ``tensors`` are part ``kind`` (``"params"``, ``"grads"``) on the device running;
        ``"buckets"``: each is a gradient bucket just made (kept by a backend that keeps them)."""
        if self.active is None:
            return
        for t in optree.tree_leaves(tensors):
            if isinstance(t, torch.Tensor) and t.is_meta:
                if kind != "buckets":
                    self.active.meter.mark(t, kind)
                elif self.active.buckets is not None:
                    self.active.buckets.take(t)


class _DeviceRun:
    def __init__(self, analysis: _Analysis, d: _Device) -> None:
        self.analysis, self.d = analysis, d

    def __enter__(self) -> None:
        self.analysis.active = self.d
        self.d.saved.__enter__()
        self.d.meter.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.d.meter.__exit__(*exc)
        self.d.saved.__exit__(*exc)
        self.analysis.active = None


class Lowered:
    """A ``shard_map``'d function lowered for its arguments: what every device does, without running it.

    Example:
        >>> lowered = f.lower(w, x)  # doctest: +SKIP
        >>> lowered.cost_analysis()["flops"], lowered.memory_analysis()["peak"]  # doctest: +SKIP
    """

    def __init__(self, name: str, mesh: Mesh, devices: dict[int, _Device], comm: dict[int, Any], out: Any) -> None:
        self.name, self.mesh, self.out = name, mesh, out
        self._devices, self._comm = devices, comm

    def cost_analysis(self, *, device: int | None = None) -> dict[str, Any]:
        """FLOPs per device as run (forward, backward, recomputation, optimiser) and communication per axis
        (payload bytes and calls, as ``fs.comm_stats`` counts them; a collective over several axes is keyed by
        their tuple), of the device with the most FLOPs (then the most bytes), or of ``device`` (a rank).

        Returns:
            ``{"flops": int, "comm_bytes": {axis: int}, "comm_calls": {axis: int}, "device": rank}``.
        """
        rank = self._pick(device, lambda r: (self._devices[r].meter.flops, self._bytes(r)))
        calls: dict[Any, int] = {}
        nbytes: dict[Any, int] = {}
        for (_, axes), (c, b) in self._comm.get(rank, {}).items():
            key = axes.split(",")[0] if "," not in axes else tuple(axes.split(","))
            calls[key] = calls.get(key, 0) + c
            nbytes[key] = nbytes.get(key, 0) + b
        return {
            "flops": int(self._devices[rank].meter.flops),
            "comm_bytes": nbytes,
            "comm_calls": calls,
            "device": rank,
        }

    def comm_rows(self, *, device: int | None = None) -> dict[tuple[str, str], tuple[int, int]]:
        """``fs.comm_stats().rows()`` of one device: ``{(collective, "axis1,axis2"): (calls, bytes)}``."""
        rank = self._pick(device, self._bytes)
        return dict(self._comm.get(rank, {}))

    def memory_analysis(self, *, device: int | None = None) -> dict[str, int]:
        """The peak of live tensor bytes on the device whose peak is largest (or on ``device``) and its parts at
        that time: ``"params"`` (differentiated inputs; where nothing is differentiated, every floating input),
        ``"grads"``, ``"optimizer_state"`` (the other floating inputs of a step that differentiates),
        ``"activations"`` (tensors saved for the backward), ``"temporaries"`` (the rest: the batch, gathered
        weights, buffers in flight)."""
        rank = self._pick(device, lambda r: self._devices[r].meter.peak)
        return self._devices[rank].meter.parts()

    def devices(self) -> list[int]:
        """The ranks that ran: one representative per class of devices."""
        return sorted(self._devices)

    def _bytes(self, rank: int) -> int:
        return sum(b for _, b in self._comm.get(rank, {}).values())

    def _pick(self, device: int | None, key: Callable[[int], Any]) -> int:
        if device is not None:
            if device not in self._devices:  # a device of a class: its representative's figures
                return self._class_rank(device)
            return device
        return max(sorted(self._devices), key=key)

    def _class_rank(self, rank: int) -> int:
        coords = self.mesh.coords_of(rank)
        for r in sorted(self._devices, reverse=True):
            rep = self.mesh.coords_of(r)
            if all(v == 0 or v == coords[a] for a, v in rep.items()):
                return r
        return min(self._devices)

    def __repr__(self) -> str:
        cost, mem = self.cost_analysis(), self.memory_analysis()
        return f"Lowered({self.name}, flops={cost['flops']:,}, peak={mem['peak']:,} bytes, mesh={self.mesh.shape})"


def abstract_args(args: tuple[Any, ...], mesh: Mesh) -> tuple[Any, ...]:
    """``args`` for the abstract twin ``mesh``: each Array as a data-less Array of its shape, dtype and layout,
    each tensor (or ``fs.ShapeDtype``) as a meta tensor."""

    def one(x: Any) -> Any:
        if isinstance(x, Array):  # its blocks cut as device_put cuts them on the twin (meta: shapes only)
            blocks = local_shards(torch.empty(x.shape, dtype=x.dtype, device="meta"), mesh, x.spec)
            return Array(mesh, x.spec, x.shape, x.dtype, blocks, x.owned)  # (owned: donated as the real one would be)
        if isinstance(x, (torch.Tensor, ShapeDtype)):
            return to_meta(x)
        return x

    return optree.tree_map(one, args, is_leaf=is_array)


def lower(
    make: Callable[[Mesh], Callable[..., Any]], mesh: Mesh, name: str, args: tuple[Any, ...], roles: list[str]
) -> Lowered:
    """Run ``make(abstract twin of mesh)(*args)`` on meta tensors, observed device by device."""
    twin = mesh if not mesh.backend_impl.holds_data else make_mesh(mesh.shape, backend="abstract")
    fn = make(twin)
    analysis = _Analysis(roles, mesh.backend_impl.keeps_buckets)  # (the backend of the run analysed)
    with comm_stats() as stats, observe_scope(analysis):
        out = fn(*abstract_args(args, twin))
    comm = {r: stats.rows(device=r) for r in stats.devices()}
    return Lowered(name, twin, analysis.devices, comm, out)


def roles_of(args: tuple[Any, ...]) -> list[str]:
    """Per argument, the part its tensors are unless marked otherwise: ``"params"`` for a floating argument whose
    tree another argument holds a copy of the structure of (an optimiser state's moments: ``(params, state,
    batch)``), other floating ones ``"optimizer_state"`` (params are also marked by the ``value_and_grad`` that
    differentiates them), the rest temporaries (a batch of ids).

    Example:
        >>> w = {"a": torch.ones(2), "b": torch.ones(3)}
        >>> roles_of((w, ({"a": torch.ones(2), "b": torch.ones(3)},), torch.ones(2, dtype=torch.int64)))
        ['params', 'optimizer_state', 'temporaries']
    """
    specs = [optree.tree_structure(a, is_leaf=is_array) for a in args]
    out = []
    for i, a in enumerate(args):
        leaves = optree.tree_leaves(a, is_leaf=is_array)
        if not any(getattr(t, "dtype", torch.int64).is_floating_point for t in leaves):
            out.append("temporaries")
            continue
        mirrored = specs[i].num_leaves > 1 and any(_holds(b, specs[i]) for j, b in enumerate(args) if j != i)
        out.append("params" if mirrored else "optimizer_state")
    return out


def _holds(tree: Any, spec: Any) -> bool:
    """Whether ``tree`` has a subtree of structure ``spec``."""
    found = []

    def match(x: Any) -> bool:
        hit = not is_array(x) and optree.tree_structure(x, is_leaf=is_array) == spec
        if hit:
            found.append(x)
        return hit or is_array(x)

    optree.tree_leaves(tree, is_leaf=match)
    return bool(found)
