"""Beyond the paper: the exact CAOTE error over many real query rows (`caote-window`, `caote-block`), checked
against a float64 brute force that evicts, renormalises and recomputes every row's output."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_ids

from caote.cache import EvictionCache
from caote.evaluation.lockstep import lockstep
from caote.scoring import caote_score, multi_row_caote_score


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
    rows = torch.randn(1, 2, 1, 7, generator=generator).softmax(-1).double()  # one query head per KV head
    values = torch.randn(1, 2, 7, 5, generator=generator).double()
    single = caote_score(rows[:, :, 0], values)
    assert torch.allclose(multi_row_caote_score(rows, values), single, rtol=1e-12)


@pytest.mark.parametrize("policy", ["caote-window", "caote-block"])
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
