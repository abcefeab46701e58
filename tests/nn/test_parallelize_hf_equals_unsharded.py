"""``fs.nn.parallelize`` of Hugging Face causal LMs (Llama, Qwen3, Mistral; tiny, random, eager attention): the loss
and every gradient on a mesh equal the unsharded module's (float32, rtol 1e-4), under sim on ``tp=2``,
``dp=2 x tp=2``, ``fsdp=2 x tp=2`` and ``fsdp=4``, and under dist (4 gloo processes, ``dp=2 x tp=2``); with the
head's vocabulary split (``loss_parallel``), tied embeddings, and ``check_vma=False``.
"""

from __future__ import annotations

import pytest
import torch

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
    "attn_implementation": "eager",
}
MESHES = {
    "tp2": {"tp": 2},
    "dp2_tp2": {"dp": 2, "tp": 2},
    "fsdp2_tp2": {"fsdp": 2, "tp": 2},
    "fsdp4": {"fsdp": 4},
}
KINDS = ("llama", "qwen3", "mistral")


def _model(kind: str, tie: bool = False) -> torch.nn.Module:
    """A tiny random ``...ForCausalLM`` of ``kind`` (norms not all ones, weights of std 0.1)."""
    transformers = pytest.importorskip("transformers")
    conf_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    extra = {"head_dim": 8} if kind == "qwen3" else {}
    torch.manual_seed(0)
    model = model_cls(conf_cls(**SIZES, **extra, tie_word_embeddings=tie))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[4, 16]`` and labels with -100 spread unevenly over the sequences (and the data shards)."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, SIZES["vocab_size"], (4, 16), generator=g)
    labels = tokens.clone()
    labels[0, :9] = -100
    labels[3, -2:] = -100
    return tokens, labels


def _reference(kind: str, tie: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = _model(kind, tie)
    tokens, labels = _batch()
    out = model(tokens, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _sharded(mesh: fs.Mesh, kind: str, tie: bool, loss_parallel: bool, check_vma: bool) -> tuple:
    """``(loss, grads)`` of the parallelized model on ``mesh`` (its own plan), gathered."""
    model = _model(kind, tie)
    params, specs, fn = fs.nn.parallelize(model, mesh, loss_parallel=loss_parallel)
    bs = fn.batch_spec
    step = fs.shard_map(
        fs.value_and_grad(lambda p, t, y: fn(p, t, labels=y).loss),
        mesh=mesh,
        in_specs=(specs, bs, bs),
        out_specs=(P(), specs),
        check_vma=check_vma,
    )
    tokens, labels = _batch()
    return fs.device_get(step(fs.device_put(params, mesh, specs), tokens, labels))


def _assert_equal(got: tuple, ref: tuple, what: str) -> None:
    loss, grads = got
    ref_loss, ref_grads = ref
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-6, msg=f"{what} loss")
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=f"{what} {name}")


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("kind", KINDS)
def test_loss_and_grads_equal_the_unsharded_module(kind: str, mesh_name: str) -> None:
    mesh = fs.make_mesh(MESHES[mesh_name], backend="sim")
    _assert_equal(_sharded(mesh, kind, False, False, True), _reference(kind), f"{kind} {mesh_name}")


@pytest.mark.parametrize(
    ("kind", "mesh_name", "check_vma"),
    [("qwen3", "dp2_tp2", True), ("mistral", "fsdp2_tp2", False), ("llama", "tp2", False)],
)
def test_vocab_split_head_with_tied_embeddings(kind: str, mesh_name: str, check_vma: bool) -> None:
    mesh = fs.make_mesh(MESHES[mesh_name], backend="sim")
    got = _sharded(mesh, kind, True, True, check_vma)
    _assert_equal(got, _reference(kind, tie=True), f"{kind} {mesh_name} tied, loss_parallel, check_vma={check_vma}")


def _dist_body(mesh: fs.Mesh) -> dict[str, tuple]:
    return {kind: _sharded(mesh, kind, False, kind == "qwen3", True) for kind in KINDS}


@pytest.mark.dist
@pytest.mark.slow
def test_loss_and_grads_equal_the_unsharded_module_dist() -> None:
    from _dist_pool import run_body

    refs = {kind: _reference(kind) for kind in KINDS}
    for rank, got in enumerate(run_body("dist", _dist_body, MESHES["dp2_tp2"])):
        for kind in KINDS:
            _assert_equal(got[kind], refs[kind], f"dist rank {rank} {kind}")


def _logits_body(mesh: fs.Mesh) -> torch.Tensor:
    model = _model("llama")
    params, specs, fn = fs.nn.parallelize(model, mesh, loss_parallel=True)
    f = fs.shard_map(
        lambda p, t: fn(p, t).logits, mesh=mesh, in_specs=(specs, fn.batch_spec), out_specs=P("dp", None, "tp")
    )
    return fs.device_get(f(fs.device_put(params, mesh, specs), _batch()[0]))


def test_logits_of_a_vocab_split_head_are_its_blocks() -> None:
    with torch.no_grad():
        ref = _model("llama")(_batch()[0]).logits
    got = _logits_body(fs.make_mesh({"dp": 2, "tp": 2}, backend="sim"))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
