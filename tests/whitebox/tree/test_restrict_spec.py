"""``restrict_spec`` (internal): a spec cut down to a mesh's axes, dropping the axes the mesh lacks (and, asked,
those of size one)."""

from __future__ import annotations

import funcshard as fs
from funcshard import P
from funcshard._src.tree.rules import restrict_spec


def test_restrict_spec() -> None:
    mesh = fs.make_mesh({"dp": 2, "tp": 1}, backend="sim")
    assert restrict_spec(P(("dp", "fsdp"), "tp", "cp"), mesh) == P("dp", "tp")
    assert restrict_spec(P(("dp", "fsdp"), "tp", "cp"), mesh, drop_size_one=True) == P("dp")
    assert restrict_spec(P(("fsdp", "dp", "tp"), None), {"dp": 2, "tp": 2, "fsdp": 2}) == P(("fsdp", "dp", "tp"))
    assert restrict_spec(P(), mesh) == P()
