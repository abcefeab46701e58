"""``fs.optim`` and ``value_and_grad``: sharded optimiser steps equal ``torch.optim`` on the unsharded params.

Every sharded body runs under ``sim`` and under ``dist`` (gloo workers) through the ``run`` fixture.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from _optim_trees import CLIP_SHAPES, CLIP_SPECS, MESH, _close, _mse, _rand, _torch_steps

import funcshard as fs
from funcshard import P, optim, value_and_grad

pytestmark = pytest.mark.oracle

# a Llama-sized toy: vocab-parallel embedding, stacked column / row parallel layers, replicated norm
LLAMA_SPECS = {
    "embed": P("tp", None),
    "layers": {"wq": P(None, "tp", None), "wo": P(None, None, "tp")},
    "norm": P(),
    "head": P("tp"),
}
LLAMA_SHAPES = {"embed": (64, 32), "layers": {"wq": (2, 32, 32), "wo": (2, 32, 32)}, "norm": (32,), "head": (64, 32)}


# ------------------------------------------------------------------------------- (a) AdamW on a sharded tree


def _adamw_body(mesh: fs.Mesh, check_vma: bool, scheduled: bool) -> str:
    params = _rand(LLAMA_SHAPES, 0)
    grads_seq = [_rand(LLAMA_SHAPES, k + 1) for k in range(5)]
    lr = optim.warmup_cosine(1e-2, 2, 5, final_lr=1e-3) if scheduled else 1e-2
    opt = optim.adamw(lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    sspecs = opt.state_specs(LLAMA_SPECS)
    step = fs.shard_map(
        lambda p, g, s: opt.update(g, s, p),
        mesh=mesh,
        in_specs=(LLAMA_SPECS, LLAMA_SPECS, sspecs),
        out_specs=(LLAMA_SPECS, sspecs),
        check_vma=check_vma,
    )
    p = fs.device_put(params, mesh, LLAMA_SPECS)
    state = opt.init(p)  # Arrays in, Arrays out: the state is laid out like the params
    assert state.mu["embed"].spec == P("tp", None) and state.count.spec == P()
    for g in grads_seq:
        p, state = step(p, g, state)

    lrs = [lr(k) for k in range(5)] if scheduled else None
    ref, topt, ref_leaves, _ = _torch_steps(
        params,
        grads_seq,
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False),
        lrs=lrs,
    )
    _close(p, ref)
    assert optree.tree_map(lambda a: a.spec, p, is_leaf=lambda x: isinstance(x, fs.Array)) == LLAMA_SPECS
    mu = optree.tree_leaves(fs.device_get(state.mu))
    nu = optree.tree_leaves(fs.device_get(state.nu))
    for r, m, v in zip(ref_leaves, mu, nu, strict=True):
        torch.testing.assert_close(m, topt.state[r]["exp_avg"], rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(v, topt.state[r]["exp_avg_sq"], rtol=1e-6, atol=1e-8)
    assert int(fs.device_get(state.count)) == 5
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_adamw_sharded_matches_torch(run, check_vma: bool) -> None:
    assert set(run(_adamw_body, MESH, check_vma, False)) == {"ok"}


def test_adamw_sharded_with_schedule_matches_torch(run) -> None:
    assert set(run(_adamw_body, MESH, True, True)) == {"ok"}


def test_adamw_transform_plus_apply_updates_matches_update() -> None:
    params, grads = _rand(LLAMA_SHAPES, 0), _rand(LLAMA_SHAPES, 1)
    opt = optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(params)
    new, s1 = opt.update(grads, state, params)
    updates, s2 = opt.transform(grads, state, params)
    _close(optim.apply_updates(params, updates), new)
    _close(s1.mu, s2.mu)
    for leaf in optree.tree_leaves(params):  # pure: nothing changed in place
        assert leaf._version == 0


def test_init_inside_shard_map_equals_init_outside() -> None:
    mesh = fs.make_mesh(MESH, backend="sim")
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
    sspecs = opt.state_specs(LLAMA_SPECS)
    params = _rand(LLAMA_SHAPES, 0)
    inside = fs.shard_map(opt.init, mesh=mesh, in_specs=(LLAMA_SPECS,), out_specs=sspecs)(params)
    outside = opt.init(params)
    _close(inside, outside)
    assert outside[1].count.dtype == torch.int64 and outside[1].count.dim() == 0


# ------------------------------------------------------------------------------- (b) global-norm clipping


def _clip_body(mesh: fs.Mesh, check_vma: bool) -> str:
    params = _rand(CLIP_SHAPES, 0)
    grads = _rand(CLIP_SHAPES, 1)
    for max_norm in (1.0, 100.0):  # clipped / let through
        clip = optim.clip_by_global_norm(max_norm)
        sspecs = clip.state_specs(CLIP_SPECS)
        f = fs.shard_map(
            lambda g, s, p, clip=clip: clip.transform(g, s, p),
            mesh=mesh,
            in_specs=(CLIP_SPECS, sspecs, CLIP_SPECS),
            out_specs=(CLIP_SPECS, sspecs),
            check_vma=check_vma,
        )
        with fs.comm_stats() as stats:
            updates, state = f(grads, clip.init(params), params)
        # one psum per distinct axis set: {tp}, {dp, tp}, {dp}; none for the replicated leaves
        assert stats.calls("psum") == 3, stats.table()
        assert stats.calls("psum", "tp") == stats.calls("psum", ("dp", "tp")) == stats.calls("psum", "dp") == 1
        _, _, ref_leaves, norms = _torch_steps(params, [grads], lambda ps: torch.optim.SGD(ps, lr=0.0), clip=max_norm)
        torch.testing.assert_close(fs.device_get(state.norm), norms[0], rtol=1e-6, atol=0)
        ref = optree.tree_unflatten(optree.tree_structure(grads), [r.grad for r in ref_leaves])
        _close(updates, ref)

    grads_seq = [_rand(CLIP_SHAPES, k + 1, scale=0.15 * (k + 1)) for k in range(3)]  # clipped from step 2 on
    cases = [
        (optim.sgd(0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False)),
        (
            optim.adamw(1e-2, b2=0.95, weight_decay=0.1),
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False),
        ),
    ]
    for inner, make in cases:
        opt = optim.chain(optim.clip_by_global_norm(2.0), inner)
        sspecs = opt.state_specs(CLIP_SPECS)
        step = fs.shard_map(
            lambda p, g, s, opt=opt: opt.update(g, s, p),
            mesh=mesh,
            in_specs=(CLIP_SPECS, CLIP_SPECS, sspecs),
            out_specs=(CLIP_SPECS, sspecs),
            check_vma=check_vma,
        )
        p, state = params, opt.init(params)
        norms_ours = []
        for g in grads_seq:
            p, state = step(p, g, state)
            norms_ours.append(fs.device_get(state[0].norm))
        ref, _, _, norms = _torch_steps(params, grads_seq, make, clip=2.0)
        torch.testing.assert_close(torch.stack(norms_ours), torch.stack(norms), rtol=1e-6, atol=0)
        assert norms[0] < 2.0 < norms[-1]
        _close(p, ref, rtol=1e-5)
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_clip_by_global_norm_sharded_matches_torch(run, check_vma: bool) -> None:
    assert set(run(_clip_body, MESH, check_vma)) == {"ok"}


def test_clip_outside_shard_map_matches_torch() -> None:
    grads = _rand(CLIP_SHAPES, 1)
    clip = optim.clip_by_global_norm(1.5)
    updates, state = clip.transform(grads, clip.init(grads))
    _, _, ref_leaves, norms = _torch_steps(grads, [grads], lambda ps: torch.optim.SGD(ps, lr=0.0), clip=1.5)
    torch.testing.assert_close(state.norm, norms[0], rtol=1e-6, atol=0)
    _close(updates, optree.tree_unflatten(optree.tree_structure(grads), [r.grad for r in ref_leaves]))
    assert optim.global_norm({}).item() == 0.0


# ------------------------------------------------------------------------------- (c) SGD


def _sgd_body(mesh: fs.Mesh, momentum: float, nesterov: bool, weight_decay: float) -> str:
    params = _rand(LLAMA_SHAPES, 0)
    grads_seq = [_rand(LLAMA_SHAPES, k + 1) for k in range(4)]
    opt = optim.sgd(0.05, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    sspecs = opt.state_specs(LLAMA_SPECS)
    step = fs.shard_map(
        lambda p, g, s: opt.update(g, s, p),
        mesh=mesh,
        in_specs=(LLAMA_SPECS, LLAMA_SPECS, sspecs),
        out_specs=(LLAMA_SPECS, sspecs),
    )
    p, state = params, opt.init(params)
    for g in grads_seq:
        p, state = step(p, g, state)
    ref, topt, ref_leaves, _ = _torch_steps(
        params,
        grads_seq,
        lambda ps: torch.optim.SGD(
            ps, lr=0.05, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, foreach=False
        ),
    )
    _close(p, ref)
    if momentum:
        for r, b in zip(ref_leaves, optree.tree_leaves(fs.device_get(state.momentum)), strict=True):
            torch.testing.assert_close(b, topt.state[r]["momentum_buffer"], rtol=1e-6, atol=1e-8)
    else:
        assert state.momentum is None
    return "ok"


@pytest.mark.parametrize(
    ("momentum", "nesterov", "weight_decay"),
    [(0.0, False, 0.0), (0.9, False, 0.01), (0.9, True, 0.0)],
    ids=["plain", "momentum_wd", "nesterov"],
)
def test_sgd_sharded_matches_torch(run, momentum: float, nesterov: bool, weight_decay: float) -> None:
    assert set(run(_sgd_body, MESH, momentum, nesterov, weight_decay)) == {"ok"}


# ------------------------------------------------------------------------------- (d) schedules


def test_warmup_cosine_values() -> None:
    s = optim.warmup_cosine(1.0, 10, 110, final_lr=0.1)
    assert s(0) == 0.0
    assert s(5) == pytest.approx(0.5)
    assert s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.55)  # half-way through the decay: the mean of peak and final
    assert s(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert s(110) == pytest.approx(0.1) and s(1000) == pytest.approx(0.1)
    assert s(torch.tensor(5)) == pytest.approx(0.5)  # the step count as the optimiser state holds it
    vals = [s(i) for i in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(vals))
    assert optim.warmup_cosine(2.0, 4, 8, init_lr=1.0)(2) == pytest.approx(1.5)


def test_linear_warmup_and_constant() -> None:
    s = optim.linear_warmup(0.4, 4)
    assert [s(i) for i in range(6)] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4, 0.4])
    assert optim.linear_warmup(0.4, 0)(0) == 0.4
    assert optim.constant(0.3)(torch.tensor(12)) == 0.3


def test_schedule_drives_sgd_step_count() -> None:
    opt = optim.sgd(optim.linear_warmup(1.0, 2))
    p = {"w": torch.zeros(1)}
    state = opt.init(p)
    seen = []
    for _ in range(4):
        new, state = opt.update({"w": torch.ones(1)}, state, p)
        seen.append(-(new["w"] - p["w"]).item())
        p = new
    assert seen == pytest.approx([0.0, 0.5, 1.0, 1.0])
    assert int(state.count) == 4


# ------------------------------------------------------------------------------- (e) value_and_grad


def test_value_and_grad_matches_torch_func() -> None:
    g = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    value, grads = value_and_grad(_mse)(p, x, y)
    ref_grads, ref_value = torch.func.grad_and_value(_mse)(p, x, y)
    torch.testing.assert_close(value, ref_value)
    _close(grads, ref_grads)

    (value2, aux), grads2 = value_and_grad(lambda p, x, y: (_mse(p, x, y), {"n": x.shape[0]}), has_aux=True)(p, x, y)
    torch.testing.assert_close(value2, ref_value)
    assert aux == {"n": 8}
    _close(grads2, ref_grads)

    value3, (gp, gx) = value_and_grad(_mse, argnums=(0, 1))(p, x, y)
    ref_gp, ref_gx = torch.func.grad(_mse, argnums=(0, 1))(p, x, y)
    torch.testing.assert_close(value3, ref_value)
    _close(gp, ref_gp)
    torch.testing.assert_close(gx, ref_gx)


# ------------------------------------------------------------------------------- (f) bad input


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: optim.adamw(-1e-3), "lr must be a finite number >= 0"),
        (lambda: optim.adamw(1e-3, b1=1.0), r"b1 must be in \[0, 1\)"),
        (lambda: optim.adamw(1e-3, b2=-0.1), "b2 must be a finite number >= 0"),
        (lambda: optim.adamw(1e-3, eps=float("nan")), "eps"),
        (lambda: optim.adamw(1e-3, weight_decay=-1.0), "weight_decay"),
        (lambda: optim.sgd(0.1, nesterov=True), "nesterov=True needs momentum > 0"),
        (lambda: optim.sgd(0.1, momentum=-0.5), "momentum"),
        (lambda: optim.clip_by_global_norm(0.0), "max_norm must be > 0"),
        (lambda: optim.chain(), "at least one transform"),
        (lambda: optim.chain(optim.sgd(0.1), "adam"), "argument 1 is a str"),
        (lambda: optim.warmup_cosine(1.0, 10, 10), "must exceed warmup_steps"),
        (lambda: optim.linear_warmup(-1.0, 3), "peak_lr"),
        (lambda: value_and_grad(_mse, argnums="w"), "argnums must be an int"),
        (lambda: value_and_grad(_mse, argnums=(0, 0)), "distinct"),
        (lambda: value_and_grad(3), "expected a function"),
    ],
)
def test_bad_hyperparameters_raise(make: Callable[[], Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_state_not_matching_params_raises() -> None:
    params = {"w": torch.ones(4, 2), "b": torch.zeros(2)}
    grads = optree.tree_map(torch.ones_like, params)
    opt = optim.adamw(1e-3)
    other = opt.init({"w": torch.ones(4, 2)})
    with pytest.raises(fs.ShardingError, match=r"state\.mu does not have the tree structure.*missing \['b'\]"):
        opt.update(grads, other, params)
    wrong_shape = opt.init({"w": torch.ones(2, 2), "b": torch.zeros(2)})
    with pytest.raises(fs.ShardingError, match=r"state\.mu leaf 'w' has shape \(2, 2\).*state_specs"):
        opt.update(grads, wrong_shape, params)
    with pytest.raises(fs.ShardingError, match="state must be the AdamWState"):
        opt.update(grads, optim.sgd(0.1).init(params), params)
    with pytest.raises(fs.ShardingError, match="tuple of 2 states"):
        optim.chain(optim.clip_by_global_norm(1.0), opt).update(grads, opt.init(params), params)
    with pytest.raises(fs.ShardingError, match=r"params does not have the tree structure"):
        opt.update(grads, opt.init(params), {"w": params["w"]})
    with pytest.raises(ValueError, match="argnums=2 names positional argument 2"):
        value_and_grad(lambda a, b: (a * b).sum(), argnums=2)(torch.ones(1), torch.ones(1))


def test_update_of_arrays_outside_shard_map_runs_on_their_mesh() -> None:
    # as optax updates sharded jax.Arrays: each device its shards, equal to the update of the full tensors
    mesh = fs.make_mesh(MESH, backend="sim")
    gen = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(4, 2, generator=gen), "b": torch.randn(2, generator=gen)}
    grads_full = {"w": torch.randn(4, 2, generator=gen), "b": torch.randn(2, generator=gen)}
    specs = {"w": P("tp"), "b": P()}
    for opt in (optim.adamw(0.1, weight_decay=0.1), optim.chain(optim.clip_by_global_norm(0.5), optim.sgd(0.1))):
        params, grads = fs.device_put(full, mesh, specs), fs.device_put(grads_full, mesh, specs)
        state = opt.init(params)
        for _ in range(2):
            params, state = opt.update(grads, state, params)
        ref, ref_state = full, opt.init(full)
        for _ in range(2):
            ref, ref_state = opt.update(grads_full, ref_state, ref)
        assert all(isinstance(params[k], fs.Array) and params[k].spec == specs[k] for k in specs)
        got = fs.device_get(params)
        for k in full:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-6)
    other = fs.make_mesh({"dp": 4}, backend="sim")
    opt = optim.sgd(0.1)
    params = fs.device_put(full, mesh, specs)
    with pytest.raises(fs.ShardingError, match="different meshes"):
        opt.update(fs.device_put(grads_full, other, {"w": P(), "b": P()}), opt.init(params), params)


def test_bad_specs_raise() -> None:
    mesh = fs.make_mesh(MESH, backend="sim")

    def f(g: torch.Tensor) -> torch.Tensor:
        return optim.global_norm({"w": g}, specs={"w": P("cp")})

    with pytest.raises(fs.ShardingError, match="names axis 'cp' that the mesh"):
        fs.shard_map(f, mesh=mesh, in_specs=(P("tp"),), out_specs=P())(torch.ones(4, 2))


def test_schedule_returning_negative_lr_raises() -> None:
    opt = optim.sgd(lambda step: -0.1)
    p = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=r"the lr schedule gave -0\.1 at step 0"):
        opt.update(p, opt.init(p), p)


def test_adamw_b2_defaults_to_optax_and_torch() -> None:
    import inspect

    assert inspect.signature(optim.adamw).parameters["b2"].default == 0.999  # optax.adamw, torch.optim.AdamW
