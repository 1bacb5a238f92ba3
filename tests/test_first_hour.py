"""The first hour of a new user: the README's main job runs the paper's bases and prints the
KL plot, `caote bench` leaves the committed results alone, the virtual environment comes first and is ignored, the
main job's row count and the policy-choice table the README quotes have one source each, caote-ahead's fidelity
measures its blocks, and every CSV has its header."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
import subprocess
from pathlib import Path

import pytest
from conftest import load_script, random_ids, tiny_model

from caote.benchmark.config import COMMITTED_OUT, DEFAULT_OUT
from caote.cli import build_parser
from caote.defaults import PAPER_BASES
from caote.evaluation.config import config_from_args
from caote.evaluation.fidelity import FidelityMeter
from caote.evaluation.grids import TRY_GRID, part_configs, planned_rows
from caote.evaluation.lockstep import fidelity
from caote.evaluation.report import run_report
from caote.evaluation.rows import row_key
from caote.policies import auto_training_free
from caote.reports.summary import summarise_rows
from caote.reports.tables import COMPARISON_FIELDS, write_csv

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
FIRST_BASH_BLOCK = README.index("```bash")
MODEL = "smollm2-135m"


def _ignored(path: str) -> bool:
    """Whether the committed .gitignore makes git ignore ``path`` (read-only ``git check-ignore``; a pattern of this
    clone's own .git/info/exclude does not count)."""
    check = subprocess.run(["git", "check-ignore", "--verbose", path], cwd=ROOT, capture_output=True, text=True)
    return check.returncode == 0 and check.stdout.split(":", 1)[0] == ".gitignore"


def _words(text: str) -> str:
    """``text`` with every run of whitespace (line breaks included) as one space."""
    return " ".join(text.split())


def _docs(name: str) -> str:
    """The text of docs/``name``."""
    return (ROOT / "docs" / name).read_text(encoding="utf-8")


# -- item 11: the main job ----------------------------------------------------------------------------------------


def test_the_try_grid_runs_the_papers_bases_and_the_base_of_every_variant():
    # the paper's comparison: auto, the default, is judged on the long grid instead (its choices: tests/test_auto.py)
    assert set(PAPER_BASES) <= set(TRY_GRID.policies)
    for policy in TRY_GRID.policies:
        base, _, transform = policy.partition("+")
        assert not transform or base in TRY_GRID.policies, policy


def _niah_row(example: int, policy: str, budget: int | None, score: float) -> dict:
    return {
        "benchmark": "niah",
        "example_id": f"niah/{example}",
        "policy": policy,
        "budget": budget,
        "score": score,
        "peak_kv_bytes": 1000 if budget is None else 250,
        "protocol": "in-prompt",
        "meta": {"context_length": 1024, "depth": 50 + 40 * example},
        "seconds": 1.0,
    }


def _text_row(policy: str, budget: int | None, kl: float) -> dict:
    return {
        "benchmark": "perplexity",
        "example_id": "essay-love-1024",
        "unit": "love",
        "policy": policy,
        "budget": budget,
        "kl": kl,
        "ppl_delta": 10 * kl,
        "ppl_full": 25.0,
        "fidelity": kl,
        "tokens": 1024,
        "seconds": 1.0,
    }


def _write_rows(folder: Path, rows: list[dict]) -> None:
    """``rows`` as one shard of the bundled model's rows under ``folder``."""
    keyed = [
        {**row, "model": MODEL, "key": row_key(MODEL, row["example_id"], row["policy"], row["budget"])} for row in rows
    ]
    folder.mkdir(parents=True)
    (folder / "rows.0.jsonl").write_text("".join(json.dumps(row) + "\n" for row in keyed), encoding="utf-8")


def test_the_try_report_prints_the_kl_plot(tmp_path):
    settings = [(policy, budget) for policy in TRY_GRID.policies[1:] for budget in TRY_GRID.budgets]
    niah = [_niah_row(example, "full", None, 1.0) for example in (0, 1)]
    niah += [_niah_row(example, policy, budget, 1.0) for example in (0, 1) for policy, budget in settings]
    texts = [_text_row("full", None, 0.0)]
    texts += [_text_row(policy, budget, 0.1 / (1 + policy.count("+"))) for policy, budget in settings]
    _write_rows(tmp_path / "runs" / "niah", niah)
    _write_rows(tmp_path / "runs" / "perplexity", texts)
    args = build_parser().parse_args(["eval", "report", "--grid", "try", "--out", str(tmp_path), "--summarise-only"])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert run_report(config_from_args(args)) == 0
    plot = re.search(r"^plot: (.*)$", printed.getvalue(), re.M).group(1)
    assert Path(plot) == tmp_path / "perplexity_kl_vs_budget.png" and Path(plot).is_file()


# -- item 12: caote bench writes into an ignored folder unless told -------------------------------------------------


def test_caote_bench_writes_into_an_ignored_folder_by_default():
    assert build_parser().parse_args(["bench"]).out == DEFAULT_OUT
    assert _ignored(f"{DEFAULT_OUT}/results.json")
    assert not _ignored(f"{COMMITTED_OUT}/results.json")
    performance = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert re.search(rf"^caote bench --out {COMMITTED_OUT} +# the committed run", performance, re.M)


# -- item 13: the virtual environment ------------------------------------------------------------------------------


def test_the_virtual_environment_is_ignored_and_made_before_the_two_commands():
    assert _ignored(".venv/bin/python")
    venv = README.index("python3 -m venv .venv && source .venv/bin/activate")
    assert venv < FIRST_BASH_BLOCK < README.index("\n## ")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    test_command = re.search(r"^TEST_COMMAND='(.*)'$", ci, re.M).group(1)
    main_job, tests = re.findall(r"^```bash\n(.*?)\n```$", README[: README.index("\n## ")], re.M | re.S)
    assert "caote eval report --grid try" in main_job and tests == test_command


# -- item 14: one source per number -------------------------------------------------------------------------------


def test_the_main_job_rows_are_quoted_from_the_grid():
    """The README and docs/evaluation.md quote the main job's row count as the try grid plans it."""
    config = config_from_args(build_parser().parse_args(["eval", "report", "--grid", "try"]))
    rows = sum(planned_rows(part_configs(TRY_GRID, config, Path("runs"))).values())
    quoted = {int(count) for count in re.findall(r"(?<![\d,])(\d+) rows\b", _words(README[:FIRST_BASH_BLOCK]))}
    assert quoted == {rows}, quoted
    # docs/evaluation.md: each paragraph (or command line) about the try grid that counts rows
    parts = re.split(r"\n\s*\n|\n(?=caote )", _docs("evaluation.md"))
    about_try = [_words(part) for part in parts if "--grid try" in part and re.search(r"\d rows\b", part)]
    assert about_try and all(f"{rows} rows" in part for part in about_try), about_try


def test_the_readmes_choice_table_is_generated_from_the_committed_runs():
    match = re.search(r"<!-- choice:start -->\n(.*?)\n<!-- choice:end -->", README, re.S)
    assert match, "README.md lacks the <!-- choice:start --> ... <!-- choice:end --> block"
    choice = load_script("choice_table")
    table = choice.choice_table(ROOT / "docs" / "results", ROOT / COMMITTED_OUT / "results.json")
    assert match.group(1) == table, "stale: paste `python benchmarks/choice_table.py` between the markers"
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == len(choice.POLICIES), rows
    # full has no same-size ratio; learned-block runs on Gemma-3 only: its 8k KL and pass keys, nothing of SmolLM2
    gemma_only = [row for row in rows if row.startswith("| `learned-block`")]
    assert all("–" not in row for row in rows[1:] if row not in gemma_only), "an evicting policy lacks a measurement"
    cells = gemma_only[0].split("|")
    assert cells[2:5] == [" – "] * 3 and "–" not in cells[5] + cells[6] + cells[8]
    # the rows named after auto's choices are its choices
    assert [auto_training_free(budget) for budget in (256, 511, 512)] == ["tova+caote", "tova+caote", "h2o+caote"]
    assert "b < 512" in choice.POLICIES["tova+caote"] and "b ≥ 512" in choice.POLICIES["h2o+caote"]


# -- item 15: caote-ahead's attention-output fidelity -------------------------------------------------------------


def test_caote_ahead_fidelity_compares_its_blocks_not_its_draft():
    """caote-ahead evicts much as caote-block does; its error was the draft's one-token outputs broadcast against
    the block's (twice caote-block's here, 6-17x on the bundled model)."""
    rows = {
        row["policy"]: row["fidelity"]
        for row in fidelity(tiny_model("llama"), random_ids(160, seed=5), ["caote-block", "caote-ahead"], [120], 32)
    }
    assert rows["caote-ahead"] == pytest.approx(rows["caote-block"], rel=0.25)


def test_the_fidelity_meter_refuses_outputs_of_other_shapes():
    import torch

    with pytest.raises(ValueError, match=r"layer 0: policy output \(1, 1, 4\) vs full \(1, 3, 4\)"):
        FidelityMeter(1).add([torch.ones(1, 1, 4)], [torch.ones(1, 3, 4)])


# -- item 16: CSV headers ------------------------------------------------------------------------------------------


def test_a_csv_without_records_has_its_header(tmp_path):
    write_csv(tmp_path / "empty.csv", [], COMPARISON_FIELDS)
    assert (tmp_path / "empty.csv").read_text(encoding="utf-8").strip() == ",".join(COMPARISON_FIELDS)


def test_every_summary_csv_has_a_header_with_or_without_comparisons(tmp_path):
    texts = [_text_row("full", None, 0.0), _text_row("tova+caote", 128, 0.05)]  # no plain base: no comparison
    summarise_rows(texts, "perplexity", tmp_path, plots=False)
    for name in ("summary", "caote_vs_plain", "vs_best_base"):
        with open(tmp_path / f"perplexity_{name}.csv", encoding="utf-8") as handle:
            assert csv.DictReader(handle).fieldnames, name
    texts.append(_text_row("tova", 128, 0.1))
    summarise_rows(texts, "perplexity", tmp_path, plots=False)
    with open(tmp_path / "perplexity_caote_vs_plain.csv", encoding="utf-8") as handle:
        records = list(csv.DictReader(handle))
    assert [(r["base"], r["transform"], r["budget"]) for r in records] == [("tova", "caote", "128")] * 3
