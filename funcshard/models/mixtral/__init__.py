"""A Mixtral-style sparse mixture-of-experts decoder (the Llama with top-k routed SwiGLU experts) as pure functions.

The functions of :mod:`funcshard.models.llama`, on every mix of ``dp`` / ``fsdp`` / ``ep`` / ``tp`` / ``cp`` / ``pp``
axes: the experts split over ``ep`` (the batch too), their hidden dim over ``tp``; :func:`loss` is Hugging Face's
``MixtralForCausalLM`` loss with ``output_router_logits=True`` (the load-balancing loss pooled over the global batch).

Example:
    >>> import funcshard as fs
    >>> from funcshard.models import mixtral
    >>> cfg = mixtral.Config.preset("debug")  # 4 experts, top-2
    >>> mesh = fs.make_mesh({"dp": 2, "ep": 2}, backend="sim")
    >>> specs = mixtral.param_specs(cfg, mesh)
    >>> specs["layers"]["w1"], specs["layers"]["wq"], mixtral.batch_spec(mesh)
    (P(None, 'ep', None, None), P(None, None, None), P(('dp', 'ep'), None))
"""

from .config import PRESETS as PRESETS
from .config import Config as Config
from .generate import generate as generate
from .hf import from_hf as from_hf
from .hf import to_hf as to_hf
from .model import forward as forward
from .model import init as init
from .model import layer as layer
from .model import loss as loss
from .model import value_and_grad as value_and_grad
from .sharding import batch_spec as batch_spec
from .sharding import param_specs as param_specs

__all__ = [
    "PRESETS",
    "Config",
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
