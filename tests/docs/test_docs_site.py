"""The docs site stays true: every page's Python runs, the names it mentions exist, and it builds strictly.

Each Markdown page under ``docs/`` (the API pages are generated from the docstrings, which
tests/docs/test_doctests.py runs) has its ```python blocks run in order in one namespace, under the simulated
backend. A block whose first line is ``# not run`` (torchrun-only, DTensor, JAX or a sketch) is skipped.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import funcshard as fs

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "api" not in p.relative_to(DOCS).parts)
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
SKIP = "# not run"
# names the pages may mention before they exist, each said there to be coming
COMING: set[str] = set()
FILE_SUFFIXES = {"json", "md", "py", "png"}


def python_blocks(page: Path) -> list[str]:
    """The page's ```python blocks, without those marked ``# not run``."""
    blocks = FENCE.findall(page.read_text())
    return [b for b in blocks if not b.lstrip().startswith(SKIP)]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_code_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # checkpoints and pictures the examples write land here
    monkeypatch.setenv("FUNCSHARD_TIMEOUT", "60")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    for var in ("RANK", "WORLD_SIZE"):  # backend="auto" in a page means "sim" here
        monkeypatch.delenv(var, raising=False)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for i, block in enumerate(python_blocks(page)):
        code = compile(block, f"{page.relative_to(ROOT)} (python block {i + 1})", "exec")
        exec(code, namespace)


def test_pages_have_code() -> None:
    """The guides show code that runs (a page of prose only is fine, but not all of them)."""
    assert PAGES, f"no pages found in {DOCS}"
    assert sum(bool(python_blocks(p)) for p in PAGES) >= 8


# how the pages import funcshard: "fs.psum", "funcshard.ops", and "ops.x" after "from funcshard import ops"
ROOTS = {"fs": "funcshard", "funcshard": "funcshard", "ops": "funcshard.ops", "pipeline": "funcshard.pipeline"}
ROOTS |= {"checkpoint": "funcshard.checkpoint", "llama": "funcshard.models.llama"}
ROOTS |= {"mixtral": "funcshard.models.mixtral"}
NAME = re.compile(r"(?<![\w/.-])(?:" + "|".join(ROOTS) + r")(?:\.[A-Za-z_]\w*)+")


def _resolve(dotted: str) -> object:
    root, *parts = dotted.split(".")
    module = ROOTS[root]
    obj: object = importlib.import_module(module)
    for part in parts:
        module += "." + part
        # a submodule its package does not import is still a name
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(module)
    return obj


def test_mentioned_names_exist() -> None:
    """Every ``fs.name``, ``funcshard.x.name`` or ``ops.name`` (``pipeline``, ``checkpoint``, ``llama``) written
    in a page, prose or code, is a real attribute."""
    missing = []
    for page in PAGES:
        for name in sorted(set(NAME.findall(page.read_text()))):
            if name in COMING or name.rsplit(".", 1)[1] in FILE_SUFFIXES:  # a file: funcshard.json, api/funcshard.md
                continue
            try:
                _resolve(name)
            except (AttributeError, ImportError):
                missing.append(f"{page.relative_to(DOCS)}: {name}")
    assert not missing, "names that do not exist:\n" + "\n".join(missing)


def test_coming_names_are_said_to_be_coming() -> None:
    for page in PAGES:
        text = page.read_text()
        for name in COMING:
            if re.search(re.escape(name) + r"\b", text) and not hasattr(fs, name.split(".")[1]):
                assert "coming" in text, f"{page.relative_to(DOCS)} mentions {name}, not there yet, as if it were"


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    for module in ("mkdocs", "mkdocstrings_handlers.python", "mkdocs_jupyter", "material"):
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[test]' installs the docs tools)")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "MPLBACKEND": "Agg"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    for page in ("index.html", "from-jax/index.html", "api/ops/index.html", "img/schedule_zb.png"):
        assert (site / page).is_file(), page
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks and all((site / "notebooks" / nb / "index.html").is_file() for nb in notebooks)
    api = (site / "api" / "funcshard" / "index.html").read_text()
    ids = re.findall(r'id="(funcshard\.[^"]+)"', api)
    assert "funcshard.shard_map" in ids and not [i for i in ids if "._" in i], "private names on the API page"
