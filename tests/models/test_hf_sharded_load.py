"""``llama.from_hf(path, mesh=..., specs=...)`` (issue #31 part 2): ``fs.Array``s whose values are the folder's,
each process reading only the bytes of its own blocks."""

from __future__ import annotations

import math
from pathlib import Path

import optree
import pytest
import torch
from _blocks import shard_slices

import funcshard as fs
from funcshard import P
from funcshard.models import llama

CFG = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32)
MESH = {"fsdp": 2, "tp": 2}


def _is_array(x: object) -> bool:
    return isinstance(x, fs.Array)


def test_sharded_load_equals_the_folder_and_lays_out_by_the_specs(tmp_path: Path) -> None:
    params = llama.init(fs.random.key(0), CFG)
    llama.to_hf(params, CFG, tmp_path, dtype=torch.float32)
    mesh = fs.make_mesh(MESH, backend="sim")
    cfg, arrays = llama.from_hf(tmp_path, mesh=mesh)
    assert cfg == CFG
    specs = llama.param_specs(CFG, mesh)
    for a, s, full in zip(
        optree.tree_leaves(arrays, is_leaf=_is_array),
        optree.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P)),
        optree.tree_leaves(params),
        strict=True,
    ):
        assert isinstance(a, fs.Array) and a.spec == s and a.mesh == mesh
        assert torch.equal(fs.device_get(a), full)
    _, replicated = llama.from_hf(tmp_path, mesh=mesh, specs=P(), dtype=torch.bfloat16)  # a prefix: one P for all
    wq = replicated["layers"]["wq"]
    assert wq.spec == P() and wq.dtype == torch.bfloat16
    assert torch.equal(fs.device_get(wq), params["layers"]["wq"].to(torch.bfloat16))


def test_bad_specs_name_the_parameter(tmp_path: Path) -> None:
    llama.to_hf(llama.init(fs.random.key(0), CFG), CFG, tmp_path, dtype=torch.float32)
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    with pytest.raises(fs.ShardingError, match="norm"):
        llama.from_hf(tmp_path, mesh=mesh, specs={**llama.param_specs(CFG, mesh), "norm": P("nope")})


def _own_blocks_only(params: dict, rank: int) -> dict:
    """``params`` with every element that the devices of process ``rank`` do not hold set to NaN."""
    specs = llama.param_specs(CFG, fs.make_mesh(MESH, backend="sim"))
    coords = fs.make_mesh(MESH, backend="sim").device_coords()[rank]

    def keep(full: torch.Tensor, spec: P) -> torch.Tensor:
        out = torch.full_like(full, math.nan)
        index = shard_slices(tuple(full.shape), spec, MESH, coords)
        out[index] = full[index]
        return out

    return optree.tree_map(keep, params, specs, none_is_leaf=False)


def _load_body(mesh: fs.Mesh, folders: list[str]) -> dict:
    _, arrays = llama.from_hf(folders[mesh.process_index()], mesh=mesh)
    return optree.tree_map(lambda a: fs.device_get(a), arrays, is_leaf=_is_array)


def test_each_process_reads_only_its_own_blocks(run, backend: str, tmp_path: Path) -> None:
    """Under dist, each rank's folder holds NaN wherever the rank holds no block: only slices were read."""
    params = llama.init(fs.random.key(1), CFG)
    folders = []
    for r in range(math.prod(MESH.values()) if backend == "dist" else 1):
        folder = tmp_path / f"rank{r}"
        llama.to_hf(_own_blocks_only(params, r) if backend == "dist" else params, CFG, folder, dtype=torch.float32)
        folders.append(str(folder))
    for loaded in run(_load_body, MESH, folders):
        for got, want in zip(optree.tree_leaves(loaded), optree.tree_leaves(params), strict=True):
            assert torch.equal(got, want)
