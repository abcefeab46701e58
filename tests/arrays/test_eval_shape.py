"""``fs.eval_shape``: the shapes and dtypes a function returns, from meta tensors, as ``jax.eval_shape``."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

import funcshard as fs


def test_matmul_shapes_from_shape_dtypes_and_tensors() -> None:
    a, w = fs.ShapeDtype((8, 4), torch.bfloat16), torch.ones(16, 4, dtype=torch.bfloat16)
    assert fs.eval_shape(lambda a, w: a @ w.T, a, w) == fs.ShapeDtype((8, 16), torch.bfloat16)  # [8, 4] @ [4, 16]
    batched = fs.eval_shape(torch.matmul, fs.ShapeDtype((3, 1, 8, 4)), fs.ShapeDtype((5, 4, 2)))
    assert batched == fs.ShapeDtype((3, 5, 8, 2), torch.float32)  # broadcast batch dims
    with pytest.raises(RuntimeError):  # torch's own shape error, as a real call would raise
        fs.eval_shape(torch.matmul, fs.ShapeDtype((8, 4)), fs.ShapeDtype((5, 2)))


def test_function_sees_meta_tensors_and_the_meta_default_device() -> None:
    seen = {}

    def f(x, y, *, n, scale=1.0):
        seen.update(x=x.device, y=y.device, made=torch.zeros(2).device, n=n, scale=scale)
        return x * scale + y.sum()

    x = torch.randn(3, 5)
    out = fs.eval_shape(f, x, y=fs.ShapeDtype((4,)), n=7, scale=2.0)
    assert out == fs.ShapeDtype((3, 5), torch.float32)
    meta = torch.device("meta")
    assert seen == {"x": meta, "y": meta, "made": meta, "n": 7, "scale": 2.0}
    assert x.device.type == "cpu" and torch.get_default_device().type == "cpu"  # the arguments and the default kept


def test_pytrees_in_and_out_non_tensor_leaves_as_they_are() -> None:
    Pair = namedtuple("Pair", ["x", "y"])

    def f(tree, k):
        h = tree["a"] @ tree["b"][0]  # [2, 3] @ [3, 4] -> [2, 4]
        return {"h": h, "pair": Pair(h.sum(-1).long(), None), "n": h.shape[-1] * k, "name": "out", "s": h.shape}

    tree = {"a": fs.ShapeDtype((2, 3)), "b": [torch.zeros(3, 4), 5]}
    out = fs.eval_shape(f, tree, 3)
    assert out["h"] == fs.ShapeDtype((2, 4))
    assert isinstance(out["pair"], Pair) and out["pair"] == Pair(fs.ShapeDtype((2,), torch.int64), None)
    assert (out["n"], out["name"]) == (12, "out")
    assert tuple(out["s"]) == (2, 4)


def test_eval_shape_allocates_nothing_for_a_huge_value() -> None:
    f = lambda x: torch.ones(10**6, 10**6, dtype=torch.bfloat16) + x  # noqa: E731 (2 TB if it were real)
    assert fs.eval_shape(f, fs.ShapeDtype((10**6,), torch.bfloat16)) == fs.ShapeDtype((10**6, 10**6), torch.bfloat16)


def test_random_draws_are_shapes() -> None:
    def init(key):
        k1, k2 = fs.random.split(key)
        return {"w": fs.random.normal(k1, (1 << 20, 1 << 20), dtype=torch.bfloat16), "b": fs.random.uniform(k2, (7,))}

    out = fs.eval_shape(init, fs.random.key(0))
    assert out == {"w": fs.ShapeDtype((1 << 20, 1 << 20), torch.bfloat16), "b": fs.ShapeDtype((7,), torch.float32)}
    assert fs.eval_shape(fs.random.split, fs.random.key(1), 4) == fs.ShapeDtype((4, 2), torch.int64)


def test_value_dependent_code_raises_torchs_error() -> None:
    with pytest.raises(RuntimeError, match="meta"):
        fs.eval_shape(lambda x: x.sum().item(), fs.ShapeDtype((3,)))
