"""A Llama-3 style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) as pure functions.

Example:
    >>> import funcshard as fs
    >>> from funcshard.models import llama
    >>> cfg = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    >>> mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    >>> specs = llama.param_specs(cfg, mesh)  # each role played by the axis of its own name
    >>> named = fs.make_mesh({"data": 2, "model": 2}, backend="sim")  # other names: roles through a plan
    >>> plan = fs.models.plan_from_mesh(named, {"dp": "data", "tp": "model"})
    >>> llama.param_specs(cfg, named, plan)["layers"]["wo"], llama.batch_spec(named, plan)
    (P(None, None, 'model'), P('data', None))
"""

from ..rope_scaling import RopeScaling as RopeScaling
from .config import PRESETS as PRESETS
from .config import Config as Config
from .generate import generate as generate
from .hf import from_hf as from_hf
from .hf import to_hf as to_hf
from .model import forward as forward
from .model import init as init
from .model import layer as layer
from .model import loss as loss
from .pipelined import value_and_grad as value_and_grad
from .sharding import batch_spec as batch_spec
from .sharding import param_specs as param_specs

__all__ = [
    "PRESETS",
    "Config",
    "RopeScaling",
    "batch_spec",
    "forward",
    "from_hf",
    "generate",
    "init",
    "layer",
    "loss",
    "param_specs",
    "to_hf",
    "value_and_grad",
]
