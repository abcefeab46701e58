"""The planner's hardware table: spec-sheet numbers, one efficiency per device, lookups and their errors."""

from __future__ import annotations

import dataclasses

import pytest

import funcshard as fs
from funcshard.job import plan
from funcshard.job.plan import HARDWARE, hardware

GPUS = ("h100", "h200", "a100")


def test_the_table_has_the_four_devices() -> None:
    assert set(HARDWARE) == {"h100", "h200", "a100", "cpu"}
    assert all(h.name == name for name, h in HARDWARE.items())


@pytest.mark.parametrize("name", GPUS)
def test_gpu_peaks_are_dense_and_ordered(name: str) -> None:
    h = hardware(name)
    assert h.peak("fp16") == h.peak("bf16")
    assert h.peak("tf32") == pytest.approx(h.peak("bf16") / 2, rel=1e-3)  # TF32 runs at half the bf16 rate
    assert h.peak("fp32") < h.peak("tf32")
    assert h.node_size == 8


def test_spec_sheet_numbers() -> None:
    h100, h200, a100 = hardware("h100"), hardware("h200"), hardware("a100")
    assert h100.peak("bf16") == 989e12 and h100.peak("fp32") == 67e12
    assert a100.peak("bf16") == 312e12 and a100.peak("tf32") == 156e12 and a100.peak("fp32") == 19.5e12
    assert all(h200.peak(d) == h100.peak(d) for d in plan.DTYPES)  # the same compute, more and faster memory
    assert h200.hbm_bandwidth > h100.hbm_bandwidth > a100.hbm_bandwidth
    # NVLink per direction is half the sheets' bidirectional total; the network is one NIC per GPU
    assert h100.intra_bandwidth == 900e9 / 2 and a100.intra_bandwidth == 600e9 / 2
    assert h100.inter_bandwidth == 400e9 / 8 and a100.inter_bandwidth == 200e9 / 8


def test_memory_is_what_the_device_reports() -> None:
    gib = {name: HARDWARE[name].hbm_bytes / 2**30 for name in GPUS}
    assert 79 < gib["h100"] < 80  # "80GB" reports 81,559 MiB
    assert 140 < gib["h200"] < 141  # "141GB" reports 143,771 MiB
    assert gib["a100"] == 80


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_one_efficiency_per_device_for_every_dtype(name: str) -> None:
    h = hardware(name)
    assert 0 < h.efficiency < 1
    for dtype in plan.DTYPES:
        assert h.achieved(dtype) == pytest.approx(h.peak(dtype) * h.efficiency)
    assert h.inter_bandwidth <= h.intra_bandwidth and h.inter_latency >= h.intra_latency


def test_lookup_spellings() -> None:
    assert hardware("H100") is HARDWARE["h100"]
    assert hardware(HARDWARE["a100"]) is HARDWARE["a100"]
    h = hardware("h100")
    assert h.peak("bfloat16") == h.peak("bf16") == h.peak("torch.bfloat16")
    assert h.peak("float32") == h.peak("fp32") and h.peak("half") == h.peak("fp16")


def test_unknown_names_raise_config_error_listing_the_table() -> None:
    with pytest.raises(fs.ConfigError) as err:
        hardware("tpu-v5p")
    assert all(name in str(err.value) for name in HARDWARE)
    with pytest.raises(fs.ConfigError, match="fp8"):
        hardware("h100").peak("fp8")


def test_entries_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        HARDWARE["h100"].efficiency = 0.9  # type: ignore[misc]
