"""Optimisers as pure transforms of pytrees (optax's design), usable inside ``shard_map``.

An :class:`Optimizer` is three pure functions: ``init(params) -> state``, ``transform(grads, state, params)
-> (updates, state)`` and ``state_specs(param_specs) -> spec tree of the state``, plus ``update(grads, state,
params) -> (params, state)``. Nothing is changed in place; every call returns new trees. Inside ``shard_map``
each device transforms its local shards, and the state is laid out like the params (its leaves take the
params' specs; scalars such as the step count take ``P()``). Given the ``fs.Array``s a training loop keeps,
outside ``shard_map``, ``update`` runs itself in one over their mesh (as optax updates sharded ``jax.Array``s).
The arithmetic mirrors ``torch.optim`` and
``torch.nn.utils.clip_grad_norm_`` operation by operation, so an unsharded run matches them bit for bit.

``clip_by_global_norm`` needs the norm over every shard: each leaf's sum of squares is summed with the others
that are sharded over the same mesh axes (read from the vma tags ``shard_map`` puts on its inputs, or from
``specs=``), then ``psum``-ed over those axes only: one collective per distinct axis set, none over axes a
leaf is replicated on.

Files: ``_base.py`` (:class:`Optimizer`, the states, :func:`apply_updates`), ``_norm.py`` (:func:`global_norm`,
:func:`clip_by_global_norm`), ``_adamw.py``, ``_sgd.py``, ``_chain.py``, ``_multi_steps.py`` (gradient
accumulation), ``schedules.py``.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P, optim
    >>> mesh = fs.make_mesh({"tp": 2}, backend="sim")
    >>> specs = {"w": P("tp", None), "b": P()}
    >>> params = {"w": torch.ones(4, 2), "b": torch.zeros(2)}
    >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3, weight_decay=0.1))
    >>> step = fs.shard_map(opt.update, mesh=mesh, in_specs=(specs, opt.state_specs(specs), specs),
    ...                     out_specs=(specs, opt.state_specs(specs)))
    >>> params, state = step(params, opt.init(params), params)  # the params as their own gradient
    >>> fs.device_get(params["w"]).shape
    torch.Size([4, 2])
"""

from ._adamw import adamw as adamw
from ._base import AdamWState as AdamWState
from ._base import ClipByGlobalNormState as ClipByGlobalNormState
from ._base import Optimizer as Optimizer
from ._base import SgdState as SgdState
from ._base import apply_updates as apply_updates
from ._chain import chain as chain
from ._multi_steps import MultiStepsState as MultiStepsState
from ._multi_steps import multi_steps as multi_steps
from ._norm import clip_by_global_norm as clip_by_global_norm
from ._norm import global_norm as global_norm
from ._sgd import sgd as sgd
from .schedules import LrSchedule as LrSchedule
from .schedules import constant as constant
from .schedules import linear_warmup as linear_warmup
from .schedules import warmup_cosine as warmup_cosine

__all__ = [
    "AdamWState",
    "ClipByGlobalNormState",
    "LrSchedule",
    "MultiStepsState",
    "Optimizer",
    "SgdState",
    "adamw",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "global_norm",
    "linear_warmup",
    "multi_steps",
    "sgd",
    "warmup_cosine",
]
