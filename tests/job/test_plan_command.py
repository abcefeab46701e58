"""``python -m funcshard plan``: the train step lowered on an abstract mesh, its memory, communication and time;
``--search`` over the layouts of N devices."""

from __future__ import annotations

import json

import pytest

import funcshard as fs
from funcshard.job.cli import plan_parser
from funcshard.job.plan import estimate, search
from funcshard.job.plan.command import main, resolve_defaults
from funcshard.models import llama

SMALL = ["--preset", "debug", "--seq", "64", "--batch", "8"]


def _args(*argv: str):
    return resolve_defaults(plan_parser().parse_args(list(argv)))


def test_plan_prints_memory_comm_and_time(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--mesh", "fsdp=2,tp=2", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    for part in ("params", "grads", "optimizer_state", "activations", "temporaries"):
        assert part in out
    assert "fits" in out and "psum_scatter" in out and "MFU" in out and "tokens/s per device" in out


def test_plan_defaults_on_gpu_are_bf16_and_selective_remat() -> None:
    e = estimate(_args(*SMALL, "--mesh", "fsdp=2", "--hardware", "h100"))
    assert e.dtype == "bf16" and e.cfg.remat == "selective"
    e = estimate(_args(*SMALL, "--mesh", "fsdp=2", "--hardware", "cpu"))
    assert e.dtype == "fp32" and e.cfg.remat == "none"


def test_plan_counts_what_a_real_sim_run_sends() -> None:
    args = _args(*SMALL, "--mesh", "dp=2,tp=2", "--hardware", "cpu")
    e = estimate(args)
    from funcshard.job.step import build_step

    mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    step = build_step(args, e.cfg, mesh)
    params = fs.device_put(llama.init(fs.random.key(0), e.cfg), mesh, step.specs)
    state = step.opt_init(params)
    import torch

    x = fs.device_put(torch.randint(0, e.cfg.vocab_size, (8, 64)), mesh, step.batch_spec)
    with fs.comm_stats() as stats:
        step.step(params, state, x, x)
    assert e.comm_rows == stats.rows()


def test_plan_json_is_plain_data(capsys: pytest.CaptureFixture[str]) -> None:
    main([*SMALL, "--mesh", "pp=2,fsdp=2", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["mesh"] == {"pp": 2, "fsdp": 2} and data["fits"] is True and data["microbatches"] == 4
    assert data["time_s"]["bubble"] > 0 and data["memory_bytes"]["peak"] > 0


def test_405b_on_8_gpus_does_not_fit_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--preset", "llama3-405b", "--mesh", "fsdp=8", "--seq", "8192", "--batch", "8"])
    out = capsys.readouterr().out
    assert code == 1 and "DOES NOT FIT" in out and "optimiser state" in out
    assert "fp32 master weights are 1.6 TB in all" in out


def test_search_ranks_layouts_that_fit(capsys: pytest.CaptureFixture[str]) -> None:
    ranked = search(_args(*SMALL, "--hardware", "h100"), 4, progress=False, workers=1)
    assert ranked and all(e.fits for e in ranked)
    assert [e.time.total for e in ranked] == sorted(e.time.total for e in ranked)
    assert main([*SMALL, "--search", "--gpus", "4", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "fastest first" in out and len(out.strip().splitlines()) == 5


def test_search_extrapolation_matches_the_whole_model() -> None:
    from funcshard.job.plan.search import extrapolated

    args = _args("--dim", "64", "--layers", "8", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--seq", "32",
                 "--batch", "8", "--mesh", "pp=2,fsdp=2", "--hardware", "h100")  # fmt: skip
    whole, fast = estimate(args), extrapolated(args, {"pp": 2, "fsdp": 2})
    assert fast.comm_rows == whole.comm_rows and fast.cost["flops"] == whole.cost["flops"]
    assert abs(fast.memory["peak"] / whole.memory["peak"] - 1) < 0.05


def test_search_extrapolation_of_an_interleaved_pipeline() -> None:
    from funcshard.job.plan.search import extrapolated

    # 12 layers, pp=2, 2 chunks a stage: lowered with 4 and 8 layers (1 and 2 a chunk), extended to 3 a chunk
    flags = "--dim 64 --layers 12 --heads 4 --kv-heads 2 --ffn 128 --seq 32 --batch 8 --mesh pp=2,fsdp=2"
    args = _args(*flags.split(), "--schedule", "interleaved", "--hardware", "h100")
    whole, fast = estimate(args), extrapolated(args, {"pp": 2, "fsdp": 2})
    assert "from 4 and 8 layers" in fast.notes[-1]
    assert fast.comm_rows == whole.comm_rows and fast.cost["flops"] == whole.cost["flops"]
    assert fast.cost["comm_bytes"] == whole.cost["comm_bytes"] and fast.cost["comm_calls"] == whole.cost["comm_calls"]
    assert abs(fast.memory["peak"] / whole.memory["peak"] - 1) < 0.05
    parts = [fast.memory[p] for p in ("params", "grads", "optimizer_state", "activations", "temporaries")]
    assert min(parts) >= 0 and sum(parts) == fast.memory["peak"]
    assert fast.memory["params"] == whole.memory["params"]


def test_plan_bad_input_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--preset", "llama3-9000"]) == 2
    assert "llama3-8b" in capsys.readouterr().err
    assert main([*SMALL, "--search"]) == 2
    assert main([*SMALL, "--hardware", "tpu"]) == 2


def test_advice_names_the_part_that_does_not_fit() -> None:
    from funcshard.job.plan.estimate import advice

    state = {"params": 40, "grads": 40, "optimizer_state": 80, "activations": 1, "temporaries": 1}
    assert "fsdp" in advice(state, 100)
    acts = {"params": 1, "grads": 1, "optimizer_state": 2, "activations": 500, "temporaries": 10}
    assert "--remat" in advice(acts, 100)


def test_search_takes_layer_counts_and_lengths_the_mesh_does_not_divide() -> None:
    from funcshard.job.plan.search import candidates, extrapolated

    # 7 layers: pp=2 and pp=4 stages of 4 + 3 and 2 + 2 + 2 + 1 layers (earlier stages take one more); a
    # sequence cp=2 does not divide (zigzag over tensor_split's blocks)
    flags = "--dim 64 --layers 7 --heads 4 --kv-heads 2 --ffn 128 --batch 8 --hardware h100"
    meshes = candidates(_args(*flags.split(), "--seq", "16385"), 4)
    assert {"pp": 2, "fsdp": 2} in meshes and {"pp": 4} in meshes and {"cp": 2, "fsdp": 2} in meshes
    # the largest stage sets the step: 7 layers on pp=2 are estimated as 8, as if both stages held 4
    args = _args(*flags.split(), "--seq", "32", "--mesh", "pp=2,fsdp=2")
    as_eight = _args(*flags.replace("--layers 7", "--layers 8").split(), "--seq", "32", "--mesh", "pp=2,fsdp=2")
    fast, seven, eight = extrapolated(args, {"pp": 2, "fsdp": 2}), estimate(args), estimate(as_eight)
    assert "to 8 (7 with 4 in the largest of the 2 chunks" in fast.notes[-1]
    assert fast.comm_rows == eight.comm_rows and fast.cost["flops"] == eight.cost["flops"]
    assert abs(fast.memory["peak"] / eight.memory["peak"] - 1) < 0.05
    assert fast.memory["peak"] >= seven.memory["peak"] and fast.cost["flops"] >= seven.cost["flops"]
