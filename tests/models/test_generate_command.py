"""``python -m funcshard generate --init-from PATH``: a Hugging Face Llama folder with its tokenizer, greedy text
equal to ``llama.generate``'s on one device, on a simulated ``tp=2`` mesh and under torchrun (2 processes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from funcshard.__main__ import main as cli_main
from funcshard.models import llama

pytestmark = pytest.mark.oracle

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "def add(a, b):"
SIZES = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny LlamaForCausalLM saved with a byte-level BPE tokenizer of 300 tokens."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    path = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, eos_token_id=None))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    return path


def _expected(folder: Path, n: int) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    cfg, params = llama.from_hf(folder)
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    return tok.decode(llama.generate(params, [ids], cfg, max_new_tokens=n)[0].tolist())


@pytest.mark.parametrize("mesh", [[], ["--mesh", "tp=2"], ["--mesh", "dp=2,tp=2"]], ids=["one", "tp2", "dp2xtp2"])
def test_generate_from_hf_folder_prints_the_greedy_text(
    folder: Path, mesh: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--init-from", str(folder), "--prompt", PROMPT, "--tokens", "12", "--temperature", "0", *mesh]
    assert cli_main(argv) == 0
    assert capsys.readouterr().out == _expected(folder, 12) + "\n"


def test_generate_samples_with_the_seed(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--init-from", str(folder), "--prompt", PROMPT, "--tokens", "12", "--top-k", "20"]
    outs = []
    for seed in ("1", "1", "2"):
        assert cli_main([*argv, "--seed", seed]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] != outs[2] and outs[0].startswith(PROMPT)


@pytest.mark.dist
@pytest.mark.slow
def test_generate_under_torchrun_tp2_prints_the_greedy_text(folder: Path) -> None:
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    cmd = [torchrun, "--nproc-per-node", "2", "-m", "funcshard", "generate", "--init-from", str(folder)]
    cmd += ["--prompt", PROMPT, "--tokens", "12", "--temperature", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout == _expected(folder, 12) + "\n", (p.stdout, sys.executable)
