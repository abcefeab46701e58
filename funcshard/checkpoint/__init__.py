"""Checkpoints of trees of ``fs.Array`` through torch.distributed.checkpoint (DCP), resharded on load.

A checkpoint is a directory; every tensor leaf is one DCP tensor of its *global* shape, named by its pytree
path (``"params/layers/wq"``) and stored as the distinct blocks of its layout (a block replicated over an
axis is written once). So the checkpoint is a standard DCP checkpoint (``dcp_to_torch_save`` turns it into
a dict of full tensors) and ``load`` can lay it out over any mesh and specs: DCP reads, for each block a
process needs, only the saved blocks that overlap it.

On disk::

    <path>/.metadata            DCP metadata: each leaf's global shape, dtype and blocks (offsets, sizes),
                                and where each block's bytes are
    <path>/__<rank>_0.distcp    DCP data: the blocks this process wrote (one file per process; fsync'd)
    <path>/funcshard.json       the manifest: format version, step, user metadata, and per leaf path its
                                kind ("array" | "tensor" | "value"), global shape, dtype, mesh, spec,
                                block offsets and a CRC-32 of each block's bytes on disk (checked when the
                                block is loaded); Python scalars (int, float, bool, str) live here by value

A save writes into ``<path>.tmp-<uuid>``, fsyncs, then swaps it in: the previous checkpoint is renamed to
``<path>.old``, the new one to ``<path>``, and ``.old`` is deleted. A crash before the swap leaves the
previous checkpoint at ``<path>`` untouched; a crash inside the swap leaves it at ``<path>.old``, where
``load(path)`` finds it. Under ``"dist"`` every process writes its own blocks and only rank 0 swaps, after a
barrier; ``path`` must be on a filesystem every process sees. ``save(..., async_save=True)`` copies the blocks
to host memory and returns a :class:`SaveHandle` at once; a background thread writes them (at most one save in
flight; the next save waits for it). A write that fails (a full disk) raises
``CheckpointError`` with the OS's reason and the file; bytes changed after the save fail their checksum at load.

Example:
    >>> import tempfile, torch, funcshard as fs
    >>> from funcshard import P, checkpoint
    >>> mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    >>> w = fs.device_put(torch.arange(16.0).reshape(4, 4), mesh, P("dp", "tp"))
    >>> d = tempfile.mkdtemp()
    >>> _ = checkpoint.save(f"{d}/ckpt", {"w": w, "step": 7})
    >>> like = {"w": fs.device_put(torch.zeros(4, 4), fs.make_mesh({"tp": 4}, backend="sim"), P(None, "tp")),
    ...         "step": 0}
    >>> out = checkpoint.load(f"{d}/ckpt", like)
    >>> out["step"], out["w"].spec, torch.equal(fs.device_get(out["w"]), torch.arange(16.0).reshape(4, 4))
    (7, P(None, 'tp'), True)
"""

from ._async import SaveHandle as SaveHandle
from ._async import in_flight as in_flight
from ._files import swap_in as _swap_in  # noqa: F401 - save calls it here, where tests patch it
from ._load import info as info
from ._load import load as load
from ._manifest import FORMAT as FORMAT
from ._manifest import MANIFEST as MANIFEST
from ._manifest import VERSION as VERSION
from ._manifest import CheckpointError as CheckpointError
from ._planners import dcp_api as _dcp  # noqa: F401 - tests patch its planners
from ._save import save as save
from ._steps import latest as latest
from ._steps import list_steps as list_steps
from ._steps import step_path as step_path

__all__ = ["CheckpointError", "SaveHandle", "in_flight", "info", "latest", "list_steps", "load", "save", "step_path"]
