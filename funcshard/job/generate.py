"""``python -m funcshard generate``: continue a prompt with the latest checkpoint of a train run, or with a
Hugging Face Llama folder (``--init-from PATH``).

The model's weights are loaded as full tensors, laid out over the mesh (one simulated device, or ``--mesh`` /
``tp`` over torchrun's processes) and :func:`funcshard.models.llama.generate` decodes with a KV cache inside
one ``shard_map`` call; the prompt is encoded, and the result decoded, as the run did (bytes, or the tokenizer
of the Hugging Face folder it started from; a folder's own ``tokenizer.json`` with ``--init-from``, its
``eos_token_id`` ending the text).

Example:
    >>> from funcshard.job import generate
    >>> generate.main(["--tokens", "20"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

import funcshard as fs
from funcshard import P, checkpoint
from funcshard import random as fsr
from funcshard.models import llama, mixtral

from . import init_from
from .cli import UsageError, finite_positive, generate_parser, parse_mesh, run

__all__ = ["generate", "load_model", "main"]


def load_model(ckpt_dir: str | os.PathLike[str]) -> tuple[llama.Config, Any, int]:
    """``(cfg, params, step)``: the latest checkpoint under ``ckpt_dir`` as plain full tensors.

    Args:
        ckpt_dir: the ``--ckpt-dir`` of a train run (holding ``config.json`` and ``step_N`` folders).

    Returns:
        ``(cfg, params, step)``: the model config, its parameters as full tensors, and the checkpoint's step.

    Raises:
        UsageError: no checkpoint, or no readable ``config.json``, under ``ckpt_dir``.

    Example:
        >>> cfg, params, step = load_model("runs/llama/ckpt")  # doctest: +SKIP
        >>> llama.forward(params, torch.tensor([list(b"def ")]), cfg).shape  # doctest: +SKIP
        torch.Size([1, 4, 256])
    """
    ckpt_dir = Path(ckpt_dir)
    steps = checkpoint.list_steps(ckpt_dir)
    if not steps:
        raise UsageError(f"--ckpt-dir '{ckpt_dir}' has no checkpoint; train first (python -m funcshard train).")
    try:
        model = json.loads((ckpt_dir / "config.json").read_text())["model"]
    except (OSError, ValueError, KeyError):
        raise UsageError(f"--ckpt-dir '{ckpt_dir}' has no readable config.json; it was not written by train.") from None
    family = mixtral if "n_experts" in model else llama  # (a Mixtral's config has the experts' fields)
    cfg = family.Config(**{**model, "sequence_parallel": False})
    mesh = fs.make_mesh({"dp": 1}, backend="sim")
    shapes = fs.eval_shape(family.init, fsr.key(0), cfg)
    zeros = fs.pytree.tree_map(lambda s: torch.zeros(s.shape), shapes, is_leaf=lambda x: isinstance(x, fs.ShapeDtype))
    like = fs.device_put(zeros, mesh, family.param_specs(cfg, mesh))
    tree = checkpoint.load(checkpoint.step_path(ckpt_dir, steps[-1]), {"params": like}, strict=False)
    return cfg, fs.device_get(tree["params"]), steps[-1]


def _source(args: argparse.Namespace) -> tuple[llama.Config, Any, init_from.Codec, list[int]]:
    """``(cfg, params, codec, stop_tokens)`` of ``--init-from``'s folder (its tokenizer and ``eos_token_id`` when
    it has them) or of the latest checkpoint under ``--ckpt-dir`` (the run's codec; no stop token)."""
    if args.init_from is None:
        cfg, params, _ = load_model(args.ckpt_dir)
        return cfg, params, init_from.checkpoint_codec(args.ckpt_dir), []
    folder = Path(args.init_from).expanduser()
    try:
        cfg, params = llama.from_hf(folder)
    except fs.FuncshardError as e:
        raise UsageError(f"--init-from: {e}") from None
    file = init_from.tokenizer_file(folder)
    if file is None:
        return cfg, params, init_from.byte_codec(), []
    tok = init_from.load_tokenizer(file)
    try:
        eos = json.loads((folder / "config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        eos = None
    stops = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return cfg, params, ((lambda text: tok.encode(text, add_special_tokens=False).ids), tok.decode), stops


def _mesh(args: argparse.Namespace) -> fs.Mesh:
    """``--mesh``, or ``tp`` over torchrun's processes (one simulated device without torchrun)."""
    if args.mesh is not None:
        return fs.make_mesh(parse_mesh(args.mesh), backend="auto")
    return fs.make_mesh({"tp": int(os.environ.get("WORLD_SIZE", "1"))}, backend="auto")


def generate(args: argparse.Namespace) -> str:
    """Continue ``args.prompt`` by ``args.tokens`` tokens with :func:`funcshard.models.llama.generate`; returns
    (and, on the first process, prints) the text.

    The model is the latest checkpoint under ``args.ckpt_dir`` or the Hugging Face folder ``args.init_from``;
    the prompt is encoded, and the result decoded, with the run's or the folder's tokenizer (bytes without
    one). Under torchrun the model is laid out over ``--mesh`` (default ``tp`` over the processes).

    Args:
        args: parsed ``funcshard generate`` options: ``ckpt_dir``, ``init_from``, ``prompt``, ``tokens``,
            ``temperature`` (0: greedy), ``top_k``, ``top_p``, ``seed``, ``mesh``.

    Returns:
        The prompt followed by the generated text (bad bytes replaced).

    Raises:
        UsageError: a negative temperature, no checkpoint under ``args.ckpt_dir``, an unreadable folder.

    Example:
        >>> from funcshard.job.cli import generate_parser
        >>> text = generate(generate_parser().parse_args(["--tokens", "20"]))  # doctest: +SKIP
    """
    finite_positive("--temperature", args.temperature, zero=True)
    cfg, params, (encode, decode), stops = _source(args)
    ids = encode(args.prompt) or encode("\n")
    mesh = _mesh(args)
    family = mixtral if isinstance(cfg, mixtral.Config) else llama
    specs = family.param_specs(cfg, mesh)
    data = tuple(a for a in mesh.axis_names if a in ("dp", "fsdp")) or None
    kw = {"temperature": args.temperature, "key": fsr.key(args.seed), "top_k": args.top_k, "top_p": args.top_p}
    step = fs.shard_map(
        lambda p: family.generate(p, [ids], cfg, max_new_tokens=args.tokens, stop_tokens=stops, **kw),
        mesh=mesh,
        in_specs=(specs,),
        out_specs=P(data),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one token at a time: ops too small to split, and spinning threads cost more
    try:
        out = fs.device_get(step(fs.device_put(params, mesh, specs)))[0].tolist()  # [1, prompt + new] -> row 0
    finally:
        torch.set_num_threads(threads)
    out = out[: len(ids)] + [t for t in out[len(ids) :] if t not in stops]  # (a stop token, and padding after it)
    text = decode(out)
    if int(os.environ.get("RANK", "0")) == 0:
        print(text)
    return text


def main(argv: list[str] | None = None) -> int:
    """``funcshard generate``: exit code 0, or 2 with one ``error: ...`` line on bad input.

    Args:
        argv: the command-line options (default ``sys.argv[1:]``).

    Returns:
        The exit code.

    Example:
        >>> main(["--tokens", "0"])  # bad input: one error line on stderr
        2
    """
    return run(generate_parser(), generate, argv)
