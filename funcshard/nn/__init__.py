"""Any ``torch.nn.Module`` as a pure function, sharded: ``functionalize`` and ``parallelize`` (API §13).

``functionalize(module)`` gives the module's parameters and buffers as a tree keyed by dotted names and a pure
function of them (``torch.func.functional_call``). ``parallelize(module, mesh, plan)`` gives the tree, its specs
over the mesh, and a function to call inside ``fs.shard_map``: Hugging Face's tensor-parallel styles (``colwise``,
``rowwise``, ...) over the mesh's ``tp`` axis, the batch over ``dp`` and ``fsdp``, every parameter sharded over
``fsdp`` and gathered just before the submodule that uses it.

Files: ``_instances.py`` (one working copy of the module per device, the state check), ``_functionalize.py``,
``_plan.py`` (plans: patterns, styles, specs), ``_styles.py`` (the styles' forwards), ``_parallelize.py`` (the
sharded function, the FSDP gathers, the causal-LM loss), ``_pretrained.py`` (``from_pretrained``: a Hugging Face
folder's model on the meta device and its weights read shard by shard).

Example:
    >>> import torch, funcshard as fs
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> params, fn = fs.nn.functionalize(mlp)
    >>> x = torch.randn(3, 4)
    >>> torch.equal(fn(params, x), mlp(x))
    True
"""

from ._functionalize import functionalize as functionalize
from ._parallelize import Parallelized as Parallelized
from ._parallelize import causal_lm_loss as causal_lm_loss
from ._parallelize import parallelize as parallelize
from ._plan import STYLES as STYLES
from ._pretrained import empty_pretrained as empty_pretrained
from ._pretrained import from_pretrained as from_pretrained
from ._pretrained import load_pretrained as load_pretrained

__all__ = [
    "STYLES",
    "Parallelized",
    "causal_lm_loss",
    "empty_pretrained",
    "from_pretrained",
    "functionalize",
    "load_pretrained",
    "parallelize",
]
