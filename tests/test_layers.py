"""The package's floors (DESIGN.md): imports only point down, never up."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "funcshard"

# module prefix -> floor; the longest matching prefix wins
FLOORS = {
    "_errors": 0,
    "pytree": 1,
    "_spec": 1,
    "_rules": 1,
    "_mesh": 2,
    "_backend": 2,
    "_context": 2,
    "_stats": 2,
    "_prims": 3,
    "_vma": 3,
    "lax": 3,
    "_shard_map": 4,
    "_shard_map_io": 4,
    "_sim_grad": 4,
    "_array": 4,
    "_visualize": 4,
    "random": 5,
    "optim": 5,
    "_grad": 5,
    "checkpoint": 5,
    "ops": 6,
    "pipeline": 7,
    "models": 8,
    "train": 8,
    "_demo": 8,
    "_data": 8,
    "_cli": 8,
    "__main__": 9,
    "__init__": 9,
}


def _floor(mod: str) -> int:
    best = None
    for prefix, floor in FLOORS.items():
        if mod == prefix or mod.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, floor)
    assert best is not None, f"module funcshard.{mod} has no floor in tests/test_layers.py; add it"
    return best[1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, mod: str) -> list[str]:
    tree = ast.parse(path.read_text())
    pkg = mod.split(".")[:-1] if not path.name == "__init__.py" else mod.split(".")
    if path.name == "__init__.py" and mod == "__init__":
        pkg = []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
            target = ".".join([*base, node.module] if node.module else base)
            if node.module is None:
                out.extend(".".join([*base, a.name]) for a in node.names)
            elif target:
                out.append(target)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("funcshard."):
            out.append(node.module.removeprefix("funcshard."))
        elif isinstance(node, ast.Import):
            out.extend(a.name.removeprefix("funcshard.") for a in node.names if a.name.startswith("funcshard."))
    return out


def test_imports_point_down() -> None:
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        mod = _module_name(path)
        floor = _floor(mod)
        for target in _imports(path, mod):
            if target and _floor(target) > floor:
                upward.append(f"funcshard.{mod} (floor {floor}) imports funcshard.{target} (floor {_floor(target)})")
    assert not upward, "imports pointing up:\n" + "\n".join(upward)


def test_only_backend_imports_torch_distributed() -> None:
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        mod = _module_name(path)
        if mod.startswith("_backend"):
            continue
        text = path.read_text()
        if mod == "checkpoint" or mod.startswith("checkpoint."):  # the checkpoint layer may use DCP, nothing else
            text = re.sub(r"torch\.distributed\.checkpoint", "DCP", text)
        if re.search(r"^\s*(import|from)\s+torch\.distributed", text, re.M):
            offenders.append(mod)
    assert not offenders, f"torch.distributed used outside the backend: {offenders}"
