"""``models.stacked.unstack`` applies ``Unstack`` by the C ``apply`` (issue #11).

``torch.autograd.Function.apply`` binds its arguments to ``forward``'s signature (``inspect.signature``, ~30 Python
calls) at every call of a Function with ``setup_context``, for the torch.func transforms; ``Unstack`` is a door
``Prim`` applied with ``extend.call``, which calls the C ``apply`` that ``Function.apply`` ends in (9 calls a step of
the Llama, ~360 Python calls). The same node, the same numbers: the Llama's dp loss and gradients bitwise either way.
"""

from __future__ import annotations

import inspect
from typing import Any

import optree
import pytest
import torch
from _llama_dp import llama_step

import funcshard as fs
from funcshard.models import llama, stacked

pytestmark = pytest.mark.counters

CFG = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _function_apply(fn: Any, *args: Any) -> Any:
    """``fn`` applied by ``torch.autograd.Function.apply`` (which binds the arguments to ``forward``'s signature)."""
    return torch.autograd.Function.apply.__func__(fn, *args)


def _body(mesh: fs.Mesh) -> dict[str, Any]:
    step, params, tok, tgt = llama_step(mesh, CFG)
    sharded = fs.device_put(params, mesh, llama.param_specs(CFG, mesh))
    real_sig, real_call = inspect.signature, stacked.call
    bound: list[str] = []
    applied: list[int] = []

    def counting_signature(f: Any, *a: Any, **kw: Any) -> Any:
        bound.append(getattr(f, "__qualname__", str(f)))
        return real_sig(f, *a, **kw)

    out = []
    for fast in (True, False):  # the C apply; Function.apply as before
        inspect.signature = counting_signature
        stacked.call = (  # extend.call (the C apply), counted; torch.autograd.Function.apply as before
            (lambda fn, *a: (applied.append(1), real_call(fn, *a))[1]) if fast else _function_apply
        )
        try:
            loss, grads = step(sharded, tok, tgt)
        finally:
            inspect.signature, stacked.call = real_sig, real_call
        out.append((fs.device_get(loss), optree.tree_leaves(fs.device_get(grads))))
        ours = [b for b in bound if b.startswith("Unstack")]
        if fast:
            fast_bound = ours
        else:
            slow_bound = len(ours) - len(fast_bound)
    same = torch.equal(out[0][0], out[1][0]) and all(
        torch.equal(a, b) for a, b in zip(out[0][1], out[1][1], strict=True)
    )
    return {"same": same, "applied": len(applied), "fast_bound": fast_bound, "slow_bound": slow_bound}


def test_unstack_skips_the_signature_binding(run: Any, backend: str) -> None:
    n_stacked = len(llama.init(fs.random.key(0), CFG)["layers"])
    for r in run(_body, {"dp": 2}):
        assert r["same"], r
        assert r["fast_bound"] == [], r  # no inspect.signature of Unstack.forward on the fast path
        # dist: every stacked leaf unstacked by the C apply; sim: torch.unbind (no Unstack node at all)
        assert r["applied"] == (n_stacked if backend == "dist" else 0), r
        assert r["slow_bound"] == (n_stacked if backend == "dist" else 0), r  # Function.apply binds at each call
