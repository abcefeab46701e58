"""funcshard: JAX-style functional sharding for PyTorch.

Write models as pure functions over parameter pytrees, say how each leaf is laid out over a mesh of named
axes with ``P(...)``, and run per-device code with ``shard_map``; every collective has the right backward,
so gradients are those of the global function. The same code runs in one process (``"sim"``) and under
torchrun (``"dist"``).

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    >>> x = fs.device_put(torch.arange(8.0).reshape(4, 2), mesh, P("dp", "tp"))
    >>> fs.device_get(x).shape
    torch.Size([4, 2])
"""

from . import lax as lax
from . import optim as optim
from . import pipeline as pipeline
from . import pytree as pytree
from . import random as random
from ._src.arrays.dtensor import from_dtensor as from_dtensor
from ._src.arrays.dtensor import to_dtensor as to_dtensor
from ._src.arrays.eval_shape import eval_shape as eval_shape
from ._src.arrays.transfers import Array as Array
from ._src.arrays.transfers import device_get as device_get
from ._src.arrays.transfers import device_put as device_put
from ._src.arrays.transfers import reshard as reshard
from ._src.arrays.visualize import visualize as visualize
from ._src.autodiff.grad import value_and_grad as value_and_grad
from ._src.autodiff.remat import checkpoint_name as checkpoint_name
from ._src.autodiff.remat import remat as remat
from ._src.autodiff.remat import remat_policies as remat_policies
from ._src.collectives.lax import all_gather as all_gather
from ._src.collectives.lax import all_to_all as all_to_all
from ._src.collectives.lax import axis_index as axis_index
from ._src.collectives.lax import axis_size as axis_size
from ._src.collectives.lax import pmax as pmax
from ._src.collectives.lax import pmean as pmean
from ._src.collectives.lax import pmin as pmin
from ._src.collectives.lax import ppermute as ppermute
from ._src.collectives.lax import psum as psum
from ._src.collectives.lax import psum_scatter as psum_scatter
from ._src.collectives.lax import pvary as pvary
from ._src.collectives.lax import ragged_all_to_all as ragged_all_to_all
from ._src.errors import ConfigError as ConfigError
from ._src.errors import FuncshardError as FuncshardError
from ._src.errors import MeshError as MeshError
from ._src.errors import ShardingError as ShardingError
from ._src.runtime.mesh import Mesh as Mesh
from ._src.runtime.mesh import make_mesh as make_mesh
from ._src.runtime.stats import CommStats as CommStats
from ._src.runtime.stats import comm_stats as comm_stats
from ._src.shard_map.api import shard_map as shard_map
from ._src.tree.precision import Precision as Precision
from ._src.tree.pytree import tree_path as tree_path
from ._src.tree.rules import logical_to_mesh as logical_to_mesh
from ._src.tree.rules import spec_rules as spec_rules
from ._src.tree.shapes import ShapeDtype as ShapeDtype
from ._src.tree.spec import P as P

__version__ = "0.1.0"

# Subpackages imported on first use (``fs.ops``, ``fs.checkpoint``, ``fs.models``): all of funcshard is one
# ``import funcshard as fs`` away, without paying for DCP or the Llama at import time.
_LAZY = ("checkpoint", "extend", "models", "ops", "process")


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'funcshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Array",
    "CommStats",
    "ConfigError",
    "FuncshardError",
    "Mesh",
    "MeshError",
    "P",
    "Precision",
    "ShapeDtype",
    "ShardingError",
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "checkpoint",
    "checkpoint_name",
    "comm_stats",
    "device_get",
    "device_put",
    "eval_shape",
    "from_dtensor",
    "lax",
    "logical_to_mesh",
    "make_mesh",
    "models",
    "ops",
    "optim",
    "pipeline",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "pvary",
    "pytree",
    "ragged_all_to_all",
    "random",
    "remat",
    "remat_policies",
    "reshard",
    "shard_map",
    "spec_rules",
    "to_dtensor",
    "tree_path",
    "value_and_grad",
    "visualize",
]
