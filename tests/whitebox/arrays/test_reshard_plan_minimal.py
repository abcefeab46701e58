"""``reshard_plan`` (internal): the steps of a reshard between two specs move no data that is already in place; an
axis moving between dims is one all-to-all."""

from __future__ import annotations

import itertools

import pytest

from funcshard import P
from funcshard._src.arrays.transfers import reshard_plan

SPECS = [P(), P("a"), P(None, "a"), P("b", "a"), P(("a", "b"))]  # those of tests/arrays/test_device_put_reshard.py


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(SPECS, SPECS)))
def test_reshard_plan_is_minimal(src: P, dst: P) -> None:
    """No step that moves data which is already in place; an axis moving between dims is one all-to-all."""
    plan = reshard_plan(src, dst, 2)
    if src == dst:
        assert plan == []
    comm = [s for s in plan if s[0] != "slice"]
    gathered = {a for s in comm for a in ((s[1],) if isinstance(s[1], str) else s[1])}
    # every communicated axis is one the source shards with and the destination does not keep in place
    assert gathered <= set(src.axes)
    if set(src.axes) <= set(dst.axes) and all(d[: len(s)] == s for s, d in zip(src.dim_axes(2), dst.dim_axes(2))):
        assert comm == []  # only refining the layout: slicing, no communication
    if (src, dst) == (P("a"), P(None, "a")):
        assert plan == [("all_to_all", "a", 1, 0)]
