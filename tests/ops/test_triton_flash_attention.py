"""``funcshard.ops.triton.flash_attention``: the Triton kernels, run on CPU by Triton's interpreter, against
``funcshard.ops.attention`` (forward, log-sum-exp, and the gradients of q, k, v), and the torch fallback.

``TRITON_INTERPRET=1`` is set only while this module's tests run (an autouse fixture): the kernels are
decorated at their first call, in the mode the variable names then, so no other test module sees it. The
interpreter is slow: small shapes (sequence lengths that leave partial blocks: the interpreter's blocks are
32 x 16 and 16 x 32), few cases. The tests of the kernels skip without triton (``pip install triton``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from funcshard import ConfigError, ShardingError
from funcshard.ops import attention
from funcshard.ops.triton import flash_attention, uses_triton

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install 'triton>=3.0')")
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _rand(*shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_()


def _qkv(b, hq, hkv, sq, d, sk=None, dtype=torch.float32):
    sk = sq if sk is None else sk
    return (
        _rand(b, hq, sq, d, seed=1, dtype=dtype),
        _rand(b, hkv, sk, d, seed=2, dtype=dtype),
        _rand(b, hkv, sk, d, seed=3, dtype=dtype),
    )


def _run(fn, q, k, v, *, causal, return_lse, **kw):
    """Outputs and the gradients of q, k, v of a random linear function of them (the lse's too)."""
    res = fn(q, k, v, causal=causal, return_lse=return_lse, **kw)
    out, lse = res if return_lse else (res, None)
    loss = (out.float() * _rand(*out.shape, seed=4).detach()).sum()
    if lse is not None:
        loss = loss + (lse * _rand(*lse.shape, seed=5).detach()).sum()
    return out, lse, torch.autograd.grad(loss, (q, k, v))


def _close(a, b, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


@needs_triton
@pytest.mark.parametrize(
    ("b", "hq", "hkv", "s", "d", "causal", "return_lse"),
    [
        (1, 2, 2, 40, 16, True, True),  # 40: partial blocks
        (2, 4, 2, 40, 32, False, True),  # GQA, 2 query heads per kv head
        (1, 4, 1, 64, 16, True, False),  # one kv head for all (MQA), whole blocks
        (2, 2, 2, 16, 32, False, False),  # shorter than a block
    ],
)
def test_matches_attention(b, hq, hkv, s, d, causal, return_lse) -> None:
    q, k, v = _qkv(b, hq, hkv, s, d)
    assert uses_triton(q)
    out, lse, grads = _run(flash_attention, q, k, v, causal=causal, return_lse=return_lse)
    ref_out, ref_lse, ref_grads = _run(attention, q, k, v, causal=causal, return_lse=return_lse)
    assert out.shape == (b, hq, s, d) and out.dtype == q.dtype
    _close(out, ref_out)
    if return_lse:
        assert lse.shape == (b, hq, s) and lse.dtype == torch.float32
        _close(lse, ref_lse)
    for g, r in zip(grads, ref_grads):
        _close(g, r)


@needs_triton
def test_more_keys_than_queries_strided_odd_head_dim_and_scale() -> None:
    """sq != sk (not causal), head_dim 24 (padded to 32 in the kernels), non-contiguous q and k, a scale."""
    q = torch.randn(1, 10, 2, 24).transpose(1, 2).requires_grad_()  # [1, 2, 10, 24], strided
    k = torch.randn(1, 37, 1, 24).transpose(1, 2).requires_grad_()  # [1, 1, 37, 24]
    v = torch.randn(1, 1, 37, 24, requires_grad=True)
    out, lse, grads = _run(flash_attention, q, k, v, causal=False, return_lse=True, scale=0.3)
    ref_out, ref_lse, ref_grads = _run(attention, q, k, v, causal=False, return_lse=True, scale=0.3)
    _close(out, ref_out)
    _close(lse, ref_lse)
    for g, r in zip(grads, ref_grads):
        _close(g, r)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype: torch.dtype) -> None:
    """Outputs and gradients in the input dtype, near the float32 reference (the rounding of the inputs' dtype);
    the log-sum-exp stays float32."""
    q, k, v = _qkv(1, 2, 1, 33, 32, dtype=dtype)
    out, lse, grads = _run(flash_attention, q, k, v, causal=True, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32 and all(g.dtype == dtype for g in grads)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse, ref_grads = _run(attention, q32, k32, v32, causal=True, return_lse=True)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 5e-3, "atol": 5e-3}
    _close(out, ref_out, **tol)
    _close(lse, ref_lse, **tol)
    for g, r in zip(grads, ref_grads):
        _close(g, r, **tol)


@needs_triton
def test_lse_merges_blocks_as_the_ring_does() -> None:
    """Attention over two halves of the keys, merged by their log-sum-exps, is attention over all keys."""
    q, k, v = (t.detach() for t in _qkv(1, 2, 2, 16, 16, sk=48))
    o1, l1 = flash_attention(q, k[:, :, :20], v[:, :, :20], return_lse=True)
    o2, l2 = flash_attention(q, k[:, :, 20:], v[:, :, 20:], return_lse=True)
    lse = torch.logaddexp(l1, l2)  # [b, h, sq]
    out = o1 * (l1 - lse).exp().unsqueeze(-1) + o2 * (l2 - lse).exp().unsqueeze(-1)
    ref_out, ref_lse = attention(q, k, v, return_lse=True)
    _close(out, ref_out)
    _close(lse, ref_lse)


@needs_triton
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap of CPU SDPA (torch's note)
def test_torch_func_grad_and_vmap() -> None:
    """``torch.func.grad`` goes through the kernels; ``vmap`` takes the torch path (same values)."""
    q, k, v = (t.detach() for t in _qkv(1, 2, 1, 20, 16))
    grads = torch.func.grad(lambda *a: flash_attention(*a, causal=True).sum(), argnums=(0, 1, 2))(q, k, v)
    ref = torch.func.grad(lambda *a: attention(*a, causal=True).sum(), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(grads, ref):
        _close(g, r)
    qs = torch.stack((q, 2 * q))  # [2, b, h, s, d]
    _close(torch.vmap(lambda x: flash_attention(x, k, v))(qs), torch.stack([attention(x, k, v) for x in qs]))


@needs_triton
def test_inside_shard_map_heads_over_tp() -> None:
    """Heads split over a simulated tp=2 mesh (a thread per device: interpreted kernels take turns), with
    ``torch.func.grad`` in the body: the gradients of the unsharded attention."""
    import funcshard as fs
    from funcshard import P

    q, k = (t.detach() for t in _qkv(1, 4, 2, 20, 16)[:2])

    def body(q, k):
        return torch.func.grad(lambda q, k: flash_attention(q, k, k, causal=True).sum(), argnums=(0, 1))(q, k)

    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    specs = (P(None, "tp"), P(None, "tp"))
    grads = fs.device_get(fs.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs)(q, k))
    ref = torch.func.grad(lambda q, k: attention(q, k, k, causal=True).sum(), argnums=(0, 1))(q, k)
    for g, r in zip(grads, ref):
        _close(g, r)


@needs_triton
def test_attention_with_lse_runs_the_kernels_on_flash_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ops.attention(return_lse=True)`` runs the kernels on :data:`FLASH_DEVICES` (CUDA; CPU
    added here, interpreted): its results and gradients are the torch path's; without the lse it stays SDPA."""
    import importlib

    from funcshard.ops.attention import triton

    attention_module = importlib.import_module("funcshard.ops.attention.local")
    calls: list[int] = []
    apply = triton._FlashAttention.apply
    monkeypatch.setattr(triton._FlashAttention, "apply", lambda *a: calls.append(1) or apply(*a))
    q, k, v = _qkv(1, 4, 2, 24, 16)
    want = _run(attention, q, k, v, causal=True, return_lse=True)
    assert calls == []  # CPU is not among the devices by default
    monkeypatch.setattr(attention_module, "FLASH_DEVICES", ("cuda", "cpu"))
    got = _run(attention, q, k, v, causal=True, return_lse=True)
    assert calls == [1]
    for a, b in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2]), strict=True):
        _close(a, b)
    attention(q, k, v, causal=True)  # no lse: SDPA
    assert calls == [1]


def test_fallback_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU without ``TRITON_INTERPRET`` it is the torch path: exactly ``attention``'s results."""
    monkeypatch.delenv("TRITON_INTERPRET")
    q, k, v = _qkv(2, 4, 2, 12, 8)
    assert not uses_triton(q)
    for causal in (False, True):
        out, lse, grads = _run(flash_attention, q, k, v, causal=causal, return_lse=True)
        ref_out, ref_lse, ref_grads = _run(attention, q, k, v, causal=causal, return_lse=True)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
        assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


def test_unsupported_inputs_raise() -> None:
    x = torch.randn(1, 2, 4, 16)
    with pytest.raises(ConfigError, match=r"float64.*funcshard\.ops\.attention"):
        flash_attention(x.double(), x.double(), x.double())
    with pytest.raises(ConfigError, match=r"head_dim 512.*256"):
        flash_attention(*(torch.randn(1, 2, 4, 512),) * 3)
    with pytest.raises(ShardingError, match="hq divisible by hkv"):
        flash_attention(torch.randn(1, 3, 4, 16), x, x)
    with pytest.raises(ShardingError, match="must match"):
        flash_attention(x, torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16), causal=True)


def test_importing_funcshard_does_not_import_triton() -> None:
    code = "import sys, funcshard, funcshard.ops, funcshard.ops.triton; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _ring_kernels_body(mesh, causal: bool, layout: str, dtype: torch.dtype, grad: str) -> dict[str, int]:
    """``ring_attention`` over cp with CPU among the flash devices (interpreted kernels): output and gradients of
    q, k, v (GQA) against the unsharded torch attention, by ``fs.value_and_grad`` or ``torch.func.grad``;
    returns how often the block kernels ran here."""
    import importlib

    import funcshard as fs
    from funcshard import P
    from funcshard.ops import ring_attention, zigzag_indices, zigzag_inverse_indices
    from funcshard.ops.attention import triton as flash

    attention_module = importlib.import_module("funcshard.ops.attention.local")
    n, s = mesh.shape["cp"], 32
    q, k, v = (t.detach() for t in _qkv(1, 4, 2, s, 16, dtype=dtype))
    r = _rand(1, 4, s, 16, seed=4).detach()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = attention(*ref, causal=causal)
    (out_ref.float() * r).sum().backward()

    order = zigzag_indices(s, n) if layout == "zigzag" else torch.arange(s)
    back = zigzag_inverse_indices(s, n) if layout == "zigzag" else torch.arange(s)
    spec = P(None, None, "cp")

    def step(r, q, k, v):
        def loss(q, k, v):
            return fs.psum((ring_attention(q, k, v, causal=causal, layout=layout).float() * r).sum(), "cp")

        if grad == "torch.func":  # its backward records a graph (for an outer level): the torch path there
            grads, value = torch.func.grad_and_value(loss, argnums=(0, 1, 2))(q, k, v)
            return value, list(grads)
        return fs.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    calls = {"fwd": 0, "bwd": 0}
    forward, backward = flash._forward, flash._backward

    def counted(name, fn):
        return lambda *a, **kw: calls.__setitem__(name, calls[name] + 1) or fn(*a, **kw)

    saved = attention_module.FLASH_DEVICES
    flash._forward, flash._backward = counted("fwd", forward), counted("bwd", backward)
    attention_module.FLASH_DEVICES = ("cuda", "cpu")
    try:
        f = fs.shard_map(step, mesh=mesh, in_specs=(spec,) * 4, out_specs=(P(), [spec] * 3))
        loss, grads = f(*(t.index_select(2, order) for t in (r, q, k, v)))
    finally:
        flash._forward, flash._backward = forward, backward
        attention_module.FLASH_DEVICES = saved
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    _close(fs.device_get(loss), (out_ref.float() * r).sum(), **tol)
    for g, a in zip(grads, ref, strict=True):
        _close(fs.device_get(g).index_select(2, back), a.grad, **tol)
    return calls


@needs_triton
@pytest.mark.parametrize(
    "causal, layout, dtype, grad",
    [
        (True, "zigzag", torch.float32, "fs"),
        (False, "contiguous", torch.float32, "fs"),
        (True, "zigzag", torch.bfloat16, "fs"),
        (True, "zigzag", torch.float32, "torch.func"),
    ],
)
def test_ring_attention_runs_the_kernels_on_flash_devices(run, causal: bool, layout: str, dtype, grad: str) -> None:
    """On :data:`FLASH_DEVICES` (CPU added here, interpreted) ring attention computes each block by the Triton
    kernels, forward and backward (``fs.value_and_grad``: no graph of the backward), under sim and dist: the loss
    and the gradients of q, k, v are those of the unsharded attention. Every device runs all n blocks here
    (zigzag causal or not causal), so n * n of each kernel over the mesh; under ``torch.func.grad`` the
    backward, which records a graph there, takes the torch path (from the kernels' saved output and lse)."""
    n = 2
    counts = run(_ring_kernels_body, {"cp": n}, causal, layout, dtype, grad)
    assert sum(c["fwd"] for c in counts) == n * n
    assert sum(c["bwd"] for c in counts) == (0 if grad == "torch.func" else n * n)
