"""The report is generated from the task registry: the committed standard-grid rows still give the committed
docs/results.md numbers (headline, claims, verdicts), and every registered task is complete."""

from __future__ import annotations

from pathlib import Path

import pytest

from caote.evaluation.config import EvalConfig
from caote.evaluation.grids import QUICK_GRID, STANDARD_GRID, part_configs, planned_rows
from caote.evaluation.registry import BENCHMARKS, REPORT, TASKS
from caote.evaluation.rows import load_rows
from caote.reports.claims import claims, claims_table
from caote.reports.document import headline_table, setup_lines, verdict_lines
from caote.reports.plots import FIGURES
from caote.reports.summary import summarise_rows

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "docs" / "results" / "runs" / "standard"


@pytest.fixture(scope="module")
def standard(tmp_path_factory):
    """The committed standard grid's rows and their summaries (no plots), as `caote eval report` reads them."""
    config = EvalConfig(REPORT, "smollm2-135m", [], list(STANDARD_GRID.budgets), [1024])
    configs = part_configs(STANDARD_GRID, config, RUNS)
    rows = {name: load_rows(part.out) for name, part in configs.items()}
    out = tmp_path_factory.mktemp("summaries")
    summaries = {name: summarise_rows(rows[name], name, out, plots=False) for name in configs}
    return configs, rows, summaries, (REPO / "docs" / "results.md").read_text(encoding="utf-8")


def test_committed_rows_give_the_committed_headline_claims_and_verdicts(standard):
    configs, rows, summaries, committed = standard
    assert all(rows.values()), "docs/results/runs/standard holds no rows"
    assert headline_table(summaries) in committed
    assert claims_table(claims(rows)) in committed
    for line in verdict_lines(summaries):
        assert line in committed


def test_setup_lines_and_planned_rows_come_from_the_specs(standard):
    configs, rows, _, committed = standard
    for line in setup_lines(configs, rows):
        assert line in committed
    counts = {name: len(value) for name, value in rows.items()}
    assert planned_rows(configs) == counts or "**Incomplete run:**" in committed


def test_every_registered_task_is_complete():
    assert BENCHMARKS == (*TASKS, REPORT)
    for name, task in TASKS.items():
        assert task.name == name and task.title and task.metrics
        assert (task.examples is None) != (task.texts is None)
        assert set(task.figures) <= set(FIGURES), task.figures
        names = [metric.name for metric in task.metrics]
        assert len(names) == len(set(names))
    for part in (*QUICK_GRID.parts, *STANDARD_GRID.parts):
        assert part.task in TASKS and set(part.subtasks or ()) <= set(TASKS[part.task].subtasks)
