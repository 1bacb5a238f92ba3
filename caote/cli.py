"""The ``caote`` command line: ``caote generate | policies | eval | bench``.

Run as ``caote ...`` or ``python -m caote ...``. Each subcommand module in `SUBCOMMANDS` exposes
``add_parser(subparsers)``, which registers its parser and sets ``func(args) -> int`` on it; this list is the only
wiring. Exit codes: 0 success, 2 usage error (`caote.arguments.UsageError`), 1 runtime error.
"""

from __future__ import annotations

import argparse
import sys

from caote import commands
from caote.arguments import Parser, UsageError
from caote.benchmark import cli as benchmark_cli
from caote.evaluation import cli as evaluation_cli

# the modules that register the subcommands, in --help order
SUBCOMMANDS = (commands, evaluation_cli, benchmark_cli)

__all__ = ["SUBCOMMANDS", "UsageError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="caote",
        description="Bounded KV-cache memory for Hugging Face causal LMs with value-aware token eviction (CAOTE).",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named after the subcommand they were given to (parse_args would say plain "caote")
        parser.exit(2, f"caote {args.command}: error: unrecognized arguments: {' '.join(unknown)}\n")
    try:
        return int(args.func(args) or 0)
    except UsageError as error:
        parser.exit(2, f"caote {args.command}: error: {error}\n")
    except (ValueError, RuntimeError, OSError) as error:
        message = " ".join(str(error).split())  # one line, also for a library's multi-line message
        print(f"caote {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"caote {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
