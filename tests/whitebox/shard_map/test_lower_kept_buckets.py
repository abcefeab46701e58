"""``lower``'s replay of a backend's kept gradient buckets (``BackendImpl.keeps_buckets``, the dist backend's
``BucketPool``): a bucket takes a kept buffer that nothing holds any more (no new bytes), else it is kept to the end
of the step; a peak set by a bucket that turns out to be a kept buffer is taken back. And the flag itself: the
analysis of a sim run keeps none, of a dist or abstract run keeps them."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.counters


def _meter():
    from torch.utils.flop_counter import flop_registry

    from funcshard._src.shard_map.lower import _KeptBuckets, _Meter

    meter = _Meter(flop_registry)
    return meter, _KeptBuckets(meter)


def _bucket(meter, n: int) -> torch.Tensor:
    t = torch.empty(n, device="meta")
    meter.add(t)  # as the meta dispatch counts a new storage
    return t


def test_a_bucket_reuses_a_kept_buffer_nothing_holds() -> None:
    meter, pool = _meter()
    a = _bucket(meter, 256)  # 1 KiB
    pool.take(a)
    grads = a[:128]  # a gradient handed out as a view of the bucket
    del a
    assert meter.live == 1024
    b = _bucket(meter, 256)  # the first bucket still held: a second buffer
    pool.take(b)
    assert meter.live == 2048 and meter.peak == 2048
    del grads, b  # nothing holds either bucket now: both stay kept (allocated) all the same
    assert meter.live == 2048
    c = _bucket(meter, 256)  # reuses a kept buffer: no new bytes, and the peak its making set is taken back
    assert meter.peak == 3072
    pool.take(c)
    assert meter.live == 2048 and meter.peak == 2048
    d = _bucket(meter, 128)  # another size: a buffer of its own
    pool.take(d)
    assert meter.live == 2560 and meter.parts()["grads"] == 2560


def test_the_analysis_of_each_backend_keeps_buckets_as_that_backend_does() -> None:
    from funcshard._src.runtime.mesh import get_backend

    assert not get_backend("sim").keeps_buckets
    assert get_backend("dist").keeps_buckets
    assert get_backend("abstract").keeps_buckets  # an abstract mesh plans a torch.distributed run
