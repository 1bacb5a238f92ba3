"""The hindsight ceiling (`oracle`), and the full-cache reference shared by every policy of a text: prefix blocks
taken from it give identical results, and every policy's row is saved as soon as it is computed."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_ids, tiny_model

import caote
from caote.cache import EvictionCache, EvictionLayer
from caote.evaluation import lockstep as lockstep_module
from caote.evaluation import runner
from caote.evaluation.config import EvalConfig
from caote.evaluation.lockstep import lockstep, reference_pass, skippable_blocks
from caote.evaluation.rows import VOLATILE_FIELDS, load_rows, read_rows
from caote.evaluation.tasks import Text
from caote.future import FutureAttention, received

BLOCK = 32
BUDGET = 48
SINKS = 4


@pytest.fixture(scope="module")
def model64():
    return tiny_model("llama", "eager").to(torch.float64)


def brute_force_future(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer ``(H_kv, T, T)``: ``[h, t, j]`` = attention that token j gets from queries t.. of KV group h."""
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions
    kv_heads = model.config.num_key_value_heads
    future = []
    for attention in attentions:  # (1, H_q, T, T)
        grouped = attention[0].view(kv_heads, -1, *attention.shape[-2:]).sum(1)  # (H_kv, T, T)
        future.append(grouped.flip(1).cumsum(1).flip(1))  # [h, t, j] = sum over queries i >= t
    return future


def test_oracle_keeps_the_tokens_with_the_most_future_attention(model64, monkeypatch):
    ids = random_ids(7 * BLOCK, seed=11)
    reference = reference_pass(model64, ids, BLOCK, future=True)
    expected_future = brute_force_future(model64, ids)
    evictions = []
    real_keep = EvictionLayer.keep

    def recording_keep(layer, indices, masked=None):
        evictions.append((layer, layer.cumulative_length, layer.positions.clone(), indices.clone()))
        real_keep(layer, indices, masked)

    monkeypatch.setattr(EvictionLayer, "keep", recording_keep)
    cache = EvictionCache(model64, budget=BUDGET, policy="oracle", block_size=BLOCK, future=reference.future)
    with cache, torch.no_grad():
        for start in range(0, ids.shape[1], BLOCK):
            mask = torch.ones(1, start + BLOCK, dtype=torch.long)
            model64(input_ids=ids[:, start : start + BLOCK], attention_mask=mask, cache=cache, use_cache=True)
    assert len(evictions) == 2 * 6  # two layers, every block after the first
    for layer, seen, positions, indices in evictions:
        if seen == ids.shape[1]:
            continue  # after the last block no query is left: every mass is 0 and any choice is as good
        index = next(i for i, candidate in enumerate(cache.layers) if candidate is layer)
        for head in range(positions.shape[1]):
            retained = positions[0, head].tolist()
            newest = max(retained)
            protected = {p for p in retained if p < SINKS or p == newest}
            free = [p for p in retained if p not in protected]
            mass = {p: float(expected_future[index][head, seen, p]) for p in free}
            best = sorted(free, key=lambda p: -mass[p])[: BUDGET - len(protected)]
            kept = {retained[i] for i in indices[0, head].tolist()}
            assert kept == protected | set(best), (index, seen, head)
            # the table the oracle read is the brute force's, up to float rounding
            recorded = reference.future.at(index, seen, positions)[0, head]
            assert torch.allclose(recorded, expected_future[index][head, seen, positions[0, head]], atol=1e-9)


def test_the_change_target_sums_each_later_querys_caote_error_over_the_kv_group():
    generator = torch.Generator().manual_seed(3)
    probabilities = torch.softmax(4 * torch.randn(1, 4, 3, 7, generator=generator, dtype=torch.float64), -1)
    values = torch.randn(1, 2, 7, 5, generator=generator, dtype=torch.float64)
    expected = torch.zeros(1, 2, 7, dtype=torch.float64)
    for head in range(4):
        kv = head // 2
        for row in probabilities[0, head]:
            output = row @ values[0, kv]
            for token, weight in enumerate(row):
                change = weight / max(1 - weight, 0.5) * torch.linalg.vector_norm(output - values[0, kv, token])
                expected[0, kv, token] += change
    assert torch.allclose(received(probabilities, values, "change"), expected)
    assert torch.allclose(received(probabilities, values, "mass"), probabilities.view(1, 2, 2, 3, 7).sum((2, 3)))
    with pytest.raises(ValueError, match="unknown future target 'norm'; choose one of mass, change"):
        FutureAttention("norm")


def test_a_reference_pass_records_the_target_it_is_asked_for(model64):
    ids = random_ids(4 * BLOCK, seed=5)
    mass = reference_pass(model64, ids, BLOCK, future=True).future
    change = reference_pass(model64, ids, BLOCK, future=True, future_target="change").future
    positions = torch.arange(2 * BLOCK).expand(1, model64.config.num_key_value_heads, -1)
    assert (mass.target, change.target) == ("mass", "change")
    assert not torch.allclose(mass.at(0, 2 * BLOCK, positions), change.at(0, 2 * BLOCK, positions))


def test_scoring_only_the_last_token_records_the_same_future_with_one_logit_row_per_earlier_block(model64):
    """Calibration's reference pass (`caote.evaluation.calibration.recipe.calibrate`) scores only the last token: the
    future it fits to must not change, and the blocks before the last keep a single row of log-probs."""
    ids = random_ids(4 * BLOCK, seed=6)
    every = reference_pass(model64, ids, BLOCK, future=True, states=set())
    last = reference_pass(model64, ids, BLOCK, future=True, states=set(), scored_tail=1)
    positions = torch.arange(3 * BLOCK).expand(1, model64.config.num_key_value_heads, -1)
    for layer in range(model64.config.num_hidden_layers):
        assert torch.equal(every.future.at(layer, 3 * BLOCK, positions), last.future.at(layer, 3 * BLOCK, positions))
    assert [rows.shape[0] for rows in last.log_probs] == [1, 1, 1, BLOCK]
    assert [rows.shape[0] for rows in every.log_probs] == [BLOCK] * 4


def test_oracle_is_refused_where_there_is_no_future(llama, tokenizer):
    with pytest.raises(ValueError, match="hindsight ceiling"):
        EvictionCache(llama, budget=BUDGET, policy="oracle")
    with pytest.raises(ValueError, match="hindsight ceiling"):
        caote.generate(llama, tokenizer, "a prompt", budget=BUDGET, policy="oracle", max_new_tokens=2)
    assert "oracle" not in caote.policy_names() and "oracle" in caote.policy_names(hindsight=True)


def test_eval_refuses_the_oracle_on_a_generating_task(capsys):
    from caote.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "niah", "--policies", "tova,oracle"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "oracle" in error[0] and "teacher-forced" in error[0]


# -- the shared reference ------------------------------------------------------------------------------------------


def test_skippable_blocks_only_where_no_state_is_carried():
    assert skippable_blocks("full", None, 32, 200) == 7
    assert skippable_blocks("tova+caote", 100, 32, 200) == 3  # block 3 (96..127) is the first to overflow
    assert skippable_blocks("snapkv", 64, 32, 200) == 2  # its 32-query window fits in the block that first evicts
    assert skippable_blocks("snapkv", 64, 16, 200) == 0  # ... but not in a 16-token block
    assert skippable_blocks("snapkv", 192, 32, 200) == 0  # ... nor in an 8-token last block
    assert skippable_blocks("h2o", 100, 32, 200) == 0  # the running sum starts at the first token
    assert skippable_blocks("tova", 400, 32, 200) == 7  # never evicts


@pytest.mark.parametrize("policy", ["tova+caote", "snapkv+fastcaote", "streamingllm", "keydiff", "random", "oracle"])
def test_taking_the_prefix_from_the_reference_changes_nothing(llama, policy):
    ids = random_ids(7 * BLOCK + 5, seed=4)
    runs = [(policy, 64), (policy, 100)]
    skipped = lockstep(llama, ids, runs, block_size=BLOCK, fidelity=True)
    computed = lockstep(llama, ids, runs, block_size=BLOCK, fidelity=True, skip_prefix=False)
    for fast, slow in zip(skipped, computed):
        assert fast["blocks_from_reference"] > 0 and slow["blocks_from_reference"] == 0
        volatile = ("seconds", "blocks_from_reference")
        assert {k: v for k, v in fast.items() if k not in volatile} == {
            k: v for k, v in slow.items() if k not in volatile
        }


def test_every_policy_row_is_saved_as_soon_as_it_is_computed(llama, tokenizer, tmp_path, monkeypatch):
    text = " ".join(f"word{i}" for i in range(150))
    config = EvalConfig(
        benchmark="perplexity",
        model="tiny",
        policies=["tova", "h2o+caote"],
        budgets=[24, 40],
        lengths=[0],
        out=tmp_path,
        block_size=16,
        progress=False,
    )
    texts = [Text("text-a", 150, text, "a"), Text("text-b", 150, text + " more", "b")]
    model = tiny_model("llama", vocab_size=49152)
    real_track, calls = lockstep_module.track, []

    def killed_on_the_third(*args, **kwargs):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(1)
        return real_track(*args, **kwargs)

    monkeypatch.setattr(lockstep_module, "track", killed_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        runner.run_texts(config, model, tokenizer, texts)
    assert len(read_rows(tmp_path / "rows.0.jsonl")) == 3  # full + two policies of text-a, saved before the kill

    monkeypatch.setattr(lockstep_module, "track", real_track)
    assert runner.run_texts(config, model, tokenizer, texts) == 2 * 5 - 3  # only the missing rows
    resumed = load_rows(tmp_path)
    fresh_out = tmp_path / "fresh"
    config.out = fresh_out
    runner.run_texts(config, model, tokenizer, texts)

    def stable(rows):
        return [{k: v for k, v in row.items() if k not in VOLATILE_FIELDS} for row in rows]

    assert stable(resumed) == stable(load_rows(fresh_out))


@pytest.mark.parametrize("policy", ["tova+caote", "h2o", "oracle"])
def test_a_scored_tail_scores_exactly_the_last_blocks_of_a_whole_pass(llama, policy):
    ids = random_ids(7 * BLOCK + 5, seed=8)  # 8 blocks, the last of 5 tokens
    runs = [("full", None), (policy, 64), (policy, 192)]  # 192: blocks 0-5 from the reference, into the scored ones
    whole = lockstep(llama, ids, runs, block_size=BLOCK)
    tail = list(lockstep_module.lockstep_results(llama, ids, runs, block_size=BLOCK, scored_tail=2 * BLOCK))
    first = lockstep_module.scored_blocks(ids.shape[1], BLOCK, 2 * BLOCK)
    assert first == 5  # token 7 * 32 + 5 - 64 = 165 lies in block 5: blocks 5, 6, 7 are scored
    if policy != "h2o":
        assert tail[2]["blocks_from_reference"] == 6 > first
    assert tail[0]["ppl_full"] == tail[1]["ppl_full"] != whole[0]["ppl_full"]  # the tail's own full-cache PPL
    # the tail's passes run matmuls of other shapes than the whole pass's, so their float32 log-probs (eps 1.2e-7)
    # round differently: a block's KL of 2e-4 moved by 3.5e-9 on CI; neighbouring blocks differ by 6e-6 or more
    kl_rounding = 1e-7
    for every, last in zip(whole[:2], tail[:2]):  # full and b=64: every one of the last blocks is in the series
        assert last["predictions"] == ids.shape[1] - first * BLOCK == 2 * BLOCK + 5
        assert last["kl_blocks"] == pytest.approx(every["kl_blocks"][-3:], rel=1e-5, abs=kl_rounding)
        assert last["nll_blocks"] == pytest.approx(every["nll_blocks"][-3:], rel=1e-5)
        sizes = torch.tensor([BLOCK, BLOCK, 5], dtype=torch.float64)
        expected_kl = float((torch.tensor(every["kl_blocks"][-3:], dtype=torch.float64) * sizes).sum() / sizes.sum())
        assert last["kl"] == pytest.approx(expected_kl, rel=1e-5, abs=kl_rounding)
        expected_nll = float((torch.tensor(every["nll_blocks"][-3:], dtype=torch.float64) * sizes).sum() / sizes.sum())
        assert math.log(last["ppl_full"] + last["ppl_delta"]) == pytest.approx(expected_nll, rel=1e-5)
    # b=192 first evicts in block 6: every KL before it is 0, so the tail holds the whole text's KL
    every, last = whole[2], tail[2]
    assert last["kl"] * last["predictions"] == pytest.approx(every["kl"] * every["predictions"], rel=1e-5)
    assert last["kl_evicted"] == pytest.approx(every["kl_evicted"], rel=1e-5)
    assert tail[0]["kl"] == 0 and tail[1]["kl"] > 0
    with pytest.raises(ValueError, match="at least 1 token"):
        lockstep_module.scored_blocks(200, 32, 0)


def test_no_scored_tail_or_one_as_long_as_the_text_scores_every_prediction():
    assert lockstep_module.scored_blocks(200, 32, None) == 0
    assert lockstep_module.scored_blocks(200, 32, 199) == 0
    assert lockstep_module.scored_blocks(200, 32, 150) == 1
