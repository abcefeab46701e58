"""The Llama on a ``pp`` axis: ``llama.value_and_grad`` runs the config's pipeline schedule and its loss and
every gradient equal the single-device model's (fp32, rtol 1e-5), for every schedule on pp=2 and pp=4, and
with dp / fsdp / tp (+SP) / cp inside the stages on 8 simulated devices; under dist (4 gloo processes)
pp=2 x tp=2 and pp=2 x dp=2. Also: ``forward`` / ``loss`` on a pp mesh, a sharded init, checkpoints that
move between pipelined and non-pipelined meshes, and one-line errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.models import llama
from funcshard.pipeline import SCHEDULE_NAMES, by_name

BASE = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _cfg(schedule: str, pp: int, **kw) -> llama.Config:
    v = by_name(schedule, pp, 2 * pp).n_virtual
    return dataclasses.replace(BASE, n_layers=max(2, pp * v), pp_schedule=schedule, **kw)


def _batch(b: int = 8, s: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.randint(0, BASE.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    tgt = torch.randint(0, BASE.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))
    tgt[0, :3] = -100  # ignored positions count nowhere
    return tok, tgt


def _close(got, ref, what: str) -> None:
    for (path, g), (_, r) in zip(fs.pytree.leaves_with_path(got), fs.pytree.leaves_with_path(ref), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=f"{what} {path}")


def _pp_body(mesh: fs.Mesh, cfg: llama.Config, check_vma: bool = True) -> str:
    params = llama.init(fs.random.key(0), cfg)
    tok, tgt = _batch()
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, cfg))(params)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    f = fs.shard_map(
        lambda p, t, y: llama.value_and_grad(p, t, y, cfg),
        mesh=mesh,
        in_specs=(specs, bs, bs),
        out_specs=(P(), specs),
        check_vma=check_vma,
    )
    loss, grads = f(fs.device_put(params, mesh, specs), tok, tgt)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    _close(fs.device_get(grads), ref_grads, "grad")
    return "ok"


PP_CASES = [(name, pp) for name in SCHEDULE_NAMES for pp in (2, 4)]


@pytest.mark.parametrize(("name", "pp"), PP_CASES, ids=[f"{n}-pp{p}" for n, p in PP_CASES])
def test_every_schedule_equals_single_device(name: str, pp: int) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _pp_body, {"pp": pp}, _cfg(name, pp)) == ["ok"]


MIXED = {  # 8 simulated devices: every other axis inside the stages
    "pp2_dp2_tp2_sp-1f1b": ({"pp": 2, "dp": 2, "tp": 2}, "1f1b", True),
    "pp2_dp2_tp2_sp-zbv": ({"pp": 2, "dp": 2, "tp": 2}, "zbv", True),
    "pp2_fsdp2_cp2-interleaved": ({"pp": 2, "fsdp": 2, "cp": 2}, "interleaved", False),
    "pp2_fsdp2_cp2-dualpipev": ({"pp": 2, "fsdp": 2, "cp": 2}, "dualpipev", False),
    "pp2_tp2_cp2-zb": ({"pp": 2, "tp": 2, "cp": 2}, "zb", False),
    "pp2_tp2_cp2_sp-gpipe": ({"pp": 2, "tp": 2, "cp": 2}, "gpipe", True),
}


@pytest.mark.parametrize("case", sorted(MIXED))
def test_pp_with_other_axes_sim(case: str) -> None:
    from _dist_pool import run_body

    shape, name, sp = MIXED[case]
    cfg = _cfg(name, 2, sequence_parallel=sp)
    assert run_body("sim", _pp_body, shape, cfg) == ["ok"]


@pytest.mark.parametrize(
    ("shape", "name", "tied"),
    [({"pp": 2, "dp": 2}, "1f1b", True), ({"pp": 2, "tp": 2}, "interleaved", False), ({"pp": 4}, "zbv", True)],
)
def test_without_vma_tracking_and_tied(shape: dict[str, int], name: str, tied: bool) -> None:
    from _dist_pool import run_body

    cfg = _cfg(name, shape["pp"], tie_embeddings=tied)
    assert run_body("sim", _pp_body, shape, cfg, False) == ["ok"]


def _dist_body(mesh: fs.Mesh) -> str:
    for name in ("1f1b", "interleaved", "zbv"):
        _pp_body(mesh, _cfg(name, 2))
    return "ok"


@pytest.mark.dist
@pytest.mark.parametrize("shape", [{"pp": 2, "tp": 2}, {"pp": 2, "dp": 2}], ids=["pp2_tp2", "pp2_dp2"])
def test_pp_dist(shape: dict[str, int]) -> None:
    from _dist_pool import run_body

    assert set(run_body("dist", _dist_body, shape)) == {"ok"}


def _forward_loss_body(mesh: fs.Mesh, cfg: llama.Config) -> str:
    """forward / loss on a pp mesh (the stages in turn, no schedule), their gradient too, and the init."""
    key = fs.random.key(0)
    params = llama.init(key, cfg)
    tok, tgt = _batch()
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    vocab = P(*bs.entries, "tp" if "tp" in mesh.shape else None)  # [b, s, V/tp]: vocab-parallel logits
    logits = fs.shard_map(lambda p, t: llama.forward(p, t, cfg), mesh=mesh, in_specs=(specs, bs), out_specs=vocab)
    torch.testing.assert_close(fs.device_get(logits(params, tok)), llama.forward(params, tok, cfg))
    ref = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, cfg))(params)
    f = fs.shard_map(
        lambda p, t, y: fs.value_and_grad(llama.loss)(p, t, y, cfg),
        mesh=mesh,
        in_specs=(specs, bs, bs),
        out_specs=(P(), specs),
    )
    loss, grads = f(params, tok, tgt)
    torch.testing.assert_close(fs.device_get(loss), ref[0], rtol=1e-5, atol=1e-6)
    _close(fs.device_get(grads), ref[1], "grad")
    sharded = fs.shard_map(lambda k: llama.init(k, cfg), mesh=mesh, in_specs=(P(),), out_specs=specs)(key)
    for (path, a), (_, b) in zip(
        fs.pytree.leaves_with_path(fs.device_get(sharded)), fs.pytree.leaves_with_path(params), strict=True
    ):
        assert torch.equal(a, b), path  # natural layer order: the same init with and without pp
    return "ok"


@pytest.mark.parametrize(("shape", "name"), [({"pp": 2, "tp": 2}, "zbv"), ({"pp": 4}, "interleaved")])
def test_forward_and_loss_on_a_pp_mesh(shape: dict[str, int], name: str) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _forward_loss_body, shape, _cfg(name, shape["pp"], tie_embeddings=True)) == ["ok"]


def test_checkpoint_moves_between_pipelined_and_plain_meshes(tmp_path) -> None:
    cfg = _cfg("interleaved", 2)
    params = llama.init(fs.random.key(0), cfg)
    piped = fs.make_mesh({"pp": 2, "tp": 2}, backend="sim")
    plain = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    fs.checkpoint.save(tmp_path / "a", fs.device_put(params, piped, llama.param_specs(cfg, piped)))
    like = fs.device_put(params, plain, llama.param_specs(cfg, plain))
    loaded = fs.checkpoint.load(tmp_path / "a", optree_zeros(like))
    _close(fs.device_get(loaded), params, "plain")
    fs.checkpoint.save(tmp_path / "b", loaded)
    back = fs.checkpoint.load(tmp_path / "b", optree_zeros(fs.device_put(params, piped, llama.param_specs(cfg, piped))))
    _close(fs.device_get(back), params, "pipelined")


def optree_zeros(tree):
    """Arrays of the same layout filled with zeros (what a fresh run passes to load as ``like``)."""
    full = fs.device_get(tree)
    return fs.pytree.tree_map(
        lambda a, t: fs.device_put(torch.zeros_like(t), a.mesh, a.spec),
        tree,
        full,
        is_leaf=lambda x: hasattr(x, "spec"),
    )


def test_errors_are_one_line() -> None:
    with pytest.raises(fs.ConfigError, match="pp_schedule='1f2b' is not a schedule"):
        dataclasses.replace(BASE, pp_schedule="1f2b")
    mesh = fs.make_mesh({"pp": 2}, backend="sim")
    with pytest.raises(fs.ConfigError, match=r"n_layers=1 is fewer than the pp=2 stages: .* n_layers >= 2"):
        llama.param_specs(dataclasses.replace(BASE, n_layers=1, pp_schedule="zbv"), mesh)  # 2 or 3 layers: fine
    with pytest.raises(fs.ConfigError, match="cannot run pp_microbatches=3 on pp=2"):
        llama.param_specs(dataclasses.replace(BASE, n_layers=4, pp_schedule="dualpipev", pp_microbatches=3), mesh)
    cfg = dataclasses.replace(BASE, pp_microbatches=3)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    f = fs.shard_map(
        lambda p, t, y: llama.value_and_grad(p, t, y, cfg), mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs)
    )
    tok, tgt = _batch(4)
    with pytest.raises(fs.ConfigError, match=r"local batch of 4 sequences .* not divisible by pp_microbatches=3"):
        f(llama.init(fs.random.key(0), cfg), tok, tgt)


def test_without_pp_it_is_value_and_grad_of_loss() -> None:
    params, (tok, tgt) = llama.init(fs.random.key(0), BASE), _batch()
    loss, grads = llama.value_and_grad(params, tok, tgt, BASE)
    ref_loss, ref_grads = fs.value_and_grad(llama.loss)(params, tok, tgt, BASE)
    assert torch.equal(loss, ref_loss)
    _close(grads, ref_grads, "grad")


@pytest.mark.slow
@pytest.mark.dist
def test_train_job_under_torchrun_with_pp(tmp_path) -> None:
    """`train --mesh pp=2,dp=2 --schedule zbv` on 4 gloo processes gives the losses of the same run on a
    simulated dp=2 mesh without a pipeline (same init, same batches)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from funcshard.__main__ import main as cli_main

    data = tmp_path / "data"
    data.mkdir()
    for i in range(12):
        (data / f"m{i}.py").write_text("".join(f"def f_{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(12)))
    tiny = ["--dim", "32", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--seq", "16"]
    common = [*tiny, "--batch", "8", "--data", str(data), "--steps", "3", "--eval-every", "3", "--threads", "1"]
    piped = [*common, "--mesh", "pp=2,dp=2", "--schedule", "zbv", "--microbatches", "4"]
    out = {name: tmp_path / name for name in ("dist", "sim")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "funcshard"]
    cmd += ["train", *piped, "--ckpt-dir", str(out["dist"] / "ckpt"), "--out", str(out["dist"])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FUNCSHARD_TIMEOUT": "120"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = [*common, "--mesh", "dp=2", "--ckpt-dir", str(out["sim"] / "ckpt"), "--out", str(out["sim"])]
    assert cli_main(["train", *plain]) == 0
    rows = {k: (v / "metrics.csv").read_text().splitlines() for k, v in out.items()}
    head = rows["dist"][0].split(",")
    for d, s in zip(rows["dist"][1:], rows["sim"][1:], strict=True):
        for col in ("train_loss", "val_loss"):
            a, b = d.split(",")[head.index(col)], s.split(",")[head.index(col)]
            assert abs(float(a or 0) - float(b or 0)) < 1e-4, (col, d, s)
