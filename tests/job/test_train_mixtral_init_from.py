"""``train --model mixtral --init-from FOLDER`` (a Mixtral or a Qwen3-MoE folder written by transformers): the
weights loaded sharded (``mixtral.from_hf(path, mesh=...)``), the step-0 held-out loss equal to the Hugging Face
model's on the same batch (cross-entropy plus the load-balancing term), on ``ep=2,fsdp=2`` and ``ep=2,tp=2``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import P
from funcshard.job import cli as job_cli
from funcshard.job import init_from, train
from funcshard.job.data import eval_batches, load_corpus
from funcshard.job.step import model_config
from funcshard.models import mixtral

pytestmark = pytest.mark.oracle

SIZES = {
    "vocab_size": 320,  # byte tokens (no tokenizer.json): the 256 byte values fit
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.3,  # large: the load-balancing term weighs in the loss
}


def _folder(tmp: Path, kind: str) -> Path:
    transformers = pytest.importorskip("transformers")
    if kind == "qwen3_moe":
        conf = transformers.Qwen3MoeConfig(**SIZES, moe_intermediate_size=24, num_experts=4, head_dim=12)
        model = transformers.Qwen3MoeForCausalLM(conf)
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**SIZES, num_local_experts=4))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    folder = tmp / "model"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _corpus(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for i in range(6):
        (d / f"mod_{i}.py").write_text(
            "".join(f"def f_{i}_{j}(x, y):\n    return x * {j} + y - {i}\n\n" for j in range(12))
        )
    return d


@pytest.mark.parametrize(("kind", "mesh"), [("mixtral", "ep=2,fsdp=2"), ("qwen3_moe", "ep=2,tp=2")])
def test_step_zero_loss_equals_the_hf_model(tmp_path: Path, kind: str, mesh: str) -> None:
    transformers = pytest.importorskip("transformers")
    folder, data = _folder(tmp_path, kind), _corpus(tmp_path / "data")
    argv = [
        *("--model", "mixtral", "--init-from", str(folder), "--data", str(data), "--mesh", mesh, "--steps", "1"),
        *("--batch", "4", "--seq", "16", "--eval-batches", "1", "--warmup", "0"),
        *("--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")),
    ]
    args = job_cli.train_parser().parse_args(argv)
    summary = train.train(args)
    assert summary["steps"] == 1

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    corpus = load_corpus(str(data), max_bytes=args.max_bytes, seq=args.seq)
    (tokens, targets) = eval_batches(corpus.val, n=1, batch=4, seq=16)[0]
    with torch.no_grad():
        out = hf(tokens.long(), output_router_logits=True)
    ce = F.cross_entropy(out.logits.flatten(0, 1), targets.long().flatten())
    ref = ce + SIZES["router_aux_loss_coef"] * out.aux_loss
    step, loss = summary["initial_val_loss"]
    assert step == 0
    torch.testing.assert_close(torch.tensor(loss), ref, rtol=1e-5, atol=1e-6)


def test_the_jobs_init_is_the_folder_read_sharded(tmp_path: Path) -> None:
    """The job's init (``init_from.load_params`` with the model's specs) equals the folder read whole."""
    folder = _folder(tmp_path, "qwen3_moe")
    args = job_cli.train_parser().parse_args(["--model", "mixtral", "--init-from", str(folder), "--seq", "16"])
    cfg = model_config(args)
    mesh = fs.make_mesh({"ep": 2, "fsdp": 2}, backend="sim")
    got = init_from.load_params(folder, mesh, mixtral.param_specs(cfg, mesh), mixtral)
    assert got["layers"]["w1"].spec == P(None, "ep", "fsdp", None)
    _, whole = mixtral.from_hf(folder)
    got_leaves = dict(fs.pytree.leaves_with_path(fs.device_get(got)))
    want_leaves = dict(fs.pytree.leaves_with_path(whole))
    assert list(got_leaves) == list(want_leaves)
    for path, want in want_leaves.items():
        assert torch.equal(got_leaves[path], want), path


def test_a_flag_that_disagrees_with_the_folder_is_one_error(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "mixtral")
    args = job_cli.train_parser().parse_args(
        ["--model", "mixtral", "--init-from", str(folder), "--experts", "2", "--seq", "16"]
    )
    with pytest.raises(job_cli.UsageError, match="--experts 2 conflicts with the model's num_local_experts"):
        model_config(args)
