"""Floor 2: the mesh, the per-device context (every thread-local mode flag), comm accounting, process questions,
and the backends (``backends/``: the only code that imports torch.distributed)."""
