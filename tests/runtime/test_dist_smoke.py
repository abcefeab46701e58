import torch

import funcshard as fs
from funcshard import P


def _body(mesh):
    x = torch.arange(8.0)
    f = fs.shard_map(lambda v: fs.psum(v, "tp"), mesh=mesh, in_specs=(P("tp"),), out_specs=P())
    return fs.device_get(f(x))


def test_psum_smoke(run):
    for r in run(_body, {"tp": 2}):
        assert torch.equal(
            r, torch.tensor([4.0 + 6.0, 5.0 + 7.0][:1] if False else [0.0 + 4.0, 1.0 + 5.0, 2.0 + 6.0, 3.0 + 7.0])
        )
