"""``train --init-from PATH``: fine-tune a Hugging Face Llama folder instead of training from a random init
(with ``--model mixtral``, a Mixtral or Qwen3-MoE folder).

The model's shape comes from the folder's ``config.json`` (a model-shape flag given with another value is an
error), its parameters from the safetensors weights (``llama.from_hf`` / ``mixtral.from_hf`` with the mesh: each
process reads only the bytes of its own shards). When the folder has a ``tokenizer.json``, the corpus is tokenised
with it through the
``tokenizers`` package (imported only then: ``pip install tokenizers``); otherwise the tokens are the bytes, as
for a model trained here (the model's vocabulary must then hold the 256 byte values). ``generate`` encodes
the prompt and decodes the sample with the tokenizer a run was trained with (its path is kept in the
checkpoint folder's ``config.json``).

Example:
    >>> byte_codec()[1](list(b"def ") + [300])  # ids beyond a byte decode as U+FFFD
    'def �'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import funcshard as fs
from funcshard.models import llama
from funcshard.models.llama.hf.config import read_config
from funcshard.models.mixtral.hf import read_config as read_moe_config

from . import bridge
from .cli import UsageError, train_parser
from .data import Corpus

__all__ = [
    "MODEL_FIELDS",
    "SHAPE_FLAGS",
    "Codec",
    "byte_codec",
    "checkpoint_codec",
    "load_params",
    "load_tokenizer",
    "model_config",
    "run_tokenizer",
    "tokenize_corpus",
    "tokenizer_file",
]

Codec = tuple[Callable[[str], list[int]], Callable[[list[int]], str]]  # (encode, decode)

# the model-shape flags of train and the config.json field each must agree with
SHAPE_FLAGS = (
    ("--dim", "dim", "dim", "hidden_size"),
    ("--layers", "layers", "n_layers", "num_hidden_layers"),
    ("--heads", "heads", "n_heads", "num_attention_heads"),
    ("--kv-heads", "kv_heads", "n_kv_heads", "num_key_value_heads"),
    ("--ffn", "ffn", "ffn_dim", "intermediate_size"),
)
# the Config fields that describe the model itself (what a folder fixes; the rest comes from the command line)
MODEL_FIELDS = (
    "vocab_size",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "max_seq_len",
    "rope_theta",
    "rope_scaling",
    "norm_eps",
    "tie_embeddings",
    "init_std",
)
# a Mixtral's (or Qwen3-MoE's) own model fields, and its flags that must agree with the folder
MOE_FIELDS = ("n_experts", "experts_per_token", "router_aux_loss_coef", "norm_topk_prob", "head_size", "qk_norm")
MOE_FLAGS = (
    ("--experts", "experts", "n_experts", "num_local_experts / num_experts"),
    ("--top-k", "top_k", "experts_per_token", "num_experts_per_tok"),
)
_CHUNK = 1 << 16  # characters tokenised per piece (tokenizers encodes a batch of pieces in parallel)


def tokenizer_file(folder: str | Path) -> Path | None:
    """``folder/tokenizer.json`` when it exists, else None.

    Example:
        >>> tokenizer_file("/no/such/folder") is None
        True
    """
    file = Path(folder).expanduser() / "tokenizer.json"
    return file.resolve() if file.is_file() else None


def run_tokenizer(args: argparse.Namespace) -> Path | None:
    """The ``tokenizer.json`` a train run tokenises with: that of ``--init-from``'s folder, if any.

    Example:
        >>> run_tokenizer(train_parser().parse_args([])) is None
        True
    """
    folder = getattr(args, "init_from", None)
    return tokenizer_file(folder) if folder else None


def load_tokenizer(file: Path) -> Any:
    """A ``tokenizers.Tokenizer`` from ``file``.

    Raises:
        UsageError: the ``tokenizers`` package is not installed, or the file is not a tokenizer.

    Example:
        >>> load_tokenizer(Path("/no/tokenizer.json"))  # doctest: +SKIP
    """
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(
            f"--init-from: '{file}' needs the tokenizers package: pip install tokenizers (or pip install "
            f"'funcshard[hf]'); or remove tokenizer.json from the folder to train on bytes."
        ) from None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 (tokenizers raises its own Exception type for a bad file)
        raise UsageError(f"--init-from: '{file}' is not a tokenizer the tokenizers package reads ({e}).") from None


def model_config(args: argparse.Namespace, flags: llama.Config) -> llama.Config:
    """The Llama of ``args.init_from``'s ``config.json``, checked against the other options.

    Args:
        args: parsed ``funcshard train`` options with ``init_from`` set.
        flags: the config the command line alone gives (its model fields are replaced by the folder's).

    Returns:
        ``flags`` with the folder's model (:data:`MODEL_FIELDS`); the rest (``sequence_parallel``, ...) kept.

    Raises:
        UsageError: a folder funcshard cannot read, a model-shape flag that differs from the folder's model,
            ``--seq`` above its ``max_position_embeddings``, a vocabulary too small for byte tokens (no
            ``tokenizer.json``), or a ``tokenizer.json`` without the ``tokenizers`` package.

    Example:
        >>> args = train_parser().parse_args(["--init-from", "/no/such/folder"])
        >>> model_config(args, llama.Config())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        funcshard.job.cli.UsageError: --init-from: from_hf: '/no/such/folder' does not exist; ...
    """
    moe = getattr(args, "model", "llama") == "mixtral"
    try:  # a non-Llama folder goes through fs.nn (funcshard.job.bridge); --model mixtral reads a Mixtral's
        cfg = read_moe_config(args.init_from) if moe else None
        cfg = cfg or (bridge.read_config(args.init_from) if bridge.wanted(args) else read_config(args.init_from))
    except fs.FuncshardError as e:
        raise UsageError(f"--init-from: {e}") from None
    defaults = train_parser()
    for flag, dest, field, hf_field in SHAPE_FLAGS + (MOE_FLAGS if moe else ()):
        given, theirs = getattr(args, dest), getattr(cfg, field)
        if given != defaults.get_default(dest) and given != theirs:
            raise UsageError(
                f"--init-from '{args.init_from}': {flag} {given} conflicts with the model's {hf_field} {theirs} "
                f"(config.json); drop {flag}, the model's shape comes from the folder."
            )
    if args.seq > cfg.max_seq_len:
        raise UsageError(
            f"--init-from '{args.init_from}': --seq {args.seq} is longer than the model's max_position_embeddings "
            f"{cfg.max_seq_len} (config.json); lower --seq."
        )
    tok = tokenizer_file(args.init_from)
    if tok is not None:
        load_tokenizer(tok)  # the package and the file, checked before anything runs
    elif cfg.vocab_size < 256:
        raise UsageError(
            f"--init-from '{args.init_from}': no tokenizer.json there, so the tokens are bytes, but the model's "
            f"vocab_size is {cfg.vocab_size} < 256; add the model's tokenizer.json to the folder."
        )
    fields = MODEL_FIELDS + (MOE_FIELDS if moe else ())
    return dataclasses.replace(flags, **{f: getattr(cfg, f) for f in fields})


def _encode_text(buf: torch.Tensor, tokenizer: Any) -> torch.Tensor:
    """The token ids (int32) of the UTF-8 bytes ``buf``, tokenised in pieces cut at line ends."""
    text = bytes(buf.numpy()).decode("utf-8", errors="replace")
    pieces, start = [], 0
    while start < len(text):
        end = text.find("\n", start + _CHUNK)
        end = len(text) if end < 0 else end + 1
        pieces.append(text[start:end])
        start = end
    encoded = tokenizer.encode_batch(pieces, add_special_tokens=False) if pieces else []
    parts = [torch.tensor(e.ids, dtype=torch.int32) for e in encoded]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int32)


def tokenize_corpus(corpus: Corpus, file: Path, *, vocab_size: int, seq: int) -> Corpus:
    """``corpus`` with its byte splits replaced by the token ids of the tokenizer in ``file`` (int32).

    Raises:
        UsageError: a token id beyond the model's vocabulary, or too few tokens for ``seq + 1`` windows.

    Example:
        >>> # corpus = tokenize_corpus(load_corpus(None, max_bytes=10**6, seq=128), file, vocab_size=32000, seq=128)
    """
    tokenizer = load_tokenizer(file)
    train, val = _encode_text(corpus.train, tokenizer), _encode_text(corpus.val, tokenizer)
    top = max(int(train.max()) if len(train) else -1, int(val.max()) if len(val) else -1)
    if top >= vocab_size:
        raise UsageError(
            f"--init-from: '{file}' gives token id {top}, but the model's vocab_size is {vocab_size}; the "
            f"tokenizer does not belong to this model."
        )
    if len(train) < seq + 1 or len(val) < seq + 1:
        raise UsageError(
            f"--data {corpus.source!r}: {len(train)} training and {len(val)} validation tokens after tokenising, "
            f"too few for windows of --seq {seq}; give more text or a smaller --seq."
        )
    source = f"{corpus.source}, tokenised by {file} ({len(train) + len(val)} tokens)"
    return dataclasses.replace(corpus, train=train, val=val, source=source)


def load_params(folder: str | Path, mesh: fs.Mesh, specs: Any, model: Any = llama) -> Any:
    """The folder's weights as ``fs.Array``s laid out by ``specs`` over ``mesh``: each process reads only the bytes
    of its own shards (``model.from_hf(..., mesh=...)``; ``model``: :mod:`~funcshard.models.llama` or
    :mod:`~funcshard.models.mixtral`).

    Raises:
        UsageError: weights funcshard cannot read (missing, of the wrong shape, corrupt).

    Example:
        >>> # params = load_params("path/to/model", mesh, llama.param_specs(cfg, mesh))
    """
    try:
        return model.from_hf(folder, mesh=mesh, specs=specs)[1]
    except fs.FuncshardError as e:
        raise UsageError(f"--init-from: {e}") from None


def byte_codec() -> Codec:
    """``(encode, decode)`` of byte tokens: UTF-8 bytes in, ids above 255 out as U+FFFD.

    Example:
        >>> encode, decode = byte_codec()
        >>> encode("hé"), decode(encode("hé"))
        ([104, 195, 169], 'hé')
    """

    def decode(ids: list[int]) -> str:
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
            else:
                out.append(run.decode("utf-8", errors="replace") + "\ufffd")
                run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")

    return (lambda text: list(text.encode("utf-8"))), decode


def checkpoint_codec(ckpt_dir: str | Path) -> Codec:
    """``(encode, decode)`` for the run in ``ckpt_dir``: its tokenizer when it was trained with one (the
    ``tokenizer`` recorded in ``config.json``), else bytes.

    Raises:
        UsageError: the run's tokenizer file is gone, or the ``tokenizers`` package is missing.

    Example:
        >>> encode, decode = checkpoint_codec("/no/such/ckpt")  # no record: bytes
        >>> encode("ab")
        [97, 98]
    """
    try:
        file = json.loads((Path(ckpt_dir) / "config.json").read_text()).get("tokenizer")
    except (OSError, ValueError, AttributeError):
        file = None
    if not file:
        return byte_codec()
    if not Path(file).is_file():
        raise UsageError(
            f"the run in '{ckpt_dir}' was trained with the tokenizer '{file}', which is gone; put it back there."
        )
    tokenizer = load_tokenizer(Path(file))
    return (lambda text: tokenizer.encode(text, add_special_tokens=False).ids), tokenizer.decode
