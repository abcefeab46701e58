"""The Mixtral train step's expert-parallel exchange, counted: on a sim ``ep`` mesh, each device's
``ragged_all_to_all`` bytes per layer and direction (forward dispatch and combine, backward combine and dispatch)
equal the rows its routing sends to other devices (counted from the expert ids each layer chose), and, under
device-balanced routing, the theory ``tokens x k x dim x bytes x (ep-1)/ep``; ``fs.comm_stats`` reports their sum.

Per layer and direction: the body's own log of its collectives in program order (``funcshard.extend.capture``,
per device thread); the routing: ``moe_ffn`` wrapped to keep each layer's expert ids (patched on the Mixtral's model
module). The counts ``comm_stats`` records are those of rows sent to OTHER devices (the rows a device keeps are not
counted).
"""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.extend import axis_index_int, capture
from funcshard.models import mixtral
from funcshard.models.mixtral import model as mixtral_model

pytestmark = pytest.mark.counters

D, LAYERS, BATCH, SEQ = 32, 2, 8, 8


def _cfg(ep: int) -> mixtral.Config:
    """``2 ep`` experts, top-``ep`` (balanced routing: each token to one expert on every device)."""
    return mixtral.Config(
        vocab_size=64, dim=D, n_layers=LAYERS, n_heads=4, n_kv_heads=2, ffn_dim=16, max_seq_len=SEQ,
        n_experts=2 * ep, experts_per_token=ep,
    )  # fmt: skip


def _balanced(params: dict, ep: int) -> dict:
    """Each layer's router with its first ``E / ep`` rows repeated on every device's block: expert ``j`` of every
    device gets the same logit, ``torch.topk`` (k = ep) takes all ``ep`` tied copies of the best one, so exactly
    ``(ep - 1) / ep`` of each token's assignments leave its device. (A zero router is not balanced: ``torch.topk``
    resolves the ties to the lowest ids, every token to experts ``0 .. k-1``, all on device 0.)"""
    router = params["layers"]["router"]  # [L, E, d]
    e_local = router.shape[1] // ep
    return {**params, "layers": {**params["layers"], "router": router[:, :e_local].repeat(1, ep, 1)}}


def _step_log(monkeypatch, ep: int, balanced: bool) -> tuple[dict, dict, fs.CommStats, mixtral.Config]:
    """One train step on sim ``{"ep": ep}``: per device, its ``ragged_all_to_all`` bytes in program order and each
    layer's expert ids ``[T_local, k]``; the ``comm_stats`` of the step."""
    cfg = _cfg(ep)
    params = mixtral.init(fs.random.key(0), cfg)
    params = _balanced(params, ep) if balanced else params
    tokens = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    mesh = fs.make_mesh({"ep": ep}, backend="sim")
    specs, bs = mixtral.param_specs(cfg, mesh), mixtral.batch_spec(mesh)
    sent: dict[int, list[int]] = {}
    ids: dict[int, list[torch.Tensor]] = {}
    inner = mixtral_model.moe_ffn

    def moe_ffn(*args, **kw):
        y, aux = inner(*args, **kw)
        ids.setdefault(axis_index_int("ep"), []).append(aux.expert_ids.detach().clone())  # [T_local, k]
        return y, aux

    monkeypatch.setattr(mixtral_model, "moe_ffn", moe_ffn)

    def body(p, t, y):
        with capture() as log:
            out = mixtral.value_and_grad(p, t, y, cfg)
        sent[axis_index_int("ep")] = [b for _, name, _, b in log if name == "ragged_all_to_all"]
        return out

    step = fs.shard_map(body, mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs))
    with fs.comm_stats() as st:
        step(fs.device_put(params, mesh, specs), tokens, tokens.roll(-1, dims=1))
    return sent, ids, st, cfg


def _expected(ids: dict[int, list[torch.Tensor]], cfg: mixtral.Config, ep: int, r: int) -> list[int]:
    """Device ``r``'s bytes per exchange in program order, from the routing: per layer forward (dispatch: its rows
    for other devices' experts; combine: the rows other devices sent it, back), then per layer in reverse the
    backward (the combine's: the dispatch's rows again; the dispatch's: the combine's)."""
    e_local, row = cfg.n_experts // ep, cfg.dim * 4
    fwd, bwd = [], []
    for layer in range(cfg.n_layers):
        dest = {j: ids[j][layer] // e_local for j in range(ep)}  # [T_local, k]: each assignment's device
        out = int((dest[r] != r).sum())
        back = sum(int((dest[j] == r).sum()) for j in range(ep) if j != r)
        fwd += [out * row, back * row]
        bwd = [out * row, back * row, *bwd]
    return fwd + bwd


@pytest.mark.parametrize("ep", [2, 4])
def test_exchange_bytes_equal_the_routing(monkeypatch, ep: int) -> None:
    sent, ids, st, cfg = _step_log(monkeypatch, ep, balanced=False)
    assert sorted(sent) == list(range(ep)) and all(len(ids[r]) == LAYERS for r in range(ep))
    for r in range(ep):
        want = _expected(ids, cfg, ep, r)
        assert sent[r] == want, f"device {r}"
        assert st.calls("ragged_all_to_all", "ep", device=r) == 4 * LAYERS
        assert st.bytes("ragged_all_to_all", "ep", device=r) == sum(want)
        assert st.calls("all_to_all", "ep", device=r) == LAYERS  # the [ep, E_local] counts, once per layer
    assert any(s[0] != s[1] for s in sent.values())  # random routing: a device sends more than it gets back


@pytest.mark.parametrize("ep", [2, 4])
def test_balanced_routing_moves_the_theory(monkeypatch, ep: int) -> None:
    sent, ids, st, cfg = _step_log(monkeypatch, ep, balanced=True)
    tokens_local, k = BATCH * SEQ // ep, cfg.experts_per_token
    theory = tokens_local * k * cfg.dim * 4 * (ep - 1) // ep  # per device, layer and direction
    for r in range(ep):
        assert sent[r] == [theory] * (4 * LAYERS), f"device {r}"
        assert sent[r] == _expected(ids, cfg, ep, r)
        assert st.bytes("ragged_all_to_all", "ep", device=r) == 4 * LAYERS * theory
    # over the devices: the global batch's tokens x k x dim x bytes x (ep-1)/ep per layer and direction
    total = sum(st.bytes("ragged_all_to_all", "ep", device=r) for r in range(ep))
    assert total == 4 * LAYERS * (BATCH * SEQ) * k * cfg.dim * 4 * (ep - 1) // ep
