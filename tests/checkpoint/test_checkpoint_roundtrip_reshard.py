"""funcshard.checkpoint: round trips, resharding across meshes and backends, atomic saves, clear errors."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from _blocks import shard_slices

import funcshard as fs
from funcshard import P, checkpoint
from funcshard.checkpoint import CheckpointError


def _full(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(64.0).reshape(8, 8) * scale,
        "b": torch.arange(8, dtype=torch.int64) * int(scale),
        "e": torch.arange(32.0, dtype=torch.bfloat16).reshape(4, 8) * scale,
        "s": torch.tensor(2.5 * scale),
    }


SAVE_SPECS = {"w": P("dp", "tp"), "b": P(("dp", "tp")), "e": P(None, "tp"), "s": P()}
LOAD_SPECS = {"w": P(None, "tp"), "b": P(), "e": P("tp"), "s": P()}


def _zeros_like(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in full.items()}


def _check_blocks(arrays: dict[str, fs.Array], full: dict[str, torch.Tensor]) -> None:
    """Every local shard is exactly its block of the full value."""
    for k, a in arrays.items():
        for c, t in a.shards.items():
            coords = dict(zip(a.mesh.axis_names, c, strict=True))
            assert torch.equal(t, full[k][shard_slices(a.shape, a.spec, a.mesh.shape, coords)]), (k, c)


def _tree(mesh: fs.Mesh, scale: float = 1.0) -> dict:
    return {"params": fs.device_put(_full(scale), mesh, SAVE_SPECS), "step": int(scale), "key": fs.random.key(7)}


def _like(mesh: fs.Mesh, specs: dict[str, P]) -> dict:
    return {
        "params": fs.device_put(_zeros_like(_full()), mesh, specs),
        "step": 0,
        "key": torch.zeros(2, dtype=torch.int64),
    }


def _sim(shape: dict[str, int]) -> fs.Mesh:
    return fs.make_mesh(shape, backend="sim")


# -- round trips and resharding (sim) ---------------------------------------------------------------------


class OptState(NamedTuple):
    count: torch.Tensor
    mu: dict[str, fs.Array]
    nu: None


def test_round_trip_same_mesh(tmp_path: Path) -> None:
    mesh = _sim({"dp": 2, "tp": 2})
    full = _full()
    params = fs.device_put(full, mesh, SAVE_SPECS)
    tree = {
        "params": params,
        "opt": OptState(torch.tensor(3), fs.device_put(_full(0.5), mesh, SAVE_SPECS), None),
        "lr": 1e-3,
        "name": "run-1",
        "done": False,
    }
    assert checkpoint.save(tmp_path / "ck", tree, step=3, metadata={"cfg": {"dim": 8}}) == str(tmp_path / "ck")
    like = {
        "params": fs.device_put(_zeros_like(full), mesh, SAVE_SPECS),
        "opt": OptState(torch.tensor(0), fs.device_put(_zeros_like(full), mesh, SAVE_SPECS), None),
        "lr": 0.0,
        "name": "",
        "done": True,
    }
    out = checkpoint.load(tmp_path / "ck", like)
    assert isinstance(out["opt"], OptState) and out["opt"].nu is None
    assert out["lr"] == 1e-3 and out["name"] == "run-1" and out["done"] is False
    assert torch.equal(out["opt"].count, torch.tensor(3))
    for k in full:
        assert out["params"][k].spec == SAVE_SPECS[k] and out["params"][k].mesh == mesh
        assert out["params"][k].dtype == full[k].dtype
        assert torch.equal(fs.device_get(out["params"][k]), full[k])
        assert torch.equal(fs.device_get(out["opt"].mu[k]), _full(0.5)[k])
    _check_blocks(out["params"], full)
    meta = checkpoint.info(tmp_path / "ck")
    assert meta["step"] == 3 and meta["metadata"] == {"cfg": {"dim": 8}}
    assert meta["leaves"]["params/w"]["spec"] == ["dp", "tp"] and meta["leaves"]["opt/0"]["kind"] == "tensor"


def test_reshard_dp2_tp2_to_tp4_and_single_device(tmp_path: Path) -> None:
    full = _full()
    checkpoint.save(tmp_path / "ck", _tree(_sim({"dp": 2, "tp": 2})))
    for shape, specs in [
        ({"tp": 4}, LOAD_SPECS),
        ({"tp": 4}, {"w": P("tp", None), "b": P("tp"), "e": P(None, "tp"), "s": P()}),
        ({"x": 1}, {k: P() for k in full}),
        ({"a": 2, "b": 4}, {"w": P("b", "a"), "b": P(("a", "b")), "e": P("a", "b"), "s": P()}),
    ]:
        out = checkpoint.load(tmp_path / "ck", _like(_sim(shape), specs))
        for k in full:
            assert out["params"][k].spec == specs[k] and out["params"][k].mesh.shape == shape
            assert torch.equal(fs.device_get(out["params"][k]), full[k]), (shape, k)
        _check_blocks(out["params"], full)
        assert out["step"] == 1 and torch.equal(out["key"], fs.random.key(7))


def test_load_into_plain_tensors(tmp_path: Path) -> None:
    full = _full()
    checkpoint.save(tmp_path / "ck", {"params": fs.device_put(full, _sim({"dp": 2, "tp": 2}), SAVE_SPECS)})
    out = checkpoint.load(tmp_path / "ck", {"params": _zeros_like(full)})
    assert all(torch.equal(out["params"][k], full[k]) for k in full)


def test_replicated_blocks_written_once_and_format_is_standard_dcp(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint.save(tmp_path / "ck", _tree(_sim({"dp": 2, "tp": 2})))
    md = dcp.FileSystemReader(str(tmp_path / "ck")).read_metadata().state_dict_metadata
    chunks = {k: len(v.chunks) for k, v in md.items()}
    assert chunks == {"params/w": 4, "params/b": 4, "params/e": 2, "params/s": 1, "key": 1}
    assert sorted(os.listdir(tmp_path / "ck")) == [".metadata", "__0_0.distcp", "funcshard.json"]
    dcp_to_torch_save(tmp_path / "ck", tmp_path / "full.pt")
    flat = torch.load(tmp_path / "full.pt")
    assert all(torch.equal(flat[f"params/{k}"], v) for k, v in _full().items())


def test_overwrite_replaces_and_cleans_up(tmp_path: Path) -> None:
    mesh = _sim({"dp": 2, "tp": 2})
    checkpoint.save(tmp_path / "ck", _tree(mesh, 1.0))
    checkpoint.save(tmp_path / "ck", _tree(mesh, 2.0))
    out = checkpoint.load(tmp_path / "ck", _like(mesh, SAVE_SPECS))
    assert torch.equal(fs.device_get(out["params"]["w"]), _full(2.0)["w"]) and out["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_step_directories(tmp_path: Path) -> None:
    mesh = _sim({"dp": 1, "tp": 2})
    assert checkpoint.list_steps(tmp_path / "none") == [] and checkpoint.latest(tmp_path) is None
    for s in (5, 100, 20):
        checkpoint.save(checkpoint.step_path(tmp_path, s), _tree(mesh, float(s)), step=s)
    (tmp_path / "step_00000200.tmp-abc").mkdir()  # a save that died
    (tmp_path / "step_00000300").mkdir()  # no manifest: incomplete
    assert checkpoint.list_steps(tmp_path) == [5, 20, 100]
    assert checkpoint.latest(tmp_path) == str(tmp_path / "step_00000100")
    assert checkpoint.info(checkpoint.latest(tmp_path))["step"] == 100


# -- both backends ----------------------------------------------------------------------------------------


def _save_load_body(mesh: fs.Mesh, path: str) -> tuple:
    checkpoint.save(path, _tree(mesh), step=1)
    m4 = fs.make_mesh({"tp": mesh.size}, backend=mesh.backend)
    out = checkpoint.load(path, _like(m4, LOAD_SPECS))
    _check_blocks(out["params"], _full())
    assert all(a.spec == LOAD_SPECS[k] for k, a in out["params"].items())
    return {k: fs.device_get(a) for k, a in out["params"].items()}, out["step"], out["key"]


def test_save_and_reshard_under_each_backend(run, backend: str, tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    full = _full()
    for params, step, key in run(_save_load_body, {"dp": 2, "tp": 2}, path):
        assert all(torch.equal(params[k], full[k]) for k in full)
        assert step == 1 and torch.equal(key, fs.random.key(7))
    # saved under `backend`, loaded here under sim on other meshes
    assert checkpoint.info(path)["leaves"]["params/w"]["backend"] == backend
    for shape in ({"x": 1}, {"tp": 2}):
        specs = {k: P("tp") if "tp" in shape and k != "s" else P() for k in full}
        out = checkpoint.load(path, _like(_sim(shape), specs))
        assert all(torch.equal(fs.device_get(out["params"][k]), full[k]) for k in full)


def _load_body(mesh: fs.Mesh, path: str) -> dict:
    out = checkpoint.load(path, _like(mesh, {"w": P("tp"), "b": P("tp"), "e": P(None, "tp"), "s": P()}))
    _check_blocks(out["params"], _full(3.0))
    return {k: fs.device_get(a) for k, a in out["params"].items()}


def test_sim_save_then_load_under_each_backend(run, tmp_path: Path) -> None:
    checkpoint.save(tmp_path / "ck", _tree(_sim({"dp": 2, "tp": 2}), 3.0))
    for params in run(_load_body, {"tp": 4}, str(tmp_path / "ck")):
        assert all(torch.equal(params[k], v) for k, v in _full(3.0).items())


def _failed_commit_body(mesh: fs.Mesh, path: str) -> str:
    checkpoint.save(path, _tree(mesh, 1.0))
    real = checkpoint._swap_in

    def broken(tmp: Path, dst: Path) -> None:
        raise OSError("disk full (injected)")

    checkpoint._swap_in = broken
    try:
        with pytest.raises((OSError, CheckpointError), match="injected"):
            checkpoint.save(path, _tree(mesh, 2.0))
    finally:
        checkpoint._swap_in = real
    out = checkpoint.load(path, _like(mesh, SAVE_SPECS))
    assert torch.equal(fs.device_get(out["params"]["w"]), _full(1.0)["w"])
    return "ok"


def test_failed_commit_keeps_previous_on_every_rank(run, tmp_path: Path) -> None:
    assert set(run(_failed_commit_body, {"dp": 2, "tp": 2}, str(tmp_path / "ck"))) == {"ok"}
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# -- crashes mid-save ------------------------------------------------------------------------------------


def _assert_previous(path: Path, mesh: fs.Mesh) -> None:
    out = checkpoint.load(path, _like(mesh, SAVE_SPECS))
    assert all(torch.equal(fs.device_get(out["params"][k]), v) for k, v in _full(1.0).items())
    assert out["step"] == 1


def test_exception_mid_write_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = _sim({"dp": 2, "tp": 2})
    checkpoint.save(tmp_path / "ck", _tree(mesh, 1.0))
    planner = checkpoint._dcp()[1]
    real, calls = planner.resolve_data, []

    def resolve_data(self, item):
        calls.append(item)
        if len(calls) == 3:  # two blocks are already on their way to disk
            raise RuntimeError("crash mid-write (injected)")
        return real(self, item)

    monkeypatch.setattr(planner, "resolve_data", resolve_data)
    with pytest.raises(Exception, match="injected"):
        checkpoint.save(tmp_path / "ck", _tree(mesh, 2.0))
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no partial checkpoint, no temp dir
    _assert_previous(tmp_path / "ck", mesh)


def test_exception_between_renames_rolls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = _sim({"dp": 2, "tp": 2})
    checkpoint.save(tmp_path / "ck", _tree(mesh, 1.0))
    real = os.rename

    def rename(src, dst):
        if ".tmp-" in Path(src).name:  # our swap, not DCP's own rename of .metadata.tmp
            raise OSError("crash between renames (injected)")
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="injected"):
        checkpoint.save(tmp_path / "ck", _tree(mesh, 2.0))
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    _assert_previous(tmp_path / "ck", mesh)


_KILL = r"""
import os, sys, torch, funcshard as fs
from funcshard import P, checkpoint
stage, path = sys.argv[1], sys.argv[2]
mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
tree = {"params": {"w": fs.device_put(torch.full((8, 8), 9.0), mesh, P("dp", "tp"))}, "step": 9}
if stage == "write":
    planner = checkpoint._dcp()[1]
    real, calls = planner.resolve_data, []
    def resolve_data(self, item):
        calls.append(item)
        if len(calls) == 3:
            os._exit(17)
        return real(self, item)
    planner.resolve_data = resolve_data
else:
    real_rename = os.rename
    def rename(src, dst):
        if ".tmp-" in os.path.basename(src):
            os._exit(17)
        real_rename(src, dst)
    os.rename = rename
checkpoint.save(path, tree, step=9)
"""


def test_process_killed_mid_save_leaves_previous_readable(tmp_path: Path) -> None:
    mesh = _sim({"dp": 2, "tp": 2})
    procs = {}
    for stage in ("write", "swap"):
        checkpoint.save(tmp_path / stage / "ck", _tree(mesh, 1.0))
        args = [sys.executable, "-c", _KILL, stage, str(tmp_path / stage / "ck")]
        procs[stage] = subprocess.Popen(args, stderr=subprocess.PIPE)
    for p in procs.values():
        _, err = p.communicate(timeout=120)
        assert p.returncode == 17, err.decode()[-2000:]
    names = {
        s: sorted(n.split(".tmp-")[0] + (".tmp" if ".tmp-" in n else "") for n in os.listdir(tmp_path / s))
        for s in procs
    }
    assert names == {"write": ["ck", "ck.tmp"], "swap": ["ck.old", "ck.tmp"]}
    for stage in procs:
        _assert_previous(tmp_path / stage / "ck", mesh)  # in "swap", found at ck.old
    checkpoint.save(tmp_path / "swap" / "ck", _tree(mesh, 2.0))  # the next save finishes the job
    assert "ck.old" not in os.listdir(tmp_path / "swap")
    assert checkpoint.info(tmp_path / "swap" / "ck")["leaves"]["step"]["value"] == 2


# -- damaged or incompatible checkpoints ------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict]:
    mesh = _sim({"dp": 2, "tp": 2})
    checkpoint.save(tmp_path / "ck", _tree(mesh))
    return tmp_path / "ck", _like(_sim({"tp": 4}), LOAD_SPECS)


def _data_file(path: Path) -> Path:
    return next(path.glob("*.distcp"))


def test_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no checkpoint at '.*nope'"):
        checkpoint.load(tmp_path / "nope", {"x": 1})


def test_missing_manifest(saved: tuple[Path, dict]) -> None:
    path, like = saved
    (path / "funcshard.json").unlink()
    with pytest.raises(CheckpointError, match=r"has no funcshard\.json"):
        checkpoint.load(path, like)


def test_missing_dcp_metadata(saved: tuple[Path, dict]) -> None:
    path, like = saved
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"cannot read the DCP metadata .*\.metadata"):
        checkpoint.load(path, like)


def test_missing_data_file(saved: tuple[Path, dict]) -> None:
    path, like = saved
    _data_file(path).unlink()
    with pytest.raises(CheckpointError, match=r"leaf '.*': block at .* is in '__0_0.distcp', which is missing"):
        checkpoint.load(path, like)


def test_truncated_data_file(saved: tuple[Path, dict]) -> None:
    path, like = saved
    f = _data_file(path)
    os.truncate(f, f.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"leaf '.*': '__0_0.distcp' is truncated \(\d+ bytes"):
        checkpoint.load(path, like)


def test_corrupted_data_file(saved: tuple[Path, dict]) -> None:
    path, like = saved
    f = _data_file(path)
    f.write_bytes(b"\x00" * f.stat().st_size)
    with pytest.raises(CheckpointError, match=r"leaf '.*': its block at .* in '.*__0_0\.distcp' fails its checksum"):
        checkpoint.load(path, like)


def test_unreadable_data_without_checksums(saved: tuple[Path, dict]) -> None:
    """A checkpoint written before checksums existed loads unchecked; data DCP cannot read still fails loudly."""
    path, like = saved
    manifest = json.loads((path / "funcshard.json").read_text())
    for entry in manifest["leaves"].values():
        entry.pop("crc32", None)
    (path / "funcshard.json").write_text(json.dumps(manifest))
    assert torch.equal(fs.device_get(checkpoint.load(path, like)["params"]["w"]), _full()["w"])
    f = _data_file(path)
    f.write_bytes(b"\x00" * f.stat().st_size)
    with pytest.raises(
        CheckpointError, match=r"reading the tensor data failed \(rank 0: .*\); the checkpoint is damaged"
    ):
        checkpoint.load(path, like)


def _flip_value(f: Path, old: float, new: float) -> None:
    """Overwrite, in place, the 4 bytes of the float32 ``old`` in ``f`` with ``new`` (same size: no error from
    the file's structure, only different numbers)."""
    data = f.read_bytes()
    at = data.find(struct.pack("<f", old))
    assert at > 0 and data.count(struct.pack("<f", old)) == 1
    with open(f, "r+b") as fh:
        fh.seek(at)
        fh.write(struct.pack("<f", new))


def test_bytes_changed_in_place_fail_the_checksum(tmp_path: Path) -> None:
    """Issue #12.4: a value changed on disk after the save used to load silently (NaN at the next step)."""
    mesh = _sim({"dp": 2, "tp": 2})
    w = torch.arange(1000.0, 1064.0).reshape(8, 8)
    checkpoint.save(tmp_path / "ck", {"params": {"w": fs.device_put(w, mesh, P("dp", "tp"))}, "step": 3})
    files = sorted((tmp_path / "ck").glob("*.distcp"))
    _flip_value(files[0], 1037.0, float("nan"))  # row 4, col 5: the block at (4, 4)
    like = {"params": {"w": fs.device_put(torch.zeros(8, 8), _sim({"tp": 4}), P(None, "tp"))}, "step": 0}
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(tmp_path / "ck", like)
    msg = str(e.value)
    assert "leaf 'params/w'" in msg and "block at (4, 4)" in msg and f"'{files[0]}'" in msg, msg
    assert "fails its checksum" in msg, msg
    # a load that never reads the damaged block is not refused: only the block at (0, 0) overlaps this one
    corner = fs.device_put(torch.zeros(8, 8), _sim({"dp": 2, "tp": 2}), P("dp", "tp"))
    assert checkpoint.info(tmp_path / "ck")["leaves"]["params/w"]["crc32"].keys() == {"0,0", "0,4", "4,0", "4,4"}
    with pytest.raises(CheckpointError, match="fails its checksum"):
        checkpoint.load(tmp_path / "ck", {"params": {"w": corner}, "step": 0})


def test_disk_full_names_the_reason_and_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #12.5: a full disk said "unexpected pos 704 vs 598" (torch.save inside DCP loses the OSError)."""
    mesh = _sim({"dp": 2, "tp": 2})
    checkpoint.save(tmp_path / "ck", _tree(mesh, 1.0))
    real_open = Path.open

    class Full:  # the data file fills the disk after 600 bytes, in the middle of torch.save
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            if self.n + len(b) > 600:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.n += len(b)
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def open_(self, mode="r", *args, **kwargs):
        f = real_open(self, mode, *args, **kwargs)
        return Full(f) if self.suffix == ".distcp" and "w" in mode else f

    monkeypatch.setattr(Path, "open", open_)
    with pytest.raises(CheckpointError) as e:
        checkpoint.save(tmp_path / "ck", _tree(mesh, 2.0))
    monkeypatch.undo()
    msg = str(e.value)
    assert "No space left on device" in msg and "unexpected pos" not in msg, msg
    assert f"'{tmp_path / 'ck'}.tmp-" in msg and "__0_0.distcp'" in msg, msg
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    _assert_previous(tmp_path / "ck", mesh)


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def test_disk_full_on_a_real_small_filesystem(tmp_path: Path) -> None:
    """The same on a 32 KiB tmpfs (root only): every size of overflow names the disk, never a torch internal."""
    disk = tmp_path / "disk"
    if not _tmpfs(disk, "32k"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        mesh = _sim({"dp": 2, "tp": 2})
        for rows in (96, 192, 400):  # fails in .metadata, mid-tensor, and on the first tensor
            w = fs.device_put(torch.randn(rows, 64), mesh, P("dp", "tp"))
            with pytest.raises(CheckpointError, match=r"No space left on device: writing '.*ck\.tmp-\w+/"):
                checkpoint.save(disk / "ck", {"w": w})
            assert os.listdir(disk) == []
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_corrupted_manifest(saved: tuple[Path, dict]) -> None:
    path, like = saved
    (path / "funcshard.json").write_text('{"format": "funcshard.checkpoint", "leaves": ')
    with pytest.raises(CheckpointError, match=r"funcshard.json' is damaged"):
        checkpoint.load(path, like)


def test_leaf_missing_from_checkpoint(saved: tuple[Path, dict]) -> None:
    path, like = saved
    like["params"]["extra"] = like["params"]["w"]
    with pytest.raises(CheckpointError, match="leaf 'params/extra' of `like` is not in the checkpoint"):
        checkpoint.load(path, like)


def test_different_tree_structure(saved: tuple[Path, dict]) -> None:
    path, like = saved
    del like["key"]
    with pytest.raises(CheckpointError, match=r"leaves that `like` lacks: \['key'\].*strict=False"):
        checkpoint.load(path, like)
    assert "key" not in checkpoint.load(path, like, strict=False)


def test_shape_mismatch(saved: tuple[Path, dict]) -> None:
    path, like = saved
    like["params"]["w"] = fs.device_put(torch.zeros(8, 4), _sim({"tp": 4}), P(None, "tp"))
    with pytest.raises(
        CheckpointError, match=r"leaf 'params/w' was saved with shape \(8, 8\).*`like` has shape \(8, 4\)"
    ):
        checkpoint.load(path, like)


def test_dtype_mismatch(saved: tuple[Path, dict]) -> None:
    path, like = saved
    like["params"]["e"] = fs.device_put(torch.zeros(4, 8), _sim({"tp": 4}), P("tp"))
    with pytest.raises(CheckpointError, match=r"'params/e' .* dtype torch.bfloat16.* dtype torch.float32"):
        checkpoint.load(path, like)


def test_kind_mismatch(saved: tuple[Path, dict]) -> None:
    path, like = saved
    like["step"] = torch.tensor(0)
    with pytest.raises(CheckpointError, match="leaf 'step' was saved as the value 1"):
        checkpoint.load(path, like)
    like["step"], like["key"] = 0, 0
    with pytest.raises(CheckpointError, match=r"leaf 'key' was saved as a tensor of shape \(2,\)"):
        checkpoint.load(path, like)


def test_save_refuses_to_replace_other_directories(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="refusing to replace it"):
        checkpoint.save(tmp_path / "data", {"x": torch.zeros(2)})
    assert (tmp_path / "data" / "notes.txt").read_text() == "keep me"


def test_save_rejects_unsupported_leaves(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="leaf 'opt/fn' is a function"):
        checkpoint.save(tmp_path / "ck", {"opt": {"fn": test_missing_checkpoint}})
    with pytest.raises(CheckpointError, match="metadata must be JSON"):
        checkpoint.save(tmp_path / "ck", {"x": 1}, metadata={"t": torch.zeros(1)})
    assert not (tmp_path / "ck").exists()


def test_manifest_is_readable_json(saved: tuple[Path, dict]) -> None:
    path, _ = saved
    text = (path / "funcshard.json").read_text()
    assert json.loads(text)["leaves"]["params/w"]["blocks"] == [[0, 0], [0, 4], [4, 0], [4, 4]]
    assert len(text.splitlines()) < 20
