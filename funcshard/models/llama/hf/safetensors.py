"""The safetensors file format (kept here for its old import path): :mod:`funcshard.checkpoint.safetensors`,
which the Llama, the Mixtral and ``fs.nn.from_pretrained`` share.

Example:
    >>> from funcshard.models.llama.hf.safetensors import read_header
    >>> read_header.__module__
    'funcshard.checkpoint.safetensors'
"""

from ....checkpoint.safetensors import DTYPES as DTYPES
from ....checkpoint.safetensors import read_block as read_block
from ....checkpoint.safetensors import read_header as read_header
from ....checkpoint.safetensors import read_tensor as read_tensor
from ....checkpoint.safetensors import write_file as write_file

__all__ = ["DTYPES", "read_block", "read_header", "read_tensor", "write_file"]
