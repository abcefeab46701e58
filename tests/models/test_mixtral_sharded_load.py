"""``mixtral.from_hf(path, mesh=..., specs=...)`` (issue #31 part 2): ``fs.Array``s whose values are the folder's
(Mixtral's per-expert tensors, transformers 5's fused ``gate_up_proj``, Qwen3-MoE's names), each process reading
only the bytes of its own blocks: under dist each rank's folder holds NaN wherever that rank holds no block."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import optree
import pytest
import torch
from _blocks import shard_slices

import funcshard as fs
from funcshard import P
from funcshard.checkpoint.safetensors import write_file
from funcshard.models import mixtral
from funcshard.models.mixtral.hf import config_to_hf, hf_names

CFG = mixtral.Config(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32, n_experts=4
)
QWEN = dataclasses.replace(CFG, qk_norm=True, norm_topk_prob=False, head_size=16)
MESHES = {"ep2": {"ep": 2}, "ep2_fsdp2": {"ep": 2, "fsdp": 2}, "tp2": {"tp": 2}}


def _is_array(x: object) -> bool:
    return isinstance(x, fs.Array)


def _write_fused(params: dict, cfg: mixtral.Config, folder: Path) -> None:
    """``params`` as transformers 5's in-memory names (``gate_up_proj [E, 2f, d]``, ``down_proj``, ``mlp.gate``)."""
    folder.mkdir(parents=True, exist_ok=True)
    lay = params["layers"]

    def get(name: str) -> torch.Tensor:
        leaf, index = spot[name]
        if index is None:
            return params[leaf]
        if name.endswith("gate_up_proj"):
            return torch.cat([lay["w1"][index], lay["w3"][index]], dim=1)
        return lay[leaf][index]

    spot = {n: (leaf, index) for n, leaf, index in hf_names(cfg, fused=True)}
    write_file(folder / "model.safetensors", [(n, get(n).shape) for n in spot], torch.float32, get)

    (folder / "config.json").write_text(json.dumps(config_to_hf(cfg)))


def _check(arrays: dict, params: dict, specs: dict, mesh: fs.Mesh) -> None:
    for a, s, full in zip(
        optree.tree_leaves(arrays, is_leaf=_is_array),
        optree.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P)),
        optree.tree_leaves(params),
        strict=True,
    ):
        assert isinstance(a, fs.Array) and a.spec == s and a.mesh == mesh
        assert torch.equal(fs.device_get(a), full)


@pytest.mark.parametrize("name", list(MESHES))
@pytest.mark.parametrize("layout", ["per_expert", "fused", "qwen3"])
def test_sharded_load_equals_the_folder(tmp_path: Path, name: str, layout: str) -> None:
    cfg = QWEN if layout == "qwen3" else CFG
    params = mixtral.init(fs.random.key(0), cfg)
    if layout == "fused":
        _write_fused(params, cfg, tmp_path)
    else:
        mixtral.to_hf(params, cfg, tmp_path, dtype=torch.float32)
    mesh = fs.make_mesh(MESHES[name], backend="sim")
    got_cfg, arrays = mixtral.from_hf(tmp_path, mesh=mesh)
    assert got_cfg == cfg
    _check(arrays, mixtral.from_hf(tmp_path)[1], mixtral.param_specs(cfg, mesh), mesh)  # the unsharded reader's
    _check(arrays, params, mixtral.param_specs(cfg, mesh), mesh)


def test_spec_prefix_dtype_and_bad_specs(tmp_path: Path) -> None:
    params = mixtral.init(fs.random.key(0), CFG)
    mixtral.to_hf(params, CFG, tmp_path, dtype=torch.float32)
    mesh = fs.make_mesh({"ep": 2}, backend="sim")
    _, rep = mixtral.from_hf(tmp_path, mesh=mesh, specs=P(), dtype=torch.bfloat16)  # a prefix: one P for all
    assert rep["layers"]["w2"].spec == P() and rep["layers"]["w2"].dtype == torch.bfloat16
    assert torch.equal(fs.device_get(rep["layers"]["w2"]), params["layers"]["w2"].to(torch.bfloat16))
    bad = mixtral.param_specs(CFG, mesh)
    bad["layers"] = {**bad["layers"], "w1": P(None, "nope")}
    with pytest.raises(fs.ShardingError, match="w1"):
        mixtral.from_hf(tmp_path, mesh=mesh, specs=bad)


DIST_MESH = {"ep": 2}


def _own_blocks_only(params: dict, rank: int) -> dict:
    """``params`` with every element that the devices of process ``rank`` do not hold set to NaN."""
    mesh = fs.make_mesh(DIST_MESH, backend="sim")
    specs, coords = mixtral.param_specs(CFG, mesh), mesh.device_coords()[rank]

    def keep(full: torch.Tensor, spec: P) -> torch.Tensor:
        out = torch.full_like(full, math.nan)
        index = shard_slices(tuple(full.shape), spec, DIST_MESH, coords)
        out[index] = full[index]
        return out

    return optree.tree_map(keep, params, specs, none_is_leaf=False)


def _load_body(mesh: fs.Mesh, folders: list[str]) -> dict:
    _, arrays = mixtral.from_hf(folders[mesh.process_index()], mesh=mesh)
    return optree.tree_map(lambda a: fs.device_get(a), arrays, is_leaf=_is_array)


def test_each_process_reads_only_its_own_experts(run, backend: str, tmp_path: Path) -> None:
    """Under dist each rank's folder holds NaN in the other rank's experts: the result shows only own blocks read."""
    params = mixtral.init(fs.random.key(1), CFG)
    folders = []
    for r in range(2 if backend == "dist" else 1):
        folder = tmp_path / f"rank{r}"
        mixtral.to_hf(_own_blocks_only(params, r) if backend == "dist" else params, CFG, folder, dtype=torch.float32)
        folders.append(str(folder))
    for loaded in run(_load_body, DIST_MESH, folders):
        for got, want in zip(optree.tree_leaves(loaded), optree.tree_leaves(params), strict=True):
            assert torch.equal(got, want)


MEM_CFG = mixtral.Config(
    vocab_size=4000, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=768, max_seq_len=64, n_experts=8
)  # 11.9M parameters: 48 MB of float32


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _peak_growth_body(mesh: fs.Mesh, folder: str) -> tuple[int, bool]:
    """(this process's peak resident growth while loading, whether the values equal the folder's) on fsdp=4."""
    import gc

    mixtral.from_hf(folder, mesh=mesh)  # a first load: code paths and allocator arenas warmed, not measured
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    before = _status_bytes("VmRSS")
    _, arrays = mixtral.from_hf(folder, mesh=mesh)
    growth = _status_bytes("VmHWM") - before
    whole = mixtral.from_hf(folder)[1]  # (after the measurement)
    equal = all(
        torch.equal(fs.device_get(a), w)
        for a, w in zip(optree.tree_leaves(arrays, is_leaf=_is_array), optree.tree_leaves(whole), strict=True)
    )
    return growth, equal


@pytest.mark.dist
@pytest.mark.slow
def test_each_rank_grows_by_less_than_0_4x_the_model_on_fsdp4(tmp_path: Path) -> None:
    """Issue #31's bound: under 4 gloo processes on fsdp=4, each rank's peak memory growth while loading is below
    0.4x the folder's size (its quarter of the experts and rows, and one tensor's mapped pages)."""
    from _dist_pool import run_body

    mixtral.to_hf(mixtral.init(fs.random.key(2), MEM_CFG), MEM_CFG, tmp_path, dtype=torch.float32)
    size = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    for rank, (growth, equal) in enumerate(run_body("dist", _peak_growth_body, {"fsdp": 4}, str(tmp_path))):
        assert equal, rank
        assert growth < 0.4 * size, f"rank {rank}: {growth / size:.2f}x of {size / 1e6:.0f} MB"
