"""Communication backends: ``sim`` (devices simulated in this process) and ``dist`` (torch.distributed).

Both expose one device handle per device with the same five collectives, each over an ordered tuple of
mesh axes (a "group": the devices that share this device's coordinates on every other axis, ordered
row-major over the named axes). Every primitive works on a leading group dim ``n``:

- ``all_reduce(x, axes, op)``: ``[*s] -> [*s]``, op in ``"sum" | "max" | "min"``.
- ``all_gather(x, axes)``: ``[*s] -> [n, *s]``, row i from group member i.
- ``reduce_scatter(x, axes)``: ``[n, *s] -> [*s]``, the sum over members of their row ``my_index``.
- ``all_to_all(x, axes)``: ``[n, *s] -> [n, *s]``, row j goes to member j; row i of the result came from i.
- ``ppermute(x, axes, perm)``: ``[*s] -> [*s]``, from ``src`` to ``dst`` for each pair; zeros elsewhere.

and one asynchronous point-to-point call, not differentiable (for runtimes that do their own backward, as
``pipeline.run``): ``p2p(ops, axes)`` posts a batch of sends and receives and returns one work per op, each
waited on (``wait()``) only where its block is needed.

This package is the only code that imports torch.distributed.
"""

from __future__ import annotations

from .base import DeviceHandle, group_members

__all__ = ["DeviceHandle", "group_members"]
