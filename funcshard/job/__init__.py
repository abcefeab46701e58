"""The main job: ``python -m funcshard train | generate | demo``, built on funcshard's public API only.

- ``train.py``: train a byte-level Llama on real text over any dp / fsdp / tp / cp mesh (setup, restore or
  init, step, report), with checkpoints and resume.
- ``generate.py``: sample text from the latest checkpoint of a train run.
- ``demo.py``: a DP x TP MLP trained with a functional step on a simulated mesh.
- ``plan/``: the hardware table and the step-time model ``python -m funcshard plan`` times a step with.
- ``cli.py``: the parsers, ``run`` (exit codes, one error line, Ctrl-C); ``preflight.py``: checks of the
  arguments before any work; ``data.py``: the corpus found on the machine and its batches.

Example:
    >>> from funcshard.job import cli
    >>> cli.parse_mesh("dp=2,tp=2")
    {'dp': 2, 'tp': 2}
"""
