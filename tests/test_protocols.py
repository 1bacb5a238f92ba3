"""Question protocols (in-prompt, question-after as kvpress, question-after-bounded), the cache's freeze, and the
evidence built on rows: units, comparisons against the best base with the oracle gap, and the claims table."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids, tiny_model

from caote.cache import EvictionCache
from caote.evaluation import runner
from caote.evaluation.examples import Example
from caote.evaluation.lockstep import lockstep
from caote.evaluation.niah import niah_example
from caote.evaluation.rows import load_rows
from caote.evaluation.tasks import MetricSpec
from caote.pipeline import CaoteTextGenerationPipeline
from caote.reports.beyond import beyond_records, beyond_table, target_lines
from caote.reports.claims import claims, claims_table
from caote.reports.tables import best_base_records, values_by_cell

KL = MetricSpec("kl", "KL", 4, higher_is_better=False)


def test_a_frozen_cache_keeps_every_later_token(llama):
    ids = random_ids(96, seed=1)
    cache = EvictionCache(llama, budget=40, policy="tova+caote", block_size=32)
    with cache, torch.no_grad():
        for start in (0, 32):
            llama(input_ids=ids[:, start : start + 32], cache=cache, use_cache=True)
        assert cache.layers[0].retained == 40
        cache.freeze()
        llama(input_ids=ids[:, 64:96], cache=cache, use_cache=True)
        assert cache.layers[0].retained == 72 and cache.stats().tokens_seen == 96
        cache.reset()
        assert not cache.frozen


@pytest.fixture(scope="module")
def vocab_model(tokenizer):
    return tiny_model(vocab_size=49152, eos_token_id=10**6)  # an eos it never writes: answers have full length


def test_pipeline_compress_context_lets_question_and_answer_grow(vocab_model, tokenizer):
    pipe = CaoteTextGenerationPipeline(model=vocab_model, tokenizer=tokenizer)
    context = " ".join(f"w{i}" for i in range(200))
    question = " and what is the word?"
    question_tokens = len(tokenizer(question, add_special_tokens=False).input_ids)
    settings = dict(question=question, budget=64, policy="tova+caote", block_size=32, max_new_tokens=5, chat=False)
    bounded = pipe(context, return_stats=True, **settings)
    grown = pipe(context, return_stats=True, compress="context", **settings)
    assert bounded["stats"][0].tokens_kept == grown["stats"][0].tokens_kept == 64  # the context at the budget
    assert bounded["stats"][-1].tokens_kept == 64
    assert grown["stats"][-1].tokens_kept == 64 + question_tokens + 4  # the last answer token is never fed back
    with pytest.raises(ValueError, match="compress must be one of"):
        pipe(context, compress="question", **settings)


def test_niah_protocols_share_the_prompt_and_differ_in_id(tokenizer):
    examples = [niah_example(tokenizer, 256, 50, protocol=p) for p in ("in-prompt", "question-after")]
    in_prompt, after = examples
    assert in_prompt.id == "niah/passkey/repeat/len256/depth50/seed0/0"  # unchanged: committed rows stay valid
    assert after.id == in_prompt.id + "/question-after"
    assert after.messages == in_prompt.messages and after.answers == in_prompt.answers
    assert after.context() + after.question == after.messages[-1]["content"]
    with pytest.raises(ValueError, match="unknown protocol"):
        Example("x", "t", ({"role": "user", "content": "q"},), ("a",), "substring_match", 2, protocol="later")


def test_runner_answers_each_protocol_and_stores_it(vocab_model, tokenizer, tmp_path):
    examples = [niah_example(tokenizer, 200, 50, protocol=p) for p in ("in-prompt", "question-after")]
    runner.run_examples(vocab_model, tokenizer, examples, ["tova"], [64], tmp_path, "tiny", "niah", block_size=32)
    rows = {(row["protocol"], row["policy"]): row for row in load_rows(tmp_path)}
    assert set(rows) == {(p, q) for p in ("in-prompt", "question-after") for q in ("full", "tova")}
    # kvpress's protocol holds the budget plus the question and answer; in-prompt never exceeds the budget
    assert rows[("question-after", "tova")]["tokens_kept"] > 64 == rows[("in-prompt", "tova")]["tokens_kept"]


# -- evidence from rows ------------------------------------------------------------------------------------------


def _text_rows(values: dict[str, list[float]], budget: int = 128) -> list[dict]:
    rows = []
    for policy, per_text in values.items():
        for index, value in enumerate(per_text):
            rows.append(
                {"policy": policy, "budget": budget, "example_id": f"t{index}", "unit": f"e{index}", "kl": value}
            )
    return rows


def test_rows_sharing_an_essay_count_once():
    rows = _text_rows({"tova": [1.0, 3.0]})
    rows[1]["unit"] = "e0"  # two excerpts of one essay
    assert values_by_cell(rows, "kl") == {("tova", 128): {"e0": 2.0}}


def test_best_base_comparison_and_the_oracle_gap_closed():
    rows = _text_rows(
        {
            "tova": [1.0, 1.1, 0.9, 1.0, 1.0, 1.2],
            "h2o": [2.0] * 6,
            "tova+caote": [0.8, 0.9, 0.7, 0.8, 0.8, 1.0],  # the best paper policy, 0.2 below tova
            "oracle": [0.4, 0.5, 0.3, 0.4, 0.4, 0.6],
        }
    )
    records = {r["policy"]: r for r in best_base_records(rows, KL, "perplexity")}
    assert records["tova"]["verdict"] == "reference" and records["tova"]["best_base"] == "tova"
    assert records["tova+caote"]["delta"] == pytest.approx(-0.2) and records["tova+caote"]["verdict"] == "helps"
    assert records["h2o"]["verdict"] == "hurts"
    assert records["oracle"]["gap_closed"] == pytest.approx(1.0)
    assert records["tova+caote"]["gap_closed"] == pytest.approx(0.0)
    assert records["tova"]["gap_closed"] == pytest.approx(-0.5)  # 0.2 worse than the best paper policy, gap 0.4


def test_claims_get_a_verdict_from_their_intervals():
    kl = {
        "h2o": [2.0, 2.1, 1.9, 2.0, 2.2, 1.8],
        "h2o+caote": [1.0, 1.1, 0.9, 1.0, 1.2, 0.8],  # halves H2O's KL
        "h2o+fastcaote": [1.0, 1.1, 0.9, 1.0, 1.2, 0.8],
        "tova": [1.0, 1.1, 0.9, 1.0, 1.2, 0.8],
        "tova+caote": [0.95, 1.05, 0.85, 0.95, 1.15, 0.75],  # 5 % better
        "tova+fastcaote": [0.95, 1.05, 0.85, 0.95, 1.15, 0.75],
        "oracle": [0.5] * 6,
    }
    rows = _text_rows(kl)
    for row in rows:
        row["ppl_delta"] = row["kl"]  # PPL moves with KL here
    items = {c.claim: c for c in claims({"perplexity": rows})}
    assert items["CAOTE lowers perplexity for H2O"].verdict == "reproduced"
    assert items["CAOTE lowers perplexity for tova"].verdict == "reproduced"
    assert items["CAOTE lowers perplexity for snapkv"].verdict == "not tested (no rows)"
    assert items["FastCAOTE ≈ CAOTE"].verdict == "reproduced"
    assert items["CAOTE's gain is larger for H2O than for tova"].verdict == "reproduced"
    assert items["The oracle (future attention) has the lowest KL"].verdict == "reproduced"
    worse = _text_rows({"h2o": kl["h2o+caote"], "h2o+caote": kl["h2o"]})
    for row in worse:
        row["ppl_delta"] = row["kl"]
    assert {c.claim: c for c in claims({"perplexity": worse})}["CAOTE lowers perplexity for H2O"].verdict == "refuted"
    assert "| CAOTE lowers perplexity for H2O | Table 4 |" in claims_table(list(items.values()))
    # a budget of the grid without rows keeps every claim from being reproduced
    partial = {c.claim: c for c in claims({"perplexity": rows}, budgets=[128, 256])}
    assert partial["CAOTE lowers perplexity for H2O"].verdict == "inconclusive"
    assert "b=256: no rows" in partial["CAOTE lowers perplexity for H2O"].evidence


def test_a_policy_name_can_fix_its_gqa_aggregation(llama):
    from caote.policies import parse_policy

    assert parse_policy("TOVA+CAOTE/mean").gqa == "mean" and parse_policy("tova+caote").gqa is None
    for bad in ("tova/mean", "tova+caote/avg", "full/mean"):
        with pytest.raises(ValueError, match="value-aware policy"):
            parse_policy(bad)
    assert EvictionCache(llama, budget=40, policy="h2o+caote/mean").settings.aggregation == "mean"
    ids = random_ids(160, seed=6)
    rows = {
        r["policy"]: r
        for r in lockstep(
            llama, ids, [("tova+caote", 40), ("tova+caote/mean", 40), ("tova+caote/max", 40)], block_size=32
        )
    }
    assert len({round(r["kl"], 12) for r in rows.values()}) == 3  # three aggregations, three different caches


def test_beyond_the_paper_against_every_paper_policy_the_oracle_and_niah():
    texts = _text_rows(
        {
            "streamingllm": [3.0, 3.1, 2.9, 3.0, 3.2, 2.8],
            "tova": [1.0, 1.1, 0.9, 1.0, 1.2, 0.8],
            "tova+caote": [0.8, 0.9, 0.7, 0.8, 1.0, 0.6],  # the best paper policy
            "oracle": [0.4, 0.5, 0.3, 0.4, 0.6, 0.2],
            "caote-block": [0.6, 0.7, 0.5, 0.6, 0.8, 0.4],  # 0.2 below the best paper policy: half the gap
            "caote-ahead": [0.8, 0.9, 0.7, 0.8, 1.0, 0.6],  # ties the best paper policy
        }
    )
    niah = [
        {"policy": policy, "budget": 128, "example_id": f"x{i}", "score": score, "protocol": protocol}
        for protocol in ("in-prompt", "question-after")
        for policy, scores in {"tova": [1.0] * 6, "tova+caote": [0.0] * 6, "caote-block": [0.0] * 6}.items()
        for i, score in enumerate(scores)
    ]
    records = {
        r["policy"]: r
        for r in beyond_records({"perplexity": texts, "niah": niah}, ["caote-block", "caote-ahead"], [128])
    }
    ours, close = records["caote-block"], records["caote-ahead"]
    assert ours["best_paper"] == "tova+caote" and ours["vs_best"].mean == pytest.approx(-0.2)
    assert ours["unbeaten"] == [] and ours["gap_closed"] == pytest.approx(0.5)
    assert close["unbeaten"] == ["tova+caote"] and close["gap_closed"] == pytest.approx(0.0)
    score, best, difference = ours["niah"]["in-prompt"]
    assert best == "tova" and score.mean == 0.0 and difference.mean == -1.0  # loses every example to TOVA
    lines = target_lines([ours, close], [128])
    assert "at 1 of 1 budgets — met; oracle gap closed b=128 50% — met" in lines[0]
    assert "loses against the best paper policy at in-prompt b=128, question-after b=128 — not met" in lines[0]
    assert "| caote-block | 128 | 0.6000" in beyond_table([ours, close])
    window = beyond_records({"perplexity": texts + _text_rows({"caote-window": [0.6] * 6})}, ["caote-window"], [128])
    assert "vs_base" not in window[0]  # no SnapKV rows: no base to compare with
    with_snapkv = texts + _text_rows({"snapkv": [1.0] * 6, "snapkv+caote": [0.9] * 6, "caote-window": [0.6] * 6})
    window = beyond_records({"perplexity": with_snapkv}, ["caote-window"], [128])[0]
    assert window["base_variant"] == "snapkv+caote" and window["vs_base"].mean == pytest.approx(-0.3)
