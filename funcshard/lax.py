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
| ``ragged_all_to_all`` | rows to each peer in counts per peer | the reverse exchange |

``axis`` is a mesh axis name or a tuple of names (their product, major to minor). Pytrees are accepted.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> mesh = fs.make_mesh({"tp": 4}, backend="sim")
    >>> f = fs.shard_map(lambda x: fs.psum(x, "tp"), mesh=mesh, in_specs=(P("tp"),), out_specs=P())
    >>> fs.device_get(f(torch.arange(4.0)))
    tensor([6.])
"""

from ._src.collectives.lax import *  # noqa: F403 (the names its __all__ lists)
from ._src.collectives.lax import __all__ as __all__
