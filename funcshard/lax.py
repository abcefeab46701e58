"""Collectives over named mesh axes, for use inside ``shard_map``. Each has the transpose as backward.

| collective | forward | backward |
|---|---|---|
| ``psum`` / ``pmean`` | all-reduce sum / mean | identity (``pvary``) |
| ``pmax`` / ``pmin`` | all-reduce max / min | to the device(s) holding the extreme |
| ``pvary`` | identity | psum |
| ``all_gather`` | all-gather | psum_scatter |
| ``psum_scatter`` | reduce-scatter | all_gather |
| ``all_to_all`` | all-to-all | all-to-all back |
| ``ppermute`` | send along ``perm`` | send back along the inverse |

``axis`` is a mesh axis name or a tuple of names (their product, major to minor). Pytrees are accepted.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> mesh = fs.make_mesh({"tp": 4}, backend="sim")
    >>> f = fs.shard_map(lambda x: fs.psum(x, "tp"), mesh=mesh, in_specs=(P("tp"),), out_specs=P())
    >>> fs.device_get(f(torch.arange(4.0)))
    tensor([6.])
"""

from ._src.collectives.lax import all_gather as all_gather
from ._src.collectives.lax import all_gather_invariant as all_gather_invariant
from ._src.collectives.lax import all_to_all as all_to_all
from ._src.collectives.lax import axis_index as axis_index
from ._src.collectives.lax import axis_size as axis_size
from ._src.collectives.lax import bucket_bytes as bucket_bytes
from ._src.collectives.lax import pmax as pmax
from ._src.collectives.lax import pmean as pmean
from ._src.collectives.lax import pmin as pmin
from ._src.collectives.lax import ppermute as ppermute
from ._src.collectives.lax import psum as psum
from ._src.collectives.lax import psum_scatter as psum_scatter
from ._src.collectives.lax import pvary as pvary

__all__ = [
    "all_gather",
    "all_gather_invariant",
    "all_to_all",
    "axis_index",
    "axis_size",
    "bucket_bytes",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "pvary",
]
