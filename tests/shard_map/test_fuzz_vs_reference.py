"""Property-based fuzzer for shard_map (issue #7): random programs against a plain-torch reference.

Each example is a random program (``_fuzz_gen.py``) on a random mesh (1-3 axes, up to 8 devices) with random
in_specs: collectives over single axes and axis tuples in any order, elementwise ops mixing invariant and
varying values, matmuls, reductions, reshapes, in-place writes (on fresh tensors and on inputs),
``fs.axis_index`` arithmetic, collectives of Python numbers, ``torch.func`` transforms (grad, vjp,
grad_and_value, jvp, vmap, nested) and a custom ``torch.autograd.Function``. Its outputs, and the gradients of
``sum(out * ct)`` with respect to its inputs, must equal the reference's (``_fuzz_ref.py``: every device run
explicitly in plain torch, float64), and the caller's tensors must be unchanged.

Modes: ``vma`` (check_vma=True), ``careful`` (check_vma=False with ``fs.pvary`` written where a careful user
would), ``lazy`` (check_vma=False with no pvary before collectives: JAX's answer or a ShardingError). Each
feature is also fuzzed on its own with the core ops (the ``[focus]`` ids), so a failing test names it.

A failure prints the program as code (the shard_map body and call, each value's shape and varying axes) and a
``@reproduce_failure`` blob. ``FUNCSHARD_FUZZ_IN_PROCESS=1`` runs funcshard in this process (for pdb);
by default a worker process runs it, so a crash fails one example instead of the session.

Profiles (hypothesis): "fuzz-ci" (default): a fixed, derandomized set of about 490 programs, under a minute. The
set is fixed for one hypothesis release (another one draws other programs): pyproject's ``test`` extra pins the
release CI runs it with.
"fuzz-slow": ``FUNCSHARD_FUZZ_EXAMPLES=5000`` spreads that many programs over the same tests, randomly.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch
from _fuzz import (
    Isolated,
    Result,
    assemble_dist_grads,
    differences,
    dist_body,
    dist_program,
    finite,
    funcshard_result,
    make_data,
    reference_result,
)
from _fuzz_gen import FEATURES, generate
from _fuzz_program import Input, Op, Program, Sub, Var
from _fuzz_ref import run_reference
from hypothesis import HealthCheck, assume, given, reject, settings
from hypothesis import strategies as st

import funcshard as fs

pytestmark = pytest.mark.oracle

# per test (the parametrized ones: per feature); the slow profile scales them up by the same factor
CI_EXAMPLES = {"vma": 30, "careful": 12, "lazy": 40, "out_spec": 12, "number": 10, "jax": 5}
CI_TOTAL = sum(n * (len(FEATURES) + 1 if k in ("vma", "careful", "out_spec") else 1) for k, n in CI_EXAMPLES.items())
SLOW = int(os.environ.get("FUNCSHARD_FUZZ_EXAMPLES", "0"))
_COMMON = {
    "deadline": None,
    "database": None,
    "print_blob": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
}
settings.register_profile("fuzz-ci", derandomize=True, **_COMMON)
settings.register_profile("fuzz-slow", derandomize=False, **_COMMON)
PROFILE = settings.get_profile("fuzz-slow" if SLOW else "fuzz-ci")


def fuzz_settings(kind: str) -> settings:
    """The profile, with this test's share of the examples."""
    n = CI_EXAMPLES[kind]
    return settings(PROFILE, max_examples=max(n, SLOW * n // CI_TOTAL) if SLOW else n)


@st.composite
def programs(draw, mode: str, focus: str | None = None, error: str | None = None) -> Program:
    """Random programs (see ``_fuzz_gen.generate``), shrinking toward short ones on small meshes."""
    return generate(draw(st.randoms(use_true_random=False)), mode, focus=focus, error=error)


ISOLATED = None if os.environ.get("FUNCSHARD_FUZZ_IN_PROCESS") else Isolated()


def sim_result(prog: Program) -> Result:
    """``prog`` under sim: in a worker process (a crash fails one example, not the session), or in this
    process with ``FUNCSHARD_FUZZ_IN_PROCESS=1`` (to debug one)."""
    if ISOLATED is None:
        return funcshard_result(prog, fs.make_mesh(prog.mesh, backend="sim"))
    return ISOLATED.run(prog)


# torch's own limits, met by plain torch on the same tensors (not funcshard's): torch.func.jvp of a primal
# that is an expanded view (a vmap output that does not depend on the batch) fails in make_dual
TORCH_LIMITS = ("more than one element of the written-to tensor refers to a single memory location",)


def check(prog: Program) -> None:
    """``prog`` under sim equals the reference (or, where the program allows it, raises ShardingError)."""
    want = reference_result(prog)
    assume(finite(want))
    try:
        got = sim_result(prog)
    except fs.ShardingError:
        if prog.may_raise:
            return
        raise
    except (AssertionError, RuntimeError) as e:
        if any(m in str(e) for m in TORCH_LIMITS):
            reject()
        raise
    problems = differences(prog, want, got)
    assert not problems, "\n".join(problems)


FOCUS = [*FEATURES, None]


@pytest.mark.parametrize("focus", FOCUS, ids=[f or "all" for f in FOCUS])
@given(data=st.data())
@fuzz_settings("vma")
def test_vma(focus, data):
    check(data.draw(programs("vma", focus), label="prog"))


@pytest.mark.parametrize("focus", FOCUS, ids=lambda f: f or "all")
@given(data=st.data())
@fuzz_settings("careful")
def test_careful_pvary(focus, data):
    check(data.draw(programs("careful", focus), label="prog"))


# check_vma=False tracks no op under dist, so a value computed from a replicated one and then reduced over an
# axis it does not vary over would get psum's transpose without the sum over its copies (JAX's answer is n
# times larger). The sim backend audits such a body (the vma mode runs, tagging but changing nothing) and
# raises there; the lazy programs below check that every such program raises or equals the reference.
@given(prog=programs("lazy", "core"))
@fuzz_settings("lazy")
def test_lazy_no_pvary(prog):
    check(prog)


@pytest.mark.parametrize("focus", FOCUS, ids=[f or "all" for f in FOCUS])
@given(data=st.data())
@fuzz_settings("out_spec")
def test_varying_output_under_omitting_spec_raises(focus, data):
    prog = data.draw(programs("vma", focus, error="out_spec"), label="prog")
    with pytest.raises(fs.ShardingError):
        sim_result(prog)


@given(prog=st.sampled_from(["vma", "careful"]).flatmap(lambda m: programs(m, error="number")))
@fuzz_settings("number")
def test_number_to_collective_that_needs_a_dim_raises(prog):
    with pytest.raises(fs.ShardingError):
        sim_result(prog)


# ------------------------------------------------------------------------------------------------------
# dist: a sample of programs on a pool of 4 gloo workers, each rebuilding its program from a seed
# ------------------------------------------------------------------------------------------------------

DIST_SEEDS = [(mode, seed) for seed in range(4) for mode in ("vma", "careful")]


@pytest.mark.dist
@pytest.mark.parametrize(("mode", "seed"), DIST_SEEDS, ids=[f"{m}-{s}" for m, s in DIST_SEEDS])
def test_dist_equals_sim_and_reference(mode, seed):
    from _dist_pool import run_body

    prog = dist_program(seed, mode, 4)
    want = reference_result(prog)
    assert finite(want), f"seed {seed} gives a program whose reference is not finite; pick another seed\n{prog}"
    ranks = run_body("dist", dist_body, prog.mesh, seed, mode)
    assert all(r["listing"] == repr(prog) for r in ranks), "a worker built a different program from the seed"
    try:
        sim = sim_result(prog)
    except fs.ShardingError as e:
        assert prog.may_raise, f"{prog}\nsim raised {e}"
        assert all("error" in r for r in ranks), f"{prog}\nsim raised {e}, dist did not"
        return
    errors = [r["error"] for r in ranks if "error" in r]
    assert not errors, f"{prog}\ndist raised {errors[0]}, sim did not"
    grads, problems = assemble_dist_grads(prog, [r["grads"] for r in ranks])
    for rank, r in enumerate(ranks):
        got = Result(r["outs"], grads, r["mutated"])
        problems += [f"rank {rank} vs reference: {p}" for p in differences(prog, want, got)]
        problems += [f"rank {rank} vs sim: {p}" for p in differences(prog, sim, got)]
    assert not problems, f"{prog}\n" + "\n".join(problems)


# ------------------------------------------------------------------------------------------------------
# The oracle itself: against JAX where it is installed, and on programs whose answers are known by hand
# ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason='needs jax: pip install "jax[cpu]"')
@given(data=st.data())
@fuzz_settings("jax")
def test_reference_equals_jax(data):
    """The reference agrees with JAX's shard_map (the model it follows) on the programs JAX runs alike."""
    import _fuzz_jax

    prog = data.draw(programs("vma", data.draw(st.sampled_from(FOCUS), label="focus")), label="prog")
    want = reference_result(prog)
    assume(finite(want))
    xs, cts = make_data(prog)
    try:
        outs, grads = _fuzz_jax.jax_result(prog, xs, cts)
    except _fuzz_jax.Unsupported:
        assume(False)
    problems = differences(prog, want, Result(outs, grads))
    assert not problems, "\n".join(problems)


def _vjp_of_psum() -> Program:
    # v3 = pull(cos(v2)) where v2, pull = vjp(psum over a, v0): the outer gradient runs through psum's transpose
    w, arg, s, out, g = (Var(i, (2,), frozenset()) for i in range(5))
    sub = Sub(arg, (Op("psum", (arg,), (s,), {"axes": "a"}),), s)
    return Program({"a": 2}, "vma", (Input(w, (2,), (), True),), (Op("vjp", (w,), (out, g), sub=sub),), ((g, ()),), 7)


SEMANTICS = {
    # an output invariant over 'a' under out_specs naming 'a' holds two copies: their gradients add up
    "tiled_output": lambda: _program(
        {"a": 2}, [((2,), (2,), (), True)], [("sin", [0], (2,), set(), {})], [(1, ("a",))]
    ),
    "vjp_of_psum": _vjp_of_psum,
}


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason='needs jax: pip install "jax[cpu]"')
@pytest.mark.parametrize("name", SEMANTICS)
def test_reference_equals_jax_on(name):
    import _fuzz_jax

    prog = SEMANTICS[name]()
    want = reference_result(prog)
    outs, grads = _fuzz_jax.jax_result(prog, *make_data(prog))
    assert not differences(prog, want, Result(outs, grads))


def _program(src_mesh, inputs, ops, outputs, mode="vma") -> Program:
    """A hand-written program: ``ops`` as (kind, [args], shape, vma, params); values are numbered in order."""
    env = {}
    ins = []
    for k, (shape, gshape, spec, grad) in enumerate(inputs):
        env[k] = Var(k, shape, frozenset(a for e in spec for a in ((e,) if isinstance(e, str) else e or ())))
        ins.append(Input(env[k], gshape, spec, grad))
    ops_out = []
    for kind, args, shape, vma, params in ops:
        v = Var(len(env), shape, frozenset(vma))
        ops_out.append(Op(kind, tuple(env[a] for a in args), (v,), params))
        env[v.id] = v
    return Program(src_mesh, mode, tuple(ins), tuple(ops_out), tuple((env[i], s) for i, s in outputs), 0)


def test_reference_axis_index_gradient_is_summed():
    # issue #7 hole 1: x * (axis_index + 1) over tp=4, x replicated: d/dx sum(out) = 1 + 2 + 3 + 4
    prog = _program(
        {"tp": 4}, [((3,), (3,), (), True)], [("index_mul", [0], (3,), {"tp"}, {"axes": "tp"})], [(1, ("tp",))]
    )
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    (out,) = run_reference(prog, [x])
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 10.0, dtype=torch.float64))


def test_reference_collectives_over_axis_tuples_follow_the_tuple_order():
    mesh = {"a": 2, "b": 2}
    x = torch.arange(4.0, dtype=torch.float64)  # device (a, b) holds a * 2 + b
    gather = _program(
        mesh,
        [((1,), (4,), (("a", "b"),), False)],
        [("all_gather", [0], (4,), {"a", "b"}, {"axes": ("b", "a"), "dim": 0, "tiled": True})],
        [(1, (("a", "b"),))],
    )
    (out,) = run_reference(gather, [x])
    assert torch.equal(out[:4], torch.tensor([0.0, 2.0, 1.0, 3.0], dtype=torch.float64))  # b major, a minor
    # over ("b", "a") index 2 is device (a=0, b=1), which holds 1.0; index 0 is device (a=0, b=0)
    shift_from_one = _program(
        mesh,
        [((1,), (4,), (("a", "b"),), False)],
        [("ppermute", [0], (1,), {"a", "b"}, {"axes": ("b", "a"), "perm": ((2, 0),)})],
        [(1, (("a", "b"),))],
    )
    (out,) = run_reference(shift_from_one, [x])
    assert torch.equal(out, torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64))


def test_reference_inner_grad_of_invariant_value_sums_over_the_loss_axes():
    # L_d = sum(w * x_d), w replicated, x sharded over dp=2: torch.func.grad(L)(w) = x_0 + x_1 on each device
    w, x = Var(0, (2,), frozenset()), Var(1, (2,), frozenset({"dp"}))
    arg, prod = Var(2, (2,), frozenset()), Var(3, (2,), frozenset({"dp"}))
    g = Var(4, (2,), frozenset())
    sub = Sub(arg, (Op("mul", (arg, x), (prod,)),), prod)
    prog = Program(
        {"dp": 2},
        "vma",
        (Input(w, (2,), (), False), Input(x, (4,), ("dp",), False)),
        (Op("grad", (w,), (g,), sub=sub),),
        ((g, ()),),
        0,
    )
    (out,) = run_reference(prog, [torch.zeros(2, dtype=torch.float64), torch.arange(4.0, dtype=torch.float64)])
    assert torch.equal(out, torch.tensor([2.0, 4.0], dtype=torch.float64))


def test_fuzzer_catches_a_wrong_collective(monkeypatch):
    # the comparison is not vacuous: a psum that halves its result is reported
    prog = _program({"tp": 2}, [((3,), (6,), ("tp",), True)], [("psum", [0], (3,), set(), {"axes": "tp"})], [(1, ())])
    want = reference_result(prog)
    psum = fs.psum
    monkeypatch.setattr(fs, "psum", lambda x, axis: psum(x, axis) * 0.5)
    got = funcshard_result(prog, fs.make_mesh(prog.mesh, backend="sim"))  # in this process, where the patch is
    assert differences(prog, want, got)


def test_programs_are_the_same_from_the_same_seed():
    for seed in range(20):
        a, b = (generate(random.Random(seed), "vma") for _ in range(2))
        assert repr(a) == repr(b)
