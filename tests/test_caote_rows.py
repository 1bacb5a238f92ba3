"""Beyond the paper: the exact CAOTE error over many real query rows (`caote-window`, `caote-block`, and
`caote-ahead` with the queries of a greedy draft), checked against a float64 brute force that evicts, renormalises
and recomputes every row's output, and against the attention of a full-cache forward."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_ids, tiny_model

from caote.bases import LOOKAHEAD_TOKENS
from caote.cache import EvictionCache
from caote.evaluation.lockstep import lockstep
from caote.layer import EvictionLayer
from caote.value_aware import caote_score, multi_row_caote_score


def brute_force(rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``sqrt(sum over the group's heads and rows of ||X_r - X_r without j||^2 / rows that see j)``, by evicting."""
    rows, values = rows.double(), values.double()
    batch, query_heads, row_count, tokens = rows.shape
    kv_heads = values.shape[1]
    group = query_heads // kv_heads
    result = torch.zeros(batch, kv_heads, tokens, dtype=torch.float64)
    for b in range(batch):
        for k in range(kv_heads):
            heads = range(k * group, (k + 1) * group)
            for j in range(tokens):
                total, seen = 0.0, 0
                for r in range(row_count):
                    seen += any(rows[b, q, r, j] > 0 for q in heads)
                    for q in heads:
                        weights = rows[b, q, r]
                        if weights.sum() == 0:
                            continue
                        weights = weights / weights.sum()
                        output = weights @ values[b, k]
                        rest = weights.clone()
                        rest[j] = 0
                        if rest.sum() == 0:
                            total = math.inf
                            continue
                        total += float((output - (rest / rest.sum()) @ values[b, k]).norm()) ** 2
                result[b, k, j] = math.sqrt(total / max(seen, 1))
    return result


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_multi_row_error_equals_evicting_and_recomputing(seed):
    generator = torch.Generator().manual_seed(seed)
    rows = (torch.randn(2, 6, 5, 9, generator=generator) * 3).softmax(-1)
    rows[:, :, 0, 6:] = 0  # the oldest row could not see the newest tokens
    rows[0, 1, 2] = torch.full((9,), 1e-10 / 8).index_fill(0, torch.tensor([4]), 1 - 1e-10)  # near one-hot row
    values = torch.randn(2, 2, 9, 4, generator=generator)
    expected = brute_force(rows, values)
    assert torch.allclose(multi_row_caote_score(rows.double(), values.double()), expected, rtol=1e-10, atol=1e-12)
    assert torch.allclose(multi_row_caote_score(rows, values).double(), expected, rtol=1e-4, atol=1e-6)


def test_one_row_is_caote_itself():
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(1, 2, 1, 7, generator=generator).double().softmax(-1)  # one query head per KV head; sums to 1
    values = torch.randn(1, 2, 7, 5, generator=generator).double()
    single = caote_score(rows[:, :, 0], values)
    assert torch.allclose(multi_row_caote_score(rows, values), single, rtol=1e-12)


@pytest.mark.parametrize("policy", ["caote-window", "caote-block", "caote-ahead"])
def test_row_policies_keep_the_budget_and_are_refused_a_caote_suffix(llama, policy):
    ids = random_ids(200, seed=8)
    cache = EvictionCache(llama, budget=48, policy=policy, block_size=32)
    with cache, torch.no_grad():
        for start in range(0, 200, 32):
            llama(input_ids=ids[:, start : start + 32], cache=cache, use_cache=True)
        assert all(layer.retained == 48 for layer in cache.layers)
    assert lockstep(llama, ids, [(policy, 48)], block_size=32)[0]["kl"] > 0
    with pytest.raises(ValueError, match="unknown policy"):
        EvictionCache(llama, budget=48, policy=f"{policy}+caote")


def test_the_look_ahead_scores_with_the_queries_of_the_greedy_draft(monkeypatch):
    """caote-ahead's first eviction reads, besides the block's rows, the attention of the greedy draft's queries over
    the tokens held before it, exactly as one eager full-cache forward over prompt + draft computes them; the draft
    leaves no trace in the cache, and every layer held budget + block + draft tokens at the peak."""
    model = tiny_model("llama", attn_implementation="eager")
    ids = random_ids(64, seed=9)
    drafted = {}
    evict = EvictionLayer.evict

    def spy(self, kept, random, **inputs):
        drafted.setdefault(index_of(self), inputs.get("ahead_rows"))
        return evict(self, kept, random, **inputs)

    monkeypatch.setattr(EvictionLayer, "evict", spy)
    cache = EvictionCache(model, budget=48, policy="caote-ahead", block_size=32)
    index_of = cache.layers.index
    with cache, torch.no_grad():
        for start in (0, 32):
            model(input_ids=ids[:, start : start + 32], cache=cache, use_cache=True)
        continuation = model.generate(
            ids, max_new_tokens=LOOKAHEAD_TOKENS, min_new_tokens=LOOKAHEAD_TOKENS, do_sample=False, pad_token_id=0
        )
        attentions = model(continuation, output_attentions=True).attentions
    assert sorted(drafted) == list(range(len(cache.layers)))
    for index, rows in drafted.items():
        expected = attentions[index][:, :, 64:, :64]
        assert rows.shape == expected.shape == (1, 4, LOOKAHEAD_TOKENS, 64)
        assert torch.allclose(rows, expected, atol=1e-6)
    for layer in cache.layers:
        assert layer.retained == 48 and layer.cumulative_length == 64 and int(layer.positions.max()) == 63
    per_token = cache.kv_bytes() // (48 * len(cache.layers))
    assert cache.stats().peak_kv_bytes == per_token * len(cache.layers) * (64 + LOOKAHEAD_TOKENS)


def test_the_look_ahead_is_refused_for_sliding_window_layers():
    with pytest.raises(ValueError, match="sliding-window layers cannot undo"):
        EvictionCache(tiny_model("gemma2", attn_implementation="eager"), budget=48, policy="caote-ahead", block_size=32)
