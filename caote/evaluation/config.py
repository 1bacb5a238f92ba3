"""`EvalConfig`: everything one ``caote eval`` run needs, validated from the command line by `config_from_args`.

Every check raises a one-line `ValueError` naming the option; ``caote eval`` reports it as a usage error (exit
code 2) before any model loads.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from caote.arguments import parse_int, parse_int_list
from caote.defaults import DEFAULT_BLOCK_SIZE
from caote.evaluation.examples import PROTOCOLS
from caote.evaluation.registry import BENCHMARKS, REPORT, TASKS
from caote.policies import expand_policies, hindsight_policies, parse_policy
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


def check_budgets(policies: list[str], budgets: list[int], block_size: int = DEFAULT_BLOCK_SIZE) -> None:
    """Every evicting policy must leave room to choose at every budget (the cache's own rule, with its defaults)."""
    for name in policies:
        if not parse_policy(name).evicts:
            continue
        for budget in budgets:
            try:
                CacheSettings(budget=budget, policy=name, block_size=block_size)
            except ValueError as error:
                raise ValueError(f"--budgets: {budget} is too small for {name} ({error})") from None


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """Validate the ``caote eval`` arguments into an `EvalConfig` (a one-line `ValueError` on anything wrong)."""
    benchmark = str(args.benchmark).strip().lower()
    if benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {args.benchmark!r} (choose from {', '.join(BENCHMARKS)})")
    task = TASKS.get(benchmark)
    try:
        if args.policies is None and benchmark == REPORT:
            policies = []  # the grid's own (`caote.evaluation.grids.part_configs`)
        else:
            policies = expand_policies(DEFAULT_POLICIES if args.policies is None else args.policies)
    except ValueError as error:
        raise ValueError(f"--policies: {error}") from None
    hindsight = hindsight_policies(policies)
    if hindsight and task is not None and task.texts is None:
        raise ValueError(
            f"--policies: {', '.join(hindsight)} reads the attention of later queries, known only on a teacher-forced "
            f"text: it runs on perplexity and fidelity, not on {benchmark}, which generates"
        )
    budgets = _int_list("--budgets", args.budgets)
    check_budgets(policies, budgets)
    lengths = _int_list("--lengths", args.lengths, minimum=16)
    samples = None if args.samples is None else _int_list("--samples", args.samples)[0]
    try:
        seed = parse_int(args.seed)
    except ValueError:
        raise ValueError(f"--seed: {args.seed!r} is not an integer") from None
    if args.split not in SPLITS:
        raise ValueError(f"--split: {args.split!r} is not 'dev' or 'test'")
    data_dir = args.data_dir
    if task is not None and task.needs_data_dir:
        if data_dir is None:
            raise ValueError(f"{benchmark} needs --data-dir: a folder of LongBench <task>.jsonl files")
        if not Path(data_dir).is_dir():
            raise ValueError(f"--data-dir: {str(data_dir)!r} is not a folder")
    if args.quick and benchmark != REPORT:
        raise ValueError(f"--quick applies to '{REPORT}' only")
    if args.summarise_only and benchmark != REPORT:
        raise ValueError(f"--summarise-only applies to '{REPORT}' only")
    predictor = getattr(args, "predictor", None)
    if predictor is not None and (task is None or task.texts is None):
        raise ValueError("--predictor applies to the texts tasks (perplexity, fidelity) only")
    if predictor is not None and not Path(predictor).is_file():
        raise ValueError(f"--predictor: {str(predictor)!r} is not a file; write one with 'caote calibrate'")
    grid = "quick" if args.quick else (args.grid or "full")
    if args.quick and args.grid not in (None, "quick"):
        raise ValueError(f"--quick is --grid quick; it contradicts --grid {args.grid}")
    if args.grid is not None and benchmark != REPORT:
        raise ValueError(f"--grid applies to '{REPORT}' only")
    if grid not in GRID_NAMES:
        raise ValueError(f"--grid: unknown grid {grid!r} (choose from {', '.join(GRID_NAMES)})")
    if args.docs is not None and benchmark != REPORT:
        raise ValueError(f"--docs applies to '{REPORT}' only")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    if tasks and task is not None and task.subtasks:
        unknown = sorted(set(tasks) - set(task.subtasks))
        if unknown:
            raise ValueError(f"--tasks: unknown {benchmark} tasks {unknown} (choose from {', '.join(task.subtasks)})")
    depths = None
    if args.depths:
        try:
            depths = [float(d) for d in args.depths.split(",") if d.strip()]
        except ValueError:
            raise ValueError(f"--depths: {args.depths!r} is not a comma list of numbers") from None
        if not depths or any(not 0 <= d <= 100 for d in depths):
            raise ValueError(f"--depths: {args.depths!r} must be percentages in 0..100")
    protocols = None
    if getattr(args, "protocols", None):
        protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
        unknown = [p for p in protocols if p not in PROTOCOLS]
        if unknown or not protocols:
            raise ValueError(f"--protocols: unknown {unknown} (choose from {', '.join(PROTOCOLS)})")
        if benchmark != "niah":
            raise ValueError("--protocols applies to 'niah' only")
    max_new_tokens = None if args.max_new_tokens is None else _int_list("--max-new-tokens", args.max_new_tokens)[0]
    threads = None if args.threads is None else _int_list("--threads", args.threads)[0]
    default_out = Path("results") / (f"{REPORT}-{grid}" if benchmark == REPORT else benchmark)
    out = Path(args.out) if args.out is not None else default_out
    return EvalConfig(
        benchmark=benchmark,
        model=args.model,
        policies=policies,
        budgets=budgets,
        lengths=lengths,
        samples=samples,
        seed=seed,
        split=args.split,
        out=out,
        data_dir=data_dir,
        tasks=tasks,
        depths=depths,
        protocols=protocols,
        max_new_tokens=max_new_tokens,
        threads=threads,
        summarise_only=bool(args.summarise_only),
        predictor=predictor,
        quick=grid == "quick",
        docs=None if args.docs is None else Path(args.docs),
        grid=grid,
        progress=not args.no_progress,
    )
