"""Hugging Face Llama folders in and out (``llama.from_hf`` / ``llama.to_hf``) and ``train --init-from``,
checked against transformers' ``LlamaForCausalLM`` on tiny random models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.__main__ import main as cli_main
from funcshard.checkpoint.safetensors import read_header, write_file
from funcshard.job import cli as job_cli
from funcshard.job import train
from funcshard.models import llama
from funcshard.models.llama.hf.convert import hf_names

pytestmark = pytest.mark.oracle

# vocab 320: above the 256 bytes and the tiny tokenizer's 300 tokens, and divisible by tp=2
HF_SIZES = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rope_theta": 50000.0,
    "rms_norm_eps": 1e-5,
}
CFG = llama.Config(320, 64, 2, 4, 2, 96, 64, rope_theta=50000.0)  # the same model in funcshard's words
TOKENS = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))


def _hf_model(tie: bool = False, seed: int = 0):
    """A random tiny LlamaForCausalLM in eval mode, with weights large enough that the logits differ a lot."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    conf = transformers.LlamaConfig(**HF_SIZES, tie_word_embeddings=tie)
    model = transformers.LlamaForCausalLM(conf).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def _hf_logits(model, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def _random_params(cfg: llama.Config = CFG) -> dict:
    """``llama.init`` with norms that are not all ones (so a swapped norm would show)."""
    params = llama.init(fs.random.key(1), cfg)
    gen = torch.Generator().manual_seed(2)
    params["norm"] = 1 + 0.2 * torch.randn(params["norm"].shape, generator=gen)
    for k in ("attn_norm", "mlp_norm"):
        params["layers"][k] = 1 + 0.2 * torch.randn(params["layers"][k].shape, generator=gen)
    return params


def _equal_trees(a: dict, b: dict) -> bool:
    la, lb = fs.pytree.leaves_with_path(a), fs.pytree.leaves_with_path(b)
    return [p for p, _ in la] == [p for p, _ in lb] and all(
        x.dtype == y.dtype and torch.equal(x, y) for (_, x), (_, y) in zip(la, lb, strict=True)
    )


# ---------------------------------------------------------------------------------------------- both ways


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["single", "sharded"])
def test_from_hf_logits_equal_transformers(tmp_path: Path, shard: str | None) -> None:
    model = _hf_model()
    kw = {} if shard is None else {"max_shard_size": shard}
    model.save_pretrained(tmp_path, safe_serialization=True, **kw)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard is not None)
    cfg, params = llama.from_hf(tmp_path)
    assert cfg == CFG and params["layers"]["wq"].dtype == torch.float32
    ref = _hf_logits(model)
    assert ref.abs().max() > 1.0  # the check below is not between two near-zero tensors
    torch.testing.assert_close(llama.forward(params, TOKENS, cfg), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("max_shard_bytes", [10**9, 30_000], ids=["single", "sharded"])
def test_to_hf_loads_in_transformers(tmp_path: Path, max_shard_bytes: int) -> None:
    transformers = pytest.importorskip("transformers")
    params = _random_params()
    llama.to_hf(params, CFG, tmp_path, max_shard_bytes=max_shard_bytes)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (max_shard_bytes < 10**9)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert model.config.num_key_value_heads == 2 and model.dtype == torch.float32
    torch.testing.assert_close(_hf_logits(model), llama.forward(params, TOKENS, CFG), atol=1e-5, rtol=1e-5)


def test_tied_embeddings_both_ways(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = _hf_model(tie=True)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    cfg, params = llama.from_hf(tmp_path / "hf")
    assert cfg.tie_embeddings and "head" not in params
    torch.testing.assert_close(llama.forward(params, TOKENS, cfg), _hf_logits(model), atol=1e-5, rtol=1e-5)
    llama.to_hf(params, cfg, tmp_path / "fs")
    assert "lm_head.weight" not in read_header(tmp_path / "fs" / "model.safetensors")[0]
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "fs").eval()
    torch.testing.assert_close(_hf_logits(again), _hf_logits(model), atol=1e-5, rtol=1e-5)
    assert _equal_trees(llama.from_hf(tmp_path / "fs")[1], params)


def test_round_trip_is_bit_identical(tmp_path: Path) -> None:
    params = _random_params()
    llama.to_hf(params, CFG, tmp_path / "one")
    llama.to_hf(params, CFG, tmp_path / "many", max_shard_bytes=20_000)
    for folder in ("one", "many"):
        cfg, back = llama.from_hf(tmp_path / folder)
        assert cfg == CFG and _equal_trees(back, params), folder
    # a second save into the same folder replaces the first one's weight files, shards included
    llama.to_hf(params, CFG, tmp_path / "many")
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == ["config.json", "model.safetensors"]


def test_bf16_on_disk(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    params = _random_params()
    llama.to_hf(params, CFG, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ref = safetensors_torch.load_file(tmp_path / "model.safetensors")  # the reference reader agrees
    assert ref["model.layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(ref["model.layers.1.mlp.down_proj.weight"], params["layers"]["w2"][1].bfloat16())
    _, kept = llama.from_hf(tmp_path, dtype=None)
    _, fp32 = llama.from_hf(tmp_path)
    as_bf16 = fs.pytree.tree_map(lambda t: t.bfloat16(), params)
    assert _equal_trees(kept, as_bf16)
    assert _equal_trees(fp32, fs.pytree.tree_map(lambda t: t.float(), as_bf16))


def test_sharded_forward_on_loaded_params_equals_transformers(tmp_path: Path) -> None:
    model = _hf_model(seed=3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg, params = llama.from_hf(tmp_path)
    mesh = fs.make_mesh({"dp": 1, "tp": 2}, backend="sim")
    specs = llama.param_specs(cfg, mesh)
    f = fs.shard_map(
        lambda p, t: llama.forward(p, t, cfg),
        mesh=mesh,
        in_specs=(specs, llama.batch_spec(mesh)),
        out_specs=P("dp", None, "tp"),
    )
    sharded = fs.device_put(params, mesh, specs)
    out = fs.device_get(f(sharded, TOKENS))
    torch.testing.assert_close(out, _hf_logits(model), atol=1e-5, rtol=1e-5)
    llama.to_hf(sharded, cfg, tmp_path / "from_arrays")  # fs.Array leaves are gathered
    assert _equal_trees(llama.from_hf(tmp_path / "from_arrays")[1], params)


# ---------------------------------------------------------------------------------------------- train --init-from


def _corpus(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for i in range(6):
        lines = [f"def function_{i}_{j}(x, y):\n    return x * {j} + y - {i}\n\n" for j in range(12)]
        (d / f"mod_{i}.py").write_text("".join(lines))
    return d


def _tokenizer(path: Path) -> None:
    """A byte-level BPE of 300 tokens trained on a few lines, saved as tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator([f"def function_{i}(x, y):\n    return x * {i} + y\n" for i in range(40)], trainer)
    tok.save(str(path / "tokenizer.json"))


def _train_args(tmp: Path, folder: Path, *extra: str) -> list[str]:
    return [
        *("--init-from", str(folder), "--data", str(_corpus(tmp / "data")), "--mesh", "tp=2", "--steps", "2"),
        *("--batch", "2", "--seq", "16", "--eval-batches", "1", "--warmup", "0", "--lr", "1e-12"),
        *("--ckpt-dir", str(tmp / "ckpt"), "--out", str(tmp / "out"), *extra),
    ]


@pytest.mark.parametrize("with_tokenizer", [False, True], ids=["bytes", "tokenizer"])
def test_train_init_from(tmp_path: Path, with_tokenizer: bool, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "model"
    _hf_model(seed=4).save_pretrained(folder, safe_serialization=True)
    if with_tokenizer:
        _tokenizer(folder)
    args = job_cli.train_parser().parse_args(_train_args(tmp_path, folder))
    summary = train.train(args)
    assert summary["steps"] == 2 and len(summary["losses"]) == 2
    # the run started from the folder's weights: a learning rate of 1e-12 leaves them where they were
    _, loaded = llama.from_hf(folder)
    after = fs.device_get(summary["params"])
    pairs = zip(fs.pytree.flatten(after)[0], fs.pytree.flatten(loaded)[0], strict=True)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in pairs)
    meta = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert (meta["tokenizer"] is not None) == with_tokenizer and meta["model"]["vocab_size"] == 320
    out = capsys.readouterr().out
    assert ("tokenised by" in out) == with_tokenizer
    assert cli_main(["generate", "--ckpt-dir", str(tmp_path / "ckpt"), "--prompt", "def ", "--tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("def ")


# ---------------------------------------------------------------------------------------------- errors


def _saved(tmp: Path) -> Path:
    folder = tmp / "model"
    llama.to_hf(_random_params(), CFG, folder)
    return folder


def _edit_config(folder: Path, **fields: object) -> None:
    conf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**conf, **fields}))


def test_from_hf_errors_name_the_problem(tmp_path: Path) -> None:
    def error(folder: Path) -> str:
        with pytest.raises(fs.ConfigError) as e:
            llama.from_hf(folder)
        msg = str(e.value)
        assert "\n" not in msg
        return msg

    assert "does not exist" in error(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert "config.json' is missing" in error(tmp_path / "empty")
    folder = _saved(tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()

    for fields, needle in [
        ({"model_type": "mistral"}, "field 'model_type' is 'mistral'"),
        ({"attention_bias": True}, "field 'attention_bias' is true"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "RoPE scaling of type 'llama3'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "field 'rope_scaling'"),
        ({"head_dim": 32}, "field 'head_dim' is 32"),
        ({"hidden_act": "gelu"}, "field 'hidden_act'"),
        ({"num_hidden_layers": "two"}, "field 'num_hidden_layers' must be a positive integer"),
    ]:
        good = (folder / "config.json").read_text()
        _edit_config(folder, **fields)
        assert needle in error(folder), fields
        (folder / "config.json").write_text(good)

    _edit_config(folder, intermediate_size=128)
    msg = error(folder)
    assert "'model.layers.0.mlp.gate_proj.weight'" in msg and "[96, 64], expected [128, 64]" in msg, msg
    _edit_config(folder, intermediate_size=96)

    entries, _ = read_header(weights)
    keep = [n for n in entries if n != "model.norm.weight"]
    full = llama.from_hf(folder)[1]
    by_name = {n: full[k] if i is None else full["layers"][k][i] for n, k, i in hf_names(CFG)}
    write_file(weights, [(n, torch.Size(entries[n]["shape"])) for n in keep], torch.float32, by_name.__getitem__)
    assert "tensor 'model.norm.weight' (shape [64]) is missing" in error(folder)

    weights.write_bytes(data[: len(data) // 2])
    assert "is truncated: tensor" in error(folder)
    weights.write_bytes(data[:5])
    assert "is truncated: 5 bytes" in error(folder)
    weights.write_bytes(data[:8] + b"\xff" * 16 + data[24:])
    assert "corrupt header (not JSON)" in error(folder)
    weights.unlink()
    assert "has no model.safetensors or model.safetensors.index.json" in error(folder)


def test_to_hf_errors(tmp_path: Path) -> None:
    params = _random_params()
    params["layers"]["wk"] = params["layers"]["wk"][:, :16]
    with pytest.raises(fs.ConfigError, match=r"leaf 'layers/wk' has shape \[2, 16, 64\], expected \[2, 32, 64\]"):
        llama.to_hf(params, CFG, tmp_path)
    with pytest.raises(fs.ConfigError, match=r"dtype torch\.int8 cannot be written"):
        llama.to_hf(_random_params(), CFG, tmp_path, dtype=torch.int8)


def test_train_init_from_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _saved(tmp_path)
    small, small_cfg = tmp_path / "small", llama.Config(128, 32, 1, 4, 2, 64, 32)
    llama.to_hf(llama.init(fs.random.key(0), small_cfg), small_cfg, small)
    for extra, where, needle in [
        (["--dim", "128"], folder, "--dim 128 conflicts with the model's hidden_size 64"),
        (["--seq", "128"], folder, "--seq 128 is longer than the model's max_position_embeddings 64"),
        ([], small, "vocab_size is 128 < 256"),
        ([], tmp_path / "nowhere", "does not exist"),
    ]:
        code = cli_main(["train", *_train_args(tmp_path, where, *extra)])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
