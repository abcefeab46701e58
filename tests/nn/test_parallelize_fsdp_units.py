"""``fs.nn.parallelize`` on an ``fsdp`` axis gathers per FSDP unit, as FSDP2's ``fully_shard`` on each decoder layer
and the root: a Hugging Face Llama step is one all-gather and one reduce-scatter per decoder layer plus one of the
root's loose parameters (embedding, final norm, head), not one per parameter or per linear (``fs.comm_stats``),
under sim and dist; the loss and every gradient equal the unsharded module's. ``fsdp_units`` chooses the units
(path patterns or class names); one naming nothing is a ``ConfigError``. With ``reshard_after_forward=True`` each
layer is gathered once more, in the backward, with the same numbers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard import P

pytestmark = pytest.mark.counters

LAYERS = 2
SIZES = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16,
    "attn_implementation": "eager",
}


def _llama(tie: bool = False) -> nn.Module:
    """A tiny random ``LlamaForCausalLM`` (norms not all ones)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, tie_word_embeddings=tie))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, SIZES["vocab_size"], (4, 12), generator=torch.Generator().manual_seed(1))
    labels = tokens.clone()
    labels[1, :5] = -100
    return tokens, labels


def _reference(model: nn.Module, *args: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(args[0], labels=args[1]).loss if len(args) == 2 else model(args[0]).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _step(mesh: fs.Mesh, model: nn.Module, *args: torch.Tensor, **kw: object) -> tuple:
    """``(loss, grads, {(collective, axes): calls})`` of one value_and_grad step of the parallelized module (the
    second call: the first recorded the units' order, the second prefetches by it)."""
    params, specs, fn = fs.nn.parallelize(model, mesh, {}, **kw)
    bs, data = fn.batch_spec, fn.layout.data_axes

    def loss(p: dict, *a: torch.Tensor) -> torch.Tensor:
        if len(a) == 2:  # a causal LM: the global mean over the labelled tokens
            return fn(p, a[0], labels=a[1]).loss
        return fs.pmean(fn(p, a[0]).square().mean(), data)  # [b/fsdp, d] -> []

    step = fs.shard_map(fs.value_and_grad(loss), mesh=mesh, in_specs=(specs, *[bs] * len(args)), out_specs=(P(), specs))
    arrays = fs.device_put(params, mesh, specs)
    step(arrays, *args)
    with fs.comm_stats() as stats:
        value, grads = step(arrays, *args)
    counts = {k: c for k, (c, _) in stats.rows().items()}
    return fs.device_get(value), fs.device_get(grads), counts


def _assert_equal(got: tuple, ref: tuple, what: str) -> None:
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-6, msg=f"{what} loss")
    for name, g in ref[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-4, atol=1e-6, msg=f"{what} {name}")


def _llama_body(mesh: fs.Mesh, tie: bool) -> tuple:
    return _step(mesh, _llama(tie), *_batch())


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_one_gather_and_one_reduce_scatter_per_decoder_layer(run, tie: bool) -> None:
    ref = _reference(_llama(tie), *_batch())
    for value, grads, counts in run(_llama_body, {"fsdp": 2}, tie):
        # the decoder layers (Hugging Face's _no_split_modules), then the root's embedding, final norm and head
        # (a tied head: the embedding's weight, gathered once): one flat bucket each
        assert counts[("all_gather", "fsdp")] == LAYERS + 1
        assert counts[("psum_scatter", "fsdp")] == LAYERS + 1  # the gathers' backward, one bucket per unit
        assert set(counts) == {("all_gather", "fsdp"), ("psum_scatter", "fsdp"), ("psum", "fsdp")}
        assert counts[("psum", "fsdp")] == 2  # the loss's global token count and its sum over the batch shards
        _assert_equal((value, grads), ref, f"tie={tie}")


def _reshard_body(mesh: fs.Mesh) -> tuple:
    kept = _step(mesh, _llama(), *_batch())
    resharded = _step(mesh, _llama(), *_batch(), reshard_after_forward=True)
    same = torch.equal(kept[0], resharded[0]) and all(torch.equal(g, resharded[1][n]) for n, g in kept[1].items())
    return resharded, same


def test_reshard_after_forward_gathers_each_layer_again_in_the_backward(run) -> None:
    """FSDP2's ``reshard_after_forward=True``: each decoder layer's gathered weights are dropped after its forward
    and gathered again for its backward (one more all-gather per layer, the root's kept); the numbers are the
    kept run's, bit for bit, and the unsharded module's."""
    ref = _reference(_llama(), *_batch())
    for (value, grads, counts), same in run(_reshard_body, {"fsdp": 2}):
        assert counts[("all_gather", "fsdp")] == 2 * LAYERS + 1
        assert counts[("psum_scatter", "fsdp")] == LAYERS + 1  # the gradients still go through the forward's gather
        assert same, "resharding changed a number"
        _assert_equal((value, grads), ref, "reshard_after_forward")


def test_fsdp_with_tp_gathers_per_unit_and_replica_set() -> None:
    """Under ``fsdp x tp`` a unit's parameters split over ``tp`` and those replicated over it (the norms) gather in
    two buckets (they vary over different axes); the gradients stay the unsharded module's."""
    mesh = fs.make_mesh({"fsdp": 2, "tp": 2}, backend="sim")
    model = _llama()
    params, specs, fn = fs.nn.parallelize(model, mesh)
    step = fs.shard_map(
        fs.value_and_grad(lambda p, t, y: fn(p, t, labels=y).loss),
        mesh=mesh,
        in_specs=(specs, fn.batch_spec, fn.batch_spec),
        out_specs=(P(), specs),
    )
    with fs.comm_stats() as stats:
        value, grads = fs.device_get(step(fs.device_put(params, mesh, specs), *_batch()))
    # each layer: its linears (tp-split) and its two norms; the root: embedding and head (tp-split), final norm
    assert stats.calls("all_gather", "fsdp") == 2 * LAYERS + 2
    assert stats.calls("psum_scatter", "fsdp") == 2 * LAYERS + 2
    _assert_equal((value, grads), _reference(_llama(), *_batch()), "fsdp2 x tp2")


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 8))


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize(
    ("units", "gathers"),
    [(None, 3), ((), 1), (["2"], 2), (["Linear"], 3)],
    ids=["children", "root_only", "one_path", "class_name"],
)
def test_fsdp_units_choose_the_buckets(units: list[str] | None, gathers: int) -> None:
    """A plain module: by default each child of the root is a unit; ``()``: the whole module is one; a path or a
    class name makes those submodules units, the rest the root's."""
    mesh = fs.make_mesh({"fsdp": 2}, backend="sim")
    value, grads, counts = _step(mesh, _mlp(), _x(), fsdp_units=units)
    assert counts[("all_gather", "fsdp")] == gathers
    assert counts[("psum_scatter", "fsdp")] == gathers
    _assert_equal((value, grads), _reference(_mlp(), _x()), f"fsdp_units={units}")


def test_an_fsdp_unit_naming_nothing_is_an_error() -> None:
    mesh = fs.make_mesh({"fsdp": 2}, backend="sim")
    with pytest.raises(fs.ConfigError, match=r"the fsdp unit 'layers\.\*' names no submodule or class of the Seq"):
        fs.nn.parallelize(_mlp(), mesh, {}, fsdp_units=["layers.*"])
