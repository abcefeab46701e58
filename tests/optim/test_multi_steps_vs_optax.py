"""``fs.optim.multi_steps``: optax's ``MultiSteps`` on the same numbers (float32), and gradient accumulation over k
microbatches equal to one step on the k-times larger batch for the sharded Llama."""

from __future__ import annotations

from typing import Any

import numpy as np
import optree
import pytest
import torch

import funcshard as fs
from funcshard import P, optim
from funcshard.models import llama

pytestmark = pytest.mark.oracle

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")


def _grads(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)} for _ in range(n)]


@pytest.mark.parametrize("kind", ["sgd_momentum", "adamw"])
@pytest.mark.parametrize("k", [1, 3])
def test_matches_optax_multisteps(kind: str, k: int) -> None:
    if kind == "sgd_momentum":
        ours, theirs = optim.sgd(0.1, momentum=0.9), optax.sgd(0.1, momentum=0.9)
    else:
        ours = optim.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
        theirs = optax.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    opt, ref = optim.multi_steps(ours, k), optax.MultiSteps(theirs, every_k_schedule=k)
    g0 = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(4, 3, generator=g0), "b": torch.randn(3, generator=g0)}
    jparams = {n: jax.numpy.asarray(v.numpy()) for n, v in params.items()}
    state, jstate = opt.init(params), ref.init(jparams)
    for i, grads in enumerate(_grads(2 * k + 1)):
        params, state = opt.update(grads, state, params)
        jg = {n: jax.numpy.asarray(v.numpy()) for n, v in grads.items()}
        ups, jstate = ref.update(jg, jstate, jparams)
        jparams = optax.apply_updates(jparams, ups)
        for n in params:
            np.testing.assert_allclose(params[n].numpy(), np.asarray(jparams[n]), rtol=1e-6, atol=1e-7, err_msg=f"{i}")
        assert int(state.mini_step) == int(jstate.mini_step)
        assert int(state.gradient_step) == int(jstate.gradient_step)


def test_transform_gives_zero_updates_between_steps_and_errors() -> None:
    opt = optim.multi_steps(optim.sgd(1.0), 2)
    p = {"w": torch.zeros(2)}
    updates, state = opt.transform({"w": torch.ones(2)}, opt.init(p), p)
    assert torch.equal(updates["w"], torch.zeros(2)) and int(state.mini_step) == 1
    updates, state = opt.transform({"w": torch.full((2,), 3.0)}, state, p)
    assert torch.equal(updates["w"], torch.full((2,), -2.0)) and int(state.mini_step) == 0
    assert torch.equal(state.acc_grads["w"], torch.zeros(2))
    with pytest.raises(fs.ConfigError, match="k must be a positive int"):
        optim.multi_steps(optim.sgd(0.1), 0)
    with pytest.raises(fs.ConfigError, match="opt must be an Optimizer"):
        optim.multi_steps("adamw", 2)
    with pytest.raises(fs.ShardingError, match="MultiStepsState"):
        opt.update({"w": torch.ones(2)}, optim.sgd(1.0).init(p), p)


def test_grad_accumulation_equals_big_batch_llama() -> None:
    cfg = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
    mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    k, batch = 2, 8
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, 16), generator=g)
    targets = tokens.roll(-1, dims=1)
    params = fs.device_put(llama.init(fs.random.key(0), cfg), mesh, specs)
    # (SGD: linear in the gradient; Adam's first step, g / |g|, would turn rounding in tiny gradients into sign
    # flips of a full lr)
    inner = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.5, momentum=0.9, weight_decay=0.1))

    def stepper(opt: optim.Optimizer) -> Any:
        def step(p: Any, s: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
            loss, grads = fs.value_and_grad(llama.loss)(p, x, y, cfg)
            return (loss, *opt.update(grads, s, p))

        sspecs = opt.state_specs(specs)
        return fs.shard_map(step, mesh=mesh, in_specs=(specs, sspecs, bs, bs), out_specs=(P(), specs, sspecs))

    big_loss, big_params, _ = stepper(inner)(
        params, fs.device_put(inner.init(fs.device_get(params)), mesh, inner.state_specs(specs)), tokens, targets
    )
    acc = optim.multi_steps(inner, k)
    state = fs.device_put(acc.init(fs.device_get(params)), mesh, acc.state_specs(specs))
    step = stepper(acc)
    p, losses = params, []
    for x, y in zip(tokens.chunk(k), targets.chunk(k), strict=True):
        loss, p, state = step(p, state, x, y)
        losses.append(fs.device_get(loss))
    torch.testing.assert_close(sum(losses) / k, fs.device_get(big_loss), rtol=1e-5, atol=0)
    for a, b in zip(optree.tree_leaves(fs.device_get(p)), optree.tree_leaves(fs.device_get(big_params)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_train_job_grad_accum_and_remat_flags(tmp_path: Any) -> None:
    """``--grad-accum 2`` (and ``--remat``) train the same model as one step on the whole batch."""
    from funcshard.job import cli, train

    data = tmp_path / "data"
    data.mkdir()
    for i in range(16):
        (data / f"m{i}.py").write_text("".join(f"def f_{i}_{j}(x):\n    return x * {j} - {i}\n\n" for j in range(12)))
    tiny = ["--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--seq", "32"]
    common = [*tiny, "--batch", "8", "--steps", "3", "--eval-every", "3", "--data", str(data), "--lr", "1e-3"]

    def run(name: str, *extra: str) -> dict[str, Any]:
        out = tmp_path / name
        args = [*common, "--ckpt-dir", str(out / "ckpt"), "--out", str(out), *extra]
        return train.train(cli.train_parser().parse_args(args))

    whole, accum = run("whole"), run("accum", "--grad-accum", "2", "--remat", "selective")
    np.testing.assert_allclose(accum["losses"], whole["losses"], rtol=1e-5)
    for a, b in zip(
        optree.tree_leaves(fs.device_get(accum["params"])),
        optree.tree_leaves(fs.device_get(whole["params"])),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with pytest.raises(cli.UsageError, match="multiple of 6"):
        run("bad", "--grad-accum", "3", "--mesh", "dp=2")
