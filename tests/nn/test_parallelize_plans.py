"""``fs.nn.parallelize`` with explicit plans on plain torch modules: one forward psum over ``tp`` per rowwise
linear (``fs.comm_stats``), under sim and dist; every style equal to the unsharded module; FSDP gathers one
bucket per unit (a plain module's: each child of the root); plans and meshes it cannot use are
``fs.FuncshardError``s naming what is wrong.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard import P

MLP_PLAN = {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"}


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)
    )


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _reference(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _step(mesh: fs.Mesh, model: nn.Module, plan: dict[str, str] | None, x: torch.Tensor, **kw):
    """``(loss, grads, stats of the forward alone)`` of the mean square of the module's output on ``mesh``."""
    params, specs, fn = fs.nn.parallelize(model, mesh, plan)
    data = fn.layout.data_axes

    def loss(p: dict, x: torch.Tensor) -> torch.Tensor:
        y = fn(p, x).square().mean()  # [b/data, ...] -> [] (this shard's mean)
        return fs.pmean(y, data) if data else y

    fwd = fs.shard_map(loss, mesh=mesh, in_specs=(specs, fn.batch_spec), out_specs=P(), **kw)
    both = fs.shard_map(
        fs.value_and_grad(loss), mesh=mesh, in_specs=(specs, fn.batch_spec), out_specs=(P(), specs), **kw
    )
    arrays = fs.device_put(params, mesh, specs)
    with fs.comm_stats() as stats:
        fwd(arrays, x)
    value, grads = fs.device_get(both(arrays, x))
    return value, grads, stats


def _mlp_body(mesh: fs.Mesh) -> tuple:
    value, grads, stats = _step(mesh, _mlp(), MLP_PLAN, _x())
    return value, grads, stats.calls("psum", "tp"), stats.calls(None, "tp")


def test_one_forward_psum_per_rowwise_linear(run) -> None:
    ref_loss, ref_grads = _reference(_mlp(), _x())
    for value, grads, tp_psums, tp_calls in run(_mlp_body, {"dp": 2, "tp": 2}):
        assert tp_psums == 2 and tp_calls == 2  # the two rowwise linears' all-reduces, nothing else over tp
        torch.testing.assert_close(value, ref_loss)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


class _Block(nn.Module):
    """A norm, a replicated-output linear, a replicated-input linear, a colwise / rowwise pair with biases."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 8)
        self.back = nn.Linear(8, 8)
        self.w1 = nn.Linear(8, 16)
        self.w2 = nn.Linear(16, 8)
        self.emb = nn.Embedding(12, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(ids))  # [b, s, d]
        h = torch.tanh(self.back(torch.tanh(self.up(h))))
        return self.w2(torch.relu(self.w1(h)))


BLOCK_PLAN = {
    "emb": "vocab",
    "norm": "sequence_parallel",
    "up": "colwise_rep",
    "back": "rowwise_rep",
    "w1": "colwise",
    "w2": "rowwise",
}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("shape", [{"tp": 2}, {"fsdp": 2, "tp": 2}], ids=["tp2", "fsdp2_tp2"])
def test_every_style_equals_the_unsharded_module(shape: dict, check_vma: bool) -> None:
    ids = torch.randint(0, 12, (2, 6), generator=torch.Generator().manual_seed(2))
    ref_loss, ref_grads = _reference(_Block(), ids)
    mesh = fs.make_mesh(shape, backend="sim")
    value, grads, _ = _step(mesh, _Block(), BLOCK_PLAN, ids, check_vma=check_vma)
    torch.testing.assert_close(value, ref_loss)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.counters
def test_fsdp_gathers_one_bucket_per_submodule_before_it_runs() -> None:
    mesh = fs.make_mesh({"fsdp": 2}, backend="sim")
    ref_loss, ref_grads = _reference(_mlp(), _x())
    _, specs, _ = fs.nn.parallelize(_mlp(), mesh, {})
    assert specs["0.weight"] == P("fsdp") and specs["0.bias"] == P("fsdp")
    # the forward alone (the first call: the order recorded), then value_and_grad (the second: prefetched)
    value, grads, stats = _step(mesh, _mlp(), {}, _x())
    assert stats.calls("all_gather", "fsdp") == 4  # each child of the root a unit: weight and bias in one bucket
    torch.testing.assert_close(value, ref_loss)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------- errors


def _tp2() -> fs.Mesh:
    return fs.make_mesh({"tp": 2}, backend="sim")


def test_a_pattern_naming_no_module_is_an_error_naming_it() -> None:
    with pytest.raises(fs.ConfigError, match=r"pattern 'layers\.\*\.q_proj' names no submodule of the Sequential"):
        fs.nn.parallelize(_mlp(), _tp2(), {"0": "colwise", "layers.*.q_proj": "colwise"})


def test_an_unknown_style_is_an_error_naming_it() -> None:
    with pytest.raises(fs.ConfigError, match=r"gives '2' the style 'rowise', which parallelize does not know"):
        fs.nn.parallelize(_mlp(), _tp2(), {"0": "colwise", "2": "rowise"})


def test_a_style_the_module_cannot_take_is_an_error() -> None:
    with pytest.raises(fs.ConfigError, match=r"gives '1' \(ReLU\) the style 'colwise'"):
        fs.nn.parallelize(_mlp(), _tp2(), {"1": "colwise"})
    with pytest.raises(fs.ConfigError, match=r"'vocab', which applies to torch\.nn\.Embedding only"):
        fs.nn.parallelize(_mlp(), _tp2(), {"0": "vocab"})


def test_a_linear_subclass_with_its_own_forward_is_refused() -> None:
    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    with pytest.raises(fs.ConfigError, match=r"'0' is a Scaled, a Linear with its own forward"):
        fs.nn.parallelize(nn.Sequential(Scaled(4, 4)), _tp2(), {"0": "colwise"})


def test_a_dim_the_axes_do_not_divide_is_a_sharding_error() -> None:
    with pytest.raises(fs.ShardingError, match=r"parameter '0\.weight' of shape \(6, 8\) .* not divisible by tp = 4"):
        fs.nn.parallelize(nn.Sequential(nn.Linear(8, 6)), fs.make_mesh({"tp": 4}, backend="sim"), {"0": "colwise"})


def test_an_unknown_axis_and_a_call_outside_shard_map_are_errors() -> None:
    with pytest.raises(fs.ShardingError, match=r"has axis 'ep'; parallelize knows dp, fsdp, tp"):
        fs.nn.parallelize(_mlp(), fs.make_mesh({"ep": 2}, backend="sim"), {})
    params, _, fn = fs.nn.parallelize(_mlp(), _tp2(), MLP_PLAN)
    with pytest.raises(fs.ShardingError, match="called outside shard_map"):
        fn(params, _x())


def test_no_plan_on_a_module_without_a_tp_plan_is_an_error() -> None:
    with pytest.raises(
        fs.ConfigError, match=r"plan=None reads config\.base_model_tp_plan, but the Sequential has none"
    ):
        fs.nn.parallelize(_mlp(), _tp2())


def test_a_head_split_by_tp_is_an_error_naming_the_head_count() -> None:
    transformers = pytest.importorskip("transformers")
    conf = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    with pytest.raises(fs.ShardingError, match=r"config\.num_key_value_heads=1 is not divisible by tp=2"):
        fs.nn.parallelize(transformers.LlamaForCausalLM(conf), _tp2())


class _Branchy(nn.Module):
    """Control flow on a local shard's values: the devices of ``tp`` take different branches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)  # [b, 8/tp]: this device's features
        if h.sum() > 0:  # data-dependent: differs across the devices of tp
            return self.down(torch.relu(h))
        return h[..., :4]


def test_data_dependent_control_flow_across_ranks_is_a_collective_deadlock_error() -> None:
    mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    params, specs, fn = fs.nn.parallelize(_Branchy(), mesh, {"up": "colwise", "down": "rowwise"})
    f = fs.shard_map(fn, mesh=mesh, in_specs=(specs, fn.batch_spec), out_specs=fn.batch_spec)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(fs.ShardingError, match=r"collective deadlock: .* waits in psum"):
        f(params, x)
