"""The grids of ``caote eval report``: which tasks run at which sizes, and how many rows a complete run writes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from caote.evaluation.config import EvalConfig
from caote.evaluation.reference import FULL
from caote.evaluation.registry import TASKS


@dataclass(frozen=True)
class GridPart:
    """One task of a grid at its sizes (``subtasks`` and ``depths`` None: the task's defaults)."""

    task: str
    lengths: tuple[int, ...]
    samples: int
    subtasks: tuple[str, ...] | None = None
    depths: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Grid:
    """Budgets, answer length and the parts (run, and shown as sections of docs/results.md, in this order)."""

    name: str
    budgets: tuple[int, ...]
    max_new_tokens: int
    parts: tuple[GridPart, ...]


# quick: about 15 min on 2 idle cores (31 policy x budget settings: ~124 answers of ~1k-token prompts plus two
# 1k-token texts in lockstep); the full grid takes hours on CPU
QUICK_GRID = Grid(
    "quick",
    budgets=(128, 256, 512),
    max_new_tokens=24,
    parts=(
        GridPart("perplexity", lengths=(1024,), samples=2),
        GridPart("niah", lengths=(1024,), samples=1, depths=(50, 90)),
        GridPart("ruler", lengths=(1024,), samples=1, subtasks=("niah_multikey", "variable_tracking")),
    ),
)
FULL_GRID = Grid(
    "full",
    budgets=(128, 256, 512),
    max_new_tokens=64,
    parts=(
        GridPart("perplexity", lengths=(2048,), samples=6),
        GridPart("niah", lengths=(1024, 2048), samples=2, depths=(10, 30, 50, 70, 90)),
        GridPart(
            "ruler",
            lengths=(1024, 2048),
            samples=3,
            subtasks=("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words"),
        ),
    ),
)


def part_configs(grid: Grid, config: EvalConfig, runs: Path) -> dict[str, EvalConfig]:
    """One `EvalConfig` per part of ``grid`` (model, policies, seed, split and progress from ``config``), writing
    rows to ``runs/<task>``."""
    return {
        part.task: EvalConfig(
            benchmark=part.task,
            model=config.model,
            policies=config.policies,
            budgets=list(grid.budgets),
            lengths=list(part.lengths),
            samples=part.samples,
            seed=config.seed,
            split=config.split,
            out=runs / part.task,
            tasks=list(part.subtasks) if part.subtasks else None,
            depths=list(part.depths) if part.depths else None,
            progress=config.progress,
            max_new_tokens=grid.max_new_tokens,
        )
        for part in grid.parts
    }


def planned_rows(configs: dict[str, EvalConfig]) -> dict[str, int]:
    """Rows a complete run writes per task (full once per example + evicting policies x budgets), for every task
    whose spec can count its examples."""
    planned = {}
    for name, config in configs.items():
        count = TASKS[name].count
        if count is not None:
            per_example = 1 + len([p for p in config.policies if p != FULL]) * len(config.budgets)
            planned[name] = per_example * count(config)
    return planned
