"""Command-line plumbing shared by the jobs: ``--mesh`` parsing, one-line errors, exit codes.

Every job turns bad input into ONE line ``error: ...`` on stderr and exit code 2 (no traceback): argparse's
own complaints, :class:`UsageError` (raised by the jobs for input they cannot use), every ``FuncshardError`` of
the library (``MeshError``, ``ShardingError``, ``ConfigError``, ``CheckpointError``, ...), whose messages already
say what to change, and an ``OSError`` (a file that could not be read or written: its reason and path). Ctrl-C
ends a job with one line and exit code 130. ``--help`` shows every option with its default, and the environment
settings.

Example:
    >>> parse_mesh("dp=2,tp=4")
    {'dp': 2, 'tp': 4}
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from funcshard import FuncshardError, MeshError
from funcshard.process import PeerError, abandoned_threads, shutdown

__all__ = [
    "ENVIRONMENT",
    "ArgumentParser",
    "HelpFormatter",
    "Interrupted",
    "StopOnCtrlC",
    "UsageError",
    "demo_parser",
    "finite_positive",
    "generate_parser",
    "parse_mesh",
    "plan_parser",
    "run",
    "train_parser",
]


class UsageError(ValueError):
    """Input a job cannot use (a path with no text, a missing checkpoint, a bad flag value)."""


class Interrupted(Exception):
    """A job stopped by Ctrl-C; the message says where it stopped and what is intact (exit code 130)."""


class StopOnCtrlC:
    """While active (a ``with`` block in the main thread): the first Ctrl-C only sets :attr:`requested`, so a
    job can stop at the end of its running step, with every simulated device and every torchrun process at
    the same point; another Ctrl-C, a second or more later, raises ``KeyboardInterrupt`` at once. (torchrun
    passes its own SIGINT on to the workers right after the terminal's: that one counts as the same Ctrl-C.)

    Example:
        >>> with StopOnCtrlC() as stop:
        ...     stop.requested
        False
    """

    REPEAT_S = 1.0

    def __init__(self) -> None:
        self.at: float | None = None
        self._previous: Any = None
        self._installed = False

    @property
    def requested(self) -> bool:
        """True once Ctrl-C was pressed."""
        return self.at is not None

    def _handle(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if self.at is None:
            self.at = now
        elif now - self.at > self.REPEAT_S:
            raise KeyboardInterrupt

    def __enter__(self) -> StopOnCtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.default_int_handler)
            self._installed = False


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=2,tp=2"`` -> ``{"dp": 2, "tp": 2}``.

    Raises:
        MeshError: text that is not ``name=size`` pairs separated by commas.

    Example:
        >>> parse_mesh("dp=2,tp=4")
        {'dp': 2, 'tp': 4}
    """
    out: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        if not eq or not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise MeshError(f"--mesh {text!r}: write axis=size pairs separated by commas, e.g. --mesh dp=2,tp=2.")
        if name.strip() in out:
            raise MeshError(f"--mesh {text!r}: axis '{name.strip()}' appears twice.")
        out[name.strip()] = int(size)
    return out


class _ArgError(Exception):
    pass


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` whose errors become one ``error: ...`` line (see :func:`run`)."""

    def error(self, message: str) -> NoReturn:
        raise _ArgError(f"{self.prog}: {message} (see {self.prog} --help)")


def _int_at_least(low: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, found {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, found {value}")
        return value

    return parse


positive_int = _int_at_least(1, "a positive integer")
positive_int.__doc__ = "An argparse type: an int >= 1."
nonneg_int = _int_at_least(0, "an integer >= 0")
nonneg_int.__doc__ = "An argparse type: an int >= 0."


ENVIRONMENT = """environment:
  FUNCSHARD_TIMEOUT  seconds a collective waits for its peers before it fails
                     with an error naming the axis and the rank it waited for
                     (default 300; sim and torchrun alike)
  FUNCSHARD_AUDIT    1: check --no-check-vma steps under torchrun as sim does
                     (raise where the untracked gradient would be wrong)
  FUNCSHARD_OVERLAP  0: under torchrun, issue gradient reductions and FSDP
                     gathers synchronously (default 1: overlapped with compute)
  FUNCSHARD_BUCKET_MB
                     the largest gradient bucket of fs.pvary in MiB (default 25,
                     DDP's bucket_cap_mb; 0: one bucket per pvary call)
  FUNCSHARD_ONE_SHOT_BYTES
                     under torchrun on CPU, an all-reduce whose gathered copies
                     take at most this many bytes gathers them and sums here
                     (default 262144; 0: always gloo's all-reduce)
  TRITON_INTERPRET   Triton's own: 1 runs funcshard.ops.triton's kernels on CPU
                     with Triton's interpreter (set it before triton is
                     imported); unset, they run on CUDA only
  RANK, WORLD_SIZE   set by torchrun: with both set, the mesh runs one device
                     per process ("dist"); without, every device is simulated
                     in this process ("sim")
  LOCAL_RANK         set by torchrun: the GPU of this process (NCCL)
  LOCAL_WORLD_SIZE   set by torchrun: processes on this machine, which share
                     its cores (see --threads)
  TORCHELASTIC_RESTART_COUNT
                     set by torchrun: a worker it restarted (--max-restarts)
                     starts its process group under a fresh store prefix
  FUNCSHARD_TEST_KILL_AFTER_CKPT
                     a test hook, RANK:STEP: that rank kills itself once the
                     checkpoint of STEP is complete (first generation only)
  MASTER_ADDR, MASTER_PORT are torch.distributed's own (set by torchrun).

exit codes: 0 done; 2 bad input or a failure, with one 'error: ...' line;
130 stopped by Ctrl-C, with one line naming the checkpoint that is intact."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` with each option's default after its line (an option whose default is None explains it in its
    own words; an on/off flag has none), and the description and epilog as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        flag = action.nargs == 0  # --resume, --no-check-vma: on or off, said by the flag itself
        if "%(default)" in text or action.default in (None, argparse.SUPPRESS) or flag or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _parser(prog: str, description: str) -> ArgumentParser:
    return ArgumentParser(prog=prog, description=description, epilog=ENVIRONMENT, formatter_class=HelpFormatter)


def train_parser() -> ArgumentParser:
    """The options of ``python -m funcshard train``; the defaults train a ~3M-parameter byte-level Llama.

    Example:
        >>> train_parser().parse_args(["--mesh", "tp=4"]).mesh
        'tp=4'
    """
    ap = _parser(
        "funcshard train",
        "Train a byte-level Llama on a real text corpus (by default the Python standard\n"
        "library's own .py files) over a mesh of dp / fsdp / tp / cp axes: simulated in this\n"
        "process, or one device per process under torchrun. Ctrl-C stops at the end of the\n"
        "running step (a second Ctrl-C, at once); --resume continues from the last checkpoint.",
    )
    _add_mesh_options(ap)
    _add_model_options(ap)
    _add_moe_options(ap)
    _add_training_options(ap)
    _add_data_options(ap)
    _add_output_options(ap)
    return ap


def _add_moe_options(ap: ArgumentParser) -> None:
    """The model family and its mixture of experts: ``--model``, ``--experts``, ``--top-k``."""
    g = ap.add_argument_group("mixture of experts")
    g.add_argument(
        "--model",
        choices=("llama", "mixtral"),
        default="llama",
        help="llama (dense) or mixtral (each layer's MLP a sparse mixture of --experts SwiGLU experts of hidden size "
        "--ffn, --top-k of them per token; an ep mesh axis splits the experts, and the batch as a data axis)",
    )
    g.add_argument("--experts", type=positive_int, default=8, help="experts per layer (--model mixtral)")
    g.add_argument("--top-k", type=positive_int, default=2, help="experts each token is routed to (--model mixtral)")
    g.add_argument(
        "--aux-loss-coef",
        type=float,
        default=0.02,
        help="weight of the load-balancing loss added to the loss (--model mixtral)",
    )


def _add_mesh_options(ap: ArgumentParser) -> None:
    """The mesh options: its axes, sequence parallelism, the pipeline schedule, vma tracking, threads."""
    g = ap.add_argument_group("mesh")
    g.add_argument("--mesh", default="dp=2,tp=2", help="axis=size pairs over dp, fsdp, tp, cp, pp (and ep)")
    g.add_argument("--sp", action="store_true", help="sequence parallelism over tp (activations split by sequence)")
    g.add_argument(
        "--schedule",
        default="1f1b",
        help="pipeline schedule on a pp axis: gpipe, 1f1b, interleaved, zb, zbv, dualpipev, interleaved_zb, looped_bfs",
    )
    g.add_argument(
        "--microbatches", type=positive_int, default=None, help="microbatches per step on a pp axis (default: 2 x pp)"
    )
    g.add_argument("--no-check-vma", dest="check_vma", action="store_false", help="turn varying-axes tracking off")
    g.add_argument("--threads", type=nonneg_int, default=0, help="torch threads per process (0: cores / processes)")


def _add_model_options(ap: ArgumentParser) -> None:
    """The model options: its shape, remat, the compute and gradient-reduction dtypes, ``--init-from``."""
    g = ap.add_argument_group("model")
    g.add_argument("--dim", type=positive_int, default=256, help="model width")
    g.add_argument("--layers", type=positive_int, default=4, help="transformer blocks")
    g.add_argument("--heads", type=positive_int, default=8, help="attention (query) heads")
    g.add_argument("--kv-heads", type=positive_int, default=4, help="key / value heads (grouped-query attention)")
    g.add_argument("--ffn", type=positive_int, default=704, help="SwiGLU hidden size")
    g.add_argument("--seq", type=positive_int, default=128, help="tokens (bytes) per sequence: the model's context")
    g.add_argument(
        "--remat",
        choices=("none", "full", "selective"),
        default="none",
        help="recompute each layer's activations in the backward (fs.remat): full keeps only the layer's input, "
        "selective also its matmul and attention outputs; the same numbers, less memory",
    )
    g.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="compute dtype (fs.Precision): the weights are cast to it for the forward and backward and FSDP "
        "gathers them in it; master weights, optimiser moments, loss and softmax statistics stay float32",
    )
    g.add_argument(
        "--reduce-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="dtype the gradients are summed in over the data axes (dp, fsdp, cp); bf16 halves those bytes",
    )
    g.add_argument(
        "--init-from",
        default=None,
        metavar="PATH",
        help="fine-tune a Hugging Face Llama folder (config.json + safetensors): the model's shape and weights come "
        "from it, and its tokenizer.json when it has one (pip install tokenizers); without one, byte tokens "
        "(default: a random init of the shape above)",
    )


def _add_training_options(ap: ArgumentParser) -> None:
    """The training options: steps, batch, accumulation, the learning-rate schedule, decay, clipping, seed."""
    g = ap.add_argument_group("training")
    g.add_argument("--steps", type=positive_int, default=200, help="total optimiser steps (the schedule's length)")
    g.add_argument("--batch", type=positive_int, default=16, help="global batch, in sequences")
    g.add_argument(
        "--grad-accum",
        type=positive_int,
        default=1,
        help="split each step's batch into K microbatches whose gradients are averaged before the update "
        "(optim.multi_steps): the same step as the whole batch at once, at 1/K of its activation memory",
    )
    g.add_argument(
        "--lr",
        type=float,
        default=1e-3,
        help="peak learning rate (1e-3 ends 4%% lower in validation loss than 3e-3 over the default 200 steps)",
    )
    g.add_argument("--final-lr", type=float, default=None, help="learning rate at the last step (default: lr / 10)")
    g.add_argument("--warmup", type=nonneg_int, default=None, help="warmup steps (default: min(20, steps / 10))")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    g.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm")
    g.add_argument("--seed", type=nonneg_int, default=0, help="seeds the init and the batches")
    g.add_argument(
        "--stop-after",
        type=positive_int,
        default=None,
        help="stop (with a checkpoint) after N steps (default: run to --steps)",
    )


def _add_data_options(ap: ArgumentParser) -> None:
    """The data options: the corpus, how much of it is read, and the validation loss's cadence."""
    g = ap.add_argument_group("data")
    g.add_argument(
        "--data", default=None, help="a UTF-8 text file or a folder of them (default: the Python standard library)"
    )
    g.add_argument("--max-bytes", type=positive_int, default=8_000_000, help="read at most this much text")
    g.add_argument("--eval-every", type=positive_int, default=25, help="validation loss every N steps")
    g.add_argument("--eval-batches", type=positive_int, default=4, help="fixed held-out batches per evaluation")


def _add_output_options(ap: ArgumentParser) -> None:
    """The output options: checkpoints (where, how often, resume or overwrite), metrics, the MFU's peak."""
    g = ap.add_argument_group("output")
    g.add_argument("--ckpt-dir", default="runs/llama/ckpt", help="checkpoints (one subfolder per step, last 2 kept)")
    g.add_argument("--ckpt-every", type=positive_int, default=100, help="save a checkpoint every N steps")
    g.add_argument(
        "--async-ckpt",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write checkpoints in the background while training goes on (one in flight; the next save and the "
        "end of the run wait for it); default: on under torchrun, off on a simulated mesh",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --ckpt-dir; with none there yet, start afresh (so one command "
        "serves every try of torchrun --max-restarts N)",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh even though --ckpt-dir holds an earlier run's checkpoints, deleting them (without it, "
        "train refuses to start there)",
    )
    g.add_argument("--out", default="runs/llama", help="where the loss curve (PNG) and metrics (CSV) go")
    g.add_argument(
        "--peak-tflops",
        type=float,
        default=0.5,
        help="assumed peak TFLOP/s of all the hardware running the mesh, for the MFU estimate (0.5: a few CPU cores)",
    )


def plan_parser() -> ArgumentParser:
    """The options of ``python -m funcshard plan``: the train job's flags, and the model preset, the hardware and
    the search.

    Example:
        >>> args = plan_parser().parse_args(["--preset", "llama3-70b", "--mesh", "pp=2,fsdp=4,tp=4"])
        >>> args.hardware, args.remat, args.dtype  # resolved by the hardware: bf16 + selective on a GPU
        ('h100', None, None)
    """
    ap = _parser(
        "funcshard plan",
        "Plan the train job's step without the hardware: lower it on an abstract mesh of any size (nothing is\n"
        "allocated) and print, per device, whether it fits, its memory by part, its communication by axis, and\n"
        "an estimated step time, tokens/s and MFU from a hardware table. On GPU hardware the defaults are\n"
        "--dtype bf16 (fp32 master weights and moments) and --remat selective, as torchtitan trains.",
    )
    g = ap.add_argument_group("plan")
    g.add_argument(
        "--preset", default=None, help="a published model shape (llama3-8b, llama3-70b, ..., mixtral-8x7b, ...)"
    )
    g.add_argument("--hardware", default="h100", help="h100, h200, a100 or cpu (docs/guides/planning.md)")
    g.add_argument("--search", action="store_true", help="rank the layouts of --gpus devices that fit")
    g.add_argument("--gpus", type=positive_int, default=None, help="devices to search layouts for (with --search)")
    g.add_argument("--top", type=positive_int, default=10, help="layouts --search lists")
    g.add_argument("--json", action="store_true", help="print the estimate (or the ranking) as JSON")
    _add_mesh_options(ap)
    _add_model_options(ap)
    _add_moe_options(ap)
    _add_training_options(ap)
    ap.set_defaults(remat=None, dtype=None, mesh="fsdp=8", seq=8192, batch=None)
    return ap


def generate_parser() -> ArgumentParser:
    """The options of ``python -m funcshard generate``.

    Example:
        >>> generate_parser().parse_args([]).tokens
        200
    """
    ap = _parser(
        "funcshard generate", "Sample text from the latest checkpoint of a train run, or a Hugging Face Llama folder."
    )
    ap.add_argument("--ckpt-dir", default="runs/llama/ckpt", help="the --ckpt-dir of a train run")
    ap.add_argument("--init-from", default=None, help="a Hugging Face Llama folder instead (its tokenizer, if any)")
    ap.add_argument("--prompt", default="def ", help="text to continue")
    ap.add_argument("--tokens", type=positive_int, default=200, help="tokens to generate")
    ap.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 for greedy")
    ap.add_argument("--top-k", type=positive_int, default=None, help="sample from the k most likely tokens")
    ap.add_argument("--top-p", type=float, default=None, help="sample from the most likely tokens of this mass")
    ap.add_argument("--seed", type=nonneg_int, default=0, help="seeds the sampling")
    ap.add_argument("--mesh", default=None, help="axis=size pairs over dp, fsdp, tp (default: tp over the processes)")
    return ap


def demo_parser() -> ArgumentParser:
    """The options of ``python -m funcshard demo``.

    Example:
        >>> demo_parser().parse_args([]).steps
        30
    """
    ap = _parser("funcshard demo", "Train a DP x TP MLP with a functional step, checked against the unsharded model.")
    ap.add_argument("--mesh", default="dp=2,tp=2", help="axis=size pairs over dp, fsdp, tp")
    ap.add_argument("--steps", type=positive_int, default=30, help="SGD steps")
    ap.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    return ap


def finite_positive(name: str, value: float, *, zero: bool = False) -> None:
    """Check a float option: finite and > 0 (>= 0 with ``zero``).

    Raises:
        UsageError: naming the flag and the value found.

    Example:
        >>> finite_positive("--lr", float("inf"))
        Traceback (most recent call last):
        ...
        funcshard.job.cli.UsageError: --lr must be a finite number > 0, found inf.
    """
    ok = math.isfinite(value) and (value >= 0 if zero else value > 0)
    if not ok:
        raise UsageError(f"{name} must be a finite number {'>= 0' if zero else '> 0'}, found {value}.")


def run(parser: ArgumentParser, job: Callable[[argparse.Namespace], object], argv: list[str] | None) -> int:
    """Parse ``argv`` and run ``job``: exit code 0; 2 with one ``error: ...`` line on bad input or a failure
    the user can act on; 130 with one line after Ctrl-C.

    Under torchrun every rank fails alike on bad input, so rank 0 alone prints; a peer that stopped answering
    (:class:`~funcshard.process.PeerError`) is seen differently by each rank, so each prints its own.

    Example:
        >>> run(demo_parser(), lambda args: None, ["--steps", "0"])  # one error line on stderr
        2
    """
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except _ArgError as e:
        return _fail(str(e))
    try:
        result = job(args)
    except Interrupted as e:
        code = _say_once(str(e), 130)
    except KeyboardInterrupt:
        code = _say_once(f"{parser.prog}: stopped (Ctrl-C).", 130)
    except PeerError as e:
        code = _fail(str(e), every_rank=True)
    except (UsageError, FuncshardError) as e:  # MeshError, ShardingError, ConfigError, CheckpointError, ...
        code = _fail(str(e))
    except OSError as e:  # a file the job could not read or write (disk full, permissions, ...)
        code = _fail(_os_message(e))
    else:
        code = result if isinstance(result, int) else 0  # (a job may return its own exit code)
    finally:
        if "RANK" in os.environ:  # under torchrun: leave the process group cleanly
            shutdown()

    if code and abandoned_threads():  # a simulated device still runs torch code: leave without the teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _os_message(e: OSError) -> str:
    """``No space left on device: 'runs/llama/metrics.csv'`` (errno text and path) from an ``OSError``."""
    what = e.strerror or str(e)
    if e.filename is not None:
        return f"{what}: '{os.fsdecode(e.filename)}'."
    return f"{what}."


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _say_once(message: str, code: int) -> int:
    if _rank() == 0:
        print(" ".join(message.split()), file=sys.stderr, flush=True)
    return code


def _fail(message: str, *, every_rank: bool = False) -> int:
    line = " ".join(message.split())  # one line, whatever the message holds
    if every_rank and "RANK" in os.environ:
        print(f"error: [rank {_rank()}] {line}", file=sys.stderr, flush=True)
    elif _rank() == 0:  # under torchrun every rank fails alike: say it once
        print(f"error: {line}", file=sys.stderr, flush=True)
    return 2
