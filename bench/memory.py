"""Peak memory per device of one Llama training step, funcshard against real torch peers on an ``nn.Module`` twin.

Each variant runs in a fresh process (or, for the per-process rows, 4 fresh gloo processes started as torchrun
would), which builds the model, parameters and batch, takes a step on a tiny batch (so the libraries' one-time
buffers are not counted), resets the kernel's peak-RSS mark (``/proc/self/clear_refs``; without it the
process's whole-life ``getrusage`` peak is used) and takes ONE step on the real batch: forward and backward
(``--optim``: and the AdamW update). The number is the peak RSS minus the RSS before that step: the memory the
step itself needed (activations, saved tensors, gathered weights, gradients; the gradients are new in every
row: torch's ``.grad`` is set to None before the step). Every process runs with a fixed glibc mmap threshold,
so freed tensors leave the RSS. tracemalloc would not see torch's tensors; on CPU, RSS does.

Rows and the peer (baseline) each is divided by:

- one process (``1 proc``): ``module`` (``loss.backward()`` on the ``nn.Module`` twin, ``bench/_memory_peers.py``:
  same shapes and parameter count), ``module_ckpt`` (each block under
  ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``), ``module_bf16`` (the module under
  ``torch.autocast("cpu", torch.bfloat16)``); the functional torch steps on ``llama.loss`` (``torch``:
  ``torch.autograd.grad``; ``torch_create_graph``; ``torch_func``: ``torch.func.grad_and_value``); funcshard:
  ``funcshard`` (``fs.value_and_grad(llama.loss)``, peer ``module``), ``remat_full`` / ``remat_selective``
  (``Config(remat=...)``, peers ``module_ckpt`` / ``module``), ``funcshard_bf16``
  (``Config(precision=fs.Precision(torch.float32, torch.bfloat16))``: float32 master weights, bfloat16 compute;
  peer ``module_bf16``);
- a simulated 4-device mesh in one process (``sim x4``: the SUM over the four devices, so a replicated leaf
  counts four times): ``fsdp4_keep`` / ``fsdp4_reshard`` (``{"fsdp": 4}``, ``Config(remat=--fsdp-remat,
  reshard_after_forward=...)``), ``dp4`` (``{"dp": 4}``), ``cp4`` (``{"cp": 4}``: ring attention), each against
  the one-device module step that does the same work (``module_ckpt`` under ``--fsdp-remat full``, else ``module``);
  not like for like (four devices' sum against one device), the ``4 procs`` rows are;
- 4 gloo processes, one CPU process per device (``4 procs``: the MAX over the ranks of each rank's step memory,
  global batch ``--batch`` split over the ranks): the torch peers ``ddp4`` (``DistributedDataParallel``),
  ``fsdp2_keep`` / ``fsdp2_reshard`` (``fully_shard`` on every block and on the root, with
  ``reshard_after_forward`` False / True), ``fsdp2_reshard_ckpt`` (True, and every block checkpointed),
  ``fsdp2_bf16_keep`` (False, ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``);
  and funcshard on ``fs.make_mesh(..., backend="dist")``: ``dp4_dist`` (peer ``ddp4``), ``fsdp4_dist_keep``
  (remat none: the gathered weights live from the forward to the backward; peer ``fsdp2_keep``),
  ``fsdp4_dist_reshard`` (remat full + ``reshard_after_forward``: the gather inside the remat region; peer
  ``fsdp2_reshard_ckpt``), ``fsdp4_dist_reshard_noremat`` (remat none + ``reshard_after_forward``: the saved-tensor
  hooks of ``ops.fsdp.reshard_after_forward``; peer ``fsdp2_reshard``), ``fsdp4_dist_bf16`` (remat none, bf16, keep;
  peer ``fsdp2_bf16_keep``), ``cp4_dist``
  (``{"cp": 4}``; peer ``ddp4``, which holds the same number of tokens per device and the same replicated weights).

Asking for a row runs its peer too. Prints (stderr) each variant's MiB and seconds as it finishes, then one table:
variant, where (``1 proc`` / ``sim x4`` / ``4 procs``), MiB, peer, peer MiB, ratio (lower is better) and loss.
``--json PATH`` writes the rows (variant, where, MiB, peer, peer MiB, ratio, loss, per-rank MiB) and the sizes.
The default sizes are the 13.2M-parameter Llama, global batch 8 x 256.

Measured figures and their history: ``docs/guides/speed.md``.

Usage:
    python bench/memory.py                      # the 13M-parameter Llama, every row: ~6 minutes on 2 cores
    python bench/memory.py --variants funcshard,remat_full --layers 4   # a subset (and its peers)
    python bench/memory.py --optim --json /tmp/memory.json               # with the AdamW step, rows to JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

from _launch import free_port

# variant -> (where it runs, its peer or None)
ROWS: dict[str, tuple[str, str | None]] = {
    "module": ("1 proc", None),
    "module_ckpt": ("1 proc", None),
    "module_bf16": ("1 proc", None),
    "torch": ("1 proc", "module"),
    "torch_create_graph": ("1 proc", "module"),
    "torch_func": ("1 proc", "module"),
    "funcshard": ("1 proc", "module"),
    "remat_full": ("1 proc", "module_ckpt"),
    "remat_selective": ("1 proc", "module"),
    "funcshard_bf16": ("1 proc", "module_bf16"),
    "fsdp4_keep": ("sim x4", "module_ckpt"),  # the peer follows --fsdp-remat (module without remat)
    "fsdp4_reshard": ("sim x4", "module_ckpt"),
    "dp4": ("sim x4", "module"),
    "cp4": ("sim x4", "module"),
    "ddp4": ("4 procs", None),
    "fsdp2_keep": ("4 procs", None),
    "fsdp2_reshard": ("4 procs", None),
    "fsdp2_reshard_ckpt": ("4 procs", None),
    "fsdp2_bf16_keep": ("4 procs", None),
    "dp4_dist": ("4 procs", "ddp4"),
    "fsdp4_dist_keep": ("4 procs", "fsdp2_keep"),
    "fsdp4_dist_reshard": ("4 procs", "fsdp2_reshard_ckpt"),
    "fsdp4_dist_reshard_noremat": ("4 procs", "fsdp2_reshard"),
    "fsdp4_dist_bf16": ("4 procs", "fsdp2_bf16_keep"),
    "cp4_dist": ("4 procs", "ddp4"),
}
VARIANTS = tuple(ROWS)
WORLD = 4
# funcshard mesh variants -> (mesh shape, Config changes); "remat": None takes --fsdp-remat
MESHES: dict[str, tuple[dict[str, int], dict[str, Any]]] = {
    "fsdp4_keep": ({"fsdp": 4}, {"remat": None, "reshard_after_forward": False}),
    "fsdp4_reshard": ({"fsdp": 4}, {"remat": None, "reshard_after_forward": True}),
    "dp4": ({"dp": 4}, {}),
    "cp4": ({"cp": 4}, {}),
    "dp4_dist": ({"dp": 4}, {}),
    "fsdp4_dist_keep": ({"fsdp": 4}, {"reshard_after_forward": False}),
    "fsdp4_dist_reshard": ({"fsdp": 4}, {"remat": "full", "reshard_after_forward": True}),
    "fsdp4_dist_reshard_noremat": ({"fsdp": 4}, {"remat": "none", "reshard_after_forward": True}),
    "fsdp4_dist_bf16": ({"fsdp": 4}, {"precision": "bf16", "reshard_after_forward": False}),
    "cp4_dist": ({"cp": 4}, {}),
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Peak:
    """The step's memory: the peak RSS after ``start()`` minus the RSS at ``start()``."""

    def start(self) -> None:
        gc.collect()
        self.before = _rss_mib()
        try:  # "5": reset the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset = True
        except OSError:  # the whole-life peak instead: right when the step is the process's largest moment
            self.reset = False

    def mib(self) -> float:
        if self.reset:
            with open("/proc/self/status") as f:
                hwm = next(line for line in f if line.startswith("VmHWM:"))
            return int(hwm.split()[1]) / 1024 - self.before
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - self.before  # KiB on Linux


def _config(args: argparse.Namespace, variant: str) -> Any:
    import torch

    import funcshard as fs
    from funcshard.models import llama

    cfg = llama.Config(
        vocab_size=256,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads or args.heads // 2,
        ffn_dim=args.ffn,
        max_seq_len=args.seq,
    )
    change: dict[str, Any] = {"remat_full": {"remat": "full"}, "remat_selective": {"remat": "selective"}}.get(
        variant, {}
    )
    if variant == "funcshard_bf16":
        change = {"precision": fs.Precision(torch.float32, torch.bfloat16)}
    if variant in MESHES:
        change = dict(MESHES[variant][1])
        if "remat" in change and change["remat"] is None:
            change["remat"] = args.fsdp_remat
        if change.get("precision") == "bf16":
            change["precision"] = fs.Precision(torch.float32, torch.bfloat16)
    return dataclasses.replace(cfg, **change)


def _batch(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, args.seq), generator=g)
    return tokens, tokens.roll(-1, dims=1)


def _module_step(variant: str, args: argparse.Namespace, model: Any) -> Any:
    """The torch module rows: ``step(tokens, targets) -> loss`` (gradients in ``.grad``, AdamW with --optim)."""
    import _memory_peers as peers
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if args.optim else None
    bf16 = variant == "module_bf16"  # (fsdp2_bf16_keep: the MixedPrecisionPolicy casts)

    def step(tokens: Any, targets: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = peers.module_loss(model, tokens, targets)
        loss.backward()
        if opt is not None:
            opt.step()
        return loss.detach()

    return step


def _drop_grads(model: Any) -> None:
    """``.grad = None`` before the measured step: it allocates its gradients, as the functional steps do (a
    ``zero_grad`` inside the step would free the warm-up's gradients after the RSS before it was read)."""
    if model is not None:
        model.zero_grad(set_to_none=True)


def _functional_step(variant: str, cfg: Any, args: argparse.Namespace) -> Any:
    """The one-process functional rows: ``step(tokens, targets) -> (loss, outputs kept alive)``."""
    import optree
    import torch

    import funcshard as fs
    from funcshard.models import llama

    params = llama.init(fs.random.key(0), cfg)
    leaves, treedef = optree.tree_flatten(params)
    opt = fs.optim.adamw(1e-3) if args.optim else None
    state = opt.init(leaves) if opt else None

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        def loss_of(flat: list[torch.Tensor]) -> torch.Tensor:
            return llama.loss(optree.tree_unflatten(treedef, flat), tokens, targets, cfg)

        if variant in ("torch", "torch_create_graph"):
            req = [x.detach().requires_grad_() for x in leaves]
            loss = loss_of(req)
            grads = torch.autograd.grad(loss, req, create_graph=variant == "torch_create_graph")
        elif variant == "torch_func":
            grads, loss = torch.func.grad_and_value(loss_of)(leaves)
        else:
            loss, grads = fs.value_and_grad(loss_of)(leaves)
        if opt is not None:
            return loss.detach(), (grads, opt.update(list(grads), state, leaves))
        return loss.detach(), grads

    return step


def _mesh_step(variant: str, cfg: Any, args: argparse.Namespace, backend: str) -> tuple[Any, Any]:
    """funcshard on a mesh (``sim`` or ``dist``): ``(step(tokens, targets) -> (loss, outputs), mesh)``."""
    import funcshard as fs
    from funcshard import P
    from funcshard.models import llama

    mesh = fs.make_mesh(MESHES[variant][0], backend=backend)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    # each device draws only its blocks (under dist: no full copy of the parameters in any process)
    params = fs.shard_map(lambda k: llama.init(k, cfg), mesh=mesh, in_specs=(P(),), out_specs=specs)(fs.random.key(0))
    if not args.optim:
        f = fs.shard_map(
            lambda p, t, y: llama.value_and_grad(p, t, y, cfg),
            mesh=mesh,
            in_specs=(specs, bs, bs),
            out_specs=(P(), specs),
        )
        return (lambda t, y: _first(f(params, t, y))), mesh
    opt = fs.optim.adamw(1e-3)
    sspecs = opt.state_specs(specs)
    state = opt.init(params)

    def train(p: Any, s: Any, t: Any, y: Any) -> Any:
        loss, grads = llama.value_and_grad(p, t, y, cfg)
        return (loss, *opt.update(grads, s, p))

    g = fs.shard_map(train, mesh=mesh, in_specs=(specs, sspecs, bs, bs), out_specs=(P(), specs, sspecs))
    return (lambda t, y: _first(g(params, state, t, y))), mesh


def _first(out: tuple[Any, ...]) -> tuple[Any, Any]:
    return out[0], out


def _scalar(x: Any) -> float:
    """A loss as a float: an ``fs.Array``'s value (a collective under dist: every rank calls it), or a tensor's."""
    if hasattr(x, "mesh"):
        import funcshard as fs

        x = fs.device_get(x)
    return float(x)


def _one(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one step of a one-process variant (``1 proc`` or ``sim x4``) in this process; its numbers."""
    import _memory_peers as peers
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    cfg = _config(args, variant)
    tokens, targets = _batch(args)
    model = None
    if variant.startswith("module"):
        model = peers.build(cfg, ckpt=variant == "module_ckpt")
        step = _module_step(variant, args, model)
        run = lambda t, y: (step(t, y), None)  # noqa: E731
    elif variant in MESHES:
        run, _ = _mesh_step(variant, cfg, args, "sim")
    else:
        run = _functional_step(variant, cfg, args)
    small = 4 if variant in MESHES else 1
    warm = run(tokens[:small, :16], targets[:small, :16])  # the libraries' one-time buffers
    del warm
    _drop_grads(model)
    peak = _Peak()
    peak.start()
    loss, kept = run(tokens, targets)
    mib = peak.mib()
    del kept
    return {"step_mib": mib, "before_mib": peak.before, "loss": _scalar(loss), "peak_reset": peak.reset}


def _rank(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One rank of a ``4 procs`` variant (started with torchrun's environment); its numbers."""
    import datetime

    import _memory_peers as peers
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same init on every rank (DDP broadcasts rank 0's anyway)
    torch.set_num_threads(1)
    cfg = _config(args, variant)
    tokens, targets = _batch(args)
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} is not divisible by the {world} ranks")
    model = None
    if variant in MESHES:
        import funcshard as fs
        from funcshard.models import llama

        run, mesh = _mesh_step(variant, cfg, args, "dist")
        bs = llama.batch_spec(mesh)
        small = [fs.device_put(x[:world, :16], mesh, bs) for x in (tokens, targets)]
        big = [fs.device_put(x, mesh, bs) for x in (tokens, targets)]
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.nn.parallel import DistributedDataParallel

        model = peers.build(cfg, ckpt=variant == "fsdp2_reshard_ckpt")
        if variant == "ddp4":
            model = DistributedDataParallel(model)
        else:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            kw: dict[str, Any] = {"reshard_after_forward": variant in ("fsdp2_reshard", "fsdp2_reshard_ckpt")}
            if variant == "fsdp2_bf16_keep":
                kw["mp_policy"] = mp
            for block in model.layers:
                fully_shard(block, **kw)
            fully_shard(model, **kw)
        step = _module_step(variant, args, model)
        run = lambda t, y: (step(t, y), None)  # noqa: E731
        per = args.batch // world
        small = [x[rank : rank + 1, :16] for x in (tokens, targets)]
        big = [x[rank * per : (rank + 1) * per] for x in (tokens, targets)]
    for _ in range(2):  # twice: DDP rebuilds its buckets at the start of the second step
        warm = run(*small)
        del warm
    _drop_grads(model)
    dist.barrier()
    peak = _Peak()
    peak.start()
    loss, kept = run(*big)
    mib = peak.mib()
    del kept
    value = _scalar(loss)
    dist.barrier()
    dist.destroy_process_group()
    return {"step_mib": mib, "before_mib": peak.before, "loss": value, "rank": rank, "peak_reset": peak.reset}


def _launch(variant: str, passthrough: list[str], timeout: float) -> dict[str, Any]:
    """Run ``variant`` in fresh processes (4 gloo ranks for a ``4 procs`` one); its row, or raise."""
    # a fixed mmap threshold: every tensor over 64 KiB gets its own mapping, returned to the OS when freed, so
    # the peak RSS follows the live tensors (glibc's moving threshold would keep freed blocks in the heap)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, __file__, "--one", variant, *passthrough]
    if ROWS[variant][0] != "4 procs":
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, timeout=timeout)
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])
    port = free_port()
    procs = []
    for r in range(WORLD):
        renv = {
            **env,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(r),
            "WORLD_SIZE": str(WORLD),
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": str(WORLD),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=renv))
    results, errors = [], []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()  # only the processes started here
            raise RuntimeError(f"{variant}: the ranks did not finish in {timeout:.0f} s") from None
        if p.returncode:
            errors.append(se[-3000:])
        else:
            results.append(json.loads(so.strip().splitlines()[-1]))
    if errors:
        raise RuntimeError("\n".join(errors))
    results.sort(key=lambda r: r["rank"])
    return {
        "step_mib": max(r["step_mib"] for r in results),
        "before_mib": max(r["before_mib"] for r in results),
        "loss": results[0]["loss"],
        "per_rank_mib": [round(r["step_mib"], 1) for r in results],
        "peak_reset": all(r["peak_reset"] for r in results),
    }


def _table(rows: dict[str, dict[str, Any]], args: argparse.Namespace, n_params: int) -> list[dict[str, Any]]:
    out = []
    for v, r in rows.items():
        where, peer = ROWS[v]
        if v in ("fsdp4_keep", "fsdp4_reshard") and args.fsdp_remat != "full":
            peer = "module"
        peer_mib = rows.get(peer, {}).get("step_mib") if peer else None
        ratio = r["step_mib"] / peer_mib if peer_mib else None
        out.append(
            {
                "variant": v,
                "where": where,
                "mib": round(r["step_mib"], 1),
                "peer": peer,
                "peer_mib": None if peer_mib is None else round(peer_mib, 1),
                "ratio": None if ratio is None else round(ratio, 3),
                "loss": r["loss"],
                "before_mib": round(r["before_mib"], 1),
                "per_rank_mib": r.get("per_rank_mib"),
                "peak_reset": r["peak_reset"],
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=0, help="key/value heads (default: heads / 2)")
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split over the ranks of the 4-process rows)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the one-process rows (ranks: 1 each)")
    ap.add_argument(
        "--fsdp-remat", default="full", help="Config.remat of fsdp4_keep / fsdp4_reshard (full / selective)"
    )
    ap.add_argument("--optim", action="store_true", help="include the AdamW update in the step")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS))
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows to PATH as JSON")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one variant may take")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one variant, print JSON
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _memory_peers
    if args.one:
        if ROWS[args.one][0] == "4 procs":
            print(json.dumps(_rank(args.one, args)))
        else:
            print(json.dumps(_one(args.one, args)))
        return 0
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in ROWS]
    if unknown:
        ap.error(f"unknown variants {unknown}; use some of {', '.join(VARIANTS)}")
    wanted += [p for v in wanted if (p := ROWS[v][1]) is not None]  # every row's peer
    if "fsdp4_keep" in wanted or "fsdp4_reshard" in wanted:
        wanted.append("module_ckpt" if args.fsdp_remat == "full" else "module")
    order = [v for v in VARIANTS if v in wanted]
    sizes = ("dim", "layers", "heads", "kv_heads", "ffn", "seq", "batch", "threads", "fsdp_remat")
    passthrough = [x for k in sizes for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    passthrough += ["--optim"] if args.optim else []
    cfg = _config(args, "funcshard")
    rows: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    for v in order:
        t0 = time.perf_counter()
        try:
            rows[v] = _launch(v, passthrough, args.timeout)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
            failed[v] = str(e)
            print(f"{v}: failed\n{e}", file=sys.stderr)
            continue
        print(f"  {v:<26} {rows[v]['step_mib']:8.1f} MiB  ({time.perf_counter() - t0:5.1f} s)", file=sys.stderr)
    table = _table(rows, args, cfg.num_params())
    what = "forward + backward + AdamW" if args.optim else "forward + backward"
    print(
        f"Llama dim={cfg.dim} layers={cfg.n_layers} heads={cfg.n_heads}/{cfg.n_kv_heads} ffn={cfg.ffn_dim} vocab 256 "
        f"({cfg.num_params():,} params), global batch {args.batch} x seq {args.seq}: peak RSS of one step "
        f"({what}), MiB over the RSS before it"
    )
    print("1 proc: one process; sim x4: sum over 4 simulated devices in one process; 4 procs: max over 4 gloo ranks")
    print(f"{'variant':<26} {'where':<8} {'MiB':>8}  {'peer':<20} {'peer MiB':>8} {'ratio':>7} {'loss':>8}")
    for r in table:
        peer_mib = "-" if r["peer_mib"] is None else f"{r['peer_mib']:.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        print(
            f"{r['variant']:<26} {r['where']:<8} {r['mib']:>8.1f}  {r['peer'] or '-':<20} {peer_mib:>8} {ratio:>7} "
            f"{r['loss']:>8.4f}"
        )
    if not all(r["peak_reset"] for r in table):
        print("note: /proc/self/clear_refs was not writable; the peaks are whole-process peaks (getrusage)")
    for v in failed:
        print(f"{v}: FAILED (see stderr)")
    if args.json:
        meta = {"sizes": {k: getattr(args, k) for k in sizes}, "optim": args.optim, "params": cfg.num_params()}
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": table, "failed": failed}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
