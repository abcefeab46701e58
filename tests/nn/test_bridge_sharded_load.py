"""``fs.nn.from_pretrained(path, mesh)`` (issue #31 part 2, the bridge): a Hugging Face folder (Qwen3 with tied
embeddings, Mistral) built on the meta device, its parameters read shard by shard into ``fs.Array``s: their values
are the folder's (sim ``tp=2``, ``dp=2 x tp=2``, ``fsdp=2 x tp=2``; dist ``fsdp=2``, where each rank's folder holds
NaN wherever that rank holds no block, so only its own blocks can have been read), the buffers (rotary
``inv_freq``) are the model's, and the loss and every gradient equal the unsharded transformers model's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _blocks import shard_slices

import funcshard as fs
from funcshard import P

pytestmark = pytest.mark.oracle

SIZES = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}
MESHES = {"tp2": {"tp": 2}, "dp2_tp2": {"dp": 2, "tp": 2}, "fsdp2_tp2": {"fsdp": 2, "tp": 2}}
TIED = {"qwen3": True, "mistral": False}


def _model(kind: str) -> torch.nn.Module:
    """A tiny random ``...ForCausalLM`` (norms not all ones, weights of std 0.1), eager attention."""
    transformers = pytest.importorskip("transformers")
    conf_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    extra = {"head_dim": 8} if kind == "qwen3" else {}
    torch.manual_seed(0)
    conf = conf_cls(**SIZES, **extra, tie_word_embeddings=TIED[kind], attn_implementation="eager")
    model = model_cls(conf)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def _folder(tmp: Path, kind: str) -> Path:
    folder = tmp / kind
    _model(kind).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("kind", sorted(TIED))
def test_values_and_buffers_are_the_folders(tmp_path: Path, kind: str, mesh_name: str) -> None:
    folder, ref = _folder(tmp_path, kind), _model(kind)
    mesh = fs.make_mesh(MESHES[mesh_name], backend="sim")
    params, specs, fn = fs.nn.from_pretrained(folder, mesh, loss_parallel=True)
    want = dict(ref.named_parameters())  # (tied: the head is the embedding, listed once)
    assert sorted(params) == sorted(want)
    for name, a in params.items():
        assert isinstance(a, fs.Array) and a.spec == specs[name], name
        assert torch.equal(fs.device_get(a), want[name].detach()), name
    assert any(a.spec != P() for a in params.values())
    for name, b in ref.named_buffers():
        assert torch.equal(dict(fn.module.named_buffers())[name], b), name
    assert all(p.is_meta for p in fn.module.parameters())  # the module itself holds no weights


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, SIZES["vocab_size"], (4, 16), generator=g)
    labels = tokens.clone()
    labels[0, :9] = -100
    return tokens, labels


@pytest.mark.parametrize("kind", sorted(TIED))
def test_loss_and_grads_equal_the_unsharded_model(tmp_path: Path, kind: str) -> None:
    folder, ref = _folder(tmp_path, kind), _model(kind)
    tokens, labels = _batch()
    out = ref(tokens, labels=labels)
    out.loss.backward()
    mesh = fs.make_mesh(MESHES["fsdp2_tp2"], backend="sim")
    params, specs, fn = fs.nn.from_pretrained(folder, mesh, loss_parallel=True)
    pspecs, bs = {n: specs[n] for n in params}, fn.batch_spec
    step = fs.shard_map(
        fs.value_and_grad(lambda p, t, y: fn(p, t, labels=y).loss),
        mesh=mesh,
        in_specs=(pspecs, bs, bs),
        out_specs=(P(), pspecs),
    )
    loss, grads = fs.device_get(step(params, tokens, labels))
    torch.testing.assert_close(loss, out.loss.detach(), rtol=1e-4, atol=1e-6)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_missing_or_misshapen_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _folder(tmp_path, "mistral")
    state = load_file(folder / "model.safetensors")
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in state.items() if k != name}, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(fs.ConfigError, match=f"parameter '{name}'.*missing"):
        fs.nn.from_pretrained(folder, mesh)
    save_file({**state, name: state[name][:, :4].contiguous()}, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(fs.ConfigError, match=f"tensor '{name}'.*shape \\[48, 4\\]"):
        fs.nn.from_pretrained(folder, mesh)


DIST_MESH = {"fsdp": 2}


def _own_blocks_only(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """The model's parameters with every element that process ``rank``'s devices do not hold set to NaN."""
    mesh = fs.make_mesh(DIST_MESH, backend="sim")
    _, specs, _ = fs.nn.parallelize(model, mesh)
    coords = mesh.device_coords()[rank]
    out = {}
    for name, p in model.named_parameters():
        full = torch.full_like(p.detach(), math.nan)
        index = shard_slices(tuple(p.shape), specs[name], DIST_MESH, coords)
        full[index] = p.detach()[index]
        out[name] = full
    return out


def _load_body(mesh: fs.Mesh, folders: list[str]) -> dict[str, torch.Tensor]:
    params, _, _ = fs.nn.from_pretrained(folders[mesh.process_index()], mesh)
    return {n: fs.device_get(a) for n, a in params.items()}


def test_each_process_reads_only_its_own_blocks(run, backend: str, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = _model("mistral")
    folders = []
    for r in range(2 if backend == "dist" else 1):
        folder = tmp_path / f"rank{r}"
        model.save_pretrained(folder, safe_serialization=True)  # config.json (and the weights, replaced below)
        if backend == "dist":
            save_file(_own_blocks_only(model, r), folder / "model.safetensors", metadata={"format": "pt"})
        folders.append(str(folder))
    want = {n: p.detach() for n, p in model.named_parameters()}
    for loaded in run(_load_body, DIST_MESH, folders):
        assert sorted(loaded) == sorted(want)
        for name, got in loaded.items():
            assert torch.equal(got, want[name]), name


@pytest.mark.parametrize("kind", ["mistral", "mixtral"])
def test_the_train_jobs_bridge_loads_sharded_or_through_transformers_renames(tmp_path: Path, kind: str) -> None:
    """The job's bridge (``train --init-from`` a non-Llama folder) reads a folder by shards; a Mixtral folder, whose
    per-expert tensors transformers fuses as it loads them, is read whole by transformers: the values either way."""
    transformers = pytest.importorskip("transformers")
    from funcshard.job import bridge

    if kind == "mixtral":
        conf = transformers.MixtralConfig(**SIZES, num_local_experts=4)
        torch.manual_seed(0)
        transformers.MixtralForCausalLM(conf).save_pretrained(tmp_path / kind)
        folder = tmp_path / kind
    else:
        folder = _folder(tmp_path, kind)
    want = dict(transformers.AutoModelForCausalLM.from_pretrained(folder).named_parameters())
    mesh = fs.make_mesh({"fsdp": 2, "tp": 2}, backend="sim")
    _, specs, _ = fs.nn.parallelize(bridge.load_model(str(folder)), mesh)
    specs = {n: specs[n] for n in want}
    got = bridge.load_weights(str(folder), mesh, specs)
    assert sorted(got) == sorted(want)
    for name, a in got.items():
        assert a.spec == specs[name] and torch.equal(fs.device_get(a), want[name].detach()), name
