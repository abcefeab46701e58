"""``funcshard.ops.moe`` against Hugging Face: ``route`` + ``moe_ffn(axis=None)`` against ``MixtralSparseMoeBlock``
and ``Qwen3MoeSparseMoeBlock`` (output and every gradient), ``load_balancing_loss`` / the stats form against
``load_balancing_loss_func``, over pooled layers and with a padding mask.

The HF blocks get our weights: ``gate.weight = router``, ``experts.gate_up_proj = cat(w1, w3, dim=1)`` (gate rows
first), ``experts.down_proj = w2``; their gradients split back the same way.
"""

from __future__ import annotations

import pytest
import torch

from funcshard.ops import moe

pytestmark = pytest.mark.oracle

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral import modeling_mixtral  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

E, D, F_, K = 8, 16, 32, 2
RTOL, ATOL = 1e-4, 1e-5


def _rand(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _params(seed=0, skew=False, dead=None):
    p = {
        "router": _rand(E, D, seed=seed),
        "w1": _rand(E, F_, D, seed=seed + 1) * 0.3,
        "w3": _rand(E, F_, D, seed=seed + 2) * 0.3,
        "w2": _rand(E, D, F_, seed=seed + 3) * 0.3,
    }
    if skew:  # tokens lean to +1 in every coordinate (see _tokens): expert 3's logit dominates
        p["router"] = p["router"] * 0.1
        p["router"][3] = 1.0
    if dead is not None:  # an expert no token picks
        p["router"][dead] = -1.0
    return p


def _tokens(seed=10, skew=False, shape=(2, 9)):
    x = _rand(*shape, D, seed=seed)
    return x + 1.0 if skew else x


def _hf_block(kind, p, norm_topk=True):
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(
            hidden_size=D, intermediate_size=F_, num_local_experts=E, num_experts_per_tok=K
        )
        block = modeling_mixtral.MixtralSparseMoeBlock(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(
            hidden_size=D, moe_intermediate_size=F_, num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm_topk
        )
        block = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(p["router"])
        block.experts.gate_up_proj.copy_(torch.cat([p["w1"], p["w3"]], dim=1))
        block.experts.down_proj.copy_(p["w2"])
    return block


def _hf_grads(block, x, r):
    x = x.clone().requires_grad_()
    y = block(x)
    (y * r).sum().backward()
    gu, down = block.experts.gate_up_proj.grad, block.experts.down_proj.grad
    return y.detach(), x.grad, {"router": block.gate.weight.grad, "w1": gu[:, :F_], "w3": gu[:, F_:], "w2": down}


def _ours(x, p, r, **kw):
    x = x.clone().requires_grad_()
    p = {n: t.clone().requires_grad_() for n, t in p.items()}
    y = moe.moe_ffn(x, p, K, axis=None, **kw)
    (y * r).sum().backward()
    return y.detach(), x.grad, {n: t.grad for n, t in p.items()}


def _close(ours, ref):
    (y, gx, gp), (ry, rgx, rgp) = ours, ref
    torch.testing.assert_close(y, ry, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(gx, rgx, rtol=RTOL, atol=ATOL)
    for name in ("router", "w1", "w3", "w2"):
        torch.testing.assert_close(gp[name], rgp[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("impl", ["torch", "segments"])
@pytest.mark.parametrize("case", ["random", "skewed", "dead_expert"])
def test_moe_ffn_equals_mixtral_block(case: str, impl: str) -> None:
    skew = case == "skewed"
    p = _params(skew=skew, dead=5 if case == "dead_expert" else None)
    x = _tokens(skew=skew or case == "dead_expert")
    r = _rand(*x.shape, seed=99)
    counts = torch.bincount(moe.route(x, p["router"], K)[1].reshape(-1), minlength=E)
    if skew:
        assert counts[3] == x.shape[0] * x.shape[1]  # every token picks expert 3
    if case == "dead_expert":
        assert counts[5] == 0
    _close(_ours(x, p, r, impl=impl), _hf_grads(_hf_block("mixtral", p), x, r))


@pytest.mark.parametrize("skew", [False, True])
def test_moe_ffn_many_tokens_equals_mixtral_block(skew: bool) -> None:
    """16800 tokens x top-2: a ``[rows, f]`` of more than 4 MiB, so on CPU the grouped experts run in blocks of whole
    experts; skewed: every token's first choice is expert 3 (one block of it alone), expert 5 gets none."""
    p = _params(seed=30, skew=skew, dead=5 if skew else None)
    x = _tokens(seed=31, skew=skew, shape=(4, 4200))
    r = _rand(*x.shape, seed=97)
    counts = torch.bincount(moe.route(x, p["router"], K)[1].reshape(-1), minlength=E)
    assert counts.sum() * F_ * 4 > 4 << 20
    if skew:
        assert counts[3] == x.shape[0] * x.shape[1] and counts[5] == 0
    ours, ref = _ours(x, p, r, impl="torch"), _hf_grads(_hf_block("mixtral", p), x, r)
    for a, b in zip((ours[0], ours[1], *ours[2].values()), (ref[0], ref[1], *ref[2].values())):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-4)  # (atol: weight gradients sum over ~10^4 rows)


@pytest.mark.parametrize("norm_topk", [False, True])
def test_moe_ffn_equals_qwen3_moe_block(norm_topk: bool) -> None:
    p, x = _params(seed=20), _tokens(seed=21)
    r = _rand(*x.shape, seed=98)
    ours = _ours(x, p, r, norm_topk=norm_topk)
    _close(ours, _hf_grads(_hf_block("qwen3", p, norm_topk), x, r))


def test_route_equals_mixtral_router() -> None:
    p, x = _params(seed=30), _tokens(seed=31)
    logits_hf, weights_hf, ids_hf = _hf_block("mixtral", p).gate(x)
    weights, ids, logits = moe.route(x, p["router"], K)
    torch.testing.assert_close(logits, logits_hf)
    torch.testing.assert_close(weights, weights_hf)
    assert torch.equal(ids, ids_hf)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and logits.shape == (x.shape[0] * x.shape[1], E)


def test_route_bf16_matches_mixtral_casting() -> None:
    """bf16 tokens: logits in bf16, weights float32 (Mixtral's router returns its float32 top-k values)."""
    p, x = _params(seed=32), _tokens(seed=33).bfloat16()
    block = _hf_block("mixtral", p).bfloat16()
    _, weights_hf, ids_hf = block.gate(x)
    weights, ids, logits = moe.route(x, p["router"].bfloat16(), K)
    assert logits.dtype == torch.bfloat16 and weights.dtype == weights_hf.dtype == torch.float32
    torch.testing.assert_close(weights, weights_hf)
    assert torch.equal(ids, ids_hf)


def _layers(n_layers=3, rows=20, seed=40):
    logits = [_rand(rows, E, seed=seed + i) * 2 for i in range(n_layers)]
    ids = [torch.topk(torch.softmax(z, -1), K, dim=-1).indices for z in logits]
    return logits, ids


def test_load_balancing_loss_equals_hf_over_layers() -> None:
    logits, ids = _layers()
    ref = modeling_mixtral.load_balancing_loss_func(tuple(logits), E, K)
    torch.testing.assert_close(moe.load_balancing_loss(logits, ids, E), ref)
    torch.testing.assert_close(
        moe.load_balancing_loss(logits[0], ids[0], E), modeling_mixtral.load_balancing_loss_func((logits[0],), E, K)
    )


def test_stats_form_equals_hf_and_pools() -> None:
    """Stats summed over layers (and, as a model would psum them, over batch halves) give HF's pooled loss, and its
    gradient in the logits."""
    logits, ids = _layers(seed=50)
    leaves = [z.clone().requires_grad_() for z in logits]
    ref = modeling_mixtral.load_balancing_loss_func(tuple(leaves), E, K)
    (ref_grads) = torch.autograd.grad(ref, leaves)
    mine = [z.clone().requires_grad_() for z in logits]
    halves = [moe.router_stats([z[:7] for z in mine], [i[:7] for i in ids], E)]
    halves.append(moe.router_stats([z[7:] for z in mine], [i[7:] for i in ids], E))
    pooled = moe.RouterStats(*(a + b for a, b in zip(*halves)))
    assert pooled.n_rows == 3 * 20 and pooled.counts.sum() == 3 * 20 * K
    loss = moe.balancing_loss_from_stats(*pooled, E)
    torch.testing.assert_close(loss, ref)
    for g, rg in zip(torch.autograd.grad(loss, mine), ref_grads):
        torch.testing.assert_close(g, rg)


def test_load_balancing_loss_with_mask_equals_hf_attention_mask() -> None:
    b, s = 2, 10
    logits, ids = _layers(rows=b * s, seed=60)
    mask = torch.ones(b, s)
    mask[0, 6:] = 0
    mask[1, :2] = 0
    ref = modeling_mixtral.load_balancing_loss_func(tuple(logits), E, K, attention_mask=mask)
    torch.testing.assert_close(moe.load_balancing_loss(logits, ids, E, mask=mask), ref)


def test_moe_ffn_router_outputs_feed_the_loss() -> None:
    p, x = _params(seed=70), _tokens(seed=71)
    _, aux = moe.moe_ffn(x, p, K, axis=None, return_router=True)
    logits_hf, _, ids_hf = _hf_block("mixtral", p).gate(x)
    torch.testing.assert_close(aux.router_logits, logits_hf)
    assert torch.equal(aux.expert_ids, ids_hf) and int(aux.dropped) == 0
    ref = modeling_mixtral.load_balancing_loss_func((logits_hf,), E, K)
    torch.testing.assert_close(moe.load_balancing_loss(aux.router_logits, aux.expert_ids, E), ref)


def test_moe_ffn_bf16_close_to_mixtral_block() -> None:
    """bfloat16 tokens and weights: within bfloat16's rounding of the HF block (which sums the k outputs in
    bfloat16, where moe_ffn sums them in float32)."""
    p, x = _params(seed=80), _tokens(seed=81)
    pb = {n: t.bfloat16() for n, t in p.items()}
    y = moe.moe_ffn(x.bfloat16(), pb, K, axis=None)
    ref = _hf_block("mixtral", p).bfloat16()(x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
