"""Audit of gradients, optimisers and randomness against their peers: optax, jax.value_and_grad, jax.random.

The cases the other test files leave out: optax's own numbers (not torch.optim's) after several steps on params
sharded over tuple axes, a 2-D grid and replicated scalars (sgd's Nesterov momentum, adamw with a schedule,
``b1=0`` and optax's weight-decay ``mask``, the clip chained in front), ``value_and_grad``'s argnums, ``None``
and integer leaves as JAX treats them, and ``jax.random``'s own signatures (``minval`` / ``maxval``, default
shapes). The optax and JAX references run in this process; sharded bodies run under ``sim`` and ``dist``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import optree
import pytest
import torch

import funcshard as fs
from funcshard import P, optim
from funcshard import random as fsr

pytestmark = pytest.mark.oracle

MESH = {"dp": 2, "tp": 2}
# a leaf over a tuple of axes, one over a 2-D grid, one over tp only, a replicated scalar and a replicated vector
SPECS = {"a": P(("dp", "tp")), "b": P("dp", "tp"), "c": P(None, "tp"), "s": P(), "r": P()}
SHAPES = {"a": (8,), "b": (4, 6), "c": (3, 4), "s": (), "r": (5,)}
STEPS = 6
MASK = {"a": True, "b": True, "c": False, "s": False, "r": False}


def _decay_matrices(p: Any) -> dict[str, bool]:
    """optax's usual mask: decay the matrices, not the vectors and scalars (``ndim``: torch and jax alike)."""
    return {k: v.ndim > 1 for k, v in p.items()}


def _data() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    grads = [{k: torch.randn(s, generator=g) * 3 for k, s in SHAPES.items()} for _ in range(STEPS)]
    return params, grads


def _ours(case: str) -> optim.Optimizer:
    schedule = optim.warmup_cosine(0.1, 2, STEPS, 0.01)
    return {
        "sgd_nesterov": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
        "sgd_schedule_momentum_none": lambda: optim.sgd(schedule, momentum=None),
        "adamw_schedule_b1_0_mask_fn": lambda: optim.adamw(
            schedule, b1=0.0, b2=0.999, weight_decay=0.5, mask=_decay_matrices
        ),
        "clip_adamw_mask_tree": lambda: optim.chain(
            optim.clip_by_global_norm(1.0), optim.adamw(0.01, b1=0.9, b2=0.95, weight_decay=0.5, mask=MASK)
        ),
    }[case]()


def _optax(case: str) -> Any:
    optax = pytest.importorskip("optax")
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, STEPS, 0.01)
    return {
        "sgd_nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
        "sgd_schedule_momentum_none": lambda: optax.sgd(schedule, momentum=None),
        "adamw_schedule_b1_0_mask_fn": lambda: optax.adamw(
            schedule, b1=0.0, b2=0.999, weight_decay=0.5, mask=_decay_matrices
        ),
        "clip_adamw_mask_tree": lambda: optax.chain(
            optax.clip_by_global_norm(1.0), optax.adamw(0.01, b1=0.9, b2=0.95, weight_decay=0.5, mask=MASK)
        ),
    }[case]()


def _optax_steps(case: str) -> dict[str, torch.Tensor]:
    """The reference: optax on the unsharded params, float32."""
    import jax.numpy as jnp
    import optax

    params, grads = _data()
    tx = _optax(case)
    p = {k: jnp.asarray(v.numpy()) for k, v in params.items()}
    state = tx.init(p)
    for g in grads:
        updates, state = tx.update({k: jnp.asarray(v.numpy()) for k, v in g.items()}, state, p)
        p = optax.apply_updates(p, updates)
    return {k: torch.tensor(np.asarray(v)) for k, v in p.items()}


def _sharded_steps(mesh: fs.Mesh, case: str) -> dict[str, torch.Tensor]:
    params, grads = _data()
    opt = _ours(case)
    sspecs = opt.state_specs(SPECS)
    step = fs.shard_map(
        lambda p, g, s: opt.update(g, s, p), mesh=mesh, in_specs=(SPECS, SPECS, sspecs), out_specs=(SPECS, sspecs)
    )
    p = fs.device_put(params, mesh, SPECS)
    state = opt.init(p)
    # the state's layout is what state_specs says: one spec per state leaf, the same tree
    specs_of = optree.tree_map(lambda a: a.spec, state, is_leaf=lambda x: isinstance(x, fs.Array))
    assert optree.tree_structure(specs_of, none_is_leaf=True) == optree.tree_structure(
        sspecs, none_is_leaf=True, is_leaf=lambda x: isinstance(x, P)
    )
    for g in grads:
        p, state = step(p, g, state)
    return fs.device_get(p)


@pytest.mark.parametrize(
    "case", ["sgd_nesterov", "sgd_schedule_momentum_none", "adamw_schedule_b1_0_mask_fn", "clip_adamw_mask_tree"]
)
def test_sharded_steps_match_optax(run, case: str) -> None:
    """Six steps on params sharded over a tuple of axes, a grid and replicated scalars equal optax's (float32:
    torch's op order differs from optax's, a few ulp)."""
    want = _optax_steps(case)
    for got in run(_sharded_steps, MESH, case):
        for k in SHAPES:
            torch.testing.assert_close(got[k], want[k], rtol=2e-5, atol=2e-6, msg=lambda m, k=k: f"{case} {k}: {m}")


def test_adamw_mask_decays_only_where_true_and_checks_itself() -> None:
    """Zero gradients: a decayed leaf shrinks by exactly ``1 - lr * wd``, an undecayed one stays; a mask that is a
    prefix (one bool for a subtree) works; a non-bool leaf or a mask that does not fit the params raises."""
    params = {"w": torch.ones(2, 2), "n": {"g": torch.ones(2), "b": torch.ones(2)}}
    zeros = optree.tree_map(torch.zeros_like, params)
    for opt in (
        optim.adamw(0.1, weight_decay=0.5, mask={"w": True, "n": False}),
        optim.adamw(0.1, weight_decay=0.5, mask=_decay_matrices_nested),
    ):
        for update in (opt.update, lambda g, s, p, opt=opt: (optim.apply_updates(p, opt.transform(g, s, p)[0]), 0)):
            new, _ = update(zeros, opt.init(params), params)
            assert torch.equal(new["w"], torch.full((2, 2), 1 - 0.1 * 0.5))
            assert torch.equal(new["n"]["g"], params["n"]["g"]) and torch.equal(new["n"]["b"], params["n"]["b"])
    with pytest.raises(fs.ConfigError, match="mask leaves must be bools"):
        optim.adamw(0.1, weight_decay=0.5, mask={"w": 1, "n": False})
    opt = optim.adamw(0.1, weight_decay=0.5, mask={"w": True, "x": False})
    with pytest.raises(fs.ShardingError, match="mask"):
        opt.update(zeros, opt.init(params), params)


FUSED_SPECS = {"w": P(None, "tp"), "b": P("tp"), "n": P()}
FUSED_SHAPES = {"w": (3, 64), "b": (96,), "n": (32,)}  # whole 16-element vectors per shard: no scalar tail


def _masked_fused_body(mesh: fs.Mesh, donate: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    params = {k: torch.randn(s, generator=g) for k, s in FUSED_SHAPES.items()}
    grads = [{k: torch.randn(s, generator=g) for k, s in FUSED_SHAPES.items()} for _ in range(3)]
    opt = optim.adamw(1e-2, b2=0.95, weight_decay=0.1, mask={"w": True, "b": False, "n": False})
    sspecs = opt.state_specs(FUSED_SPECS)
    step = fs.shard_map(
        lambda p, g, s: opt.update(g, s, p),
        mesh=mesh,
        in_specs=(FUSED_SPECS, FUSED_SPECS, sspecs),
        out_specs=(FUSED_SPECS, sspecs),
        donate=donate,
    )
    p = fs.device_put(params, mesh, FUSED_SPECS)
    state = fs.shard_map(opt.init, mesh=mesh, in_specs=(FUSED_SPECS,), out_specs=sspecs)(p)
    for grad in grads:
        p, state = step(p, grad, state)
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    torch_opt = torch.optim.AdamW(
        [{"params": [ref["w"]], "weight_decay": 0.1}, {"params": [ref["b"], ref["n"]], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    for grad in grads:
        for k, t in ref.items():
            t.grad = grad[k].clone()
        torch_opt.step()
    return [fs.device_get(p), {k: t.detach() for k, t in ref.items()}]


@pytest.mark.parametrize("donate", [(0, 2), ()], ids=["donated", "not_donated"])
def test_adamw_mask_is_torch_param_groups_bit_for_bit(run, donate: tuple[int, ...]) -> None:
    """A mask splits the fused kernel's call by weight decay: torch.optim.AdamW(fused=True) with one param group
    decayed and one not, bit for bit, donated or not."""
    for got, want in run(_masked_fused_body, {"tp": 2}, donate):
        for k in FUSED_SHAPES:
            assert torch.equal(got[k], want[k]), k


def _decay_matrices_nested(p: Any) -> Any:
    return optree.tree_map(lambda v: v.ndim > 1, p)


def _compiled_body(mesh: fs.Mesh) -> list[Any]:
    specs = {"w": P("dp"), "b": P()}
    out = []
    for opt in (
        optim.sgd(optim.linear_warmup(0.1, 3), momentum=0.9),  # sgd read its count: no compiled sgd at all
        optim.adamw(optim.warmup_cosine(0.1, 2, 6, 0.01), weight_decay=0.1, mask={"w": True, "b": False}),
    ):
        sspecs = opt.state_specs(specs)
        runs = []
        for compile in (False, {"backend": "aot_eager"}):
            g = torch.Generator().manual_seed(0)
            p = fs.device_put({"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}, mesh, specs)
            s = fs.shard_map(opt.init, mesh=mesh, in_specs=(specs,), out_specs=sspecs)(p)
            step = fs.shard_map(
                lambda p, g, s, opt=opt: opt.update(g, s, p),
                mesh=mesh,
                in_specs=(specs, specs, sspecs),
                out_specs=(specs, sspecs),
                compile=compile,
            )
            for _ in range(5):
                p, s = step(p, {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}, s)
            runs.append(fs.device_get(p))
        out.append(runs)
    return out


@pytest.mark.dist
def test_compiled_steps_with_schedules_equal_eager() -> None:
    """``compile=`` with an lr schedule (sgd with any lr): the compiled steps equal the eager ones (sgd bit for
    bit; adamw's eager step runs torch's fused kernel, an ulp apart from the op-by-op path a graph records)."""
    from _dist_pool import run_body

    for (sgd_eager, sgd_compiled), (adamw_eager, adamw_compiled) in run_body("dist", _compiled_body, {"dp": 2}):
        for k in ("w", "b"):
            assert torch.equal(sgd_eager[k], sgd_compiled[k])
            torch.testing.assert_close(adamw_eager[k], adamw_compiled[k], rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------- value_and_grad


def _f(a: torch.Tensor, p: dict[str, Any], x: torch.Tensor) -> Any:
    return (a * p["w"] * x).sum() + (p["w"] ** 3).sum(), {"n": 3, "t": p["w"] * 2, "none": None}


def test_value_and_grad_argnums_none_leaves_and_aux_match_jax() -> None:
    """Negative and reordered argnums, a ``None`` leaf in a differentiated tree (an empty subtree: its gradient is
    ``None``, as JAX's) and an aux pytree with non-tensor leaves, against ``jax.value_and_grad``."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    g = torch.Generator().manual_seed(1)
    a, w, x = (torch.randn(4, generator=g, dtype=torch.float64) for _ in range(3))
    p = {"w": w, "none": None}
    jf = lambda a, p, x: ((a * p["w"] * x).sum() + (p["w"] ** 3).sum(), {"n": 3, "t": p["w"] * 2, "none": None})  # noqa: E731
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        ja, jp, jx = jnp.asarray(a.numpy()), {"w": jnp.asarray(w.numpy()), "none": None}, jnp.asarray(x.numpy())
        for argnums in (-1, (-2, 0), (2, 1, 0), 1):
            (v, aux), grads = fs.value_and_grad(_f, argnums=argnums, has_aux=True)(a, p, x)
            (jv, jaux), jgrads = jax.value_and_grad(jf, argnums=argnums, has_aux=True)(ja, jp, jx)
            assert float(v) == pytest.approx(float(jv), rel=1e-14)
            assert aux["n"] == 3 and aux["none"] is None and np.allclose(aux["t"].numpy(), np.asarray(jaux["t"]))
            ours, theirs = (
                optree.tree_flatten(grads, none_is_leaf=True),
                jax.tree_util.tree_flatten(jgrads, is_leaf=lambda t: t is None),
            )
            assert len(ours[0]) == len(theirs[0])
            for o, t in zip(ours[0], theirs[0], strict=True):
                assert (o is None and t is None) or np.allclose(o.numpy(), np.asarray(t), rtol=1e-13, atol=0)
    finally:
        jax.config.update("jax_enable_x64", prev)


def test_value_and_grad_refuses_one_argument_twice_and_integer_leaves() -> None:
    """``argnums=(0, -2)`` with two arguments names argument 0 twice: it used to give that argument a zero gradient
    (one copy overwrote the other); now an error, as ``(0, 0)`` is. An integer leaf (tensor or number) raises
    naming the argument and the leaf, as JAX's grad refuses integer inputs."""
    f = lambda a, b: (a * b * b).sum()  # noqa: E731
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    with pytest.raises(fs.ConfigError, match=r"names one positional argument twice .*\[0, 0\]"):
        fs.value_and_grad(f, argnums=(0, -2))(a, b)
    with pytest.raises(fs.ConfigError, match=r"names one positional argument twice"):
        fs.value_and_grad(f, argnums=(-1, 1))(a, b)
    _, (ga, gb) = fs.value_and_grad(f, argnums=(0, -1))(a, b)  # distinct: still fine
    assert torch.equal(ga, b * b) and torch.equal(gb, 2 * a * b)
    # numpy integers, as JAX takes them (they were refused)
    assert torch.equal(fs.value_and_grad(f, argnums=np.int64(1))(a, b)[1], gb)
    _, (ga2, gb2) = fs.value_and_grad(f, argnums=(np.int32(0), np.int64(-1)))(a, b)
    assert torch.equal(ga2, ga) and torch.equal(gb2, gb)
    loss = lambda p: (p["w"] ** 2).sum()  # noqa: E731
    for leaf, found in ((torch.tensor([1, 2]), "torch.int64 tensor"), (3, "value of type int")):
        with pytest.raises(fs.ConfigError, match=re.escape(f"argument 0 leaf 'k' is a {found}")):
            fs.value_and_grad(loss)({"w": a, "k": leaf})
    with pytest.raises(fs.ConfigError, match=r"argument 1 is a torch\.int64 tensor"):
        fs.value_and_grad(lambda x, i: x[i].sum(), argnums=(0, 1))(a, torch.tensor([1]))


def _vag_body(mesh: fs.Mesh) -> list[Any]:
    """A dp-sharded batch, params with a None leaf, argnums=(-2, 0) inside shard_map: the global gradients."""
    g = torch.Generator().manual_seed(2)
    w, bias, x = torch.randn(3, 2, generator=g), torch.randn(2, generator=g), torch.randn(8, 3, generator=g)
    specs = {"w": P(None, "tp"), "b": P("tp"), "none": None}

    def loss(params: Any, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = x @ params["w"] + params["b"]  # [b/dp, 3] @ [3, 2/tp] -> [b/dp, 2/tp]
        return fs.psum((y.tanh() * scale).pow(2).sum(), ("dp", "tp"))  # [] summed over the batch and the columns

    def step(params: Any, scale: torch.Tensor, x: torch.Tensor) -> Any:
        v, (gs, gp) = fs.value_and_grad(loss, argnums=(-2, 0))(params, scale, x)
        return v, gs, gp

    f = fs.shard_map(step, mesh=mesh, in_specs=(specs, P(), P("dp")), out_specs=(P(), P(), specs))
    scale = torch.tensor(1.5)
    v, gs, gp = f({"w": w, "b": bias, "none": None}, scale, x)
    ref = {"w": w.clone().requires_grad_(), "b": bias.clone().requires_grad_()}
    s_ref = scale.clone().requires_grad_()
    rv = ((x @ ref["w"] + ref["b"]).tanh() * s_ref).pow(2).sum()
    rv.backward()
    return [
        fs.device_get(v),
        rv.detach(),
        fs.device_get(gs),
        s_ref.grad,
        fs.device_get(gp),
        ref["w"].grad,
        ref["b"].grad,
    ]


def test_value_and_grad_in_shard_map_negative_argnums_and_none_leaf(run) -> None:
    for v, rv, gs, rgs, gp, rw, rb in run(_vag_body, MESH):
        torch.testing.assert_close(v, rv)
        torch.testing.assert_close(gs, rgs)
        torch.testing.assert_close(gp["w"], rw)
        torch.testing.assert_close(gp["b"], rb)
        assert gp["none"] is None


# -------------------------------------------------------------------------------------------------- fs.random


@pytest.fixture
def jr() -> Any:
    """jax.random under JAX's default configuration (x64 off)."""
    jax = pytest.importorskip("jax")
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    yield jax.random
    jax.config.update("jax_enable_x64", prev)


def _bits(x: Any) -> np.ndarray:
    """The raw bits of a float array (torch or jax; bfloat16 through int16)."""
    if isinstance(x, torch.Tensor):
        x = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
        return x.numpy().reshape(-1).view(np.uint8)
    return np.asarray(x).reshape(-1).view(np.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_uniform_and_randint_take_jax_signature(jr: Any, dtype: torch.dtype) -> None:
    """``uniform(key, shape, dtype, minval, maxval)`` positionally and by JAX's keywords, bit for bit; ``low`` /
    ``high`` give the same; giving a bound twice raises. ``randint``'s ``minval`` / ``maxval`` likewise."""
    import jax.numpy as jnp

    jdt = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}[dtype]
    k, jk = fsr.key(21), jr.key(21)
    want = _bits(jr.uniform(jk, (3, 77), jdt, -2.5, 0.75))
    assert np.array_equal(_bits(fsr.uniform(k, (3, 77), dtype, -2.5, 0.75)), want)
    assert np.array_equal(_bits(fsr.uniform(k, (3, 77), dtype, minval=-2.5, maxval=0.75)), want)
    assert np.array_equal(_bits(fsr.uniform(k, (3, 77), dtype, low=-2.5, high=0.75)), want)
    with pytest.raises(fs.ConfigError, match="minval= or low=, not both"):
        fsr.uniform(k, (3,), dtype, -1.0, low=-1.0)
    got = fsr.randint(k, (5, 41), minval=-7, maxval=300)
    assert np.array_equal(got.numpy(), np.asarray(jr.randint(jk, (5, 41), minval=-7, maxval=300)).astype(np.int64))
    with pytest.raises(fs.ConfigError, match="give both bounds"):
        fsr.randint(k, (3,), maxval=4)


def test_default_shapes_and_many_keys_match_jax(jr: Any) -> None:
    """JAX's defaults: ``normal(key)``, ``uniform(key)``, ``bits(key)`` draw one value, ``bernoulli(key)`` one with
    p = 0.5; zero-size shapes; a split into thousands of keys; fold_in of the largest 32-bit number."""
    import jax.numpy as jnp

    k, jk = fsr.key(2**32 - 3), jr.key(2**32 - 3)
    assert np.array_equal(_bits(fsr.normal(k)), _bits(jr.normal(jk)))
    assert np.array_equal(_bits(fsr.uniform(k)), _bits(jr.uniform(jk)))
    assert int(fsr.bits(k)) == int(np.asarray(jr.bits(jk, (), jnp.uint32)))
    assert bool(fsr.bernoulli(k)) == bool(jr.bernoulli(jk)) and fsr.bernoulli(k).shape == ()
    for shape in ((0,), (3, 0, 2)):
        assert fsr.normal(k, shape).shape == jr.normal(jk, shape).shape
    kd = lambda jkeys: np.asarray(jr.key_data(jkeys)).astype(np.int64)  # noqa: E731
    assert np.array_equal(fsr.split(k, 4099).numpy(), kd(jr.split(jk, 4099)))
    for shape in ((2, 3), (0,), (4, 1, 2)):  # split into a shape of keys (was a TypeError)
        assert np.array_equal(fsr.split(k, shape).numpy(), kd(jr.split(jk, shape)))
    assert np.array_equal(fsr.fold_in(k, 2**32 - 1).numpy(), kd(jr.fold_in(jk, 2**32 - 1)))


def test_bernoulli_with_a_tensor_p_is_jax(jr: Any) -> None:
    """A tensor ``p`` (it raised 'only one element tensors can be converted'): drawn in ``p``'s dtype, of ``p``'s
    shape or broadcast to ``shape``, as ``jax.random.bernoulli``; sharded blocks compare their block of ``p``."""
    import jax.numpy as jnp

    k, jk = fsr.key(7), jr.key(7)
    cases = [
        (torch.full((1000,), 0.3, dtype=torch.float16), None),
        (torch.full((300,), 0.6, dtype=torch.bfloat16), None),
        (torch.linspace(0, 1, 12).reshape(3, 4), None),
        (torch.linspace(0, 1, 4), (3, 4)),
    ]
    for p, shape in cases:
        pj = jnp.asarray(p.float().numpy()).astype(
            {torch.float16: jnp.float16, torch.bfloat16: jnp.bfloat16}.get(p.dtype, jnp.float32)
        )
        assert np.array_equal(fsr.bernoulli(k, p, shape).numpy(), np.asarray(jr.bernoulli(jk, pj, shape)))
    mesh = fs.make_mesh(MESH, backend="sim")
    pp = torch.rand(4, 6, generator=torch.Generator().manual_seed(0))
    f = fs.shard_map(
        lambda key: fsr.bernoulli(key, pp, spec=P("dp", "tp")), mesh=mesh, in_specs=(P(),), out_specs=P("dp", "tp")
    )
    assert torch.equal(fs.device_get(f(k)), fsr.bernoulli(k, pp))
    with pytest.raises(fs.ConfigError, match="floating dtype"):
        fsr.bernoulli(k, torch.tensor([1, 0]))
    with pytest.raises(fs.ConfigError, match="does not broadcast"):
        fsr.bernoulli(k, torch.ones(3), (2,))


def test_negative_seeds_are_jax_x64_keys() -> None:
    """A negative seed is a 64-bit two's complement, as JAX with ``jax_enable_x64`` makes its key (JAX's default,
    32-bit seeds, would give ``[0, seed % 2**32]`` instead: the docstring of ``key`` says which one we follow)."""
    jax = pytest.importorskip("jax")
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        for seed in (-1, -5, -(2**31), -(2**63)):
            want = np.asarray(jax.random.key_data(jax.random.key(seed))).astype(np.int64)
            assert np.array_equal(fsr.key(seed).numpy(), want), seed
    finally:
        jax.config.update("jax_enable_x64", prev)


def _tuple_axes_body(mesh: fs.Mesh) -> list[torch.Tensor]:
    spec = P(("tp", "dp"), None)  # minor axis first: the block order is tp-major

    def draw(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fsr.uniform(k, (8, 3), torch.bfloat16, -1.0, 2.0, spec=spec), fsr.bernoulli(k, 0.3, (8, 3), spec=spec)

    f = fs.shard_map(draw, mesh=mesh, in_specs=(P(),), out_specs=(spec, spec))
    return [fs.device_get(x) for x in f(fsr.key(5))]


def test_sharded_draws_over_tuple_axes_are_slices(run) -> None:
    """Draws over a tuple of axes in minor-major order, under sim and dist: the slices of the unsharded draws."""
    want_u = fsr.uniform(fsr.key(5), (8, 3), torch.bfloat16, -1.0, 2.0)
    want_b = fsr.bernoulli(fsr.key(5), 0.3, (8, 3))
    for u, b in run(_tuple_axes_body, MESH):
        assert torch.equal(u, want_u) and torch.equal(b, want_b)


def _fold_in_axis_body(mesh: fs.Mesh) -> list[Any]:
    def noise(k: torch.Tensor) -> torch.Tensor:
        return fsr.normal(fsr.fold_in(k, fs.axis_index("tp")), (3,))  # this device's own stream

    try:
        fs.shard_map(noise, mesh=mesh, in_specs=(P(),), out_specs=P())(fsr.key(4))
        refused = ""
    except fs.ShardingError as e:
        refused = str(e)

    def grad(w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return fs.value_and_grad(lambda w: (w * noise(k)).sum())(w)[1]  # w meets a tp-varying value: psum'd

    g = fs.shard_map(grad, mesh=mesh, in_specs=(P(), P()), out_specs=P())(torch.ones(3), fsr.key(4))
    per_device = fs.shard_map(noise, mesh=mesh, in_specs=(P(),), out_specs=P("tp"))(fsr.key(4))
    return [refused, fs.device_get(g), fs.device_get(per_device)]


def test_fold_in_of_axis_index_varies_over_the_axis(run) -> None:
    """``fold_in(key, axis_index("tp"))`` gave a key tagged invariant: draws that differ per device passed an out
    spec without tp (device 0's returned for all) and a replicated weight meeting them got device 0's gradient
    alone. Now the key varies over tp, as in JAX: the replicated out spec is refused, the gradient is the sum
    over the devices of their draws."""
    want = torch.stack([fsr.normal(fsr.fold_in(fsr.key(4), i), (3,)) for i in range(2)])
    for refused, g, per_device in run(_fold_in_axis_body, MESH):
        assert "varies over axis 'tp'" in refused
        assert torch.equal(per_device, want.reshape(-1))
        torch.testing.assert_close(g, want.sum(0))
    with pytest.raises(fs.ConfigError, match="0-dim integer tensor"):
        fsr.fold_in(fsr.key(0), torch.tensor([1, 2]))
    assert torch.equal(fsr.fold_in(fsr.key(0), torch.tensor(2**40)), fsr.fold_in(fsr.key(0), 2**40))


def test_precision_parses_jmps_short_keys() -> None:
    """jmp's short policy keys (``p=``, ``c=``, ``o=``; ``r=`` for the reduction), refused before."""
    got = fs.Precision.parse("p=f32,c=bf16,o=f16,r=bf16")
    assert got == fs.Precision(torch.float32, torch.bfloat16, torch.bfloat16, torch.float16)
    assert fs.Precision.parse("p=f32, c=bf16") == fs.Precision.parse("params=float32,compute=bfloat16")


# -------------------------------------------------------------------------------------------------- DTensor


def _foreign_device_mesh_body(mesh: fs.Mesh) -> list[Any]:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    x = torch.arange(16.0).reshape(4, 4)
    out: list[Any] = []
    column_major = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=("dp", "tp"))
    swapped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    for dm, m, placements in (
        (column_major, None, [Shard(0), Shard(1)]),  # ranks not row-major
        (swapped, mesh, [Shard(0), Replicate()]),  # the same names in another order than mesh's
        (swapped, None, [Shard(0), Replicate()]),  # a mesh made from it: its own order, fine
        (column_major, None, [Replicate(), Replicate()]),  # the same value everywhere: fine
    ):
        try:
            a = fs.from_dtensor(distribute_tensor(x, dm, placements), m)
            out.append(torch.equal(fs.device_get(a), x))
        except fs.ShardingError as e:
            out.append(str(e))
    return out


@pytest.mark.dist
def test_from_dtensor_refuses_a_device_mesh_with_other_rank_positions() -> None:
    """A DeviceMesh whose ranks are not laid out as the mesh's (row-major over the same axis order) gave an Array
    whose blocks sat under other devices' coordinates: a silently shuffled value. Now an error naming the rank."""
    from _dist_pool import run_body

    for bad1, bad2, ok1, ok2 in run_body("dist", _foreign_device_mesh_body, MESH):
        assert "puts rank 2 at {'dp': 0, 'tp': 1}" in bad1 and "puts rank 1 at {'tp': 0, 'dp': 1}" in bad2
        assert ok1 is True and ok2 is True


# ------------------------------------------------------------------------------------------------------ remat


def test_remat_policy_names_that_never_appear() -> None:
    """``save_only_these_names`` / ``save_anything_except_these_names`` with names no checkpoint_name uses, and a
    remat nested in a remat: the gradients of the plain function, bit for bit (float64)."""
    rp = fs.remat_policies
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = fs.checkpoint_name(torch.tanh(x @ w), "h")  # [8, 6] @ [6, 4] -> [8, 4]
        return h.sin() @ w.T  # [8, 4] @ [4, 6] -> [8, 6]

    def loss(b: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return lambda w, x: b(x, w).pow(2).sum()

    v0, g0 = fs.value_and_grad(loss(block), argnums=(0, 1))(w, x)
    names = (
        rp.save_only_these_names("nope"),
        rp.save_anything_except_these_names("nope"),
        rp.save_only_these_names("h", "nope"),
    )
    cases = [fs.remat(block, policy=p) for p in names]
    cases.append(fs.remat(lambda x, w: fs.remat(block, policy=rp.dots_saveable)(x, w) + 0.0))
    for b in cases:
        v1, g1 = fs.value_and_grad(loss(b), argnums=(0, 1))(w, x)
        assert torch.equal(v0, v1) and all(torch.equal(a, c) for a, c in zip(g0, g1, strict=True))


def test_remat_takes_jax_static_argnums() -> None:
    """``remat(f, static_argnums=...)`` as ``jax.checkpoint`` (a TypeError before): Python values pass through,
    the gradient is the plain one; a tensor named static, or a position past the arguments, raises."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(4, 4, generator=g, dtype=torch.float64)

    def f(x: torch.Tensor, w: torch.Tensor, n: int, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return act(x @ w).sum() * n  # [3, 4] @ [4, 4] -> [3, 4]

    want = fs.value_and_grad(f, argnums=1)(x, w, 3, torch.tanh)
    got = fs.value_and_grad(fs.remat(f, static_argnums=(2, -1)), argnums=1)(x, w, 3, torch.tanh)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(fs.ConfigError, match="argument 1, which is a tensor"):
        fs.remat(f, static_argnums=1)(x, w, 3, torch.tanh)
    with pytest.raises(fs.ConfigError, match="argument 7, which is missing"):
        fs.remat(f, static_argnums=7)(x, w, 3, torch.tanh)
    with pytest.raises(fs.ConfigError, match="static_argnums must be"):
        fs.remat(f, static_argnums=[2])
