"""Regression tests for issue #7's holes: places where shard_map once returned a wrong number silently.

Each body runs under "sim" and on gloo workers ("dist"); each checks a value against the global function
computed by hand on full tensors.
"""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard import P


class Mul(torch.autograd.Function):
    """A user's fused kernel: forward ``a * b``, backward ``(g * b, g * a)``."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, g * a


class MulSetup(torch.autograd.Function):
    """The same kernel in the ``setup_context`` form, usable under torch.func transforms."""

    @staticmethod
    def forward(a, b):
        return a * b

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, g * a


# -- hole 1: axis_index is a varying value -----------------------------------------------------------------


def _axis_index_grad(mesh):
    f = fs.shard_map(lambda x: x * (fs.axis_index("tp") + 1), mesh=mesh, in_specs=(P(),), out_specs=P("tp"))
    x = torch.ones(3, requires_grad=True)
    out = fs.device_get(f(x))
    out.sum().backward()
    return out.detach(), x.grad


def test_axis_index_varies_and_gets_summed_gradient(run):
    for out, grad in run(_axis_index_grad, {"tp": 4}):
        assert torch.equal(out, torch.tensor([1.0, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]))
        assert torch.equal(grad, torch.full((3,), 10.0))  # 1 + 2 + 3 + 4


def _axis_index_under_invariant_spec(mesh):
    f = fs.shard_map(lambda x: x * (fs.axis_index("tp") + 1), mesh=mesh, in_specs=(P(),), out_specs=P())
    with pytest.raises(fs.ShardingError, match="varies over axis 'tp'"):
        f(torch.ones(3))
    return True


def test_axis_index_result_under_invariant_spec_raises(run):
    assert all(run(_axis_index_under_invariant_spec, {"tp": 2}))


def test_axis_index_is_a_tensor_with_int():
    mesh = fs.make_mesh({"a": 2, "b": 3}, backend="sim")

    def f(x):
        i = fs.axis_index(("a", "b"))
        assert isinstance(i, torch.Tensor) and i.dim() == 0 and i.dtype == torch.int64
        return x.narrow(0, int(i), 1)

    out = fs.shard_map(f, mesh=mesh, in_specs=(P(),), out_specs=P(("a", "b")))(torch.arange(6.0))
    assert torch.equal(fs.device_get(out), torch.arange(6.0))


# -- hole 2: a user's autograd.Function ------------------------------------------------------------------


def _custom_function(mesh, cls):
    f = fs.shard_map(
        lambda w, x: fs.psum(cls.apply(w, x).sum(), "dp"), mesh=mesh, in_specs=(P(), P("dp")), out_specs=P()
    )
    w = torch.ones(3, requires_grad=True)
    x = torch.arange(12.0).reshape(4, 3)
    fs.device_get(f(w, x)).backward()
    return w.grad


@pytest.mark.parametrize("cls", [Mul, MulSetup])
def test_custom_function_invariant_operand_gets_summed_gradient(run, cls):
    for g in run(_custom_function, {"dp": 2}, cls):
        assert torch.equal(g, torch.arange(12.0).reshape(4, 3).sum(0))


def _custom_function_inside_grad(mesh):
    def step(w, x):
        return torch.func.grad(lambda w: fs.psum(MulSetup.apply(w, x).sum(), "dp"))(w)

    f = fs.shard_map(step, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P())
    return fs.device_get(f(torch.ones(3), torch.arange(12.0).reshape(4, 3)))


def test_custom_function_inside_torch_func_grad(run):
    for g in run(_custom_function_inside_grad, {"dp": 2}):
        assert torch.equal(g, torch.arange(12.0).reshape(4, 3).sum(0))


def test_custom_function_output_is_tagged():
    mesh = fs.make_mesh({"dp": 2}, backend="sim")
    f = fs.shard_map(lambda w, x: Mul.apply(w, x), mesh=mesh, in_specs=(P(), P("dp")), out_specs=P())
    with pytest.raises(fs.ShardingError, match="varies over axis 'dp'"):
        f(torch.ones(3), torch.ones(2, 3))


# -- hole 4: gradients from torch.func carry their primal's axes -------------------------------------------


def _func_grad_norm(mesh, how):
    def body(w):
        loss = lambda w: (w * w).sum() / 2  # noqa: E731
        if how == "grad":
            g = torch.func.grad(loss)(w)
        elif how == "grad_and_value":
            g = torch.func.grad_and_value(loss)(w)[0]
        else:
            _, vjp = torch.func.vjp(loss, w)
            g = vjp(torch.ones(()))[0]
        return fs.optim.global_norm(g), g

    f = fs.shard_map(body, mesh=mesh, in_specs=(P("tp"),), out_specs=(P(), P("tp")))
    norm, g = f(torch.tensor([6.0, 8.0]))
    return fs.device_get(norm), fs.device_get(g)


@pytest.mark.parametrize("how", ["grad", "grad_and_value", "vjp"])
def test_torch_func_gradients_are_tagged(run, how):
    for norm, g in run(_func_grad_norm, {"tp": 2}, how):
        assert torch.equal(norm, torch.tensor(10.0))  # not this device's 6 or 8
        assert torch.equal(g, torch.tensor([6.0, 8.0]))


def test_untagged_varying_gradient_cannot_pass_as_invariant():
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    f = fs.shard_map(
        lambda w: torch.func.grad(lambda w: (w * w).sum())(w), mesh=mesh, in_specs=(P("tp"),), out_specs=P()
    )
    with pytest.raises(fs.ShardingError, match="varies over axis 'tp'"):
        f(torch.tensor([6.0, 8.0]))


def test_vmap_out_dims_result_keeps_its_axes():
    mesh = fs.make_mesh({"dp": 2}, backend="sim")
    f = fs.shard_map(
        lambda x: torch.vmap(lambda r: r * 2, out_dims=1)(x), mesh=mesh, in_specs=(P("dp"),), out_specs=P()
    )
    with pytest.raises(fs.ShardingError, match="varies over axis 'dp'"):
        f(torch.ones(4, 3))


def _pvary_through_transform(mesh, how):
    def body(x):
        if how == "vmap":  # the batched result is handed back as a view of the P() argument's storage
            return torch.vmap(lambda r: fs.pvary(r, "a"))(x)
        if how == "vjp":
            return torch.func.vjp(lambda r: fs.pvary(r, "a") * 2, x)[0]
        return torch.func.jvp(lambda r: fs.pvary(r, "a") * 2, (x,), (torch.ones_like(x),))[0]

    x = torch.ones(2, 3, requires_grad=True)
    fs.device_get(fs.shard_map(body, mesh=mesh, in_specs=(P(),), out_specs=P("a"))(x)).sum().backward()
    return x.grad


@pytest.mark.parametrize("how", ["vmap", "vjp", "jvp"])
def test_transform_outputs_keep_their_axes(run, how):
    # out = [f(x); f(x)] over a=2: the gradient is the sum of the two copies, counted once (it was 2x with vmap)
    k = 2.0 if how == "vmap" else 4.0
    for grad in run(_pvary_through_transform, {"a": 2}, how):
        assert torch.equal(grad, torch.full((2, 3), k))
    mesh = fs.make_mesh({"a": 2}, backend="sim")
    with pytest.raises(fs.ShardingError, match="varies over axis 'a'"):  # was returned silently: device 0's value
        fs.shard_map(lambda x: torch.vmap(lambda r: fs.pvary(r, "a"))(x), mesh=mesh, in_specs=(P(),), out_specs=P())(
            torch.ones(2, 3)
        )


def _second_derivative_through_extreme(mesh, name, vma):
    def body(x):
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            y = getattr(fs, name)(fs.pvary(x * 1.0, "a"), "a")  # n equal copies: their extreme is x itself
            (dy,) = torch.autograd.grad(y, x, torch.cos(y), create_graph=True)  # cos(x)
            (d2,) = torch.autograd.grad(torch.sin(dy).sum(), x)  # d/dx sin(cos(x))
        return d2

    f = fs.shard_map(body, mesh=mesh, in_specs=(P(),), out_specs=P(), check_vma=vma)
    return fs.device_get(f(torch.tensor([0.3, 1.2], dtype=torch.float64)))


@pytest.mark.parametrize("name", ["pmax", "pmin"])
@pytest.mark.parametrize("vma", [True, False])
def test_second_derivative_through_pmax(run, name, vma):
    # the backward's invariant cotangent meets the varying tie mask: without a pvary there, 1/n of the truth
    x = torch.tensor([0.3, 1.2], dtype=torch.float64)
    for got in run(_second_derivative_through_extreme, {"a": 2}, name, vma):
        torch.testing.assert_close(got, torch.cos(torch.cos(x)) * -torch.sin(x))


# -- hole 5: check_vma=False and a replicated operand of a reduction -----------------------------------------


def _psum_replicated_no_vma(mesh, name):
    n = mesh.size
    f = fs.shard_map(lambda x: getattr(fs, name)(x, "tp"), mesh=mesh, in_specs=(P(),), out_specs=P(), check_vma=False)
    x = torch.arange(3.0, requires_grad=True)
    out = fs.device_get(f(x))
    out.sum().backward()
    return n, out.detach(), x.grad


@pytest.mark.parametrize("name", ["psum", "pmean"])
def test_check_vma_false_psum_of_replicated_input(run, name):
    for n, out, grad in run(_psum_replicated_no_vma, {"tp": 2}, name):
        k = n if name == "psum" else 1  # psum of n equal copies; their mean is the value itself
        assert torch.equal(out, k * torch.arange(3.0))
        assert torch.equal(grad, torch.full((3,), float(k)))  # as JAX with check_vma=False


def _chained_psum_no_vma(mesh):
    f = fs.shard_map(
        lambda x: fs.psum(fs.psum(x, "a"), "b"), mesh=mesh, in_specs=(P("a"),), out_specs=P(), check_vma=False
    )
    x = torch.arange(4.0, requires_grad=True)
    fs.device_get(f(x)).sum().backward()
    return x.grad


def test_check_vma_false_collective_result_is_known_invariant(run):
    # under dist each process holds the gradient of the block it owns (zeros elsewhere): combine them
    g = torch.stack(run(_chained_psum_no_vma, {"a": 2, "b": 2})).amax(0)
    assert torch.equal(g, torch.full((4,), 2.0))  # psum over b of a value invariant over b: 2 copies


def _derived_replicated(mesh, fix):
    def body(x):
        y = x * 2  # computed from a replicated argument: the same on every device of 'tp'
        if fix:
            y = fs.pvary(y, "tp")
        return fs.psum(y, "tp")

    f = fs.shard_map(body, mesh=mesh, in_specs=(P(),), out_specs=P(), check_vma=False)
    x = torch.arange(3.0, requires_grad=True)
    fs.device_get(f(x)).sum().backward()
    return x.grad


def test_check_vma_false_derived_replicated_value_raises_in_sim():
    # untracked (dist), psum's transpose would give 2 where the global function gives 2 * n: the sim audit raises
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    with pytest.raises(fs.ShardingError, match=r"psum \(check_vma=False\).*fs.pvary\(x, 'tp'\)"):
        _derived_replicated(mesh, fix=False)


def test_check_vma_false_derived_replicated_value_with_pvary(run):
    for grad in run(_derived_replicated, {"tp": 2}, True):
        assert torch.equal(grad, torch.full((3,), 4.0))  # d/dx of sum(2 * 2 x)


def test_check_vma_false_derived_value_without_gradient_passes():
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    f = fs.shard_map(lambda x: fs.psum(x * 2, "tp"), mesh=mesh, in_specs=(P(),), out_specs=P(), check_vma=False)
    assert torch.equal(fs.device_get(f(torch.arange(3.0))), torch.arange(3.0) * 4)  # no gradient: nothing wrong


# -- hole 6: each device owns what it writes; the caller's arguments are never written ------------------------


def _inplace(mesh, big):
    z = torch.zeros(big)
    w = torch.zeros(big)
    arr = fs.device_put(torch.zeros(big), mesh, P())

    def body(x, y, a):
        x.add_(1)
        y[0] = fs.axis_index("tp").to(y.dtype) + 1
        a.mul_(2).add_(3)
        return x, y, a

    f = fs.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=(P(), P("tp"), P()))
    x, y, a = f(z, w, arr)
    return fs.device_get(x), fs.device_get(y), fs.device_get(a), z, w, fs.device_get(arr)


@pytest.mark.parametrize("big", [4, 1 << 16])
def test_inplace_on_arguments_is_per_device(run, big):
    mesh_shape = {"dp": 2, "tp": 2}
    for x, y, a, z, w, arr in run(_inplace, mesh_shape, big):
        assert torch.equal(x, torch.ones(big))  # sim once gave 4 (and races on large tensors)
        want_y = torch.zeros(2 * big)
        want_y[0], want_y[big] = 1, 2
        assert torch.equal(y, want_y)
        assert torch.equal(a, torch.full((big,), 3.0))
        assert torch.equal(z, torch.zeros(big)) and torch.equal(w, torch.zeros(big))  # the caller's, untouched
        assert torch.equal(arr, torch.zeros(big))


def test_inplace_on_sharded_argument_leaves_caller_alone():
    mesh = fs.make_mesh({"dp": 4}, backend="sim")
    x = torch.arange(8.0)
    out = fs.shard_map(lambda b: b.mul_(10), mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))(x)
    assert torch.equal(fs.device_get(out), torch.arange(8.0) * 10)
    assert torch.equal(x, torch.arange(8.0))


# -- hole 7: Python numbers --------------------------------------------------------------------------------


def _numbers(mesh):
    def body(x):
        return (
            x + fs.pmean(3.0, "tp"),
            x + fs.psum(3.0, "tp"),
            x + fs.pmax(3.0, "tp"),
            fs.all_gather(3.0, "tp"),
            fs.ppermute(3.0, "tp", [(0, 1), (1, 0)]) + x,
        )

    # gathered and permuted values vary over the axis (as in JAX), so their specs name it
    f = fs.shard_map(body, mesh=mesh, in_specs=(P(),), out_specs=(P(), P(), P(), P("tp"), P("tp")))
    return [fs.device_get(o) for o in f(torch.zeros(1))]


def test_collectives_of_python_numbers(run):
    for pmean, psum, pmax, gathered, permuted in run(_numbers, {"tp": 2}):
        assert pmean.item() == 3.0 and psum.item() == 6.0 and pmax.item() == 3.0
        assert torch.equal(gathered, torch.full((4,), 3.0))
        assert torch.equal(permuted, torch.full((2,), 3.0))


def test_scatter_of_a_number_is_a_sharding_error():
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    f = fs.shard_map(lambda x: fs.psum_scatter(3.0, "tp") + x, mesh=mesh, in_specs=(P(),), out_specs=P())
    with pytest.raises(fs.ShardingError, match="psum_scatter"):
        f(torch.zeros(1))


# -- found by the fuzzer: an invariant value returned under a spec that names an axis ------------------------


def _invariant_under_tiled_spec(mesh):
    f = fs.shard_map(lambda v0: v0 * 1.0, mesh=mesh, in_specs=(P(),), out_specs=P("a"))
    v0 = torch.arange(4.0, requires_grad=True)
    ct = torch.arange(8.0)
    (fs.device_get(f(v0)) * ct).sum().backward()
    return v0.grad


def test_invariant_output_under_spec_naming_axis_sums_cotangents(run):
    # the output is [v0; v0]: the gradient of v0 sums the cotangents of both blocks
    for g in run(_invariant_under_tiled_spec, {"a": 2}):
        assert torch.equal(g, torch.arange(4.0) + torch.arange(4.0, 8.0))
