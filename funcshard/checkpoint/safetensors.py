"""The safetensors file format, read and written with no dependency (Hugging Face folders: the Llama, the
Mixtral, ``fs.nn.from_pretrained``).

A file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON (each tensor's ``dtype``, ``shape``
and ``data_offsets`` ``[begin, end)`` into the data; an optional ``__metadata__`` of strings; padded with
spaces so the data starts 8-byte aligned), then the tensors' raw little-endian bytes, back to back. Tensors
are read one at a time, straight into a tensor of their own, so reading a model holds one tensor beside the parameters;
:func:`read_block` reads one block of a tensor through a memory map of its bytes (a process loading its shards).

Example:
    >>> import tempfile, torch
    >>> f = Path(tempfile.mkdtemp()) / "w.safetensors"
    >>> w = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    >>> write_file(f, [(n, t.shape) for n, t in w.items()], torch.bfloat16, w.__getitem__)
    20
    >>> entries, start = read_header(f)
    >>> entries["a"]
    {'dtype': 'BF16', 'shape': [2, 3], 'data_offsets': [0, 12]}
    >>> with open(f, "rb") as fh:
    ...     read_tensor(fh, f, "a", entries["a"], start)
    tensor([[0., 1., 2.],
            [3., 4., 5.]], dtype=torch.bfloat16)
"""

from __future__ import annotations

import json
import math
import mmap
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..extend import ConfigError

__all__ = ["DTYPES", "read_block", "read_header", "read_tensor", "write_file"]

# safetensors dtype names -> torch dtypes (what funcshard reads; it writes any of them too)
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100_000_000  # bytes of JSON header (the safetensors library's own limit)


def _entry_ok(e: Any) -> bool:
    if not (isinstance(e, dict) and isinstance(e.get("dtype"), str) and isinstance(e.get("shape"), list)):
        return False
    offsets = e.get("data_offsets")
    return (
        all(isinstance(d, int) and d >= 0 for d in e["shape"])
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) for o in offsets)
    )


def read_header(file: str | os.PathLike[str]) -> tuple[dict[str, dict[str, Any]], int]:
    """``(entries, data_start)`` of a safetensors file: each tensor's ``dtype``, ``shape`` and ``data_offsets``
    (checked to lie inside the file), and the file offset where the data begins. ``__metadata__`` is left out.

    Args:
        file: the ``.safetensors`` file.

    Returns:
        ``(entries, data_start)``: tensor name -> its header entry, and the data's first byte in the file.

    Raises:
        ConfigError: a file that cannot be read, is truncated, or whose header is not a safetensors header
            (naming the file, and the tensor where one is to blame).

    Example:
        >>> import tempfile
        >>> f = Path(tempfile.mkdtemp()) / "bad.safetensors"
        >>> _ = f.write_bytes(b"\\x10\\x00")
        >>> read_header(f)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        funcshard._src.errors.ConfigError: safetensors: '...bad.safetensors' is truncated: 2 bytes, ...
    """
    file = Path(file)
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConfigError(
                    f"safetensors: '{file}' is truncated: {size} bytes, less than the 8-byte header length; "
                    f"save or download it again."
                )
            n = int.from_bytes(head, "little")
            if n > size - 8 or n > MAX_HEADER:
                raise ConfigError(
                    f"safetensors: '{file}' is truncated or not a safetensors file: its header length says {n} "
                    f"bytes, but {size - 8} follow; save or download it again."
                )
            raw = f.read(n)
    except OSError as e:
        raise ConfigError(f"safetensors: cannot read '{file}' ({e.strerror or e}).") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise ConfigError(
            f"safetensors: '{file}' has a corrupt header (not JSON); save or download it again."
        ) from None
    if not isinstance(header, dict):
        raise ConfigError(f"safetensors: '{file}' has a corrupt header (not a JSON object); save or download it again.")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, e in header.items():
        if not _entry_ok(e):
            raise ConfigError(f"safetensors: '{file}' has a corrupt header entry for tensor '{name}': {e!r}.")
        begin, end = e["data_offsets"]
        if not 0 <= begin <= end <= data_size:
            raise ConfigError(
                f"safetensors: '{file}' is truncated: tensor '{name}' ends at byte {end} of the data, which holds "
                f"{data_size} bytes; save or download it again."
            )
    return header, 8 + n


def _layout(file: Path, name: str, entry: Mapping[str, Any]) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """``(dtype, shape, begin, end)`` of a tensor's header entry, checked (dtype read, size agrees with shape)."""
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ConfigError(
            f"safetensors: tensor '{name}' in '{file}' has dtype {entry['dtype']}; funcshard reads {sorted(DTYPES)}."
        )
    if sys.byteorder != "little":
        raise ConfigError("safetensors: this machine is big-endian; safetensors files hold little-endian bytes.")
    begin, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    numel = math.prod(shape)
    if end - begin != numel * dtype.itemsize:
        raise ConfigError(
            f"safetensors: tensor '{name}' in '{file}' holds {end - begin} bytes, but shape {list(shape)} of "
            f"{entry['dtype']} needs {numel * dtype.itemsize}; the file is corrupt."
        )
    return dtype, shape, begin, end


def read_tensor(f: BinaryIO, file: Path, name: str, entry: Mapping[str, Any], data_start: int) -> torch.Tensor:
    """One tensor of an open safetensors file, in its on-disk dtype, read straight into its own storage.

    Args:
        f: the file, open for binary reading.
        file: its path (for messages).
        name: the tensor's name (for messages).
        entry: its header entry (from :func:`read_header`).
        data_start: where the data begins (from :func:`read_header`).

    Returns:
        The tensor (CPU, the dtype on disk).

    Raises:
        ConfigError: a dtype funcshard does not read, a size that does not match the shape, a truncated file.

    Example:
        >>> # with open(file, "rb") as f: read_tensor(f, file, name, entries[name], data_start)
    """
    dtype, shape, begin, end = _layout(file, name, entry)
    if begin == end:
        return torch.empty(shape, dtype=dtype)
    out = torch.empty(shape, dtype=dtype)  # torch's own storage (a tensor over a Python buffer is not everywhere)
    f.seek(data_start + begin)
    if f.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy())) != end - begin:
        raise ConfigError(f"safetensors: '{file}' is truncated inside tensor '{name}'; save or download it again.")
    return out


def read_block(
    file: Path, name: str, entry: Mapping[str, Any], data_start: int, index: tuple[slice, ...]
) -> torch.Tensor:
    """The block ``index`` (one slice per dim) of one tensor, read through a memory map of that tensor's bytes
    alone: only the pages holding the block's elements are read, and the map is closed before returning (the
    process keeps the block, in a tensor of its own, and nothing else).

    Args:
        file: the safetensors file.
        name: the tensor's name (for messages).
        entry: its header entry (from :func:`read_header`).
        data_start: where the data begins (from :func:`read_header`).
        index: the block, a slice per dim (step 1).

    Returns:
        The block (CPU, the dtype on disk).

    Raises:
        ConfigError: as :func:`read_tensor`.

    Example:
        >>> import tempfile
        >>> f = Path(tempfile.mkdtemp()) / "w.safetensors"
        >>> _ = write_file(f, [("a", torch.Size([4, 6]))], torch.float32, lambda n: torch.arange(24.0).reshape(4, 6))
        >>> entries, start = read_header(f)
        >>> read_block(f, "a", entries["a"], start, (slice(2, 4), slice(3, 6)))
        tensor([[15., 16., 17.],
                [21., 22., 23.]])
    """
    dtype, shape, begin, end = _layout(file, name, entry)
    block = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))
    if begin == end or math.prod(block) == 0:
        return torch.empty(block, dtype=dtype)
    start = data_start + begin
    base = start - start % mmap.ALLOCATIONGRANULARITY  # a map starts on a granularity boundary
    try:
        with (
            open(file, "rb") as f,
            mmap.mmap(f.fileno(), data_start + end - base, offset=base, access=mmap.ACCESS_READ) as mm,
        ):
            with warnings.catch_warnings():  # a read-only buffer: the view is only read
                warnings.simplefilter("ignore", UserWarning)
                whole = torch.frombuffer(mm, dtype=dtype, count=math.prod(shape), offset=start - base).view(shape)
            out = whole[index].clone()  # the block's own storage: the map closes below
            del whole
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"safetensors: cannot read tensor '{name}' of '{file}' ({e}); save or download it again."
        ) from None
    return out


def write_file(
    file: Path,
    entries: list[tuple[str, torch.Size]],
    dtype: torch.dtype,
    get: Callable[[str], torch.Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write the tensors ``entries`` (name, shape) as ``dtype`` to ``file``, each one asked of ``get(name)`` when
    its turn comes (so only one is converted at a time), through a temporary file and a rename.

    Args:
        file: the ``.safetensors`` file to write.
        entries: ``(name, shape)`` of each tensor, in the order they are stored.
        dtype: the dtype on disk (one of :data:`DTYPES`).
        get: ``name -> tensor`` of that shape (any dtype and device: converted here).
        metadata: the header's ``__metadata__`` (default ``{"format": "pt"}``, which transformers expects).

    Returns:
        The bytes of tensor data written.

    Raises:
        ConfigError: a tensor whose shape is not the one announced.

    Example:
        >>> # write_file(Path("model.safetensors"), [("w", torch.Size([2]))], torch.float32, {"w": torch.ones(2)}.get)
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, shape in entries:
        nbytes = shape.numel() * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for name, shape in entries:
                t = get(name).detach().to(device="cpu", dtype=dtype).contiguous()
                if t.shape != shape:
                    raise ConfigError(
                        f"safetensors: tensor '{name}' has shape {list(t.shape)}, expected {list(shape)}."
                    )
                if t.numel():
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)
    return offset
