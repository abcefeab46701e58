"""MkDocs hooks: add the notebooks of ``notebooks/`` to the site and draw the pipeline pictures.

The notebooks stay where the tests run them (``notebooks/``); they are rendered as they are stored (without
outputs, not executed). The schedule timelines are drawn by ``Schedule.plot`` at build time, so the picture
is always the one the code makes.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
# name -> (schedule name, stages, microbatches); drawn into img/<name>.png
PICTURES = {"schedule_1f1b": ("1f1b", 4, 8), "schedule_zb": ("zb", 4, 8)}

_tmp: tempfile.TemporaryDirectory[str] | None = None


@event_priority(100)  # before mkdocs-jupyter's on_files, which must see the notebooks
def on_files(files: Files, config: Any) -> Files:
    global _tmp
    os.environ.setdefault("MPLBACKEND", "Agg")
    from funcshard.pipeline import by_name

    urls = config["use_directory_urls"]
    for nb in sorted(NOTEBOOKS.glob("*.ipynb")):
        files.append(File(f"notebooks/{nb.name}", str(NOTEBOOKS.parent), config["site_dir"], urls))
    _tmp = tempfile.TemporaryDirectory(prefix="funcshard-docs-")
    for name, (schedule, stages, microbatches) in PICTURES.items():
        by_name(schedule, stages, microbatches).plot(Path(_tmp.name) / "img" / f"{name}.png")
        files.append(File(f"img/{name}.png", _tmp.name, config["site_dir"], urls))
    return files


def on_post_build(config: Any) -> None:
    global _tmp
    if _tmp is not None:
        _tmp.cleanup()
        _tmp = None
