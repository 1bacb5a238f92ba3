"""The report is generated from the task registry: the committed quick-grid rows still give the committed
docs/results.md numbers, and every registered task is complete."""

from __future__ import annotations

from pathlib import Path

import pytest

from caote.evaluation.config import EvalConfig
from caote.evaluation.document import headline_table, setup_lines, verdict_lines
from caote.evaluation.grids import QUICK_GRID, part_configs, planned_rows
from caote.evaluation.plots import FIGURES
from caote.evaluation.registry import BENCHMARKS, REPORT, TASKS
from caote.evaluation.rows import load_rows
from caote.evaluation.tables import comparison_records, summary_records
from caote.policies import expand_policies

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "docs" / "results" / "runs" / "quick"


@pytest.fixture(scope="module")
def quick():
    """The committed quick grid's rows and their records (tables only, no plots), as `caote eval report` reads them."""
    config = EvalConfig(REPORT, "smollm2-135m", expand_policies("paper"), list(QUICK_GRID.budgets), [1024])
    configs = part_configs(QUICK_GRID, config, RUNS)
    rows = {name: load_rows(part.out) for name, part in configs.items()}
    summaries = {
        name: {
            "records": [r for metric in TASKS[name].metrics for r in summary_records(rows[name], metric, name)],
            "comparison_records": [
                r for metric in TASKS[name].metrics for r in comparison_records(rows[name], metric, name)
            ],
        }
        for name in configs
    }
    return configs, rows, summaries, (REPO / "docs" / "results.md").read_text(encoding="utf-8")


def test_committed_rows_give_the_committed_headline_and_verdicts(quick):
    configs, rows, summaries, committed = quick
    assert all(rows.values()), "docs/results/runs/quick holds no rows"
    assert headline_table(summaries) in committed
    for line in verdict_lines(summaries):
        assert line in committed


def test_setup_lines_and_planned_rows_come_from_the_specs(quick):
    configs, rows, _, committed = quick
    for line in setup_lines(configs, rows):
        assert line in committed
    assert planned_rows(configs) == {name: len(value) for name, value in rows.items()}


def test_every_registered_task_is_complete():
    assert BENCHMARKS == (*TASKS, REPORT)
    for name, task in TASKS.items():
        assert task.name == name and task.title and task.metrics
        assert (task.examples is None) != (task.texts is None)
        assert set(task.figures) <= set(FIGURES), task.figures
        names = [metric.name for metric in task.metrics]
        assert len(names) == len(set(names))
    for part in QUICK_GRID.parts:
        assert part.task in TASKS and set(part.subtasks or ()) <= set(TASKS[part.task].subtasks)
