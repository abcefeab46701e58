"""The sim backend builds the ``__annotations__`` dicts of funcshard's functions before a call's device threads start.

CPython 3.11 keeps a function's annotations as a tuple until their first read; the reading thread builds the dict
from a tuple it holds no reference to, so two device threads reading them at once (``inspect.signature`` in
``torch.autograd.Function.apply``, ``functools.wraps``) can find it freed and crash the process. Whether a
function's annotations are still the tuple is read through ``gc.get_referents`` (what the function holds). (A
``staticmethod`` or ``classmethod`` copies them, as a dict, when its class is made.)
"""

from __future__ import annotations

import gc
import sys
import types

import torch

import funcshard as fs
from funcshard import P

_SOURCE = """
def probe(x: int, y: "torch.Tensor") -> float:
    return 0.0


class Op:
    def forward(self, x: int) -> int:
        return x

    @property
    def size(self) -> int:
        return 1
"""


def _annotations_are_a_dict(f: types.FunctionType) -> bool:
    held = gc.get_referents(f)
    if any(isinstance(r, dict) and "return" in r for r in held):
        return True
    assert any(isinstance(r, tuple) and "return" in r for r in held), held  # the lazy (name, value, ...) tuple
    return False


def test_a_sim_call_settles_the_annotations_of_funcshard_modules() -> None:
    name = "funcshard._settle_probe"
    module = types.ModuleType(name)
    exec(compile(_SOURCE, name, "exec"), module.__dict__)
    for obj in (module.probe, module.Op):
        obj.__module__ = name
    sys.modules[name] = module
    try:
        fns = [module.probe, module.Op.__dict__["forward"], module.Op.__dict__["size"].fget]
        assert not any(_annotations_are_a_dict(f) for f in fns)
        mesh = fs.make_mesh({"dp": 2}, backend="sim")
        out = fs.shard_map(lambda x: fs.psum(x.sum(), "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())(torch.ones(4))
        assert fs.device_get(out).item() == 4.0
        assert all(_annotations_are_a_dict(f) for f in fns)
    finally:
        del sys.modules[name]


def test_shard_map_settles_the_annotations_of_its_functions_module() -> None:
    name = "user_settle_probe"
    module = types.ModuleType(name)
    exec(compile(_SOURCE + "\n\ndef body(x):\n    return x * 2\n", name, "exec"), module.__dict__)
    for obj in (module.probe, module.Op, module.body):
        obj.__module__ = name
    sys.modules[name] = module
    try:
        fns = [module.probe, module.Op.__dict__["forward"], module.Op.__dict__["size"].fget]
        assert not any(_annotations_are_a_dict(f) for f in fns)
        fs.shard_map(module.body, mesh=fs.make_mesh({"dp": 2}, backend="sim"), in_specs=P("dp"), out_specs=P("dp"))
        assert all(_annotations_are_a_dict(f) for f in fns)  # at the shard_map, before any device thread runs
    finally:
        del sys.modules[name]
