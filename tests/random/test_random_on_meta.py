"""``fs.random`` where the default device is meta, or the key a meta tensor: keys stay small real tensors, draws
are meta tensors of their shape and dtype, computed from nothing; real draws are unchanged."""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard import random as fsr

DRAWS = {
    "bits": (lambda k, s: fsr.bits(k, s), torch.int64),
    "uniform": (lambda k, s: fsr.uniform(k, s, minval=-2.0, maxval=3.0), torch.float32),
    "uniform_f64": (lambda k, s: fsr.uniform(k, s, torch.float64, -1.0, 1.0), torch.float64),
    "normal": (lambda k, s: fsr.normal(k, s), torch.float32),
    "normal_bf16": (lambda k, s: fsr.normal(k, s, dtype=torch.bfloat16), torch.bfloat16),
    "normal_f16": (lambda k, s: fsr.normal(k, s, dtype=torch.float16), torch.float16),
    "normal_f64": (lambda k, s: fsr.normal(k, s, dtype=torch.float64), torch.float64),
    "bernoulli": (lambda k, s: fsr.bernoulli(k, 0.3, s), torch.bool),
    "bernoulli_p": (lambda k, s: fsr.bernoulli(k, torch.full(s[-1:], 0.5), s), torch.bool),
    "randint": (lambda k, s: fsr.randint(k, s, 0, 10), torch.int64),
}


@pytest.mark.parametrize("name", sorted(DRAWS))
@pytest.mark.parametrize("where", ["meta_default", "meta_key"])
def test_draws_on_meta_are_shapes(name: str, where: str) -> None:
    draw, dtype = DRAWS[name]
    shape = (1 << 40, 3)  # 2**41 elements: never computed
    if where == "meta_default":
        with torch.device("meta"):
            out = draw(fsr.key(0), shape)
    else:
        out = draw(fsr.key(0).to("meta"), shape)
    assert out.is_meta and tuple(out.shape) == shape and out.dtype == dtype


def test_keys_stay_real_under_the_meta_default_device() -> None:
    real = fsr.key(7)
    with torch.device("meta"):
        k = fsr.key(7)
        folded, keys = fsr.fold_in(k, 3), fsr.split(k, 4)
    assert not (k.is_meta or folded.is_meta or keys.is_meta)
    assert torch.equal(k, real) and torch.equal(folded, fsr.fold_in(real, 3)) and torch.equal(keys, fsr.split(real, 4))


def test_meta_keys_derive_meta_keys() -> None:
    km = fsr.key(0).to("meta")
    assert fsr.fold_in(km, 5).shape == (2,) and fsr.fold_in(km, 5).is_meta
    assert fsr.split(km, (2, 3)).shape == (2, 3, 2) and fsr.split(km, 3).is_meta
    assert fsr.fold_in(fsr.key(0), torch.tensor(2, device="meta")).is_meta  # a meta index: a meta key


def test_real_draws_unchanged_after_meta_draws() -> None:
    k = fsr.key(3)
    before = [fsr.normal(k, (64,)), fsr.uniform(k, (64,), minval=-1.0, maxval=1.0), fsr.randint(k, (64,), 0, 9)]
    with torch.device("meta"):
        fsr.normal(k, (64,))
    after = [fsr.normal(k, (64,)), fsr.uniform(k, (64,), minval=-1.0, maxval=1.0), fsr.randint(k, (64,), 0, 9)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_meta_bound_is_a_config_error() -> None:
    with pytest.raises(fs.ConfigError, match="meta tensor"):
        fsr.uniform(fsr.key(0), (3,), minval=torch.tensor(0.5, device="meta"))
