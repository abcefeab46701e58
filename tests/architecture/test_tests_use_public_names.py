"""The tests' own layout: public names outside the white-box folder, one folder per floor or package.

Only ``tests/whitebox/`` (tests that count, patch or read internals) and ``tests/support/`` (the helpers) import
``funcshard._src`` or a private module of a public package (``funcshard.optim._adamw``,
``funcshard.ops.attention._ring_kernel``, or a private name from one); every other test uses the names the package
exports, so moving a private module breaks no test outside those two folders. Test files sit in folders (none at
the top of ``tests/``) and their names are unique: pytest imports them by their bare names (rootdir-relative
``prepend`` mode, no ``__init__.py``), and the dist workers unpickle test bodies by those names.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PRIVATE_OK = ("whitebox", "support")
PRIVATE = "funcshard._src"


def _private(name: str) -> bool:
    """Whether the dotted ``name`` reaches past funcshard's public names: the core (``funcshard._src...``), a private
    module of a public package (``funcshard.optim._adamw``), or a private name of one
    (``funcshard.models.stacked._pending_rows``); dunder names (``__version__``) are public."""
    parts = name.split(".")
    return parts[0] == "funcshard" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _private_uses(path: Path) -> list[str]:
    """A private part of funcshard (:func:`_private`) as an import or a dotted string
    (``mock.patch("funcshard._src...")``, ``monkeypatch.setattr("funcshard.optim._adamw._FUSED", ...)``) in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Call):  # mock.patch("funcshard._src.x.y", ...), monkeypatch.setattr("...", ...)
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        found += [f"{path.relative_to(TESTS)}:{node.lineno}: {n}" for n in names if _private(n)]
    return found


def test_only_whitebox_and_support_import_funcshard_src() -> None:
    """Neither ``funcshard._src`` nor a private module (or name) of a public package outside whitebox / support."""
    offenders = [
        use
        for path in sorted(TESTS.rglob("*.py"))
        if path.relative_to(TESTS).parts[0] not in PRIVATE_OK
        for use in _private_uses(path)
    ]
    assert not offenders, (
        "tests outside tests/whitebox/ use funcshard._src or a private module of a public package (use the public "
        f"name, or move the test, or its white-box part, to tests/whitebox/<floor>/): {offenders}"
    )


def test_the_check_sees_private_imports_and_patches() -> None:
    assert _private_uses(Path(__file__)) == []
    imports = _private_uses(TESTS / "whitebox" / "tree" / "test_restrict_spec.py")
    assert any(u.endswith(PRIVATE + ".tree.rules.restrict_spec") for u in imports), imports
    patches = _private_uses(TESTS / "whitebox" / "shard_map" / "test_call_vma_fast_paths.py")
    assert any(u.endswith(PRIVATE + ".shard_map.api.executor_for") for u in patches), patches


def _dotted(*parts: str) -> str:
    """``parts`` joined by dots (this file spells the private names it checks in parts, so it names none itself)."""
    return ".".join(parts)


def test_the_check_sees_private_modules_of_public_packages() -> None:
    modules = _private_uses(TESTS / "whitebox" / "optim" / "test_adamw_quiet_update.py")
    adamw = _dotted("funcshard", "optim", "_adamw")
    assert any(u.endswith(adamw) for u in modules), modules  # from funcshard.optim import _adamw
    kernel = _private_uses(TESTS / "whitebox" / "ops" / "test_ring_saves_one_block.py")
    ring = _dotted("funcshard", "ops", "attention", "_ring_kernel", "ring_through_autograd")
    assert any(u.endswith(ring) for u in kernel), kernel
    assert _private(_dotted(adamw, "_FUSED")) and _private(_dotted("funcshard", "models", "stacked", "_pending_rows"))
    assert not _private("funcshard.optim.adamw") and not _private("funcshard.__version__")
    assert not _private("funcshard.models.llama.model")


def test_test_files_sit_in_folders_with_unique_names() -> None:
    files = sorted(TESTS.rglob("test_*.py"))
    assert not [f.name for f in files if f.parent == TESTS], "a test file at the top of tests/: put it in a folder"
    twice = [name for name, n in Counter(f.name for f in files).items() if n > 1]
    assert not twice, f"test file names used twice (pytest imports them by bare name): {twice}"
    assert not list((TESTS / "support").glob("test_*.py")), "tests/support/ holds helpers, not tests"
