"""The main job: train the Llama on real text over a dp / fsdp / tp / cp mesh, simulated or under torchrun.

``python -m funcshard train`` (no arguments) trains a ~3M-parameter byte-level Llama on the Python standard
library's own source on a simulated ``dp=2,tp=2`` mesh; ``torchrun --nproc-per-node 4 -m funcshard train``
runs the same job with one device per process. The whole step is ONE ``shard_map``: loss and gradients
(``fs.value_and_grad`` of ``llama.loss``) and the optimiser update (clip by global norm, AdamW with warmup +
cosine), with the parameters and optimiser state laid out by ``llama.param_specs`` in and out. Parameters are
initialised sharded (each device draws only its blocks). Along the way: a progress bar (loss, tokens/s, MFU
estimate), held-out validation loss, checkpoints with exact resume; at the end a loss curve and a CSV.

Nothing is lost and nothing hangs: a run refuses a ``--ckpt-dir`` holding an earlier run's checkpoints unless
``--resume`` or ``--overwrite`` says what to do with them; bad input is one ``error:`` line before the first step
(:mod:`funcshard.job.preflight`); Ctrl-C stops after the running step, every device and process at the same step,
with one line naming the checkpoint that is intact (exit code 130).

``python -m funcshard generate`` samples from the checkpoints a run leaves (:mod:`funcshard.job.generate`).

Example:
    >>> from funcshard.job import train
    >>> train.main(["--steps", "2", "--dim", "32", "--layers", "1", "--ffn", "64"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import optree
import torch

import funcshard as fs
from funcshard import P, checkpoint
from funcshard import random as fsr
from funcshard.models import llama
from funcshard.process import PeerError, any_process, collective_timeout

from . import bridge, init_from, preflight
from .cli import Interrupted, StopOnCtrlC, UsageError, parse_mesh, run, train_parser
from .data import eval_batches, load_corpus, train_batch
from .saving import Saver, async_default, remove_checkpoint
from .step import build_step, model_config, model_module

__all__ = ["main", "train"]

CSV_FIELDS = ("step", "train_loss", "val_loss", "tokens_per_s")


def _lead() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _say(*args: Any) -> None:
    if _lead():
        print(*args, flush=True)


def slow_matmul_note(dtype: str) -> str | None:
    """A line for the job's header when ``--dtype`` asks for a matmul dtype this CPU has no native kernels for
    (torch 2.13 on an AVX2-only CPU: a bf16 matmul ran ~47x slower than fp32, 2048x256 @ 256x1024), else None.

    Example:
        >>> slow_matmul_note("fp32") is None
        True
    """
    if dtype == "fp32":
        return None
    probe = {"bf16": "_is_mkldnn_bf16_supported", "fp16": "_is_mkldnn_fp16_supported"}[dtype]
    try:
        native = bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):  # a torch without the probe: say nothing rather than guess
        return None
    if native:
        return None
    return (
        f"note: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native {dtype} matmul: torch runs "
        f"{dtype} matmuls many times slower than fp32 here; --dtype {dtype} on it checks the numbers, not the speed"
    )


def model_dict(cfg: llama.Config) -> dict[str, Any]:
    """The model's config as JSON-able data (the precision as its string form), as checkpoints store it."""
    d = dataclasses.asdict(cfg)
    d["precision"] = None if cfg.precision is None else str(cfg.precision)
    return d


def _threads(args: argparse.Namespace, mesh: fs.Mesh) -> int:
    """Torch threads per process: this machine's cores shared by its processes (a simulated mesh's devices
    then share the process's threads: the sim backend gives each device thread its part)."""
    if args.threads:
        return args.threads
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if mesh.is_multiprocess else 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // local)


# ---------------------------------------------------------------------------------------------- reports


def _read_rows(path: Path, upto: int) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if int(r["step"]) <= upto]


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)


def _plot(path: Path, rows: list[dict[str, Any]], title: str) -> bool:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    train = [(int(r["step"]), float(r["train_loss"])) for r in rows if r["train_loss"] != ""]
    val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"] != ""]
    fig = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train, strict=True), lw=1, label="train (batch)")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", lw=2, label="validation (held out)")
    ax.set(xlabel="step", ylabel="loss (nats / byte)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


# ---------------------------------------------------------------------------------------------- train


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the training job described by ``args`` (see ``funcshard train --help``); returns a summary.

    Before the first step it checks what can be checked (numbers, the checkpoint folder, that ``--out`` and
    ``--ckpt-dir`` are writable, that one step fits memory and time: see :mod:`funcshard.job.preflight`). Ctrl-C
    stops at the end of the running step (a second one at once) with :class:`~funcshard.job.cli.Interrupted`.

    Args:
        args: parsed ``funcshard train`` options (``funcshard.job.cli.train_parser``).

    Returns:
        A summary: ``initial_val_loss`` and ``final_val_loss`` as ``(step, loss)``, ``tokens_per_s``, ``mfu``,
        ``wall_s``, ``steps``, the train ``losses`` of this run, and the final ``params``.

    Raises:
        UsageError: options the mesh, the machine or the checkpoints cannot use (also MeshError, ShardingError,
            CheckpointError).
        Interrupted: Ctrl-C; the message names the last step done and the checkpoint that is intact.

    Example:
        >>> from funcshard.job.cli import train_parser
        >>> args = train_parser().parse_args(["--steps", "2", "--dim", "32", "--layers", "1", "--ffn", "64"])
        >>> summary = train(args)  # doctest: +SKIP
        >>> summary["steps"]  # doctest: +SKIP
        2
    """
    cfg = model_config(args)
    preflight.check_numbers(args)
    mesh_shape = parse_mesh(args.mesh)
    preflight.check_mesh_sizes(args)
    collective_timeout()  # MeshError now, not at the first collective: a FUNCSHARD_TIMEOUT that is not a number
    ckpt_dir, out = Path(args.ckpt_dir), Path(args.out)
    saved = preflight.check_ckpt_dir(ckpt_dir, resume=args.resume, overwrite=args.overwrite)
    preflight.check_writable("--ckpt-dir", ckpt_dir)
    preflight.check_writable("--out", out)
    mesh_shape = preflight.node_order(mesh_shape)  # several nodes: tp and cp inside one
    preflight.check_step_size(args, cfg)
    preflight.check_shared_ckpt_dir(ckpt_dir, fs.make_mesh(mesh_shape))
    progress = {"step": None}  # the last step done, for the message after Ctrl-C
    stop = StopOnCtrlC()
    try:
        return _train(args, cfg, mesh_shape, ckpt_dir, out, saved, stop, progress)
    except KeyboardInterrupt:
        raise Interrupted(_stopped(progress["step"], ckpt_dir, args)) from None
    except PeerError:
        if stop.requested:  # a peer left after Ctrl-C: what the user asked for
            raise Interrupted(_stopped(progress["step"], ckpt_dir, args)) from None
        raise


def _say_nodes(mesh: fs.Mesh, asked: dict[str, int]) -> None:
    """On several nodes: how many, which axes stay inside one, and the reordering of ``--mesh`` if any."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if not mesh.is_multiprocess or not local or local >= mesh.size:
        return
    inside = ", ".join(mesh.node_local_axes()) or "none"
    _say(f"nodes: {mesh.size // local} of {local} processes; axes inside a node: {inside}")
    if list(asked) != list(mesh.shape):
        _say(f"note: --mesh {_mesh_text(asked)} ran as {_mesh_text(mesh.shape)}: tp and cp innermost, inside a node")


def _mesh_text(shape: dict[str, int]) -> str:
    """``{"dp": 2, "tp": 2}`` -> ``dp=2,tp=2``."""
    return ",".join(f"{a}={s}" for a, s in shape.items())


def _stopped(step: int | None, ckpt_dir: Path, args: argparse.Namespace) -> str:
    """The line after Ctrl-C: where the run stopped and which checkpoint is intact."""
    where = "before the first step" if step is None else f"at step {step}"
    steps = checkpoint.list_steps(ckpt_dir)
    if steps:
        return f"stopped {where}; the checkpoint of step {steps[-1]} is intact; --resume continues"
    return (
        f"stopped {where}; no checkpoint yet (one every {args.ckpt_every} steps, --ckpt-every); run the same "
        f"command to start over"
    )


@dataclasses.dataclass
class _Run:
    """A train run's parts, built once by :func:`_setup`: the mesh, the data, and the sharded functions."""

    args: argparse.Namespace
    cfg: llama.Config
    mesh: fs.Mesh
    corpus: Any
    ckpt_dir: Path
    out: Path
    n_threads: int
    train_step: Any  # (params, opt_state, tokens, targets) -> (loss, params, opt_state)
    eval_step: Any  # (params, tokens, targets) -> loss
    init: Any  # key -> params
    opt_init: Any  # params -> opt_state
    abstract: Any  # () -> (params, opt_state) as arrays of meta tensors: the layout a resume loads into
    vals: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)

    def evaluate(self, p: Any) -> float:
        """The mean loss over the held-out batches."""
        return sum(float(fs.device_get(self.eval_step(p, x, y))) for x, y in self.vals) / len(self.vals)


def _setup(args: argparse.Namespace, cfg: llama.Config, mesh_shape: dict[str, int], ckpt_dir: Path, out: Path) -> _Run:
    """Read the corpus, build the mesh and check the run fits it, and shard_map the step, eval and init."""
    corpus = load_corpus(args.data, max_bytes=args.max_bytes, seq=args.seq)
    tokenizer = init_from.run_tokenizer(args)
    if tokenizer is not None:  # --init-from a folder with a tokenizer.json: its tokens, not bytes
        corpus = init_from.tokenize_corpus(corpus, tokenizer, vocab_size=cfg.vocab_size, seq=args.seq)
    mesh = fs.make_mesh(mesh_shape)
    step = build_step(args, cfg, mesh)
    specs, bs, accum = step.specs, step.batch_spec, getattr(args, "grad_accum", 1)
    if args.resume:
        _check_same_model(ckpt_dir, cfg)
    resuming = args.resume and bool(checkpoint.list_steps(ckpt_dir))

    model = model_module(cfg)

    def eval_fn(p: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model.loss(p, tokens, targets, cfg)

    kw = {"mesh": mesh, "check_vma": args.check_vma}
    init = fs.shard_map(lambda k: model.init(k, cfg), in_specs=(P(),), out_specs=specs, **kw)
    if getattr(args, "init_from", None) and not resuming:  # the folder's weights (a resume loads its own)
        init = lambda k: init_from.load_params(args.init_from, mesh, specs, model)  # noqa: E731
    eval_step = fs.shard_map(eval_fn, in_specs=(specs, bs, bs), out_specs=P(), **kw)
    abstract = lambda: _abstract_state(model.init, cfg, step, mesh)  # noqa: E731
    if bridge.wanted(args):  # a Hugging Face model that is not a Llama: its loss and weights through fs.nn
        eval_step, init = bridge.eval_and_init(args, mesh, specs, bs)  # (a resume loads its own over these)
        abstract = functools.partial(_loaded_state, init, step.opt_init)  # the folder's weights, loaded over
    return _Run(
        args,
        cfg,
        mesh,
        corpus,
        ckpt_dir,
        out,
        n_threads=_threads(args, mesh),
        train_step=_accumulating(step.step, accum),
        eval_step=eval_step,
        init=init,
        opt_init=step.opt_init,
        abstract=abstract,
    )


def _abstract_state(init: Any, cfg: llama.Config, step: Any, mesh: fs.Mesh) -> tuple[Any, Any]:
    """The params and optimiser state as ``fs.Array``s of meta tensors on ``mesh`` (their shapes from
    ``fs.eval_shape`` of the model's ``init``: nothing drawn, nothing allocated), for ``checkpoint.load`` to fill on
    a resume."""
    shapes = fs.eval_shape(lambda k: init(k, cfg), fsr.key(0))
    state_shapes = fs.eval_shape(step.optimizer.init, shapes)

    def meta(tree: Any) -> Any:
        return optree.tree_map(lambda s: torch.empty(s.shape, dtype=s.dtype, device="meta"), tree)

    return fs.device_put(meta(shapes), mesh, step.specs), fs.device_put(meta(state_shapes), mesh, step.state_specs)


def _loaded_state(init: Any, opt_init: Any) -> tuple[Any, Any]:
    """The params ``init`` gives (a bridged model's folder weights) and their optimiser state: the layout a
    resume loads into where the model has no ``init`` of shapes alone."""
    params = init(None)
    return params, opt_init(params)


def _accumulating(step: Any, k: int) -> Any:
    """``step`` on a whole batch as ``k`` calls on its ``k`` microbatches (the optimiser, ``multi_steps(opt, k)``,
    updates on the last); the loss is their mean, as the whole batch's."""
    if k == 1:
        return step

    def run(p: Any, s: Any, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[Any, Any, Any]:
        losses = []
        for x, y in zip(tokens.chunk(k), targets.chunk(k), strict=True):  # [b, s] -> k x [b/k, s]
            loss, p, s = step(p, s, x, y)
            losses.append(fs.device_get(loss))
        return torch.stack(losses).mean(), p, s

    return run


def _restore_or_init(run: _Run, saved: list[int]) -> tuple[Any, Any, torch.Tensor, int]:
    """``(params, opt_state, data_key, start step)``: from the latest checkpoint with ``--resume``, else a fresh
    sharded init (and, with ``--overwrite``, an earlier run's checkpoints removed)."""
    args, ckpt_dir = run.args, run.ckpt_dir
    key = fsr.key(args.seed)
    data_key = fsr.fold_in(key, 1)
    if args.resume and saved:  # loaded into the abstract layout: no random init first
        params, state = run.abstract()
        path = checkpoint.step_path(ckpt_dir, saved[-1])
        like = {"params": params, "opt_state": state, "step": 0, "data_key": data_key}
        tree = checkpoint.load(path, like)
        params, state, start, data_key = tree["params"], tree["opt_state"], tree["step"], tree["data_key"]
        if start >= args.steps:
            raise UsageError(f"--resume: the checkpoint is at step {start} already; raise --steps to train on.")
        return params, state, data_key, start
    params = run.init(fsr.fold_in(key, 0))  # sharded init: each device draws its own blocks
    state = run.opt_init(params)
    if args.resume:
        _say(f"--resume: no checkpoint in '{ckpt_dir}' yet; starting afresh")
    elif saved and _lead():  # --overwrite (check_ckpt_dir refused the rest): the old run's checkpoints go
        for s in saved:
            remove_checkpoint(ckpt_dir, s)
        print(f"--overwrite: removed {len(saved)} checkpoint(s) of an earlier run in {ckpt_dir}", flush=True)
    return params, state, data_key, 0


def _train(
    args: argparse.Namespace,
    cfg: llama.Config,
    mesh_shape: dict[str, int],
    ckpt_dir: Path,
    out: Path,
    saved: list[int],
    stop: StopOnCtrlC,
    progress: dict[str, int | None],
) -> dict[str, Any]:
    run = _setup(args, cfg, mesh_shape, ckpt_dir, out)
    mesh = run.mesh
    threads = torch.get_num_threads()
    torch.set_num_threads(run.n_threads)
    try:
        params, state, data_key, start = _restore_or_init(run, saved)
        progress["step"] = start
        if _lead():
            meta = {"model": model_dict(cfg), "args": vars(args), "mesh": mesh.shape}
            tok = init_from.run_tokenizer(args)
            meta["tokenizer"] = None if tok is None else str(tok)  # generate decodes with it
            (ckpt_dir / "config.json").write_text(json.dumps({**meta, "corpus": run.corpus.describe()}, indent=1))
        run.vals = eval_batches(run.corpus.val, n=args.eval_batches, batch=args.batch, seq=args.seq)
        _say(f"mesh {mesh.shape} ({mesh.backend}, {mesh.size} devices){'  sequence parallel' if args.sp else ''}")
        _say_nodes(mesh, parse_mesh(args.mesh))
        _say(f"model: {_name(cfg)}, {cfg.num_params() / 1e6:.2f}M params, {cfg}")
        _say(f"data: {run.corpus.describe()}")
        _say(f"batch {args.batch} x {args.seq} = {args.batch * args.seq} tokens/step; steps {start} -> {args.steps}")
        note = slow_matmul_note(getattr(args, "dtype", "fp32"))
        if note:
            _say(note)
        rows: list[dict[str, Any]] = _read_rows(out / "metrics.csv", start) if start else []
        if start == 0:
            rows.append({"step": 0, "train_loss": "", "val_loss": run.evaluate(params), "tokens_per_s": ""})
            v = cfg.vocab_size
            _say(f"step 0: val loss {rows[-1]['val_loss']:.4f} (ln {v} = {math.log(v):.4f})")
        end = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
        t_start = time.perf_counter()
        params, times = _steps(run, (params, state, data_key), range(start, end), rows, stop, progress)
        wall = time.perf_counter() - t_start
        if bridge.wanted(args):  # the trained weights as a folder that from_pretrained loads
            _say(f"Hugging Face folder: {bridge.save_hf(params, args, out / 'hf')}")
    finally:
        torch.set_num_threads(threads)
    return _summary(run, params, rows, start, end, times, wall)


def _steps(
    run: _Run,
    carry: tuple[Any, Any, torch.Tensor],
    steps: range,
    rows: list[dict[str, Any]],
    stop: StopOnCtrlC,
    progress: dict[str, int | None],
) -> tuple[Any, list[float]]:
    """Train over ``steps`` (eval, checkpoint and metrics rows on their cadence; stop together after Ctrl-C);
    the final params and each step's seconds."""
    from tqdm.auto import tqdm

    args, cfg, ckpt_dir, out = run.args, run.cfg, run.ckpt_dir, run.out
    params, state, data_key = carry
    start, end = steps.start, steps.stop
    tok_per_step, flops, peak = args.batch * args.seq, cfg.flops_per_token(args.seq), args.peak_tflops * 1e12
    times: list[float] = []
    last_val = next((float(r["val_loss"]) for r in reversed(rows) if r["val_loss"] != ""), float("nan"))
    bar = tqdm(total=end, initial=start, desc="train", disable=not _lead(), dynamic_ncols=True, mininterval=0.5)
    background = args.async_ckpt if args.async_ckpt is not None else async_default(run.mesh.is_multiprocess)
    saver = Saver(ckpt_dir, {"model": model_dict(cfg)}, asynchronous=background)
    with stop:
        for i in steps:
            if _agree(stop.requested, run.mesh):  # every device and process stops after the same step
                saver.finish()  # the checkpoint in flight is in place before the line says it is intact
                bar.close()
                if _lead():
                    _write_rows(out / "metrics.csv", rows)
                raise Interrupted(_stopped(i, ckpt_dir, args))
            tokens, targets = train_batch(run.corpus.train, data_key, step=i, batch=args.batch, seq=args.seq)
            t0 = time.perf_counter()
            loss, params, state = run.train_step(params, state, tokens, targets)
            loss_v = float(fs.device_get(loss))
            times.append(time.perf_counter() - t0)
            if not math.isfinite(loss_v):
                raise UsageError(f"the loss became {loss_v} at step {i + 1}; lower --lr (now {args.lr}).")
            progress["step"] = i + 1
            row: dict[str, Any] = {"step": i + 1, "train_loss": loss_v, "val_loss": ""}
            row["tokens_per_s"] = tok_per_step / times[-1]
            if (i + 1) % args.eval_every == 0 or i + 1 == end:
                row["val_loss"] = last_val = run.evaluate(params)
            rows.append(row)
            tps = tok_per_step * min(len(times), 10) / sum(times[-10:])
            bar.set_postfix(
                loss=f"{loss_v:.3f}", val=f"{last_val:.3f}", tok_s=f"{tps:.0f}", mfu=f"{flops * tps / peak:.1%}"
            )
            bar.update(1)
            if (i + 1) % args.ckpt_every == 0 or i + 1 == end:
                saver.save(i + 1, params, state, data_key)  # (with --async-ckpt, written while training goes on)
                if _lead():
                    _write_rows(out / "metrics.csv", rows)
    saver.finish()
    bar.close()
    return params, times


def _summary(
    run: _Run, params: Any, rows: list[dict[str, Any]], start: int, end: int, times: list[float], wall: float
) -> dict[str, Any]:
    """The run's summary (val losses, throughput, MFU, the final params); the lead also writes the report."""
    args, cfg = run.args, run.cfg
    flops, peak = cfg.flops_per_token(args.seq), args.peak_tflops * 1e12
    steady = times[1:] or times
    tps = args.batch * args.seq * len(steady) / sum(steady) if steady else float("nan")
    vals_seen = [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"] != ""]
    summary = {
        "initial_val_loss": vals_seen[0],  # (step, loss)
        "final_val_loss": vals_seen[-1],
        "tokens_per_s": tps,
        "mfu": flops * tps / peak,
        "wall_s": wall,
        "steps": end,
        "losses": [float(r["train_loss"]) for r in rows if r["train_loss"] != "" and int(r["step"]) > start],
        "params": params,
    }
    if _lead():
        title = f"{_name(cfg)} {cfg.num_params() / 1e6:.1f}M on {run.mesh.shape}, byte-level"
        _report(args, summary, rows, title, flops)
    return summary


def _name(cfg: llama.Config) -> str:
    """How the reports name the model: ``Llama``, or ``Mixtral (8 experts, top-2)``."""
    if model_module(cfg).__name__.endswith("mixtral"):
        return f"Mixtral ({cfg.n_experts} experts, top-{cfg.experts_per_token})"
    return "Llama"


def _agree(flag: bool, mesh: fs.Mesh) -> bool:
    """``flag`` on any process (under torchrun, a tiny all-reduce; simulated, the flag itself)."""
    return any_process(flag, mesh)


def _report(
    args: argparse.Namespace, summary: dict[str, Any], rows: list[dict[str, Any]], title: str, flops: float
) -> None:
    """Write the CSV and the loss curve into ``--out`` and print the numbers of the run."""
    out = Path(args.out)
    _write_rows(out / "metrics.csv", rows)
    plotted = _plot(out / "loss.png", rows, title)
    (s0, v0), (s1, v1) = summary["initial_val_loss"], summary["final_val_loss"]
    print(f"val loss {v0:.4f} (step {s0}) -> {v1:.4f} (step {s1})")
    print(
        f"{len(summary['losses'])} steps in {summary['wall_s']:.1f} s: {summary['tokens_per_s']:.0f} tokens/s, "
        f"MFU ~{summary['mfu']:.1%} (an estimate: {flops / 1e6:.1f} MFLOP/token over an assumed peak of "
        f"{args.peak_tflops} TFLOP/s, --peak-tflops)"
    )
    print(f"metrics: {out / 'metrics.csv'}")
    print(f"loss curve: {out / 'loss.png'}" if plotted else "loss curve: skipped (pip install matplotlib)")
    print(f"checkpoints: {args.ckpt_dir} (step {summary['steps']}); sample with: python -m funcshard generate")


def _check_same_model(ckpt_dir: Path, cfg: llama.Config) -> None:
    try:
        saved = json.loads((ckpt_dir / "config.json").read_text())["model"]
    except (OSError, ValueError, KeyError):
        return  # nothing to compare with: loading checks the shapes
    # how it runs, not which model (the master weights stay float32 under any --dtype)
    layout_only = ("sequence_parallel", "pp_schedule", "pp_microbatches", "remat", "precision")
    now = {k: v for k, v in model_dict(cfg).items() if k not in layout_only}
    diff = [f"{k}={saved.get(k)!r} (now {v!r})" for k, v in now.items() if saved.get(k) != v]
    if diff:
        raise UsageError(
            f"--resume: the checkpoints in '{ckpt_dir}' are of another model: {', '.join(diff)}; "
            f"pass the same model flags, or use another --ckpt-dir."
        )


def main(argv: list[str] | None = None) -> int:
    """``funcshard train``: exit code 0, or 2 with one ``error: ...`` line on bad input.

    Args:
        argv: the command-line options (default ``sys.argv[1:]``).

    Returns:
        The exit code.

    Example:
        >>> main(["--steps", "0"])  # bad input: one error line on stderr
        2
    """
    return run(train_parser(), train, argv)
