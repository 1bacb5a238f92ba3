"""The ``caote`` command line: ``caote generate | policies | eval | bench``.

Run as ``caote ...`` or ``python -m caote ...``. Each subcommand lives in its own module and exposes
``add_parser(subparsers)``, which registers the parser and sets ``func(args) -> int`` on it.
Exit codes: 0 success, 2 usage error, 1 runtime error.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# module that defines each subcommand's `add_parser`, in --help order
SUBCOMMANDS = ("caote.commands", "caote.evaluation.cli", "caote.benchmark")


class UsageError(ValueError):
    """A bad command-line value: reported in one line with exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="caote",
        description="Bounded KV-cache memory for Hugging Face causal LMs with value-aware token eviction (CAOTE).",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as error:
        parser.exit(2, f"caote {args.command}: error: {error}\n")
    except (ValueError, RuntimeError, OSError) as error:
        print(f"caote {args.command}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"caote {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Import main from the package module, not this __main__ copy, so UsageError raised by the subcommands is the
    # class main() catches (exit code 2).
    from caote.cli import main as package_main

    sys.exit(package_main())
