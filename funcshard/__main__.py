"""``python -m funcshard <command>``: the command-line entry (``demo`` for now)."""

from __future__ import annotations

import sys

USAGE = """usage: python -m funcshard <command> [options]

commands:
  demo    train a DP x TP MLP with a functional step on a simulated mesh (or under torchrun)
"""


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a command; exit code 2 on bad usage."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from ._demo import main as demo_main

        return demo_main(rest)
    print(f"error: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
