"""``caote eval BENCHMARK``: run a task over policies x budgets, or the whole default grid (``report``).

Every task appends one JSON row per (example, policy, budget) to ``<out>/rows.<rank>.jsonl`` and skips rows already
there, so an interrupted run resumes where it stopped; ``accelerate launch -m caote.cli eval ...`` shards the
examples over processes. After the rows, a summary (Markdown + CSV, means with 95 % intervals) and plots are written
to ``<out>``. This module is the only place of `caote.evaluation` where a bad value becomes a usage error (exit 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from caote.arguments import UsageError
from caote.evaluation.registry import BENCHMARKS, REPORT

DEFAULT_POLICIES = "paper"
DEFAULT_BUDGETS = "128,256,512"
DEFAULT_LENGTHS = "1024,2048"


def add_parser(subparsers) -> None:
    """Register ``eval`` on the ``caote`` subcommand parser."""
    parser = subparsers.add_parser(
        "eval",
        help="measure what eviction costs: NIAH, RULER-style, LongBench, perplexity/KL, attention fidelity",
        description=(
            "Run BENCHMARK for every policy x budget (plus the full cache as the reference) and summarise it with "
            "95%% confidence intervals. 'report' runs the default grid on the bundled model and writes "
            "docs/results.md. Rows go to OUT/rows.<rank>.jsonl; rerunning resumes. Shard over processes with "
            "'accelerate launch -m caote.cli eval ...'."
        ),
    )
    parser.add_argument("benchmark", metavar="BENCHMARK", help=f"one of: {', '.join(BENCHMARKS)}")
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="'smollm2-135m' (bundled, offline), a local path or a hub id (default: %(default)s)",
    )
    parser.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help="comma list of policies or a group ('paper', 'all') (default: %(default)s)",
    )
    parser.add_argument("--budgets", default=DEFAULT_BUDGETS, help="comma list of KV budgets (default: %(default)s)")
    parser.add_argument(
        "--lengths", default=DEFAULT_LENGTHS, help="comma list of context lengths in tokens (default: %(default)s)"
    )
    parser.add_argument(
        "--samples",
        default=None,
        help="examples per task and length (texts for perplexity/fidelity); default per benchmark",
    )
    parser.add_argument("--seed", default="0", help="seed of example generation (default: %(default)s)")
    parser.add_argument(
        "--split", default="test", help="essay split for haystacks and texts: dev or test (default: %(default)s)"
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: results/<benchmark>)")
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="LongBench folder holding <task>.jsonl files (longbench only)"
    )
    parser.add_argument("--tasks", default=None, help="comma list of tasks (ruler, longbench); default: all")
    parser.add_argument("--depths", default=None, help="niah: comma list of needle depths in %% (default: 10,50,90)")
    parser.add_argument("--quick", action="store_true", help="report: the small grid that runs in ~15 min on 2 cores")
    parser.add_argument(
        "--summarise-only",
        action="store_true",
        help="report: rewrite results.md from the rows already computed, running nothing",
    )
    parser.add_argument(
        "--docs",
        type=Path,
        default=Path("docs"),
        help="report: folder for results.md and results/ (default: %(default)s)",
    )
    parser.add_argument(
        "--max-new-tokens", default=None, help="cap on every example's answer length (default: each task's own)"
    )
    parser.add_argument("--threads", default=None, help="torch CPU threads per process (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Validate the arguments (a bad one is a `UsageError`, before any model loads), then run."""
    # start-up: the runners import torch and transformers, which `caote --help` does not need
    from caote.evaluation import report
    from caote.evaluation.config import config_from_args

    try:
        config = config_from_args(args)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if config.benchmark == REPORT:
        return report.run_report(config)
    return report.run_benchmark(config)
