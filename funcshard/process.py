"""What a job needs from the processes (or simulated devices) it runs on, beyond the mesh.

- :class:`PeerError`: a collective whose peers did not answer in time or whose connection broke.
- :func:`collective_timeout`: seconds a collective waits for its peers (``FUNCSHARD_TIMEOUT``), checked early.
- :func:`any_process`: whether a flag is set on any process of a mesh (how a job's processes agree to stop).
- :func:`abandoned_threads`: simulated devices still running after their call raised (leave with ``os._exit``).
- :func:`shutdown`: leave torch.distributed cleanly at the end of a job under torchrun.

Example:
    >>> import funcshard as fs
    >>> from funcshard import process
    >>> process.any_process(True, fs.make_mesh({"dp": 2}, backend="sim"))
    True
    >>> process.collective_timeout() > 0
    True
"""

from ._src.runtime.process import *  # noqa: F403 (the names its __all__ lists)
from ._src.runtime.process import __all__ as __all__
