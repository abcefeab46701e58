"""Several nodes (issue #31 part 5): which axes of a mesh stay inside a node, and the warning when ``tp`` or ``cp``
would cross nodes (nodes of ``LOCAL_WORLD_SIZE`` consecutive ranks, as torchrun places them)."""

from __future__ import annotations

import os
import warnings

import funcshard as fs


def _nodes_body(mesh: fs.Mesh) -> dict:
    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # as on 2 nodes of 2 processes
    try:
        out = {}
        for shape in ({"dp": 2, "tp": 2}, {"tp": 2, "dp": 2}, {"cp": 2, "fsdp": 2}, {"pp": 2, "tp": 2}):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                m = fs.make_mesh(shape, backend=mesh.backend)
            key = ",".join(f"{a}={s}" for a, s in shape.items())
            out[key] = (m.node_local_axes(), [str(w.message) for w in caught])
        return out
    finally:
        if before is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before


def test_innermost_axes_stay_inside_a_node_and_tp_across_nodes_warns(run, backend: str) -> None:
    for out in run(_nodes_body, {"dp": 4}):
        if backend == "sim":  # one process runs every device: one node
            assert all(axes == tuple(k.split("=")[0] for k in key.split(",")) for key, (axes, _) in out.items())
            assert not any(msgs for _, msgs in out.values())
            continue
        assert out["dp=2,tp=2"] == (("tp",), [])
        assert out["pp=2,tp=2"] == (("tp",), [])
        axes, msgs = out["tp=2,dp=2"]
        assert axes == ("dp",) and len(msgs) == 1
        assert "'tp'" in msgs[0] and "cross nodes" in msgs[0] and "make_mesh({'dp': 2, 'tp': 2})" in msgs[0], msgs
        axes, msgs = out["cp=2,fsdp=2"]
        assert axes == ("fsdp",) and len(msgs) == 1 and "'cp'" in msgs[0]
