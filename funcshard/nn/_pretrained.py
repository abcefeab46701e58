"""A Hugging Face folder straight into a parallelized module: ``from_pretrained`` (API §13, issue #31).

The module is built from the folder's ``config.json`` with its parameters on the meta device (no memory, no random
init); its buffers are made real and computed by the model's own initialisation (the rotary ``inv_freq``), or
read from the weights when saved there. ``parallelize`` gives each parameter's spec; each process then reads, for
every parameter, only its own devices' blocks from the safetensors files, one tensor's slice at a time through a
memory map (``funcshard.checkpoint.sharded_read``, as ``llama.from_hf(path, mesh=...)``). A tied parameter (the
head of a model whose ``tie_word_embeddings`` is set) is one tensor, read once under whichever name the files hold.
So a process's memory grows by its own shards, never the model.

Files: this one (the module, its weights); ``_parallelize.py`` (the sharded function).

Example:
    >>> import tempfile, torch, transformers, funcshard as fs
    >>> conf = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
    ...                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    >>> folder = tempfile.mkdtemp()
    >>> transformers.Qwen3ForCausalLM(conf).save_pretrained(folder)  # doctest: +ELLIPSIS
    ...
    >>> mesh = fs.make_mesh({"fsdp": 2, "tp": 2}, backend="sim")
    >>> params, specs, fn = from_pretrained(folder, mesh)
    >>> params["model.layers.0.self_attn.q_proj.weight"].spec
    P(('tp', 'fsdp'))
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint.safetensors import read_block
from ..checkpoint.sharded_read import Headers, read_array, read_headers
from ..extend import Array, ConfigError, P
from ._instances import tied_names
from ._parallelize import Parallelized, parallelize

__all__ = ["empty_pretrained", "from_pretrained", "load_pretrained"]

PathLike = str | os.PathLike[str]


def _folder(path: PathLike, fn: str) -> Path:
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"{fn}: '{folder}' has no config.json; give the folder of a Hugging Face model (save_pretrained's)."
        )
    return folder


def empty_pretrained(path: PathLike, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of a Hugging Face folder (``AutoModelForCausalLM`` of its ``config.json``, in train mode), its
    parameters on the meta device (no memory), its buffers real: computed by the model's own initialisation (the
    rotary ``inv_freq``), or read from the weights where they are saved.

    Args:
        path: the folder (``config.json`` and safetensors weights).
        dtype: the parameters' dtype.

    Returns:
        The module (give it to :func:`~funcshard.nn.parallelize`, then its weights to :func:`load_pretrained`).

    Raises:
        ConfigError: no ``config.json``, transformers missing, or a config it cannot build a causal LM of.

    Example:
        >>> m = empty_pretrained("path/to/Qwen3-0.6B")  # doctest: +SKIP
        >>> m.lm_head.weight.device.type, m.model.rotary_emb.inv_freq.device.type  # doctest: +SKIP
        ('meta', 'cpu')
    """
    folder = _folder(path, "empty_pretrained")
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"empty_pretrained: '{folder}' needs transformers (pip install transformers).") from None
    try:
        conf = transformers.AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(conf, dtype=dtype)
    except Exception as e:  # noqa: BLE001 (transformers raises many types for a config it cannot build)
        why = f"{type(e).__name__}: {e}"
        raise ConfigError(f"empty_pretrained: transformers cannot build '{folder}' ({why}).") from None
    _real_buffers(model, folder)
    return model.train()


def _real_buffers(model: nn.Module, folder: Path) -> None:
    """Each meta buffer of ``model`` made real: read from the weights if saved there, else the model's own
    initialisation of its module (transformers' ``_init_weights``: the rotary ``inv_freq``)."""
    where, headers = read_headers(folder, "empty_pretrained")
    init = getattr(model, "_init_weights", None)
    for path, mod in model.named_modules():
        metas = [k for k, b in mod.named_buffers(recurse=False) if b.is_meta]
        for k in metas:
            mod._buffers[k] = torch.empty_like(mod._buffers[k], device="cpu")
        saved = {k: f"{path}.{k}" if path else k for k in metas}
        if any(n not in where for n in saved.values()):
            if init is None:
                raise ConfigError(
                    f"empty_pretrained: the buffers {sorted(saved.values())} are neither in the weights of '{folder}' "
                    f"nor computed by the model (it has no _init_weights)."
                )
            init(mod)  # computes the module's buffers (its parameters are meta: untouched)
        for k, name in saved.items():
            if name in where:
                entries, start = headers[where[name]]
                full = tuple(slice(0, n) for n in entries[name]["shape"])
                mod._buffers[k].copy_(read_block(where[name], name, entries[name], start, full))


def load_pretrained(path: PathLike, module: nn.Module, mesh: Any, specs: dict[str, P]) -> dict[str, Array]:
    """The parameters of ``module`` (by dotted name, those ``specs`` names) as ``fs.Array``s laid out by ``specs``
    over ``mesh``, each process reading only its own blocks from the folder's safetensors files.

    Args:
        path: the folder whose weights ``module`` (e.g. :func:`empty_pretrained`'s) has the names and shapes of.
        module: the module (its parameters may be meta: only their names, shapes and dtypes are used).
        mesh: the mesh.
        specs: ``{name: P}`` (``parallelize``'s); buffers in it are left out of the result (the module's own).

    Returns:
        ``{name: fs.Array}`` of the parameters, in the module's dtype.

    Raises:
        ConfigError: a parameter missing from the weights or of another shape there (naming it and the file).
        ShardingError: a spec the mesh cannot lay a parameter out by.

    Example:
        >>> module = empty_pretrained("path/to/Qwen3-0.6B")  # doctest: +SKIP
        >>> _, specs, fn = fs.nn.parallelize(module, mesh)  # doctest: +SKIP
        >>> params = load_pretrained("path/to/Qwen3-0.6B", module, mesh, specs)  # doctest: +SKIP
    """
    folder = _folder(path, "load_pretrained")
    where, headers = read_headers(folder, "load_pretrained")
    aliases: dict[str, list[str]] = {}
    for alias, kept in tied_names(module).items():
        aliases.setdefault(kept, []).append(alias)
    owned = dict(module.named_parameters())
    out = {}
    for name, spec in specs.items():
        if name not in owned:
            continue  # a buffer: the module's own
        p = owned[name]
        stored = _stored_name(name, aliases.get(name, []), tuple(p.shape), where, headers, folder)
        out[name] = read_array(
            mesh, spec, tuple(p.shape), p.dtype, 0, lambda _, n=stored: (n, ()), where, headers, path=name,
            fn="load_pretrained",
        )  # fmt: skip
    return out


def _stored_name(
    name: str, aliases: list[str], shape: tuple[int, ...], where: dict[str, Path], headers: Headers, folder: Path
) -> str:
    """The name the weights hold parameter ``name`` under (its own, or a tied alias's), its shape checked."""
    found = next((n for n in (name, *aliases) if n in where), None)
    if found is None:
        raise ConfigError(
            f"load_pretrained: parameter '{name}' (shape {list(shape)}) is missing from the weights in '{folder}'; "
            f"the folder's weights do not belong to its config.json."
        )
    entry = headers[where[found]][0].get(found)
    if entry is None:
        raise ConfigError(f"load_pretrained: tensor '{found}' is missing from '{where[found]}' (its index names it).")
    if tuple(entry["shape"]) != shape:
        raise ConfigError(
            f"load_pretrained: tensor '{found}' in '{where[found]}' has shape {entry['shape']}, but the model of "
            f"config.json has {list(shape)}; the weights do not belong to this config."
        )
    return found


def from_pretrained(
    path: PathLike,
    mesh: Any,
    plan: dict[str, str] | None = None,
    *,
    loss_parallel: bool = False,
    check_state: bool = True,
) -> tuple[dict[str, Array], dict[str, P], Parallelized]:
    """A Hugging Face folder's model sharded over ``mesh`` as :func:`~funcshard.nn.parallelize` gives it, its
    parameters read straight into ``fs.Array``s: each process reads only its own blocks (never the whole model).

    Args:
        path: the folder (``config.json``, ``model.safetensors`` or an index and its shards).
        mesh: an ``fs.Mesh`` whose axes are among ``dp``, ``fsdp``, ``tp``.
        plan: as ``parallelize``'s (``None``: the config's ``base_model_tp_plan``).
        loss_parallel: as ``parallelize``'s.
        check_state: as ``parallelize``'s.

    Returns:
        ``(params, specs, fn)``: the parameters (``fs.Array``s by dotted name; the buffers are the module's own,
        which ``fn`` uses), the specs (parameters and buffers), and the function to call inside ``shard_map``.

    Raises:
        ConfigError: as :func:`empty_pretrained` and :func:`load_pretrained`, and ``parallelize``'s.
        ShardingError: as ``parallelize``'s.

    Example:
        >>> params, specs, fn = fs.nn.from_pretrained("path/to/Qwen3-0.6B", mesh)  # doctest: +SKIP
        >>> step = fs.shard_map(fn, mesh=mesh, in_specs=({n: specs[n] for n in params}, fn.batch_spec),
        ...                     out_specs=...)  # doctest: +SKIP
    """
    module = empty_pretrained(path)
    _, specs, fn = parallelize(module, mesh, plan, loss_parallel=loss_parallel, check_state=check_state)
    return load_pretrained(path, module, mesh, specs), specs, fn
