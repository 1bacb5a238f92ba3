"""Command-line values shared by every subcommand: the one `UsageError` and the integer parsers.

Lower layers raise a plain `ValueError`; a subcommand's command-line module turns the ones that come from a bad
argument into `UsageError`, which `caote.cli.main` reports in one line with exit code 2.
"""

from __future__ import annotations

import argparse


class UsageError(ValueError):
    """A bad command-line value: reported in one line with exit code 2."""


class Parser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose errors are one line on stderr, ``PROG: error: MESSAGE``, exit code 2 (no
    usage lines before it: ``--help`` shows them). Subcommand parsers inherit the class (``add_subparsers`` uses the
    parent's class), so one instance at the top covers every subcommand."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_int(text: str, minimum: int | None = None) -> int:
    """``"128"`` -> ``128``; a one-line `ValueError` for anything that is not an integer or lies below ``minimum``."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ValueError(f"{str(text).strip()!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{value} is below the minimum {minimum}")
    return value


def parse_int_list(text: str, minimum: int | None = None, unique: bool = False) -> list[int]:
    """``"128,256"`` -> ``[128, 256]`` (empty items skipped; with ``unique`` repeats dropped, first kept); a one-line
    `ValueError` naming the bad item, or when no value is given."""
    values = [parse_int(item, minimum) for item in str(text).split(",") if item.strip()]
    if unique:
        values = list(dict.fromkeys(values))
    if not values:
        raise ValueError(f"no value given in {text!r}")
    return values


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        return parse_int(text, minimum=1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None


def int_tuple(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated integers (repeats kept: ``--repeats 2,2,1`` means one value per context)."""
    try:
        return tuple(parse_int_list(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {error}") from None


def memory_limits(text: str) -> dict:
    """argparse type: ``"cpu=200MiB,0=6GiB"`` -> ``{"cpu": "200MiB", 0: "6GiB"}`` (accelerate's ``max_memory``;
    a number names a GPU)."""
    limits: dict = {}
    for item in (part.strip() for part in str(text).split(",") if part.strip()):
        device, sep, size = item.partition("=")
        device, size = device.strip(), size.strip()
        if not sep or not device or not size or not size[0].isdigit():
            raise argparse.ArgumentTypeError(f"expected DEVICE=SIZE items such as 'cpu=200MiB', got {item!r}")
        limits[int(device) if device.isdigit() else device] = size
    if not limits:
        raise argparse.ArgumentTypeError(f"no DEVICE=SIZE item in {text!r}")
    return limits
