"""funcshard's private core. Its folders are floors: each imports only from the floors listed before it.

| floor | folder | holds |
|---|---|---|
| 0 | ``errors.py`` | the error types |
| 1 | ``tree/`` | pure data: pytrees with paths, ``P`` and shard arithmetic, spec rules, precision policies |
| 2 | ``runtime/`` | the mesh, the per-device context, comm accounting, process questions, the backends |
| 3 | ``collectives/`` | collective primitives (autograd Functions with vma rules), varying-axes tracking, ``lax`` |
| 4 | ``shard_map/``, ``arrays/``, ``autodiff/`` | the transform; the ``Array`` and its transfers; gradients and remat |

Everything public is re-exported from ``funcshard/__init__.py``, ``funcshard.lax``, ``funcshard.pytree`` and
``funcshard.process``; ``tests/architecture/test_floors_import_down.py`` checks the floors.

Glossary (one meaning per word):

- **axis**: a named mesh axis (``"tp"``); **dim**: a tensor dimension.
- **spec**: a ``P(...)``, one entry per dim. **layout**: the pair (mesh, spec) of an ``Array``.
- **shard** / **block**: the piece of a global value one device holds.
- **device**: one position of the mesh (a thread under ``sim``, a process under ``dist``); **process**: an OS
  process (one under ``sim``, one per device under ``dist``).
- **vma**: the set of axes a value varies over (JAX's "varying manual axes"); a **tag** is that set stored on a
  tensor, read and written only in ``collectives/``.
- **backend**: how devices communicate (``sim``, ``dist``); an **executor** runs one shard_map call on it.
- **parallel plan** (``ParallelPlan``): which mesh axis plays which role (dp, fsdp, tp, cp, pp).
- **moves**: the collectives a ``reshard`` runs to go from one layout to another (``reshard_plan``).
- **schedule**: the pipeline's actions per stage (data); **step**: one optimiser update (one call of a train
  step function).
"""
