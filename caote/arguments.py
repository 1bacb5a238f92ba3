"""Command-line values shared by every subcommand: the one `UsageError`, the parser class, `add_subcommand`, the
number parsers, the checks of a ``--model`` and of a predictor file given for it (both before the model loads) and
the warning that torch's threads will share cores.

Lower layers raise a plain `ValueError`; a subcommand's command-line module turns the ones that come from a bad
argument into `UsageError`, which `caote.cli.main` reports in one line with exit code 2.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from pathlib import Path


class UsageError(ValueError):
    """A bad command-line value: reported in one line with exit code 2."""


class Parser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose errors are one line on stderr, ``PROG: error: MESSAGE``, exit code 2 (no
    usage lines before it: ``--help`` shows them), and which takes no abbreviated option (``--budge`` is not
    ``--budget``). Subcommand parsers inherit the class (``add_subparsers`` uses the parent's class), so one instance
    at the top covers every subcommand."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_subcommand(subparsers, name: str, run, help: str, description: str, arguments=None) -> argparse.ArgumentParser:
    """Register the subcommand ``name``: its one-line ``help`` in ``caote --help``, its ``description``, its options
    (``arguments(parser)``, which adds them in --help order) and ``run(args) -> int`` as its ``func``."""
    parser = subparsers.add_parser(name, help=help, description=description)
    if arguments is not None:
        arguments(parser)
    parser.set_defaults(func=run)
    return parser


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


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        return parse_int(text, minimum=0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None


def temperature(text: str) -> float:
    """argparse type: a finite number >= 0 (a sampling temperature; 0 means greedy decoding)."""
    value = _number(text)
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def probability(text: str) -> float:
    """argparse type: a number in (0, 1] (a nucleus sampling mass)."""
    value = _number(text)
    if value is None or not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def _number(text: str) -> float | None:
    """``text`` as a finite float, or None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


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


def check_model(name: str) -> None:
    """A `UsageError` for a ``--model`` that names no model (a missing directory, a file, a folder without
    config.json, a malformed hub id), before torch is imported; a hub id that cannot be fetched stays a runtime
    error (exit 1)."""
    from caote.models import BUNDLED, check_model_name  # torch-free at import

    if name in BUNDLED:
        return
    try:
        check_model_name(name)
    except ValueError as error:
        raise UsageError(str(error)) from None


def check_predictor_file(path: str | Path, model: str, option: str = "--predictor"):
    """The predictor file ``path`` given with ``option`` for the model named ``model``, read and checked before the
    model loads (`caote.predictor.Predictor.check_file` against `caote.models.model_identity`): a file that is not a
    predictor, was calibrated for another model (its fingerprint against a bundled model's), is not shaped as the
    model's config says or holds NaN or infinite weights is a `UsageError` naming ``option``. What only the loaded
    model tells (another local model of the same shapes) is checked once it loads (`Predictor.for_model`)."""
    # start-up: the predictor imports torch, the model's config transformers, which other arguments do not need
    from caote.models import model_identity
    from caote.predictor import Predictor

    try:
        Predictor.load(path)  # a file that is no predictor is refused before the model's config is read
        config, fingerprint = model_identity(model)
        return Predictor.check_file(path, model, config, fingerprint)
    except ValueError as error:
        raise UsageError(f"{option}: {error}") from None


def check_loaded_predictor(path: str | Path | None, model, option: str = "--predictor") -> None:
    """A `UsageError` naming ``option`` when the predictor at ``path`` (None: nothing to check) does not fit the
    loaded ``model`` (`caote.predictor.Predictor.for_model`): what `check_predictor_file` could not tell before it
    loaded (another local model of the same shapes)."""
    from caote.predictor import Predictor

    if path is None:
        return
    try:
        Predictor.for_model(model, path)
    except ValueError as error:
        raise UsageError(f"{option}: {error}") from None


def warn_if_threads_share_cores(threads: int | None) -> None:
    """Say in one line on stderr when torch's ``threads`` (None: torch's default) will share cores with other work:
    when the 1-minute load average already holds a whole core's worth of work beyond the CPUs they leave free (a
    fraction of one is the background of an idle machine). Threads that share cores can run many times slower (a
    report that takes 2 minutes took 33 on a busy machine); with one thread there is nothing to advise."""
    if threads is None:
        import torch  # start-up: only the long-running commands call this, after their argument checks

        threads = torch.get_num_threads()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this system
        return
    cpus = os.cpu_count() or 1
    if threads > 1 and load >= cpus - threads + 1:
        print(
            f"caote: load average {load:.1f} on {cpus} CPUs: torch's {threads} threads will share cores and can run "
            "many times slower; try --threads 1",
            file=sys.stderr,
            flush=True,
        )


@functools.cache
def warn_once_if_threads_share_cores() -> None:
    """`warn_if_threads_share_cores` for torch's thread count now, at most once per process (each part of a grid
    starts its rows)."""
    warn_if_threads_share_cores(None)
