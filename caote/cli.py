"""The ``caote`` command line: ``caote generate | policies | calibrate | validate | eval | bench``.

Run as ``caote ...`` or ``python -m caote ...``. Each subcommand module in `SUBCOMMANDS` exposes
``add_parser(subparsers)``, which registers its parser and sets ``func(args) -> int`` on it; this list is the only
wiring. Exit codes: 0 success, 2 usage error (`caote.arguments.UsageError`), 1 runtime error (a missing optional
dependency among them: one line naming the extra to install).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re
import sys

from caote import calibrate_command, commands, validate_command
from caote.arguments import Parser, UsageError
from caote.benchmark import cli as benchmark_cli
from caote.evaluation import cli as evaluation_cli

# the modules that register the subcommands, in --help order
SUBCOMMANDS = (commands, calibrate_command, validate_command, evaluation_cli, benchmark_cli)

__all__ = ["SUBCOMMANDS", "UsageError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="caote",
        description="Bounded KV-cache memory for Hugging Face causal LMs with value-aware token eviction (CAOTE).",
    )
    parser.add_argument("--version", action="version", version=f"caote {importlib.metadata.version('caote')}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def optional_modules() -> dict[str, str]:
    """Each module of an optional dependency -> the extra that installs it (pyproject.toml's, from caote's installed
    metadata)."""
    modules: dict[str, str] = {}
    for requirement in importlib.metadata.requires("caote") or []:
        name = re.match(r"[A-Za-z0-9._-]+", requirement).group()
        extra = re.search(r'extra == "([^"]+)"', requirement)
        if extra and name != "caote":
            modules.setdefault(name.lower().replace("-", "_"), extra.group(1))
    return modules


def missing_dependency(error: ImportError, extra: str | None) -> str | None:
    """The one line for an ``error`` caused by an optional dependency that is not installed (named by the error or
    in its message), with the extra to install: ``extra`` (the command's own) or the dependency's; else None."""
    message = str(error)
    for module, module_extra in optional_modules().items():
        named = (error.name or "").partition(".")[0] == module or re.search(rf"\b{module}\b", message)
        if named and importlib.util.find_spec(module) is None:
            return f'{module} is not installed: pip install "caote[{extra or module_extra}]"'
    return None


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
    except ImportError as error:
        message = missing_dependency(error, getattr(args, "extra", None))
        if message is None:
            raise
        print(f"caote {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"caote {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
