"""``train --init-from`` a Hugging Face folder that is not a Llama (Qwen3, Mistral) on ``--mesh dp=2,tp=2``: the
model runs through ``fs.nn.parallelize``; its loss at step 0 equals the Hugging Face model's on the same held-out
batch; the trained weights come back as a folder that ``from_pretrained`` loads and ``generate`` samples from.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard.job import cli as job_cli
from funcshard.job import train
from funcshard.job.data import eval_batches, load_corpus

pytestmark = pytest.mark.oracle


def _folder(tmp: Path, kind: str) -> Path:
    transformers = pytest.importorskip("transformers")
    conf_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    extra = {"head_dim": 8} if kind == "qwen3" else {}
    torch.manual_seed(0)
    conf = conf_cls(
        vocab_size=320,  # byte tokens (no tokenizer.json): the 256 byte values fit
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **extra,
    )
    folder = tmp / "model"
    model_cls(conf).save_pretrained(folder, safe_serialization=True)
    return folder


def _corpus(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for i in range(6):
        (d / f"mod_{i}.py").write_text(
            "".join(f"def f_{i}_{j}(x, y):\n    return x * {j} + y - {i}\n\n" for j in range(12))
        )
    return d


@pytest.mark.parametrize("kind", ["qwen3", "mistral"])
def test_step_zero_loss_equals_the_hf_model_and_the_result_loads_back(tmp_path: Path, kind: str) -> None:
    transformers = pytest.importorskip("transformers")
    folder, data = _folder(tmp_path, kind), _corpus(tmp_path / "data")
    argv = [
        *("--init-from", str(folder), "--data", str(data), "--mesh", "dp=2,tp=2", "--steps", "2"),
        *("--batch", "4", "--seq", "16", "--eval-batches", "1", "--warmup", "0"),
        *("--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")),
    ]
    args = job_cli.train_parser().parse_args(argv)
    summary = train.train(args)
    assert summary["steps"] == 2 and len(summary["losses"]) == 2

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    corpus = load_corpus(str(data), max_bytes=args.max_bytes, seq=args.seq)
    (tokens, targets) = eval_batches(corpus.val, n=1, batch=4, seq=16)[0]
    with torch.no_grad():
        logits = hf(tokens.long()).logits
    ref = F.cross_entropy(logits.flatten(0, 1), targets.long().flatten())
    step, loss = summary["initial_val_loss"]
    assert step == 0
    torch.testing.assert_close(torch.tensor(loss), ref, rtol=1e-5, atol=1e-6)

    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "hf")
    after = fs.device_get(summary["params"])
    for name, p in trained.named_parameters():
        torch.testing.assert_close(p.detach(), after[name], msg=name)
    assert not torch.equal(trained.lm_head.weight, hf.lm_head.weight)  # trained: not the folder's weights
    out = trained.generate(torch.tensor([list(b"def ")]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8)
