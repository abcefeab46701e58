"""``fs.visualize``: a text picture of which device holds which block of an ``fs.Array``.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    >>> print(fs.visualize(fs.device_put(torch.zeros(4, 4), mesh, P("dp")), show=False))
    shape (4, 4)  spec P('dp')  mesh {'dp': 2, 'tp': 2}
    ┌─────────────┐
    │   dev 0,1   │
    │  dp=0 tp=*  │
    ├─────────────┤
    │   dev 2,3   │
    │  dp=1 tp=*  │
    └─────────────┘
"""

from __future__ import annotations

import math

from ..errors import ShardingError
from ..tree.spec import block_index, format_mesh, split_sizes
from .array import Array

__all__ = ["Picture", "visualize"]


def _label_rows(a: Array, ranks: list[int]) -> list[str]:
    names = a.mesh.axis_names
    coords = [a.mesh.coords_of(r) for r in ranks]
    parts = []
    for n in names:
        vals = sorted({c[n] for c in coords})
        parts.append(
            f"{n}={vals[0]}" if len(vals) == 1 else f"{n}=*" if len(vals) == a.mesh.shape[n] else f"{n}={vals}"
        )
    return ["dev " + ",".join(map(str, ranks)), " ".join(parts)]


class Picture(str):
    """The text picture; in a notebook it is not shown a second time when it was already printed.

    Example:
        >>> import torch, funcshard as fs
        >>> from funcshard import P
        >>> mesh = fs.make_mesh({"tp": 2}, backend="sim")
        >>> pic = fs.visualize(fs.device_put(torch.zeros(2, 4), mesh, P(None, "tp")), show=False)
        >>> pic.shown, pic.splitlines()[0]
        (False, "shape (2, 4)  spec P(None, 'tp')  mesh {'tp': 2}")
        >>> pic.shown = True  # what visualize(..., show=True) sets after printing it
        >>> pic
        <sharding picture, 5 lines>
    """

    shown: bool = False

    def _ipython_display_(self) -> None:
        if not self.shown:
            print(self)

    def __repr__(self) -> str:
        return str(self) if not self.shown else f"<sharding picture, {len(self.splitlines())} lines>"


def visualize(a: Array, *, show: bool = True) -> Picture:
    """Draw which devices hold each block of ``a`` (the first two dims; like
    ``jax.debug.visualize_array_sharding``). Returns the picture and prints it unless ``show=False``; under
    ``"dist"`` the first process alone prints it (each process returns it).

    Each cell is one block; it lists the ranks that hold it and their coordinates (``*`` = every index of
    that axis, i.e. replicated over it). A dim split unevenly is noted in the header with its blocks' sizes.

    Raises:
        ShardingError: ``a`` is not an ``fs.Array``.

    Example:
        >>> pic = visualize(w, show=False)  # doctest: +SKIP
    """
    if not isinstance(a, Array):
        raise ShardingError(f"visualize: expected an fs.Array, found {type(a).__name__}; use fs.device_put first.")
    mesh = a.mesh
    nd = a.ndim
    dims = a.spec.dim_axes(max(nd, 2))[:2] if nd >= 1 else ((), ())
    rows_n = math.prod(mesh.shape[x] for x in dims[0])
    cols_n = math.prod(mesh.shape[x] for x in dims[1]) if nd >= 2 else 1
    cells: dict[tuple[int, int], list[int]] = {}
    for r, c in enumerate(mesh.device_coords()):
        i = block_index(dims[0], c, mesh.shape)[0]
        j = block_index(dims[1], c, mesh.shape)[0] if nd >= 2 else 0
        cells.setdefault((i, j), []).append(r)
    texts = {k: _label_rows(a, v) for k, v in cells.items()}
    width = max(len(line) for t in texts.values() for line in t) + 4
    header = f"shape {a.shape}  spec {a.spec!r}  mesh {format_mesh(mesh)}"
    if nd > 2:
        header += (
            f"  (dims 0 and 1 shown; dims 2..{nd - 1} {'are sharded' if any(a.spec.dim_axes(nd)[2:]) else 'whole'})"
        )
    for d, axes in enumerate(a.spec.dim_axes(nd)):
        n = math.prod(mesh.shape[x] for x in axes)
        if a.shape[d] % n:  # an uneven split: torch.tensor_split's blocks, the first ones one row longer
            header += f"  (dim {d} split unevenly: blocks of {list(split_sizes(a.shape[d], n))})"
    lines = [header]
    hline = "─" * width

    def border(left: str, mid: str, right: str) -> str:
        return left + mid.join([hline] * cols_n) + right

    lines.append(border("┌", "┬", "┐"))
    for i in range(rows_n):
        for k in range(2):
            lines.append("│" + "│".join(texts[(i, j)][k].center(width) for j in range(cols_n)) + "│")
        lines.append(border("├", "┼", "┤") if i < rows_n - 1 else border("└", "┴", "┘"))
    pic = Picture("\n".join(lines))
    if show and a.mesh.process_index() == 0:  # under torchrun, printed once (every process returns it)
        print(pic)
        pic.shown = True
    return pic
