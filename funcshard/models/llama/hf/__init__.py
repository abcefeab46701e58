"""Hugging Face Llama checkpoints: :func:`from_hf` / :func:`to_hf` (``convert.py``), the ``config.json``
translation (``config.py``) and the safetensors file format with no dependency (``safetensors.py``).

The public names are :mod:`funcshard.models.llama`'s (``llama.from_hf``, ``llama.to_hf``).
"""

from .convert import from_hf as from_hf
from .convert import to_hf as to_hf
