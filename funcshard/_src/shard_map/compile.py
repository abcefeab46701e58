"""``shard_map(..., compile=...)``: a device's body recorded once into a graph of torch ops, then compiled.

As ``jax.jit`` does, the body is traced (``make_fx``, at the level of torch's ops) at the first call of each
input signature, while it runs for real: everything Python does around the ops (the varying-axes tracking
with its ``pvary``s, pytrees, spec checks, the optimisers' bookkeeping, ``fs.comm_stats``' counts) happens
then, once, and what remains is one graph of tensor ops, forward, backward and update alike. The dist
backend's collectives are recorded as torch's functional collectives, ops of that graph, so ``torch.compile``
sees the whole step (``fullgraph=True``: no graph break at all) and inductor may overlap communication with
compute. Later calls with the same signature run the compiled graph; the vma tags and communication counts
of the traced call are put back on its outputs and into open ``fs.comm_stats`` blocks.

The recorded graph is a pure function of the tensor arguments: Python state the body reads, or a constant
tensor's value, is frozen at the trace (JAX's rule), except the numbers, strings and flags it reads from
closures and module globals (and those of the user functions it reaches): those are read again at each call,
and a changed one records the body again for the new value (one graph per value; one warning), as dynamo's
guards would. A read of a value that depends on the arguments (``int(x)``, ``x.item()``, ``if x.any():``)
would be frozen wrongly, so it is refused with an error naming the line; value checks that cannot be held in a
graph (the token ids' range) are skipped.

Only the ``"dist"`` backend compiles: simulated devices are threads of one process that meet in Python
(conditions and shared buffers), which a graph of tensor ops cannot hold; under ``"sim"`` the body runs
eagerly, with one warning saying so.

Example:
    >>> # under torchrun --nproc-per-node 2:
    >>> # step = fs.shard_map(step_fn, mesh=mesh, in_specs=..., out_specs=..., compile=True)
    >>> # step = fs.shard_map(step_fn, ..., compile={"backend": "aot_eager"})  # options for torch.compile
"""

from __future__ import annotations

import functools
import os
import threading
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..collectives.vma import set_vma, tags_of
from ..errors import ShardingError
from ..runtime.context import dynamo_tracing, trace_scope
from ..runtime.stats import capture, record

__all__ = ["CompiledBody", "compile_options", "eager_body", "opaque_to_dynamo", "warn_sim"]

_COMPILE_KEYS = ("backend", "mode", "options", "fullgraph", "dynamic")


def compile_options(compile: bool | dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``torch.compile`` options of ``shard_map(compile=...)``, or None for no compilation.

    Raises:
        ShardingError: ``compile`` is neither a bool nor a dict of ``torch.compile`` options.

    Example:
        >>> compile_options(True)
        {'backend': 'inductor', 'fullgraph': True, 'dynamic': False}
        >>> compile_options(False) is None
        True
    """
    if compile is None or compile is False:
        return None
    if compile is True:
        compile = {}
    if not isinstance(compile, dict) or not all(k in _COMPILE_KEYS for k in compile):
        raise ShardingError(
            f"shard_map: compile must be True, False or a dict of torch.compile options (keys among "
            f"{list(_COMPILE_KEYS)}), found {compile!r}; e.g. compile={{'backend': 'aot_eager'}}."
        )
    return {"backend": "inductor", "fullgraph": True, "dynamic": False, **compile}


_warned: set[int] = set()
_warn_lock = threading.Lock()


def warn_sim(name: str, key: int) -> None:
    """Warn once per shard_map function that ``compile=`` is ignored under ``"sim"``."""
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(
        f"{name}: compile= is ignored on a 'sim' mesh, whose body runs eagerly: its simulated devices are threads "
        f"of this process that meet in Python (conditions and shared buffers) at every collective, which a "
        f"compiled graph of tensor ops cannot hold. Under torchrun (backend 'dist') the body is compiled.",
        UserWarning,
        stacklevel=3,
    )


def eager_body(f: Callable[..., Any], name: str, check_vma: bool) -> Callable[..., Any]:
    """``f``, or where ``f`` is ``torch.compile``'d and ``check_vma`` is on, the function it wraps (one warning).

    Dynamo cannot trace a body under the varying-axes tracking (the tags it keeps on tensors and the mode that
    reads them: an ``InternalTorchDynamoError`` at the first op), so such a body runs eagerly; the warning names
    ``shard_map(..., compile=...)``, which compiles a device's body with its collectives and tracking.

    Example:
        >>> body = lambda x: x + 1
        >>> eager_body(body, "shard_map(f)", True) is body
        True
    """
    inner = f
    while True:
        if isinstance(inner, torch.nn.Module) and hasattr(inner, "_orig_mod"):  # torch.compile(module)
            inner = inner._orig_mod
        elif callable(getattr(inner, "_torchdynamo_orig_callable", None)):  # torch.compile(function)
            inner = inner._torchdynamo_orig_callable  # type: ignore[union-attr]
        else:
            break
    if inner is f or not check_vma:
        return f
    warnings.warn(
        f"{name}: its function is torch.compile'd, which cannot trace check_vma's tracking of the varying axes "
        f"(tags on the tensors), so it runs eagerly. To compile a device's body, pass "
        f"shard_map(..., compile=True) (or a dict of torch.compile options): under torchrun it is recorded with "
        f"its collectives and tracking into one graph and compiled; or pass check_vma=False (write fs.pvary).",
        UserWarning,
        stacklevel=3,
    )
    return inner


#: the frame evaluation hook torch.compile installs while a compiled frame runs (None: none), where torch has it
_frame_hook: Callable[[], Any] | None = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "get_eval_frame_callback", None
)


def opaque_to_dynamo(mapped: Callable[..., Any], name: str, tell: bool = False) -> Callable[..., Any]:
    """``mapped`` (a shard_map'd function) run eagerly where ``torch.compile`` meets it: a graph break there
    (``fullgraph=True`` raises, naming ``compile=``) instead of dynamo tracing the devices' threads, pytrees and
    tags, which it cannot (an internal error). Called eagerly with no compiled frame running, ``mapped`` is called
    directly (``disable``'s wrapper would switch off, and back on, a hook that is not there). ``tell``: the first
    time ``torch.compile`` meets it, warn that its body runs eagerly and that ``compile=True`` compiles it (a dist
    mesh without ``compile=``).

    Example:
        >>> g = opaque_to_dynamo(lambda x: x, "shard_map(f)")
        >>> g(3)
        3
    """
    disable = getattr(torch.compiler, "disable", None)
    if disable is None:  # (an old torch: no torch.compiler)
        return mapped
    reason = (
        f"{name} runs eagerly under torch.compile (its devices, pytrees and tags are not traceable); "
        f"shard_map(..., compile=True) compiles a device's body"
    )
    told: list[bool] = [] if tell else [True]

    def say() -> None:
        told.append(True)
        warnings.warn(
            f"{name}: torch.compile runs it eagerly (a graph break: its devices, pytrees and tags are not "
            f"traceable by dynamo). shard_map(..., compile=True) records and compiles its body, collectives "
            f"included.",
            UserWarning,
            stacklevel=4,
        )

    try:
        off, say = disable(mapped, reason=reason), disable(say, reason=reason)
    except TypeError:  # (a torch whose disable takes no reason)
        off, say = disable(mapped), disable(say)

    @functools.wraps(mapped)
    def call(*args: Any) -> Any:  # (torch.compile(off) itself would unwrap off to mapped and trace it)
        if dynamo_tracing():  # (dynamo takes this branch as a constant: it never sees the hook's read below)
            if not told:
                say()
            return off(*args)
        if _frame_hook is not None and _frame_hook() is None:
            # eager, no torch.compile'd frame around the call: no frame evaluation hook for off to switch off
            return mapped(*args)
        return off(*args)

    call.__wrapped__ = getattr(mapped, "__wrapped__", mapped)  # type: ignore[attr-defined]  # (the user's f)
    return call


def _hashable(v: Any) -> Any:
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return (type(v), v)


def _signature(body: Any, leaves: list[list[Any]]) -> tuple[Any, ...]:
    """What a recorded graph is specific to: the arguments' structure, layouts and tensor metadata, the other
    leaves' values, and the grad mode."""
    inputs = body.inputs
    metas = tuple(
        (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)
        if isinstance(t, torch.Tensor)
        else _hashable(t)
        for arg in leaves
        for t in arg
    )
    donated = None if inputs.donated is None else tuple(map(tuple, inputs.donated))
    specs = tuple(map(tuple, inputs.specs))
    layouts = tuple(map(tuple, inputs.layouts))
    return (tuple(inputs.treedefs), specs, layouts, donated, metas, torch.is_grad_enabled())


def _mutated_inputs(gm: torch.fx.GraphModule) -> set[int]:
    """The positions of the placeholders the graph writes to (in place, directly or through a view)."""
    owner: dict[torch.fx.Node, int] = {}
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        owner[node] = i
    written: set[int] = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for arg_schema, arg in zip(schema.arguments, node.args, strict=False):
            info = arg_schema.alias_info
            if info is not None and info.is_write and isinstance(arg, torch.fx.Node) and arg in owner:
                written.add(owner[arg])
        ret = schema.returns[0].alias_info if schema.returns else None
        if ret is not None and node.args and isinstance(node.args[0], torch.fx.Node) and node.args[0] in owner:
            owner[node] = owner[node.args[0]]  # a view of an argument: writing to it writes the argument
    return written


_SCALARS = (bool, int, float, complex, str, type(None))
_LIBRARY_DIRS: list[str] = []  # torch's, optree's, the standard library's and funcshard's own folders


def _library(code: Any) -> bool:
    """Whether ``code`` is a library's (whose globals are its own business, not the user's values)."""
    if not _LIBRARY_DIRS:
        import sysconfig

        import optree

        dirs = [_HERE, os.path.dirname(torch.__file__), os.path.dirname(optree.__file__)]
        dirs.append(sysconfig.get_paths()["stdlib"])
        _LIBRARY_DIRS.extend(os.path.join(d, "") for d in dirs)
    return code.co_filename.startswith(tuple(_LIBRARY_DIRS))


_EMPTY = object()  # an empty closure cell / a global gone


def _watched(v: Any) -> bool:
    """A value a recording would freeze that is cheap to compare: a number, string, flag or None, a short tuple of
    them, or a tensor (by identity: one rebound to another tensor is a new constant of the graph)."""
    return (
        isinstance(v, _SCALARS)
        or isinstance(v, torch.Tensor)
        or (isinstance(v, tuple) and len(v) <= 16 and all(isinstance(x, _SCALARS) for x in v))
    )


def _frozen(v: Any) -> Any:
    """``v`` as a part of a signature (a tensor by identity: its ``==`` is elementwise)."""
    return ("tensor", id(v)) if isinstance(v, torch.Tensor) else _hashable(v)


def _codes(code: Any) -> Any:
    """``code`` and the code objects nested in it (comprehensions, inner functions): the names they read."""
    yield code
    for c in code.co_consts:
        if hasattr(c, "co_names"):
            yield from _codes(c)


def _cell_reader(cell: Any) -> Callable[[], Any]:
    def read() -> Any:
        try:
            return cell.cell_contents
        except ValueError:
            return _EMPTY

    return read


def python_values(fn: Any, depth: int = 4) -> list[tuple[str, Callable[[], Any]]]:
    """The Python values ``fn`` reads that a recording would freeze: the numbers, strings, None (and tuples of them)
    and tensors (by identity) in its closure cells and in the module globals it names, and in those of the functions
    it reaches the same way (``depth`` deep; library functions not entered). Each as ``(name, read)``: ``read()``
    gives the value now, so a later call can tell that one changed (``dynamo``'s guards, for the common case of a
    learning rate or a flag reassigned between steps).

    Example:
        >>> lr = 0.1
        >>> [name.split()[0] for name, _ in python_values(lambda g: g * lr)]
        ['lr']
    """
    found: list[tuple[str, Callable[[], Any]]] = []
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = [(fn, depth)]
    while todo:
        g, left = todo.pop()
        if isinstance(g, functools.partial):
            todo.extend((a, left) for a in (g.func, *g.args, *g.keywords.values()) if callable(a))
            for i, a in enumerate(g.args):
                if _watched(a):
                    found.append((f"{getattr(g.func, '__name__', 'partial')} argument {i}", lambda a=a: a))
            continue
        code = getattr(g, "__code__", None)
        if code is None:  # fs.value_and_grad's and functools.wraps' wrappers, bound methods: what they call
            inner = getattr(g, "__wrapped__", None) or getattr(g, "__func__", None)
            if inner is not None and left > 0:
                todo.append((inner, left))
            continue
        if id(g) in seen or left <= 0:
            continue
        seen.add(id(g))
        if _library(code):
            continue
        where = getattr(g, "__qualname__", "f")
        for name, cell in zip(code.co_freevars, getattr(g, "__closure__", None) or (), strict=False):
            read = _cell_reader(cell)
            v = read()
            if _watched(v):
                found.append((f"{name} (closed over by {where})", read))
            elif callable(v):
                todo.append((v, left - 1))
        space = getattr(g, "__globals__", {})
        for c in _codes(code):
            for name in c.co_names:
                v = space.get(name, _EMPTY)
                if v is _EMPTY:
                    continue
                if _watched(v):
                    found.append(
                        (f"{name} (a global of {where})", lambda space=space, name=name: space.get(name, _EMPTY))
                    )
                elif callable(v) and not isinstance(v, type):
                    todo.append((v, left - 1))
    return found


#: called with each recorded graph (after :func:`sink_waits`), before it is compiled (a test's window; None: nothing)
recorded_hook: Callable[[torch.fx.GraphModule], None] | None = None


def _is_wait(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops._c10d_functional.wait_tensor.default


def _writes(node: torch.fx.Node) -> bool:
    """Whether the op of ``node`` writes into one of its arguments (an in-place op, a ``copy_``)."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and any(
        a.alias_info is not None and a.alias_info.is_write for a in getattr(schema, "arguments", ())
    )


def sink_waits(gm: torch.fx.GraphModule) -> int:
    """Move each collective's ``wait_tensor`` down to just before the first node that uses its result, so
    the collective travels while the ops in between compute (the recording puts every wait right after its
    collective: ``make_fx`` waits at once, and inductor does not reorder communication on its own). A wait is
    never moved past a node that writes into a tensor in place (such a write could touch the collective's
    buffers). Returns how many waits moved.

    Example:
        >>> # all_reduce(g1); wait(g1); mm(...); use(g1)  ->  all_reduce(g1); mm(...); wait(g1); use(g1)
    """
    moved = 0
    for node in [n for n in gm.graph.nodes if _is_wait(n)]:
        users = set(node.users)
        stop = node.next
        while stop.op != "output" and stop not in users and not _writes(stop):
            stop = stop.next
        if stop is not node.next:
            stop.prepend(node)  # the wait now runs right before its first user (or the write, or the end)
            moved += 1
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved


_HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the funcshard package
_OWN_FILES = {os.path.join(_HERE, "_src", "collectives", "vma.py"), os.path.abspath(__file__)}


def _value_read(name: str, err: RuntimeError) -> ShardingError:
    """The error for a body that reads, in Python, the value of a tensor computed from its arguments (make_fx
    refuses it), naming the line: the innermost frame outside torch and funcshard's vma mode."""
    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if f"{os.sep}torch{os.sep}" not in f.filename and f.filename not in _OWN_FILES
    ]
    where = f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else "(unknown line)"
    return ShardingError(
        f"{name} (compile=...): the body reads the value of a tensor computed from its arguments in Python "
        f"(int(x), float(x), x.item(), bool(x), an if on a tensor) at {where}. A compiled body is recorded "
        f"once, so that value would be frozen at the first call's. Keep it a tensor (torch.where instead of an "
        f"if), or drop compile= for this function."
    )


class _Graph:
    """One recorded and compiled body: how to call it and how to rebuild its outputs."""

    def __init__(
        self,
        fn: Callable[..., Any],
        out_def: Any,
        out_leaves: list[Any],
        tags: list[frozenset[str] | None],
        comm: list[tuple[int, str, tuple[str, ...], int]],
        copy: set[int],
    ) -> None:
        self.fn, self.out_def, self.comm = fn, out_def, comm
        self.template = [None if isinstance(t, torch.Tensor) else t for t in out_leaves]
        self.tags = tags
        self.copy = copy  # positions of tensor arguments the graph writes to but the caller did not donate

    def __call__(self, tensors: list[torch.Tensor]) -> tuple[list[Any], Any]:
        if self.copy:
            tensors = [t.clone() if i in self.copy else t for i, t in enumerate(tensors)]
        outs = iter(self.fn(*tensors))
        leaves = []
        for t, tag in zip(self.template, self.tags, strict=True):
            if t is None:
                t = next(outs)
                if tag:
                    set_vma(t, tag)
            leaves.append(t)
        for r in self.comm:
            record(*r)
        return leaves, self.out_def


class CompiledBody:
    """The compiled graphs of one ``shard_map`` function, one per input signature (see the module docstring)."""

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        self.name, self.options = name, options
        self.graphs: dict[tuple[Any, ...], _Graph] = {}
        self.values: list[tuple[str, Callable[[], Any]]] | None = None  # the Python values a recording freezes
        self.warned = False

    def run(self, body: Any, dev: Any, leaves: list[list[Any]]) -> tuple[list[Any], Any]:
        """``body`` on this device's ``leaves``: recorded (and run) at a new signature, else the compiled graph."""
        if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for arg in leaves for t in arg
        ):
            raise ShardingError(
                f"{self.name} (compile=...): an argument requires grad, but a compiled body is not differentiated "
                f"from outside the shard_map. Take the gradients inside the body (fs.value_and_grad, as a train "
                f"step does), pass detached values, or drop compile=."
            )
        if self.values is None:
            self.values = python_values(body.f)
        frozen = tuple(_frozen(read()) for _, read in self.values)
        key = (_signature(body, leaves), frozen)
        graph = self.graphs.get(key)
        if graph is None:
            self._changed(key)
            result, self.graphs[key] = self._trace(body, dev, leaves)
            return result
        return graph([t for arg in leaves for t in arg if isinstance(t, torch.Tensor)])

    def _changed(self, key: tuple[Any, ...]) -> None:
        """Warn once when a graph is recorded again only because a Python value the body reads has changed."""
        same = [k[1] for k in self.graphs if k[0] == key[0]]
        if not same or self.warned or self.values is None:
            return
        names = [name for (name, _), now, was in zip(self.values, key[1], same[0], strict=True) if now != was]
        self.warned = True
        warnings.warn(
            f"{self.name} (compile=...): the body reads {', '.join(names)}, whose value changed since it was "
            f"recorded, so it is recorded (and compiled) again, once per value; a value that changes every step "
            f"is better passed as a tensor argument (recorded once).",
            UserWarning,
            stacklevel=6,
        )

    def _trace(self, body: Any, dev: Any, leaves: list[list[Any]]) -> tuple[tuple[list[Any], Any], _Graph]:
        from torch.fx.experimental.proxy_tensor import make_fx

        owned = body.own(leaves)  # the traced run writes into its own copies, as an eager call would
        box: list[tuple[list[Any], Any]] = []

        def flat_body(*tensors: torch.Tensor) -> list[torch.Tensor]:
            it = iter(tensors)
            args = [[next(it) if isinstance(t, torch.Tensor) else t for t in arg] for arg in owned]
            out_leaves, out_def = body.run(dev, args)
            box.append((out_leaves, out_def))
            return [t for t in out_leaves if isinstance(t, torch.Tensor)]

        tensors = [t for arg in owned for t in arg if isinstance(t, torch.Tensor)]
        try:
            with trace_scope(), capture() as comm:
                gm = make_fx(flat_body, tracing_mode="real")(*tensors)
        except RuntimeError as e:
            if "_local_scalar_dense" in str(e):
                raise _value_read(self.name, e) from None
            raise
        out_leaves, out_def = box[-1]
        donated = [False] * len(tensors)
        if body.inputs.donated is not None:
            flags = zip(leaves, body.inputs.donated, strict=True)
            donated = [d for arg, ds in flags for t, d in zip(arg, ds, strict=True) if isinstance(t, torch.Tensor)]
        copy = {i for i in _mutated_inputs(gm) if not donated[i]}
        sink_waits(gm)  # the gradient reductions (and gathers) overlap the compute after them, as in eager
        if recorded_hook is not None:
            recorded_hook(gm)
        fn = torch.compile(gm, **self.options)
        tags = tags_of(out_leaves)
        return (out_leaves, out_def), _Graph(fn, out_def, list(out_leaves), tags, list(comm), copy)
