"""Following ``in_specs`` through one ``shard_map`` (decorating and calling it) goes down the floors: the calls
that receive the specs, or a value computed from them, climb back to a module of a higher floor at most 5 times."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from test_floors_import_down import _floor, _module_name

import funcshard as fs
from funcshard import P

ROOT = Path(fs.__file__).resolve().parent
MAX_CLIMBS = 5


class _Follow:
    """A profiler that records each call of a funcshard function whose arguments hold a followed object, and
    follows what such a call returns."""

    def __init__(self, *roots: Any) -> None:
        self.ids: set[int] = set()
        self.keep: list[Any] = []  # followed objects stay alive, so an id is never reused
        self.live: set[int] = set()
        self.calls: list[tuple[str, str]] = []
        for r in roots:
            self._follow(r)

    def _follow(self, v: Any, depth: int = 0) -> None:
        if v is None or isinstance(v, (bool, int, float, str, torch.Tensor)) or id(v) in self.ids:
            return
        self.ids.add(id(v))
        self.keep.append(v)
        if depth < 2 and isinstance(v, (tuple, list)):
            for x in v[:32]:
                self._follow(x, depth + 1)

    def _holds(self, v: Any, depth: int = 0) -> bool:
        if id(v) in self.ids:
            return True
        if depth < 2 and isinstance(v, (tuple, list)):
            return any(self._holds(x, depth + 1) for x in v[:32])
        if depth < 2 and isinstance(v, dict):
            return any(self._holds(x, depth + 1) for x in list(v.values())[:32])
        return False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        path = Path(frame.f_code.co_filename)
        if not path.is_relative_to(ROOT):
            return
        if event == "call":
            code = frame.f_code
            names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            if any(n in frame.f_locals and self._holds(frame.f_locals[n]) for n in names):
                self.calls.append((_module_name(path), code.co_name))
                self.live.add(id(frame))
        elif event == "return" and id(frame) in self.live:
            self.live.discard(id(frame))
            self._follow(arg)


def _stays(in_specs: tuple[P, ...]) -> list[tuple[str, int, str]]:
    mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    x = fs.device_put(torch.randn(4, 8), mesh, P(None, "dp"))  # resharded to in_specs[0]
    w = fs.device_put(torch.randn(8, 6), mesh, P("tp", None))  # resharded to in_specs[1]
    follow = _Follow(in_specs)
    sys.setprofile(follow)
    try:
        f = fs.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=in_specs, out_specs=P("dp", "tp"))
        y = f(x, w)
    finally:
        sys.setprofile(None)
    torch.testing.assert_close(fs.device_get(y), fs.device_get(x) @ fs.device_get(w))
    stays: list[tuple[str, int, str]] = []
    for mod, fn in follow.calls:
        if not stays or stays[-1][0] != mod:
            stays.append((mod, _floor(mod), fn))
    return stays


@pytest.mark.slow
def test_in_specs_climbs_to_a_higher_floor_at_most_five_times() -> None:
    stays = _stays((P("dp", None), P(None, "tp")))
    assert len(stays) > 3, stays  # the tracer sees the path (the transform, the specs, the reshard moves)
    climbs = [(a, b) for a, b in itertools.pairwise(stays) if b[1] > a[1]]
    assert len(climbs) <= MAX_CLIMBS, "in_specs climbs back up:\n" + "\n".join(f"{a} -> {b}" for a, b in climbs)
