"""Models written as pure functions over parameter pytrees, and the parallel plans that lay them out.

A :class:`ParallelPlan` says which mesh axis plays each parallel role (``dp``, ``fsdp``, ``tp``, ``cp``,
``pp``, ``ep``); :func:`plan_from_mesh` builds and checks it once. Models take it explicitly (``plan=None``: each
role played by the mesh axis of its own name), so the mesh's axes may have any names.

Example:
    >>> import funcshard as fs
    >>> from funcshard.models import llama, plan_from_mesh
    >>> mesh = fs.make_mesh({"data": 2, "model": 2}, backend="sim")
    >>> plan = plan_from_mesh(mesh, {"dp": "data", "tp": "model"})
    >>> cfg = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    >>> llama.param_specs(cfg, mesh, plan)["embed"], llama.batch_spec(mesh, plan)
    (P('model', None), P('data', None))
"""

from .plan import ROLES as ROLES
from .plan import ParallelPlan as ParallelPlan
from .plan import plan_from_mesh as plan_from_mesh

__all__ = ["ROLES", "ParallelPlan", "plan_from_mesh"]
