"""Every notebook in ``notebooks/`` runs top to bottom without an error (one test per notebook).

The kernel is a private ``python3`` kernelspec written for this test session: it runs the interpreter that
runs pytest (so the editable funcshard install is the one imported) and hides any GPU from the kernel.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT = 300
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

KERNEL_ENV = {
    "CUDA_VISIBLE_DEVICES": "",  # CPU only, whatever the machine has
    "FUNCSHARD_TIMEOUT": "60",
    "MPLBACKEND": "Agg",
    "PYDEVD_DISABLE_FILE_VALIDATION": "1",
}


@pytest.fixture(scope="session")
def jupyter_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data dir holding a ``python3`` kernelspec for ``sys.executable`` with ``KERNEL_ENV``."""
    root = tmp_path_factory.mktemp("jupyter")
    spec_dir = root / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (funcshard tests)",
        "language": "python",
        "env": KERNEL_ENV,
        "metadata": {"debugger": False},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1))
    return root


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, jupyter_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # JUPYTER_PATH comes before the user / system dirs, so "python3" resolves to the spec above
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_path))
    for k, v in KERNEL_ENV.items():
        monkeypatch.setenv(k, v)
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs"), f"{path.name}: store notebooks without outputs"
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT,
        allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{_ANSI.sub('', str(e))}", pytrace=False)


def test_notebooks_exist() -> None:
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"
