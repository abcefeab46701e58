"""AdamW with decoupled weight decay, the arithmetic of ``torch.optim.AdamW``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from .. import pytree
from ..extend import ConfigError, P, is_donated, tags_agree, tracing, transforms_active
from ._base import (
    AdamWState,
    Optimizer,
    PyTree,
    check_count,
    check_like,
    check_nonneg,
    check_state,
    is_array,
    scalar_like,
    tensor_leaves,
    zeros_like,
)
from .schedules import LrSchedule, check_lr, lr_at


def adamw(
    lr: float | LrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    mask: PyTree | Callable[[PyTree], PyTree] = None,
) -> Optimizer:
    """AdamW with decoupled weight decay, the arithmetic of ``torch.optim.AdamW``.

    Per leaf, with ``t`` the step (from 1): ``p *= 1 - lr * wd``; ``m = lerp(m, g, 1 - b1)``;
    ``v = b2 * v + (1 - b2) * g * g``; ``p -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)``.
    Elementwise, so each device updates its own shards with no communication.

    ``update`` of float32 CPU leaves runs torch's fused AdamW kernel (one pass over memory for all of them,
    ``torch.optim.AdamW(fused=True)``'s numbers bit for bit, which round differently from the single-tensor
    path's in a fraction of the elements, by about one unit in the last place);
    ``transform``, other dtypes and devices, and a step recorded into a compiled graph run the single-tensor
    path's ops (``torch.optim.AdamW(foreach=False)``'s numbers).

    Args:
        lr: learning rate, or a schedule of the step count (see :func:`warmup_cosine`).
        b1: first-moment decay, in [0, 1).
        b2: second-moment decay, in [0, 1) (optax's and torch's default 0.999; LLM recipes use 0.95).
        eps: added to the denominator, >= 0.
        weight_decay: decoupled decay coefficient, >= 0.
        mask: where the weight decay applies, as optax's ``adamw(mask=...)``: a tree of bools with the params'
            structure (or a prefix of it: one bool for a subtree), or a function of the params returning one
            (inside ``shard_map`` it gets the local shards); ``False`` leaves are not decayed (norms, biases).
            ``None``: every leaf.

    Returns:
        An :class:`Optimizer` whose state is an :class:`AdamWState`.

    Raises:
        ConfigError: a hyperparameter out of range.

    Example:
        >>> opt = adamw(1e-2, weight_decay=0.1)
        >>> p = {"w": torch.ones(2)}
        >>> p, state = opt.update({"w": torch.ones(2)}, opt.init(p), p)
        >>> p["w"]
        tensor([0.9890, 0.9890])
    """
    fn = "adamw"
    check_lr(fn, lr)
    check_nonneg(fn, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    for k, v in (("b1", b1), ("b2", b2)):
        if not v < 1:
            raise ConfigError(f"{fn}: {k} must be in [0, 1), found {v!r}.")

    if mask is not None and not callable(mask):
        _mask_leaves(mask, None)  # the bools checked now; their fit to the params at each step
    h = _AdamW(lr, b1, b2, eps, weight_decay, mask)
    return Optimizer(h.init, h.transform, h.state_specs, name=fn, apply=h.apply)


#: elements per block of the in-place update (:func:`_chunks`): 1M float32 = 4 MiB per operand, so a block's
#: gradient, moments, parameter and denominator (~20 MiB) stay in the last-level cache through its seven ops.
#: Measured on the 13.2M Llama's AdamW step (2 gloo processes on one 32 MiB-L3 CPU, load 2): 33-34 ms per step
#: at 1M against 36-37 ms at 128K (more, smaller ops) and 35 ms for torch.optim.AdamW; one process: 28.4 vs 33.8
CHUNK = 1 << 20

#: torch's fused AdamW kernel (``torch.optim.AdamW(fused=True)``; None in a torch without it)
_FUSED: Any = getattr(torch, "_fused_adamw_", None)

#: elements of the widest SIMD vector of torch's CPU kernels (AVX-512, float32). The fused kernel updates a
#: tensor's last ``numel % vector`` elements by a scalar path whose second moment rounds differently from its
#: vector path, so each tensor goes over as a body of whole vectors and its tail padded to one vector
#: (:func:`_fused_update`): every element then gets the vector arithmetic, and its numbers do not depend on how
#: the leaf is laid out, cut into rows or sharded
_VEC = 16


#: where the fused kernel runs: the CPU, and meta (an abstract run, which should plan the memory the CPU's uses)
_FUSED_DEVICES = ("cpu", "meta")


def _fusable(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether the fused kernel takes this leaf: float32 moments and parameter, a gradient of any dtype (the
    update converts it to the moments' dtype first: asked the same of the gradient before and after that, so the
    donated and the non-donated update take the same path), all on the CPU, none differentiated (the kernel has
    no derivative, no batching rule)."""
    return (
        _FUSED is not None
        and type(g) is torch.Tensor
        and all(t.device.type in _FUSED_DEVICES and not t.requires_grad for t in (g, m, v, p))
        and m.dtype == v.dtype == p.dtype == torch.float32
        and not transforms_active()
    )


def _quiet(rows: Sequence[Sequence[Any]], hyper: Sequence[Any] = ()) -> bool:
    """Whether the in-place update may run with torch functions off (no vma mode over its ops): not recorded into
    a graph nor under a torch.func transform (the fast-path predicate), and each leaf's operands (``rows``: the
    gradients, moments and parameters, lists in leaf order; leaf ``i`` is their ``i``-th entries) tagged with one
    set of axes, leaves possibly with different ones, every tensor among the ``hyper``-parameters (lr, step size,
    bias correction) with one tag within each leaf's, none requiring grad (:func:`funcshard.extend.tags_agree`).
    Then the mode would change nothing: each leaf's update mixes only its own operands and the hyper-parameters,
    writes only into those leaves (their tags stay) and its temporaries (views, blocks, padding, the step count)
    never leave it; it would only tag them, ~500 Python calls a step of the 13.2M Llama's 75 leaf rows (dp), ~300
    torch functions under tp. The numbers are the same."""
    return not tracing() and not transforms_active() and tags_agree(zip(*rows, strict=True), hyper)


def _mask_leaves(mask: PyTree, params: PyTree) -> list[bool]:
    """``mask``'s bools, one per leaf of ``params`` (``mask`` a prefix of it), or its own leaves (``params`` None).

    Raises:
        ConfigError: a leaf of ``mask`` is not a bool.
        ShardingError: ``mask`` is not a prefix of ``params``.
    """
    is_bool = lambda x: isinstance(x, bool)  # noqa: E731
    if params is None:
        leaves = optree.tree_leaves(mask, is_leaf=is_bool)
    else:
        leaves = pytree.broadcast_prefix(mask, params, prefix_is_leaf=is_bool, what="mask", where="adamw: ")
    for x in leaves:
        if not isinstance(x, bool):
            raise ConfigError(
                f"adamw: mask leaves must be bools (True: decay this leaf), found {type(x).__name__} {x!r}; e.g. "
                f"mask=lambda p: {{k: v.dim() > 1 for k, v in p.items()}}."
            )
    return leaves


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t``."""
    return t.clone(memory_format=torch.contiguous_format)


def _fused_update(
    leaves: list[tuple[torch.Tensor, ...]], lr: float, b1: float, b2: float, eps: float, wd: float, step: int
) -> None:
    """The AdamW step of ``leaves`` (``(g, m, v, p)`` each, :func:`_fusable`) in place, by one call of torch's
    fused kernel on all of them (``torch.optim.AdamW(fused=True)``'s arithmetic): one pass over each leaf's
    memory where the op-by-op path makes seven.

    The kernel reads each operand as contiguous memory: a strided gradient (a stacked leaf's, a view of the
    layers' bucket buffer) goes over by rows, each contiguous (or as a contiguous copy where its rows are not),
    a non-contiguous moment or parameter as a contiguous copy written back. Each piece goes over as its body of
    whole SIMD vectors (:data:`_VEC`) and, where there is one, its tail copied into a zero-padded vector of its
    own, so every element gets the kernel's vector arithmetic (zeros update to zeros)."""
    pieces: list[list[torch.Tensor]] = [[], [], [], []]  # p, g, m, v
    back: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, source), written back after the kernel

    def add(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, p: torch.Tensor) -> None:
        flat = [t.view(-1) for t in (p, g, m, v)]
        n = flat[0].numel()
        body = n - n % _VEC
        if body:
            for out, t in zip(pieces, flat, strict=True):
                out.append(t if body == n else t[:body])
        if body < n:  # [n % VEC] -> [VEC], zero-padded
            pad = [torch.zeros(_VEC, dtype=t.dtype, device=t.device) for t in flat]
            for q, t, out in zip(pad, flat, pieces, strict=True):
                q[: n - body].copy_(t[body:])
                out.append(q)
            back.extend((flat[k][body:], pad[k][: n - body]) for k in (0, 2, 3))

    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for g, m, v, p in leaves:
        own = []
        for t in (m, v, p):
            if not t.is_contiguous():
                copies.append((t, t.contiguous()))
                t = copies[-1][1]
            own.append(t)
        m, v, p = own
        if g.is_contiguous():
            add(g, m, v, p)
        elif g.dim() > 1 and g[0].is_contiguous():  # [n, *s] -> n x [*s], each contiguous: rows of the layers' buffer
            for row in zip(g.unbind(0), m.unbind(0), v.unbind(0), p.unbind(0), strict=True):
                add(*row)
        else:
            add(g.contiguous(), m, v, p)
    if pieces[0]:
        ps, gs, ms, vs = pieces
        if ps[0].is_meta:  # an abstract run (shapes only): the step count and a scheduled lr have no value either
            t = torch.empty((), dtype=torch.float32, device="meta")
            lr = 0.0 if isinstance(lr, torch.Tensor) else lr  # (the kernel's tensor-lr form has no meta kernel)
        else:
            t = torch.tensor(float(step), dtype=torch.float32)  # the step count, as AdamW(fused=True) keeps it
        _FUSED(ps, gs, ms, vs, [], [t] * len(ps), lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
               amsgrad=False, maximize=False)  # fmt: skip
    for dst, src in back + copies:
        dst.copy_(src)


def _fused_op(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    lr: torch.Tensor,
    step: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """:func:`_fused_update` as one op of a recorded graph (``shard_map(..., compile=...)``): declared to write
    into ``params``, ``exp_avgs`` and ``exp_avg_sqs``, so the compiler keeps it in place on the step's donated
    buffers (one pass of the fused kernel) instead of the op-by-op update writing fresh buffers. ``lr`` and
    ``step`` come as tensors (a schedule's lr and the step count stay tensors in a recorded step)."""
    leaves = list(zip(grads, exp_avgs, exp_avg_sqs, params, strict=True))
    _fused_update(leaves, float(lr), beta1, beta2, eps, weight_decay, int(step))


_FUSED_OP: Any = None


def _fused_in_graph() -> Any:
    """The op of :func:`_fused_op` (``funcshard::adamw_fused_``), registered at its first use."""
    global _FUSED_OP
    if _FUSED_OP is None:
        op = torch.library.custom_op(
            "funcshard::adamw_fused_",
            _fused_op,
            mutates_args=("params", "exp_avgs", "exp_avg_sqs"),
            schema="(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
            "Tensor lr, Tensor step, float beta1, float beta2, float eps, float weight_decay) -> ()",
        )
        op.register_fake(lambda *args: None)
        _FUSED_OP = op
    return _FUSED_OP


def _chunks(n: int, *ts: torch.Tensor) -> Any:
    """``ts`` (same shape) cut into matching blocks of about ``n`` elements (views), or ``(ts,)`` itself where
    that is one block or ``n`` is 0. Contiguous: flat blocks of ``n``; else (a stacked leaf's gradient as a
    strided view of the layers' bucket buffer) blocks of whole rows of dim 0, as even as they come. The update
    is elementwise, so its numbers do not depend on the cut; block by block, each op reads its operands from
    cache instead of memory (a whole-leaf op streams a stacked ``[layers, ...]`` leaf through memory seven
    times)."""
    numel = ts[0].numel()
    if n <= 0 or numel <= n:
        return (ts,)
    if all(t.is_contiguous() for t in ts):
        return zip(*(t.view(-1).split(n) for t in ts), strict=True)
    rows = ts[0].shape[0] if ts[0].dim() else 1
    blocks = min(rows, -(-numel // n))  # ceil(numel / n) blocks of whole rows, at most one row each
    if blocks <= 1:
        return (ts,)
    per = -(-rows // blocks)
    return zip(*(t.split(per) for t in ts), strict=True)  # [rows, *s] -> k x [<= per, *s]


def _addcdiv(
    p: torch.Tensor, m: torch.Tensor, d: torch.Tensor, value: float | torch.Tensor, in_place: bool = False
) -> torch.Tensor:
    """``p + value * m / d`` (in place with ``in_place``); ``value`` a number, or a 0-dim tensor in a compiled step."""
    if isinstance(value, torch.Tensor):
        upd = torch.div(m, d).mul_(value)  # addcdiv's order: value * (m / d)
        return p.add_(upd) if in_place else p + upd
    return p.addcdiv_(m, d, value=value) if in_place else torch.addcdiv(p, m, d, value=value)


class _AdamW:
    """The hyperparameters of one :func:`adamw` and its pure functions."""

    def __init__(
        self, lr: float | LrSchedule, b1: float, b2: float, eps: float, weight_decay: float, mask: Any = None
    ) -> None:
        self.lr, self.b1, self.b2, self.eps, self.wd, self.mask = lr, b1, b2, eps, weight_decay, mask

    def _wds(self, params: PyTree, n: int) -> list[float]:
        """The weight decay of each of the ``n`` leaves: ``wd``, or 0 where the mask says False."""
        if self.mask is None or self.wd == 0:
            return [self.wd] * n
        mask = self.mask(params) if callable(self.mask) else self.mask
        return [self.wd if m else 0.0 for m in _mask_leaves(mask, params)]

    def init(self, params: PyTree) -> AdamWState:
        mu = optree.tree_map(lambda x: zeros_like(x, "adamw"), params, is_leaf=is_array)
        nu = optree.tree_map(lambda x: zeros_like(x, "adamw"), params, is_leaf=is_array)
        return AdamWState(scalar_like(params, 0, torch.int64), mu, nu)

    def _checked(self, grads: PyTree, state: Any, params: PyTree, where: str) -> tuple[Any, ...]:
        """The leaves of grads, moments and params, checked, and this step's lr, step size and bias correction."""
        b1, b2 = self.b1, self.b2
        check_state(where, state, AdamWState)
        count = check_count(where, state.count, read=not tracing())  # compiled: it stays a tensor
        step = count + 1 if isinstance(count, int) else (count + 1).to(torch.float64)
        g_leaves, _ = tensor_leaves(where, "grads", grads)
        m_leaves = check_like(where, "state.mu", state.mu, grads, "grads")
        v_leaves = check_like(where, "state.nu", state.nu, grads, "grads")
        p_leaves = check_like(where, "params", params, grads, "grads") if params is not None else None
        if p_leaves is None and self.wd != 0:
            raise ConfigError(f"{where}: weight_decay={self.wd} needs the params; pass them as third argument.")
        lr_t = lr_at(where, self.lr, state.count)
        step_size, bc2_sqrt = lr_t / (1 - b1**step), (1 - b2**step) ** 0.5
        wds = self._wds(params, len(g_leaves))
        return g_leaves, m_leaves, v_leaves, p_leaves, lr_t, step_size, bc2_sqrt, wds

    def moments(
        self, grads: PyTree, state: Any, params: PyTree, where: str, checked: tuple[Any, ...] | None = None
    ) -> tuple[Any, ...]:
        """The new moments, the denominators and the step size (shared by transform and apply); ``checked``:
        ``_checked``'s result where the caller has it already."""
        b1, b2 = self.b1, self.b2
        if checked is None:
            checked = self._checked(grads, state, params, where)
        g_leaves, m_leaves, v_leaves, p_leaves, lr_t, step_size, bc2_sqrt, wds = checked
        ms, vs, dens = [], [], []
        for g, m, v in zip(g_leaves, m_leaves, v_leaves, strict=True):
            g = g if g.dtype == m.dtype else g.to(m.dtype)  # a low-precision gradient meets float32 moments
            m = torch.lerp(m, g, 1 - b1)  # first moment
            v = v.mul(b2).addcmul(g, g, value=1 - b2)  # second moment
            ms.append(m)
            vs.append(v)
            dens.append(v.sqrt() / bc2_sqrt + self.eps)
        treedef = optree.tree_structure(grads)
        new_state = AdamWState(state.count + 1, optree.tree_unflatten(treedef, ms), optree.tree_unflatten(treedef, vs))
        return treedef, p_leaves, lr_t, step_size, ms, dens, new_state, wds

    def transform(self, grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, AdamWState]:
        treedef, p_leaves, lr_t, step_size, ms, dens, new_state, wds = self.moments(grads, state, params, "adamw")
        ups = []
        for k, (m, d) in enumerate(zip(ms, dens, strict=True)):
            if wds[k] != 0:
                ups.append(_addcdiv(p_leaves[k] * -(lr_t * wds[k]), m, d, -step_size))
            else:
                ups.append(torch.div(m, d).mul(-step_size))
        return optree.tree_unflatten(treedef, ups), new_state

    def apply(self, grads: PyTree, state: Any, params: PyTree) -> tuple[PyTree, AdamWState]:
        if isinstance(state, AdamWState) and is_donated(
            *optree.tree_leaves(params), *optree.tree_leaves(state.mu), *optree.tree_leaves(state.nu)
        ):
            return self._apply_in_place(grads, state, params)
        checked = None
        if not tracing() and not torch.compiler.is_compiling() and _FUSED is not None:
            # the donated step's arithmetic on copies (the fused kernel's numbers, donated or not)
            checked = self._checked(grads, state, params, "adamw.update")
            g_leaves, m_leaves, v_leaves, p_leaves = checked[:4]
            if any(_fusable(*leaf) for leaf in zip(g_leaves, m_leaves, v_leaves, p_leaves, strict=True)):
                mu, nu, new = ([_copy(t) for t in leaves] for leaves in (m_leaves, v_leaves, p_leaves))
                self._update_in_place(g_leaves, mu, nu, new, *checked[4:], state.count)
                treedef = optree.tree_structure(grads, is_leaf=is_array)  # (checked: that of mu, nu and params)
                mu, nu, new = (optree.tree_unflatten(treedef, leaves) for leaves in (mu, nu, new))
                return new, AdamWState(state.count + 1, mu, nu)
        treedef, p_leaves, lr_t, step_size, ms, dens, new_state, wds = self.moments(
            grads, state, params, "adamw.update", checked
        )
        new = []
        for p, m, d, wd in zip(p_leaves, ms, dens, wds, strict=True):
            if wd != 0:
                p = p * (1 - lr_t * wd)  # decoupled weight decay
            new.append(_addcdiv(p, m, d, -step_size))
        return optree.tree_unflatten(treedef, new), new_state

    def _apply_in_place(self, grads: PyTree, state: Any, params: PyTree) -> tuple[PyTree, AdamWState]:
        """:meth:`apply` writing into params and moments donated to the running shard_map (``donate=``): the
        same ops, in place, one block of :data:`CHUNK` elements of a leaf at a time (the numbers do not depend on
        the cut; the block's operands stay in cache), so the step holds one copy of the state (and one block's
        denominator) instead of two."""
        checked = self._checked(grads, state, params, "adamw.update")
        self._update_in_place(*checked, state.count)
        return params, AdamWState(state.count + 1, state.mu, state.nu)

    def _update_in_place(
        self,
        g_leaves: list[torch.Tensor],
        m_leaves: list[torch.Tensor],
        v_leaves: list[torch.Tensor],
        p_leaves: list[torch.Tensor],
        lr_t: Any,
        step_size: Any,
        bc2_sqrt: Any,
        wds: list[float],
        count: torch.Tensor,
    ) -> None:
        """The update of :meth:`_apply_in_place` on checked leaves (``_checked``'s), written into the moments'
        and parameters' leaves: the fused kernel's leaves in one call, the others block by block. With each leaf's
        operands tagged alike (:func:`_quiet`), torch functions are off meanwhile."""
        traced = tracing()
        chunk = 0 if traced else CHUNK
        quiet = _quiet((g_leaves, m_leaves, v_leaves, p_leaves), (lr_t, step_size, bc2_sqrt))
        with torch._C.DisableTorchFunction() if quiet else contextlib.nullcontext():
            b1, b2 = self.b1, self.b2
            fused: dict[float, list[tuple[torch.Tensor, ...]]] = {}  # the fused kernel's leaves by weight decay
            for g, m, v, p, wd in zip(g_leaves, m_leaves, v_leaves, p_leaves, wds, strict=True):
                g = g if g.dtype == m.dtype else g.to(m.dtype)
                if (chunk or traced) and _fusable(g, m, v, p):
                    fused.setdefault(wd, []).append((g, m, v, p))
                    continue
                for g_, m_, v_, p_ in _chunks(chunk, g, m, v, p):
                    m_.lerp_(g_, 1 - b1)  # first moment
                    v_.mul_(b2).addcmul_(g_, g_, value=1 - b2)  # second moment
                    den = v_.sqrt().div_(bc2_sqrt).add_(self.eps)
                    if wd != 0:
                        p_.mul_(1 - lr_t * wd)  # decoupled weight decay
                    _addcdiv(p_, m_, den, -step_size, in_place=True)
            if fused and traced:  # one op of the graph, in place (the count and a schedule's lr: tensors)
                lr = lr_t if isinstance(lr_t, torch.Tensor) else torch.tensor(lr_t, dtype=torch.float64)
                with torch._C.DisableTorchFunction():  # no vma tags: the op returns nothing, writes its operands
                    for wd, leaves in fused.items():
                        gs, ms, vs, ps = (list(t) for t in zip(*leaves, strict=True))
                        _fused_in_graph()(ps, gs, ms, vs, lr, count + 1, b1, b2, self.eps, wd)
            elif fused:
                step = 1 if count.is_meta else int(count) + 1  # read: not tracing (meta: an abstract run)
                for wd, leaves in fused.items():  # one call per weight decay (two at most: masked and not)
                    _fused_update(leaves, lr_t, b1, b2, self.eps, wd, step)

    def state_specs(self, param_specs: PyTree) -> AdamWState:
        return AdamWState(P(), param_specs, param_specs)
