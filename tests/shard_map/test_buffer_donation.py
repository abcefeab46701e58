"""Buffer donation (issue #10 item 0): ``shard_map(..., donate=...)``, JAX's ``donate_argnums``.

A donated step (params and AdamW state) gives bit for bit the numbers of the same step without donation,
writes the new params and moments into the donated buffers (once they are the step's own results: the first
``device_put`` of a user tensor is never written), deletes the donated Arrays (a later use raises), and
refuses what cannot be donated. Under sim and dist.
"""

from __future__ import annotations

import optree
import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.models import llama

CFG = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _steps(mesh: fs.Mesh, donate: tuple[int, ...], n: int = 3) -> tuple[list[float], dict, list[bool], bool, bool]:
    specs, bs = llama.param_specs(CFG, mesh), llama.batch_spec(mesh)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(1e-2, weight_decay=0.1))
    sspecs = opt.state_specs(specs)

    def step(p, s, t, y):
        loss, g = llama.value_and_grad(p, t, y, CFG)
        p, s = opt.update(g, s, p)
        return loss, p, s

    f = fs.shard_map(step, mesh=mesh, in_specs=(specs, sspecs, bs, bs), out_specs=(P(), specs, sspecs), donate=donate)
    params0 = llama.init(fs.random.key(0), CFG)
    copy = optree.tree_map(torch.clone, params0)
    p = fs.device_put(params0, mesh, specs)
    s = fs.shard_map(opt.init, mesh=mesh, in_specs=(specs,), out_specs=sspecs)(p)
    tok = torch.randint(0, CFG.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
    tgt = tok.roll(-1, 1)
    losses, in_place = [], []
    raised = True
    for _ in range(n):
        before = [t.data_ptr() for t in p["layers"]["wq"].shards.values()]
        mu_before = [t.data_ptr() for t in s[1].mu["layers"]["w1"].shards.values()]
        old = p
        loss, p, s = f(p, s, tok, tgt)
        losses.append(fs.device_get(loss).item())
        after = [t.data_ptr() for t in p["layers"]["wq"].shards.values()]
        mu_after = [t.data_ptr() for t in s[1].mu["layers"]["w1"].shards.values()]
        in_place.append(before == after and mu_before == mu_after)
        if donate:
            with pytest.raises(fs.ShardingError, match="was donated"):
                fs.device_get(old)
            raised = raised and old["layers"]["wq"].is_deleted()
    untouched = all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(params0), optree.tree_leaves(copy)))
    return losses, fs.device_get(p), in_place, raised, untouched


def _donation_body(mesh: fs.Mesh) -> tuple[bool, list[bool], bool, bool]:
    losses_d, p_d, in_place, raised, untouched = _steps(mesh, (0, 1))
    losses, p, plain_in_place, _, _ = _steps(mesh, ())
    same = losses_d == losses and all(
        torch.equal(a, b) for a, b in zip(optree.tree_leaves(p_d), optree.tree_leaves(p), strict=True)
    )
    assert not any(plain_in_place)  # without donation every step allocates new params
    return same, in_place, raised, untouched


@pytest.mark.parametrize("shape", [{"fsdp": 2, "dp": 2}, {"tp": 2}])
def test_donated_step_is_exact_and_in_place(run, shape) -> None:
    for same, in_place, raised, untouched in run(_donation_body, shape):
        assert same, "donation changed a number"
        # the first step's params are views of the user's tensor (copied on write); from then on, in place
        assert in_place == [False, True, True]
        assert raised and untouched


def test_donate_bad_input() -> None:
    mesh = fs.make_mesh({"dp": 2}, backend="sim")
    with pytest.raises(fs.ShardingError, match="donate must be"):
        fs.shard_map(lambda x: x, mesh=mesh, in_specs=(P(),), out_specs=P(), donate="x")
    f = fs.shard_map(lambda x: x, mesh=mesh, in_specs=(P(),), out_specs=P(), donate=3)
    with pytest.raises(fs.ShardingError, match="donate names argument 3"):
        f(torch.ones(2))
    x = fs.device_put(torch.ones(2, requires_grad=True), mesh, P())
    g = fs.shard_map(lambda x: x * 2, mesh=mesh, in_specs=(P(),), out_specs=P(), donate=0)
    with pytest.raises(fs.ShardingError, match="requires grad"):
        g(x)
    # a plain tensor is never written, and stays usable
    t = torch.ones(4)
    h = fs.shard_map(lambda x: x.mul_(3), mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"), donate=0)
    assert torch.equal(fs.device_get(h(t)), torch.full((4,), 3.0)) and torch.equal(t, torch.ones(4))


def test_returned_twice_is_not_written_through() -> None:
    """An output returned twice shares its storage: donating one must not change the other."""
    mesh = fs.make_mesh({"dp": 2}, backend="sim")
    both = fs.shard_map(lambda x: (x * 2, None), mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))
    a, _ = both(torch.ones(4))
    pair = fs.shard_map(lambda x: (x + 0, x + 0), mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))(a)
    twice = fs.shard_map(lambda x: (x, x), mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))(pair[0])
    assert pair[0].owned and not twice[0].owned and not twice[1].owned
    write = fs.shard_map(lambda x: x.add_(1), mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"), donate=0)
    write(twice[0])
    assert torch.equal(fs.device_get(twice[1]), torch.full((4,), 2.0))
