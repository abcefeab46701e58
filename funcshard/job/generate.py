"""``python -m funcshard generate``: sample text from the latest checkpoint of a train run.

The checkpoint is loaded as plain full tensors (one simulated device) and the unsharded ``llama.forward`` runs
one token at a time; the prompt is encoded, and the result decoded, as the run did (bytes, or the tokenizer of
the Hugging Face folder it started from).

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
import torch.nn.functional as F

import funcshard as fs
from funcshard import checkpoint
from funcshard import random as fsr
from funcshard.models import llama, mixtral

from . import init_from
from .cli import UsageError, finite_positive, generate_parser, run

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


def generate(args: argparse.Namespace) -> str:
    """Sample ``args.tokens`` bytes after ``args.prompt`` from the latest checkpoint; returns (and prints) the text.

    Args:
        args: parsed ``funcshard generate`` options: ``ckpt_dir``, ``prompt``, ``tokens``, ``temperature``
            (0: greedy), ``seed``.

    Returns:
        The prompt followed by the sampled bytes, decoded as UTF-8 (bad bytes replaced).

    Raises:
        UsageError: a negative temperature, or no checkpoint under ``args.ckpt_dir``.

    Example:
        >>> from funcshard.job.cli import generate_parser
        >>> text = generate(generate_parser().parse_args(["--tokens", "20"]))  # doctest: +SKIP
    """
    finite_positive("--temperature", args.temperature, zero=True)
    cfg, params, _ = load_model(args.ckpt_dir)
    encode, decode = init_from.checkpoint_codec(args.ckpt_dir)  # bytes, or the run's tokenizer
    ids = encode(args.prompt) or encode("\n")
    key = fsr.key(args.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one token at a time: ops too small to split, and spinning threads cost more
    try:
        ids = _sample(params, cfg, ids, key, args.tokens, args.temperature)
    finally:
        torch.set_num_threads(threads)
    text = decode(ids)
    print(text)
    return text


def _sample(params: Any, cfg: llama.Config, ids: list[int], key: torch.Tensor, n: int, temperature: float) -> list[int]:
    """``ids`` followed by ``n`` sampled bytes (inverse-CDF draws from ``fs.random``, so the seed fixes them)."""
    ids = list(ids)
    with torch.no_grad():
        for i in range(n):
            ctx = torch.tensor([ids[-cfg.max_seq_len :]])  # [1, s]
            logits = _forward(params, ctx, cfg)[0, -1].float()  # [1, s, V] -> [V]
            if temperature == 0:
                nxt = int(logits.argmax())
            else:
                cdf = F.softmax(logits / temperature, dim=-1).cumsum(0)  # [V]
                u = fsr.uniform(fsr.fold_in(key, i), ()) * cdf[-1]
                nxt = min(int(torch.searchsorted(cdf, u, right=True)), cfg.vocab_size - 1)
            ids.append(nxt)
    return ids


def _forward(params: Any, tokens: torch.Tensor, cfg: llama.Config) -> torch.Tensor:
    """The unsharded logits of the checkpoint's model (a Llama or a Mixtral)."""
    family = mixtral if isinstance(cfg, mixtral.Config) else llama
    return family.forward(params, tokens, cfg)


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
