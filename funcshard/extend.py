"""The one door into funcshard's core, for code that writes its own parallel ops (as ``jax.extend`` is for JAX).

``funcshard.ops``, ``funcshard.models``, ``funcshard.optim``, ``funcshard.pipeline`` and ``funcshard.checkpoint``
reach the core through this module and the public API only (``tests/architecture/test_floors_import_down.py``
checks it). What it holds:

- **Declare and bind.** A collective or a fused op is an autograd Function subclassing :class:`Prim`: its
  ``forward`` / ``setup_context`` / ``backward`` (and, for a collective, ``jvp`` / ``vmap``) once. Apply it with
  :func:`call` (no ``inspect.signature`` per call). An op whose operands and results are tagged is declared as an
  :class:`Op` (a ``Prim`` with a varying-axes rule ``vma``) and applied with :func:`bind`, which reads the operands'
  tags, asks the rule, runs the op and tags its results: no tag bookkeeping around it. An op whose operands enter its
  own collectives (ring attention's k and v) declares them (``Op.varying_operands``, ``Op.agree``): ``bind`` makes
  them varying first (``Pvary``), as for a collective's operand.
  A Function whose operands need no tags (an identity with a hand-made backward, an unstacking node) is a ``Prim``
  applied with :func:`call` as well.
- **May the fast path run?** :func:`transforms_active` is the one predicate: a hand-written fast path (an in-place
  write, a kept buffer, a hand-made autograd node) runs only where it is False; further conditions
  (:func:`tracing`: a body recorded into a graph; grad mode; an operand's flags) are spelled beside it. Beside it,
  :func:`tags_agree` says whether ops that each mix one group of tensors (an optimiser's leaf) may run with the vma
  mode off: where each group's tags agree it would change no tag.
- **Varying axes (vma).** Inside ``shard_map`` each tensor carries the set of mesh axes it varies over. Read it
  with :func:`get_vma` (untagged: invariant), :func:`find_vma` (None where untagged), :func:`known_vma` (what the
  current vma mode knows: None where nothing is; :class:`Audited` where only the sim audit of a
  ``check_vma=False`` call knows) or :func:`official_vma` (what shard_map itself knows); write it on a tensor the
  caller makes outside the vma mode (a received block, a detached copy) with :func:`set_vma`; make a value vary
  over more axes with ``funcshard.lax.pvary``. The tag itself is stored by ``funcshard._src.collectives`` alone:
  nothing else touches the attribute.
- **Point to point.** :func:`p2p` posts a batch of sends and receives over a mesh axis, outside autograd (a
  runtime that does its own backward, as ``pipeline.run``), counted by ``fs.comm_stats``.
- **Device context.** :func:`current` / :func:`maybe_current` (this device's mesh, handle and vma mode),
  :func:`axes_of` (an ``axis`` argument checked against the mesh).
- The public names the library's own subpackages need (``P``, the errors, ``Array``, ``Precision``,
  ``value_and_grad``, ``remat``, ``shard_map``, ...): the same objects as ``funcshard.X``, here because the package
  root imports those subpackages (they cannot import it).

Example:
    A fused op: ``y = x * w`` whose backward sums ``x``'s gradient over ``axis`` (``pvary`` folded in), declared once
    and bound; ``bind`` tags ``y`` as ``pvary`` + ``*`` would.

    >>> import torch, funcshard as fs
    >>> from funcshard import P, extend
    >>> class Scale(extend.Op):
    ...     @staticmethod
    ...     def forward(dev, axes, x, w):
    ...         return (x * w,)
    ...     @staticmethod
    ...     def setup_context(ctx, inputs, output):
    ...         ctx.dev, ctx.axes = inputs[:2]
    ...         ctx.save_for_backward(*inputs[2:])
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         x, w = ctx.saved_tensors  # dx: all-reduced over the axes (x is invariant over them)
    ...         return None, None, extend.call(extend.AllReduce, g * w, ctx.dev, ctx.axes, "sum", "psum"), g * x
    ...     @staticmethod
    ...     def vma(axes, x_axes, w_axes):
    ...         return None if x_axes & axes else x_axes | axes | w_axes
    >>> mesh = fs.make_mesh({"tp": 2}, backend="sim")
    >>> f = fs.shard_map(lambda x, w: extend.bind(Scale, x, w, axis="tp", name="scale")[0],
    ...                  mesh=mesh, in_specs=(P(), P("tp")), out_specs=P("tp"))
    >>> fs.device_get(f(torch.ones(1), torch.tensor([2.0, 3.0])))
    tensor([2., 3.])
"""

from __future__ import annotations

from ._src.arrays.transfers import Array as Array
from ._src.arrays.transfers import device_get as device_get
from ._src.autodiff.grad import has_tangent as has_tangent
from ._src.autodiff.grad import value_and_grad as value_and_grad
from ._src.autodiff.remat import checkpoint_name as checkpoint_name
from ._src.autodiff.remat import current_vma_mode as current_vma_mode
from ._src.autodiff.remat import device_scope as device_scope
from ._src.autodiff.remat import only_grad_transforms as only_grad_transforms
from ._src.autodiff.remat import remat as remat
from ._src.autodiff.remat import remat_policies as remat_policies
from ._src.collectives.lax import all_gather_cast as all_gather_cast
from ._src.collectives.lax import axis_index_int as axis_index_int
from ._src.collectives.lax import psum_owned as psum_owned
from ._src.collectives.lax import psum_pending as psum_pending
from ._src.collectives.lax import pvary_cast as pvary_cast
from ._src.collectives.lax import split_invariant as split_invariant
from ._src.collectives.p2p import p2p as p2p
from ._src.collectives.prims import AllReduce as AllReduce
from ._src.collectives.prims import BucketPool as BucketPool
from ._src.collectives.prims import Ppermute as Ppermute
from ._src.collectives.prims import Prim as Prim
from ._src.collectives.prims import call as call
from ._src.collectives.uneven import block_sizes as block_sizes
from ._src.collectives.vma import Audited as Audited
from ._src.collectives.vma import Op as Op
from ._src.collectives.vma import bind as bind
from ._src.collectives.vma import find_vma as find_vma
from ._src.collectives.vma import get_vma as get_vma
from ._src.collectives.vma import keep_tags as keep_tags
from ._src.collectives.vma import known_vma as known_vma
from ._src.collectives.vma import official_vma as official_vma
from ._src.collectives.vma import one_op as one_op
from ._src.collectives.vma import set_vma as set_vma
from ._src.collectives.vma import settle as settle
from ._src.collectives.vma import tags_agree as tags_agree
from ._src.errors import ConfigError as ConfigError
from ._src.errors import FuncshardError as FuncshardError
from ._src.errors import ShardingError as ShardingError
from ._src.runtime.context import axes_of as axes_of
from ._src.runtime.context import current as current
from ._src.runtime.context import is_donated as is_donated
from ._src.runtime.context import maybe_current as maybe_current
from ._src.runtime.context import observer as observer
from ._src.runtime.context import prefetch_scope as prefetch_scope
from ._src.runtime.context import tracing as tracing
from ._src.runtime.context import transforms_active as transforms_active
from ._src.runtime.context import user_call as user_call
from ._src.runtime.mesh import BackendImpl as BackendImpl
from ._src.runtime.mesh import get_backend as get_backend
from ._src.runtime.stats import capture as capture
from ._src.shard_map.api import shard_map as shard_map
from ._src.tree.precision import Precision as Precision
from ._src.tree.pytree import PyTree as PyTree
from ._src.tree.rules import logical_to_mesh as logical_to_mesh
from ._src.tree.rules import spec_rules as spec_rules
from ._src.tree.spec import P as P
from ._src.tree.spec import check_spec as check_spec
from ._src.tree.spec import is_spec as is_spec
from ._src.tree.spec import shard_shape as shard_shape
from ._src.tree.spec import shard_slices as shard_slices
from ._src.tree.spec import split_sizes as split_sizes

__all__ = [
    "AllReduce",
    "Array",
    "Audited",
    "BackendImpl",
    "BucketPool",
    "ConfigError",
    "FuncshardError",
    "Op",
    "P",
    "Ppermute",
    "Precision",
    "Prim",
    "PyTree",
    "ShardingError",
    "all_gather_cast",
    "axes_of",
    "axis_index_int",
    "bind",
    "block_sizes",
    "call",
    "capture",
    "check_spec",
    "checkpoint_name",
    "current",
    "current_vma_mode",
    "device_get",
    "device_scope",
    "find_vma",
    "get_backend",
    "get_vma",
    "has_tangent",
    "is_donated",
    "is_spec",
    "keep_tags",
    "known_vma",
    "logical_to_mesh",
    "maybe_current",
    "observer",
    "official_vma",
    "one_op",
    "only_grad_transforms",
    "p2p",
    "prefetch_scope",
    "psum_owned",
    "psum_pending",
    "pvary_cast",
    "remat",
    "remat_policies",
    "set_vma",
    "settle",
    "shard_map",
    "shard_shape",
    "shard_slices",
    "spec_rules",
    "split_invariant",
    "split_sizes",
    "tags_agree",
    "tracing",
    "transforms_active",
    "user_call",
    "value_and_grad",
]
