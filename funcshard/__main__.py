"""``python -m funcshard <command>`` (or ``funcshard <command>``): the command-line entry."""

from __future__ import annotations

import sys

USAGE = """usage: python -m funcshard <command> [options]

commands:
  train     train a byte-level Llama (or --model mixtral) on real text over a dp / fsdp / tp / cp / pp / ep mesh
            (simulated, or under torchrun)
  generate  sample text from the latest checkpoint of a train run
  demo      train a DP x TP MLP with a functional step on a simulated mesh (or under torchrun)
  plan      does the train step fit, what does it send, how fast: on an abstract mesh of any size, no hardware

'python -m funcshard <command> --help' lists a command's options (with their defaults) and the environment
settings: FUNCSHARD_TIMEOUT (seconds a collective waits for its peers, default 300) and torchrun's RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE.
"""


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a command; exit code 2 on bad usage.

    Args:
        argv: the command and its options (default ``sys.argv[1:]``).

    Returns:
        The command's exit code; 2 on an unknown or missing command.

    Example:
        >>> main(["nope"])  # unknown command: one error line on stderr
        2
    """
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    try:
        return _dispatch(argv[0], argv[1:])
    except KeyboardInterrupt:  # Ctrl-C while the command's modules load (the jobs handle their own)
        print("funcshard: stopped (Ctrl-C).", file=sys.stderr)
        return 130


def _dispatch(cmd: str, rest: list[str]) -> int:
    if cmd == "train":
        from .job.train import main as train_main

        return train_main(rest)
    if cmd == "generate":
        from .job.generate import main as generate_main

        return generate_main(rest)
    if cmd == "demo":
        from .job.demo import main as demo_main

        return demo_main(rest)
    if cmd == "plan":
        from .job.plan.command import main as plan_main

        return plan_main(rest)
    print(
        f"error: unknown command {cmd!r}; choose train, generate, demo or plan (python -m funcshard --help)",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
