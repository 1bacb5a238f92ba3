"""`EvalConfig`: everything one ``caote eval`` run needs, validated from the command line by `config_from_args`.

Every check raises a one-line `ValueError` naming the option; ``caote eval`` reports it as a usage error (exit
code 2) before any model loads.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from caote.arguments import parse_int, parse_int_list
from caote.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_PREFILL, PREFILL_MODES
from caote.evaluation.examples import PROTOCOLS
from caote.evaluation.registry import BENCHMARKS, REPORT, TASKS
from caote.policies import expand_policies, hindsight_policies
from caote.settings import CacheSettings

SPLITS = ("dev", "test")
DEFAULT_POLICIES = "paper"  # when --policies is not given (report: the grid's own, if it has some)
GRID_NAMES = ("try", "quick", "standard", "long", "full")  # `caote.evaluation.grids.GRIDS`


@dataclass
class EvalConfig:
    """One benchmark over ``policies`` x ``budgets``; ``samples``, ``tasks`` and ``depths`` None mean each task's
    own default. The command line's defaults live in `caote.evaluation.cli`."""

    benchmark: str
    model: str
    policies: list[str]
    budgets: list[int]
    lengths: list[int]
    samples: int | None = None
    seed: int = 0
    split: str = "test"
    out: Path = Path("results")
    data_dir: Path | None = None
    tasks: list[str] | None = None
    depths: list[float] | None = None
    protocols: list[str] | None = None  # niah: `caote.evaluation.examples.PROTOCOLS` (None: in-prompt)
    quick: bool = False
    docs: Path | None = None  # report: write <docs>/results.md and rows under <docs>/results/runs (None: only out)
    grid: str = "full"  # report: the grid (`caote.evaluation.grids.GRIDS`)
    progress: bool = True
    block_size: int = DEFAULT_BLOCK_SIZE
    prefill: str = DEFAULT_PREFILL  # examples tasks: `caote.settings.CacheSettings.prefill`
    max_new_tokens: int | None = None
    threads: int | None = None
    summarise_only: bool = False
    predictor: Path | None = None  # texts tasks: the learned policies' predictor file (None: the model's committed one)
    scored_tail: int | None = None  # texts tasks: score only the last tokens' predictions (`lockstep.scored_blocks`)
    fidelity: bool = True  # texts tasks: measure the attention-output error (the long grid turns it off)


def _int_list(option: str, text: str, minimum: int = 1) -> list[int]:
    try:
        return parse_int_list(text, minimum, unique=True)
    except ValueError as error:
        raise ValueError(f"{option}: {error}") from None


def check_budgets(
    policies: list[str], budgets: list[int], block_size: int = DEFAULT_BLOCK_SIZE, prefill: str = DEFAULT_PREFILL
) -> None:
    """Every evicting policy (auto: its training-free choice) must leave room to choose at every budget (the cache's own
    rule, with its defaults; the full cache passes it at any budget)."""
    for name in policies:
        for budget in budgets:
            try:
                CacheSettings(budget=budget, policy=name, block_size=block_size, prefill=prefill)
            except ValueError as error:
                raise ValueError(f"--budgets: {budget} is too small for {name} ({error})") from None


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """Validate the ``caote eval`` arguments into an `EvalConfig` (a one-line `ValueError` on anything wrong)."""
    benchmark = _benchmark(args.benchmark)
    task = TASKS.get(benchmark)
    policies = _policies(args.policies, benchmark, task)
    budgets = _int_list("--budgets", args.budgets)
    prefill = _prefill(getattr(args, "prefill", DEFAULT_PREFILL), benchmark, task)
    check_budgets(policies, budgets, prefill=prefill)
    lengths = _int_list("--lengths", args.lengths, minimum=16)
    samples = _optional_count("--samples", args.samples)
    seed = _seed(args.seed)
    if args.split not in SPLITS:
        raise ValueError(f"--split: {args.split!r} is not 'dev' or 'test'")
    data_dir = _data_dir(args.data_dir, benchmark, task)
    _only_for_report("--quick", args.quick, benchmark)
    _only_for_report("--summarise-only", args.summarise_only, benchmark)
    predictor = _predictor(getattr(args, "predictor", None), task)
    grid = _grid(args.grid, args.quick, benchmark)
    _only_for_report("--docs", args.docs is not None, benchmark)
    tasks = _subtasks(args.tasks, benchmark, task)
    depths = _depths(args.depths)
    protocols = _protocols(getattr(args, "protocols", None), benchmark)
    max_new_tokens = _optional_count("--max-new-tokens", args.max_new_tokens)
    threads = _optional_count("--threads", args.threads)
    default_out = Path("results") / (f"{REPORT}-{grid}" if benchmark == REPORT else benchmark)
    if prefill != DEFAULT_PREFILL:
        default_out = default_out.with_name(f"{default_out.name}-{prefill}")
    return EvalConfig(
        benchmark=benchmark,
        model=args.model,
        policies=policies,
        budgets=budgets,
        lengths=lengths,
        samples=samples,
        seed=seed,
        split=args.split,
        out=Path(args.out) if args.out is not None else default_out,
        data_dir=data_dir,
        tasks=tasks,
        depths=depths,
        protocols=protocols,
        max_new_tokens=max_new_tokens,
        threads=threads,
        prefill=prefill,
        summarise_only=bool(args.summarise_only),
        predictor=predictor,
        quick=grid == "quick",
        docs=None if args.docs is None else Path(args.docs),
        grid=grid,
        progress=not args.no_progress,
    )


def _benchmark(name) -> str:
    """The benchmark's name, lower-cased; one of `BENCHMARKS`."""
    benchmark = str(name).strip().lower()
    if benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r} (choose from {', '.join(BENCHMARKS)})")
    return benchmark


def _policies(text: str | None, benchmark: str, task) -> list[str]:
    """``--policies`` expanded (default: `DEFAULT_POLICIES`; a report without it: none, the grid's own); a hindsight
    policy only on a teacher-forced texts task."""
    try:
        if text is None and benchmark == REPORT:
            policies = []  # the grid's own (`caote.evaluation.grids.part_configs`)
        else:
            policies = expand_policies(DEFAULT_POLICIES if text is None else text)
    except ValueError as error:
        raise ValueError(f"--policies: {error}") from None
    hindsight = hindsight_policies(policies)
    if hindsight and task is not None and task.texts is None:
        raise ValueError(
            f"--policies: {', '.join(hindsight)} reads the attention of later queries, known only on a teacher-forced "
            f"text: it runs on perplexity and fidelity, not on {benchmark}, which generates"
        )
    return policies


def _optional_count(option: str, text: str | None) -> int | None:
    """A positive integer option, or None when it is not given."""
    return None if text is None else _int_list(option, text)[0]


def _seed(text) -> int:
    """``--seed``: any integer."""
    try:
        return parse_int(text)
    except ValueError:
        raise ValueError(f"--seed: {text!r} is not an integer") from None


def _data_dir(data_dir, benchmark: str, task):
    """``--data-dir``, required (an existing folder) by a task that reads one."""
    if task is not None and task.needs_data_dir:
        if data_dir is None:
            raise ValueError(f"{benchmark} needs --data-dir: a folder of LongBench <task>.jsonl files")
        if not Path(data_dir).is_dir():
            raise ValueError(f"--data-dir: {str(data_dir)!r} is not a folder")
    return data_dir


def _only_for_report(option: str, given, benchmark: str) -> None:
    """An option of ``caote eval report`` alone: given to another benchmark, a `ValueError`."""
    if given and benchmark != REPORT:
        raise ValueError(f"{option} applies to '{REPORT}' only")


def _predictor(predictor, task):
    """``--predictor``: an existing file, for the texts tasks only."""
    if predictor is not None and (task is None or task.texts is None):
        raise ValueError("--predictor applies to the texts tasks (perplexity, fidelity) only")
    if predictor is not None and not Path(predictor).is_file():
        raise ValueError(f"--predictor: {str(predictor)!r} is not a file; write one with 'caote calibrate'")
    return predictor


def _grid(grid: str | None, quick: bool, benchmark: str) -> str:
    """The report's grid: ``--grid`` (default full), or quick with ``--quick``; one of `GRID_NAMES`."""
    chosen = "quick" if quick else (grid or "full")
    if quick and grid not in (None, "quick"):
        raise ValueError(f"--quick is --grid quick; it contradicts --grid {grid}")
    _only_for_report("--grid", grid is not None, benchmark)
    if chosen not in GRID_NAMES:
        raise ValueError(f"--grid: unknown grid {chosen!r} (choose from {', '.join(GRID_NAMES)})")
    return chosen


def _subtasks(text: str | None, benchmark: str, task) -> list[str] | None:
    """``--tasks`` as a list (None: every subtask), each one of the task's subtasks where it names them."""
    tasks = [t.strip() for t in text.split(",") if t.strip()] if text else None
    if tasks and task is not None and task.subtasks:
        unknown = sorted(set(tasks) - set(task.subtasks))
        if unknown:
            raise ValueError(f"--tasks: unknown {benchmark} tasks {unknown} (choose from {', '.join(task.subtasks)})")
    return tasks


def _depths(text: str | None) -> list[float] | None:
    """``--depths`` as percentages in 0..100 (None when not given)."""
    if not text:
        return None
    try:
        depths = [float(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise ValueError(f"--depths: {text!r} is not a comma list of numbers") from None
    if not depths or any(not 0 <= d <= 100 for d in depths):
        raise ValueError(f"--depths: {text!r} must be percentages in 0..100")
    return depths


def _prefill(mode: str, benchmark: str, task) -> str:
    """``--prefill``, one of `PREFILL_MODES`; a mode other than blocks only for a task that answers examples (a
    texts task teacher-forces its text in blocks, so its KL reads no prompt to compress)."""
    if mode not in PREFILL_MODES:
        raise ValueError(f"--prefill: {mode!r} is not one of {', '.join(PREFILL_MODES)}")
    if mode != DEFAULT_PREFILL and (task is None or task.texts is not None):
        raise ValueError(f"--prefill {mode} applies to the tasks that answer prompts (niah, passkey, ruler, longbench)")
    return mode


def _protocols(text: str | None, benchmark: str) -> list[str] | None:
    """``--protocols`` (niah and passkey only), each one of `PROTOCOLS` (None when not given)."""
    if not text:
        return None
    protocols = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in protocols if p not in PROTOCOLS]
    if unknown or not protocols:
        raise ValueError(f"--protocols: unknown {unknown} (choose from {', '.join(PROTOCOLS)})")
    if benchmark not in ("niah", "passkey"):
        raise ValueError("--protocols applies to 'niah' and 'passkey' only")
    return protocols
