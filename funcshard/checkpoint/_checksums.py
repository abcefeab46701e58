"""Checksums of the saved blocks: a CRC-32 of each block's bytes on disk, recorded in the manifest at save time
and checked at load time, so bytes changed in place after a save (a failing disk, a stray write) are caught
with the file and the leaf named instead of loading silently.

The checksum covers the byte range DCP's ``.metadata`` gives for the block (``relative_path``, ``offset``,
``length``): exactly what a load reads. In the manifest each leaf's entry holds ``"crc32": {"<offsets>": crc}``
with the block's offsets joined by commas (``"0,4"``; ``""`` for a 0-dim tensor). Checkpoints written before
checksums existed have no such field and load unchecked.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ._manifest import CheckpointError

_READ = 1 << 20  # bytes read at a time: memory stays flat whatever the block size


def block_key(offsets: Iterable[int]) -> str:
    """The manifest key of a block: its offsets joined by commas.

    Example:
        >>> block_key((0, 4)), block_key(())
        ('0,4', '')
    """
    return ",".join(str(int(o)) for o in offsets)


def crc32_range(path: Path, offset: int, length: int) -> int:
    """CRC-32 of ``length`` bytes of the file ``path`` from ``offset``.

    Example:
        >>> import tempfile, zlib
        >>> f = Path(tempfile.mkdtemp()) / "x"
        >>> _ = f.write_bytes(b"abcdef")
        >>> crc32_range(f, 2, 3) == zlib.crc32(b"cde")
        True
    """
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left > 0:
            chunk = f.read(min(_READ, left))
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk)
    return crc


def _location(meta: Any, index_cls: Any, name: str, offsets: Sequence[int]) -> Any:
    return meta.storage_data.get(index_cls(name, offsets))


def record(ckpt: Path, meta: Any, index_cls: Any, entries: dict[str, dict[str, Any]]) -> None:
    """Add ``"crc32"`` to the manifest entry of every tensor leaf of the freshly written checkpoint ``ckpt``.

    Args:
        ckpt: the checkpoint directory (its data files and ``.metadata`` written and synced).
        meta: its DCP metadata.
        index_cls: DCP's ``MetadataIndex``.
        entries: the manifest's leaves, updated in place.
    """
    for name, entry in entries.items():
        if entry.get("kind") not in ("array", "tensor"):
            continue
        md = meta.state_dict_metadata.get(name)
        sums = {}
        for c in getattr(md, "chunks", None) or []:
            loc = _location(meta, index_cls, name, c.offsets)
            rel = getattr(loc, "relative_path", None)
            if rel is not None:
                sums[block_key(c.offsets)] = crc32_range(ckpt / rel, loc.offset, loc.length)
        entry["crc32"] = sums


def _overlaps(off: Sequence[int], sizes: Sequence[int], boff: Sequence[int], bsizes: Sequence[int]) -> bool:
    return all(o < bo + bs and bo < o + s for o, s, bo, bs in zip(off, sizes, boff, bsizes, strict=True))


def verify(
    ckpt: Path,
    meta: Any,
    index_cls: Any,
    name: str,
    entry: dict[str, Any],
    blocks: Iterable[tuple[Sequence[int], Sequence[int]]],
    where: str,
) -> None:
    """Check the saved blocks of leaf ``name`` that overlap ``blocks`` (``(offsets, sizes)`` this process
    reads) against the checksums of the manifest.

    Raises:
        CheckpointError: a block whose bytes differ from the save's, naming the leaf and the file.
    """
    sums = entry.get("crc32")
    if not isinstance(sums, dict):
        return  # written before checksums existed
    wanted = list(blocks)
    for c in meta.state_dict_metadata[name].chunks:
        if not any(_overlaps(c.offsets, c.sizes, o, s) for o, s in wanted):
            continue
        key = block_key(c.offsets)
        loc = _location(meta, index_cls, name, c.offsets)
        rel = getattr(loc, "relative_path", None)
        if rel is None or key not in sums:
            continue
        have = crc32_range(ckpt / rel, loc.offset, loc.length)
        if have != sums[key]:
            raise CheckpointError(
                f"{where}: leaf '{name}': its block at {tuple(c.offsets)} in '{ckpt / rel}' fails its checksum "
                f"(crc32 {have:08x}, saved {int(sums[key]):08x}): the file changed after the save (a failing disk "
                f"or a stray write); load an earlier checkpoint."
            )
