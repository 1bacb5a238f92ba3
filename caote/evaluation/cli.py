"""``caote eval BENCHMARK``: run a task over policies x budgets, or the whole default grid (``report``).

Every task appends one JSON row per (example, policy, budget) to ``<out>/rows.<rank>.jsonl`` and skips rows already
there, so an interrupted run resumes where it stopped; ``accelerate launch -m caote.cli eval ...`` shards the
examples over processes. After the rows, a summary (Markdown + CSV, means with 95 % intervals) and plots are written
to ``<out>``. This module is the only place of `caote.evaluation` where a bad value becomes a usage error (exit 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from caote.arguments import Parser, UsageError, check_predictor_file
from caote.defaults import DEFAULT_PREFILL
from caote.evaluation.registry import BENCHMARKS, REPORT

DEFAULT_BUDGETS = "128,256,512"
DEFAULT_LENGTHS = "1024,2048"
# the wall time of `caote eval report --grid try` (the README's main job) from an empty output folder on two CPU
# cores, measured; the README and docs/evaluation.md quote it (tests/test_first_hour.py)
TRY_GRID_TIME = "1 min 44 s"


EVAL_DESCRIPTION = (
    "Run BENCHMARK for every policy x budget (plus the full cache as the reference) and summarise it with 95% "
    "confidence intervals. Rows go to OUT/rows.<rank>.jsonl; rerunning resumes. Shard over processes with "
    "'accelerate launch -m caote.cli eval ...'. 'caote eval report' runs a grid of tasks instead (--grid try: the "
    f"README's main job, {TRY_GRID_TIME}): see 'caote eval report --help'."
)
REPORT_DESCRIPTION = (
    "Run a grid of tasks (each at its own lengths and budgets) on the model, full cache first, with one overall "
    "progress bar; rows go to OUT/runs/<task>/ (rerunning resumes), tables, plots and results.md to OUT. At the end "
    "a compact table (NIAH hits, KL from the full cache, KV memory saved) and the path of a plot are printed. "
    "--docs DOCS regenerates the committed DOCS/results.md instead. The task options of 'caote eval BENCHMARK' "
    "(--budgets, --lengths, ...) do not apply."
)

# (flags, add_argument keywords, where): "both" = `caote eval BENCHMARK` and `caote eval report`, "task" = only a
# single benchmark, "report" = only the report; the eval parser accepts all of them (config_from_args rejects misuse)
OPTIONS: tuple[tuple[tuple[str, ...], dict, str], ...] = (
    (
        ("--model",),
        {
            "default": "smollm2-135m",
            "help": "'smollm2-135m' (bundled, offline), a local path or a hub id (default: %(default)s)",
        },
        "both",
    ),
    (
        ("--policies",),
        {
            "default": None,
            "help": "comma list of policies or a group ('paper', 'all') (default: paper; report: the grid's own)",
        },
        "both",
    ),
    (("--budgets",), {"default": DEFAULT_BUDGETS, "help": "comma list of KV budgets (default: %(default)s)"}, "task"),
    (
        ("--lengths",),
        {"default": DEFAULT_LENGTHS, "help": "comma list of context lengths in tokens (default: %(default)s)"},
        "task",
    ),
    (
        ("--samples",),
        {"default": None, "help": "examples per task and length (texts for perplexity/fidelity); default: per task"},
        "task",
    ),
    (("--seed",), {"default": "0", "help": "seed of example generation (default: %(default)s)"}, "both"),
    (
        ("--split",),
        {"default": "test", "help": "essay split for haystacks and texts: dev or test (default: %(default)s)"},
        "both",
    ),
    (
        ("--out",),
        {"type": Path, "default": None, "help": "output folder (default: results/<benchmark>, results/report-<grid>)"},
        "both",
    ),
    (
        ("--data-dir",),
        {"type": Path, "default": None, "help": "LongBench folder holding <task>.jsonl files (longbench only)"},
        "task",
    ),
    (
        ("--predictor",),
        {
            "type": Path,
            "default": None,
            "help": "perplexity / fidelity: the predictor file from 'caote calibrate' of the learned policies and "
            "auto (default: the one committed for the model)",
        },
        "task",
    ),
    (("--tasks",), {"default": None, "help": "comma list of tasks (ruler, longbench); default: all"}, "task"),
    (
        ("--depths",),
        {
            "default": None,
            "help": "niah, passkey: comma list of needle depths in %% (default: niah 10,50,90; passkey ten from 20 "
            "to 90)",
        },
        "task",
    ),
    (
        ("--protocols",),
        {
            "default": None,
            "help": "niah, passkey: comma list of question protocols: in-prompt (the question in the last prompt "
            "block, default), question-after (context compressed, then question and answer uncompressed, as kvpress), "
            "question-after-bounded (the question and answer evicted too)",
        },
        "task",
    ),
    (
        ("--prefill",),
        {
            "default": DEFAULT_PREFILL,
            "help": "examples tasks (niah, passkey, ruler, longbench): how a prompt is read: blocks (of 128, each "
            "evicted to the budget) or compress (whole with the full cache, then evicted to the budget once; rows go "
            "to results/<benchmark>-compress unless --out) (default: %(default)s)",
        },
        "task",
    ),
    (
        ("--grid",),
        {
            "default": None,
            "help": f"try (full cache vs 7 policies at b=128/256, NIAH + KL: {TRY_GRID_TIME} on 2 cores), quick "
            "(31 settings, 2 texts: ~25 min), standard (docs/results.md: 20 texts, 10 NIAH examples per cell and "
            "protocol, with the oracle: hours, resumable), long (4k-8k tokens, SmolLM2 and Gemma-3 270M, each part "
            "on its own model whatever --model says; docs/results/long.md: hours per part, resumable) or full "
            "(default: full)",
        },
        "report",
    ),
    (("--quick",), {"action": "store_true", "help": "the same as --grid quick"}, "report"),
    (
        ("--summarise-only",),
        {"action": "store_true", "help": "rewrite results.md from the rows already computed, running nothing"},
        "report",
    ),
    (
        ("--docs",),
        {
            "type": Path,
            "default": None,
            "help": "regenerate the committed documents: DOCS/results.md, plots under DOCS/results/, rows under "
            "DOCS/results/runs/<grid> (resumed: delete them to recompute); e.g. --grid standard --docs docs. Without "
            "it nothing outside --out is written",
        },
        "report",
    ),
    (
        ("--max-new-tokens",),
        {"default": None, "help": "cap on every example's answer length (default: each task's own)"},
        "task",
    ),
    (("--threads",), {"default": None, "help": "torch CPU threads per process (default: torch's choice)"}, "both"),
    (("--no-progress",), {"action": "store_true", "help": "hide the progress bars"}, "both"),
)


class _EvalHelp(argparse.Action):
    """``-h/--help`` of ``caote eval``: after ``report`` it prints the report's own help (`report_parser`)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, "benchmark", None) == REPORT:
            report_parser(parser.prog).print_help()
        else:
            parser.print_help()
        parser.exit()


def report_parser(prog: str = "caote eval") -> argparse.ArgumentParser:
    """The options of ``caote eval report`` alone, for its ``--help``."""
    parser = Parser(prog=f"{prog} {REPORT}", description=REPORT_DESCRIPTION)
    for flags, keywords, where in OPTIONS:
        if where != "task":
            parser.add_argument(*flags, **keywords)
    return parser


def add_parser(subparsers) -> None:
    """Register ``eval`` on the ``caote`` subcommand parser."""
    parser = subparsers.add_parser(
        "eval",
        help="measure what eviction costs: NIAH, RULER-style, LongBench, perplexity/KL, attention fidelity",
        description=EVAL_DESCRIPTION,
        add_help=False,
    )
    parser.add_argument("-h", "--help", action=_EvalHelp, help="show this help ('report --help': the report's own)")
    parser.add_argument("benchmark", metavar="BENCHMARK", help=f"one of: {', '.join(BENCHMARKS)}")
    for flags, keywords, where in OPTIONS:
        if where == "report":
            keywords = {**keywords, "help": f"report: {keywords['help']}"}
        parser.add_argument(*flags, **keywords)
    parser.set_defaults(func=run, extra="eval")  # the optional dependencies it needs: `pip install "caote[eval]"`


def run(args: argparse.Namespace) -> int:
    """Validate the arguments (a bad one is a `UsageError`, before any model loads), then run."""
    # start-up: the config imports torch, which `caote --help` does not need
    from caote.evaluation.config import config_from_args

    try:
        config = config_from_args(args)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if config.predictor is not None:  # readable, finite, of this feature set and model: known before it loads
        check_predictor_file(config.predictor, config.model)
    # start-up: the runners import transformers and the tasks' dependencies, which a refusal does not need
    from caote.evaluation import report

    if config.benchmark == REPORT:
        return report.run_report(config)
    return report.run_benchmark(config)
