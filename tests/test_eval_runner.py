"""The evaluation runner (resume, torn lines, sharding), perplexity/KL/fidelity in lockstep, and the CI math."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_ids, tiny_model

from caote.evaluation import runner, stats
from caote.evaluation.config import config_from_args
from caote.evaluation.examples import Example
from caote.evaluation.lockstep import fidelity, lockstep
from caote.evaluation.rows import VOLATILE_FIELDS, RowStore, load_rows, read_rows
from caote.evaluation.tasks import MetricSpec
from caote.reports import tables

REPO = Path(__file__).resolve().parents[1]
SCORE = MetricSpec("score", "accuracy", 2, higher_is_better=True, binary=True)
CONTINUOUS_SCORE = MetricSpec("score", "F1", 2, higher_is_better=True)
POLICIES = ["tova", "h2o+caote"]
BUDGETS = [24, 40]


@pytest.fixture(scope="module")
def big_vocab_model(tokenizer):
    return tiny_model(
        vocab_size=49152,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )


def _examples(count: int = 3) -> list[Example]:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    examples = []
    for index in range(count):
        text = " ".join(words[(index + k) % len(words)] for k in range(40))
        examples.append(
            Example(
                id=f"toy/{index}",
                task="toy",
                messages=({"role": "user", "content": text},),
                answers=(words[index],),
                metric="substring_match",
                max_new_tokens=3,
                answer_prefix="Answer:",
                meta={"index": index},
            )
        )
    return examples


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in VOLATILE_FIELDS} for row in rows]


def _run(model, tokenizer, out: Path, examples, rank: int = 0, world: int = 1) -> int:
    return runner.run_examples(
        model, tokenizer, examples, POLICIES, BUDGETS, out, "tiny", "toy", rank, world, block_size=16
    )


def test_resume_after_crash_gives_every_row_once(big_vocab_model, tokenizer, tmp_path, monkeypatch):
    examples = _examples()
    expected = len(examples) * (1 + len(POLICIES) * len(BUDGETS))
    reference_dir = tmp_path / "reference"
    assert _run(big_vocab_model, tokenizer, reference_dir, examples) == expected
    reference = load_rows(reference_dir)
    assert len(reference) == expected
    assert all(row["evicted"] for row in reference if row["budget"] is not None)  # budgets < prompt: all computed

    real_answer, calls = runner.answer, []

    def crashing(*args, **kwargs):
        if len(calls) == 4:
            raise RuntimeError("killed")
        calls.append(1)
        return real_answer(*args, **kwargs)

    out = tmp_path / "resumed"
    monkeypatch.setattr(runner, "answer", crashing)
    with pytest.raises(RuntimeError, match="killed"):
        _run(big_vocab_model, tokenizer, out, examples)
    assert len(read_rows(out / "rows.0.jsonl")) == 4

    counted = []

    def counting(*args, **kwargs):
        counted.append(1)
        return real_answer(*args, **kwargs)

    monkeypatch.setattr(runner, "answer", counting)
    assert _run(big_vocab_model, tokenizer, out, examples) == expected - 4
    assert len(counted) == expected - 4  # nothing recomputed
    lines = (out / "rows.0.jsonl").read_text().splitlines()
    keys = [json.loads(line)["key"] for line in lines]
    assert len(keys) == len(set(keys)) == expected
    assert _stable(load_rows(out)) == _stable(reference)
    # a third run has nothing left to do
    assert _run(big_vocab_model, tokenizer, out, examples) == 0


def test_the_shared_cores_hint_comes_once_the_shard_is_ours(big_vocab_model, tokenizer, tmp_path, monkeypatch, capsys):
    from caote.arguments import warn_once_if_threads_share_cores

    warn_once_if_threads_share_cores.cache_clear()
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 1.9, 1.9))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with RowStore(tmp_path, 0):  # another writer holds the shard: the refusal is the only line
        with pytest.raises(RuntimeError, match="is being written by another process"):
            _run(big_vocab_model, tokenizer, tmp_path, _examples(1))
    assert "--threads 1" not in capsys.readouterr().err
    _run(big_vocab_model, tokenizer, tmp_path, _examples(1))
    _run(big_vocab_model, tokenizer, tmp_path / "second", _examples(1))
    assert capsys.readouterr().err.count("try --threads 1") == 1  # once per process
    warn_once_if_threads_share_cores.cache_clear()


def test_a_bar_handed_in_is_not_advanced_for_rows_already_stored(big_vocab_model, tokenizer, tmp_path):
    class Counting:
        n = 0

        def update(self, count):
            self.n += count

    examples = _examples(1)
    _run(big_vocab_model, tokenizer, tmp_path, examples)
    bar = Counting()  # run_parts' bar starts at the rows stored: a resumed run must not count them again
    runner.run_examples(
        big_vocab_model, tokenizer, examples, POLICIES, BUDGETS, tmp_path, "tiny", "toy", block_size=16, bar=bar
    )
    assert bar.n == 0


def test_torn_last_line_is_cut_and_recomputed(big_vocab_model, tokenizer, tmp_path):
    examples = _examples(1)
    out = tmp_path / "torn"
    _run(big_vocab_model, tokenizer, out, examples)
    shard = out / "rows.0.jsonl"
    lines = shard.read_text().splitlines(keepends=True)
    lost = json.loads(lines[-1])["key"]
    shard.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # killed mid-write
    assert lost not in {row["key"] for row in load_rows(out)}
    assert _run(big_vocab_model, tokenizer, out, examples) == 1
    rows = [json.loads(line) for line in shard.read_text().splitlines()]  # every line parses again
    assert [row["key"] for row in rows].count(lost) == 1
    assert len(rows) == len(lines)


def test_budget_covering_the_prompt_reuses_the_full_row(big_vocab_model, tokenizer, tmp_path):
    examples = _examples(1)
    runner.run_examples(
        big_vocab_model, tokenizer, examples, ["tova"], [24, 4096], tmp_path, "tiny", "toy", block_size=16
    )
    rows = {row["budget"]: row for row in load_rows(tmp_path)}
    assert rows[4096]["evicted"] is False and rows[4096]["prediction"] == rows[None]["prediction"]
    assert rows[24]["evicted"] is True and rows[24]["full_score"] == rows[None]["score"]


def test_an_examples_row_of_auto_records_what_it_resolved_to(
    big_vocab_model, tokenizer, tmp_path, tiny_predictors, monkeypatch
):
    from caote.predictor import Predictor

    monkeypatch.setattr(Predictor, "for_model", classmethod(tiny_predictors))  # none ships for a tiny model
    examples = _examples(1)
    runner.run_examples(
        big_vocab_model, tokenizer, examples, ["auto", "tova"], [24, 4096], tmp_path, "tiny", "toy", block_size=16
    )
    rows = {(row["policy"], row["budget"]): row for row in load_rows(tmp_path)}
    assert rows[("auto", 24)]["resolved"] == "tova+caote" and rows[("auto", 24)]["evicted"]
    assert rows[("auto", 4096)]["resolved"] == "h2o+caote"  # the full row reused, under auto's choice at 4096
    assert not any("resolved" in row for (policy, _), row in rows.items() if policy != "auto")


def test_rank_shards_split_examples_round_robin(big_vocab_model, tokenizer, tmp_path):
    examples = _examples(3)
    _run(big_vocab_model, tokenizer, tmp_path, examples, rank=1, world=2)
    assert {row["example_id"] for row in load_rows(tmp_path)} == {"toy/1"}
    assert (tmp_path / "rows.1.jsonl").is_file() and not (tmp_path / "rows.0.jsonl").exists()


def test_two_processes_give_the_same_rows_as_one(tokenizer, tmp_path):
    model_dir = tmp_path / "tiny-model"
    model = tiny_model(
        vocab_size=49152,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    arguments = [
        "eval",
        "niah",
        "--model",
        str(model_dir),
        "--policies",
        "tova,tova+caote",
        "--budgets",
        "64",
        "--lengths",
        "200",
        "--depths",
        "10,50,90",
        "--max-new-tokens",
        "4",
        "--no-progress",
        "--threads",
        "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    sharded = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            "29631",
            "-m",
            "caote.cli",
            *arguments,
            "--out",
            str(tmp_path / "two"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert sharded.returncode == 0, sharded.stderr[-2000:]
    # the single-process reference runs in this process, through the same argument parsing and row code
    from caote.cli import build_parser
    from caote.models import load_model

    config = config_from_args(build_parser().parse_args([*arguments, "--out", str(tmp_path / "one")]))
    loaded, loaded_tokenizer = load_model(str(model_dir))
    runner.run_rows(config, loaded, loaded_tokenizer)
    two, one = load_rows(tmp_path / "two"), load_rows(tmp_path / "one")
    assert {row["rank"] for row in two} == {0, 1}
    assert len(one) == 3 * (1 + 2) and _stable(two) == _stable(one)
    assert (tmp_path / "two" / "summary.md").is_file()


# -- perplexity, KL, fidelity --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama96():
    return tiny_model("llama")


def test_full_policy_perplexity_equals_a_plain_forward(llama96):
    ids = random_ids(200, seed=3)
    results = {
        r["policy"]: r for r in lockstep(llama96, ids, [("full", None), ("tova", 40)], block_size=32, fidelity=True)
    }
    with torch.no_grad():
        log_probs = torch.log_softmax(llama96(ids).logits[0].float(), dim=-1)
    plain = math.exp(-log_probs[:-1].gather(1, ids[0, 1:].view(-1, 1)).mean().item())
    full = results["full"]
    assert full["ppl"] == pytest.approx(plain, rel=1e-4)
    assert full["ppl_full"] == pytest.approx(plain, rel=1e-4)
    assert full["predictions"] == 199 and len(full["nll_blocks"]) == 7
    assert full["kl"] == 0.0 and full["ppl_delta"] == 0.0  # the reference against itself, exactly
    assert full["fidelity"] == 0.0 and full["fidelity_layers"] == [0.0, 0.0]
    evicting = results["tova"]
    assert evicting["kl"] > 1e-6 and evicting["kl_evicted"] > evicting["kl"]
    assert evicting["fidelity"] > 0 and all(value > 0 for value in evicting["fidelity_layers"])
    assert evicting["ppl_full"] == full["ppl_full"]
    # only blocks that start after the budget are measured: 64, 96, ..., 192 -> 5 blocks
    assert evicting["fidelity_blocks"] == 5 and len(evicting["fidelity_per_block"]) == 5


def test_fidelity_is_zero_for_full_and_positive_under_eviction(llama96):
    ids = random_ids(160, seed=5)
    rows = {
        (r["policy"], r["budget"]): r
        for r in fidelity(llama96, ids, ["full", "snapkv", "snapkv+caote"], [48], block_size=32)
    }
    assert rows[("full", 48)]["fidelity"] == 0.0
    assert rows[("snapkv", 48)]["fidelity"] > 0 and rows[("snapkv+caote", 48)]["fidelity"] > 0
    assert len(rows[("snapkv", 48)]["fidelity_layers"]) == len(llama96.model.layers)


# -- interval math -------------------------------------------------------------------------------------------------


def test_wilson_interval_matches_known_values():
    low, high = stats.wilson_interval(5, 10)
    assert (low, high) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    low, high = stats.wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    low, high = stats.wilson_interval(10, 10)
    assert low == pytest.approx(0.7225, abs=1e-4) and high == 1.0


def test_bootstrap_and_estimate():
    assert stats.bootstrap_interval([2.5] * 7) == (2.5, 2.5)
    low, high = stats.bootstrap_interval([0.0, 1.0] * 50)
    # normal approximation of the mean of 100 fair coin flips: 0.5 +- 1.96 * 0.05
    assert low == pytest.approx(0.402, abs=0.03) and high == pytest.approx(0.598, abs=0.03)
    binary = stats.estimate([1, 0, 1, 1])
    assert binary.method == "wilson" and binary.mean == 0.75
    continuous = stats.estimate([0.2, 0.4, 0.9])
    assert continuous.method == "bootstrap" and 0.2 <= continuous.low <= continuous.mean <= continuous.high <= 0.9
    assert stats.estimate([]).n == 0 and stats.estimate([]).cell() == "–"
    zero_kl = stats.estimate([0.0, 0.0], binary=False)
    assert zero_kl.method == "bootstrap" and (zero_kl.low, zero_kl.high) == (0.0, 0.0)


def test_paired_comparison_and_verdicts():
    difference = stats.paired_difference({"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 0.5, "b": 1.5, "c": 2.5, "d": 9.0})
    assert difference.n == 3 and difference.mean == pytest.approx(0.5)
    assert (difference.low, difference.high) == (pytest.approx(0.5), pytest.approx(0.5))
    rows = []
    for index in range(6):
        rows.append({"policy": "tova", "budget": 64, "example_id": f"e{index}", "score": 0.0})
        rows.append({"policy": "tova+caote", "budget": 64, "example_id": f"e{index}", "score": 1.0})
        rows.append({"policy": "h2o", "budget": 64, "example_id": f"e{index}", "score": 1.0})
        rows.append({"policy": "h2o+caote", "budget": 64, "example_id": f"e{index}", "score": float(index % 2)})
    records = {(r["base"], r["transform"]): r for r in tables.comparison_records(rows, SCORE, "toy")}
    assert records[("tova", "caote")]["verdict"] == "helps" and records[("tova", "caote")]["delta"] == 1.0
    assert records[("h2o", "caote")]["verdict"] == "hurts"
    few = tables.comparison_records(rows[:8], SCORE, "toy")
    assert all(r["verdict"].startswith("too few") for r in few)


def test_summary_records_put_the_full_reference_beside_each_cell():
    rows = [
        {"policy": "full", "budget": None, "example_id": "a", "score": 1.0, "metric": "substring_match"},
        {"policy": "full", "budget": None, "example_id": "b", "score": 0.0, "metric": "substring_match"},
        {"policy": "tova", "budget": 64, "example_id": "a", "score": 1.0, "metric": "substring_match"},
    ]
    f1 = tables.summary_records([{**row, "metric": "qa_f1"} for row in rows], CONTINUOUS_SCORE, "toy")
    assert {r["ci_method"] for r in f1} == {"bootstrap"}  # a continuous metric, even when its values are 0 or 1
    records = {r["policy"]: r for r in tables.summary_records(rows, SCORE, "toy")}
    assert records["tova"]["full_mean"] == 1.0  # only the examples the cell has
    assert records["full"]["mean"] == 0.5 and records["full"]["ci_method"] == "wilson"
    kl = MetricSpec("kl", "KL", 4, higher_is_better=False)
    continuous = tables.summary_records([{**row, "kl": 0.0} for row in rows], kl, "toy")
    assert {r["ci_method"] for r in continuous} == {"bootstrap"}
    assert all(r["ci_high"] == 0.0 for r in continuous)
    table = tables.markdown_table(list(records.values()))
    assert "**full (reference)**" in table and "| tova | 1.00 [" in table


def test_rows_of_the_two_prefill_modes_never_share_a_folder(big_vocab_model, tokenizer, tmp_path):
    examples = _examples(1)
    assert runner.run_examples(big_vocab_model, tokenizer, examples, ["tova"], [24], tmp_path, "tiny", "toy") == 2
    with pytest.raises(ValueError, match="holds rows read with prefill blocks; write prefill compress's to another"):
        runner.run_examples(
            big_vocab_model, tokenizer, examples, ["tova"], [24], tmp_path, "tiny", "toy", prefill="compress"
        )
    written = runner.run_examples(
        big_vocab_model, tokenizer, examples, ["tova"], [24], tmp_path / "compress", "tiny", "toy", prefill="compress"
    )
    assert written == 2 and {row["prefill"] for row in load_rows(tmp_path / "compress")} == {"compress"}
