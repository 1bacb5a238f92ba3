"""The eviction math against brute force."""

import pytest
import torch

from caote.scoring import (
    accumulate_attention,
    aggregate_groups,
    caote_score,
    fast_caote_score,
    group_query_heads,
    keep_recent_rows,
    keydiff_score,
    knorm_score,
    normalise_weights,
    snapkv_score,
)


def brute_force_errors(logits: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """||X - X_{-j}|| for every j, recomputing the softmax without token j (float64)."""
    logits, values = logits.double(), values.double()
    output = torch.einsum("...n,...nd->...d", torch.softmax(logits, -1), values)
    errors = []
    for j in range(logits.shape[-1]):
        keep = [i for i in range(logits.shape[-1]) if i != j]
        without = torch.einsum("...n,...nd->...d", torch.softmax(logits[..., keep], -1), values[..., keep, :])
        errors.append(torch.linalg.vector_norm(output - without, dim=-1))
    return torch.stack(errors, -1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_caote_equals_brute_force_single_query_multi_head(seed):
    generator = torch.Generator().manual_seed(seed)
    heads, tokens, dim = 4, 37, 16
    logits = torch.randn(heads, tokens, generator=generator, dtype=torch.float64) * 3
    values = torch.randn(heads, tokens, dim, generator=generator, dtype=torch.float64)
    weights = torch.softmax(logits, -1)
    expected = brute_force_errors(logits, values)
    got = caote_score(weights, values)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-9)


def test_caote_normalises_unnormalised_weights():
    generator = torch.Generator().manual_seed(3)
    weights = torch.rand(2, 20, generator=generator)
    values = torch.randn(2, 20, 8, generator=generator)
    torch.testing.assert_close(
        caote_score(weights * 7.5, values), caote_score(weights / weights.sum(-1, keepdim=True), values)
    )


def test_gqa_root_sum_square_equals_error_of_concatenated_group_output():
    generator = torch.Generator().manual_seed(4)
    kv_heads, group, tokens, dim = 2, 3, 25, 8
    logits = torch.randn(1, kv_heads * group, tokens, generator=generator, dtype=torch.float64) * 2
    values = torch.randn(1, kv_heads, tokens, dim, generator=generator, dtype=torch.float64)
    # Brute force: evict token j from every head of the group, compare the concatenated head outputs.
    per_query_values = values.repeat_interleave(group, dim=1)
    per_head = brute_force_errors(logits, per_query_values)  # (1, H_q, N)
    expected = per_head.view(1, kv_heads, group, tokens).pow(2).sum(2).sqrt()
    grouped_weights = group_query_heads(torch.softmax(logits, -1), kv_heads)
    got = aggregate_groups(caote_score(grouped_weights, values.unsqueeze(2)), "rss")
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-9)


def test_fast_caote_uses_the_mean_value():
    generator = torch.Generator().manual_seed(5)
    weights = torch.softmax(torch.randn(3, 12, generator=generator), -1)
    values = torch.randn(3, 12, 4, generator=generator)
    mean = values.mean(-2, keepdim=True)
    expected = weights / (1 - weights) * torch.linalg.vector_norm(mean - values, dim=-1)
    torch.testing.assert_close(fast_caote_score(weights, values), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dominant_mass", [1.0, 1 - 1e-4, 1 - 1e-7])
@pytest.mark.parametrize("score", [caote_score, fast_caote_score])
def test_a_token_holding_nearly_all_mass_ranks_first_and_nothing_is_nan(dtype, dominant_mass, score):
    generator = torch.Generator().manual_seed(6)
    tokens = 16
    weights = torch.full((2, tokens), (1 - dominant_mass) / (tokens - 1))
    weights[:, 5] = dominant_mass
    values = torch.randn(2, tokens, 8, generator=generator)
    got = score(weights.to(dtype), values.to(dtype))
    assert torch.isfinite(got).all()
    assert (got.argmax(-1) == 5).all()
    assert got.dtype == torch.float32


def test_normalise_weights_handles_signed_scores_and_masked_tokens():
    scores = torch.tensor([[-3.0, -1.0, float("-inf"), 0.0]])
    weights = normalise_weights(scores, signed=True)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 2 / 5, 0.0, 3 / 5]]))


def test_h2o_accumulation_carries_old_mass_and_starts_new_tokens_at_zero():
    previous = torch.tensor([[[1.0, 2.0]]])
    attention = torch.tensor([[[[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]]]])
    torch.testing.assert_close(accumulate_attention(previous, attention), torch.tensor([[[1.7, 2.55, 0.75]]]))


def test_recent_rows_pad_old_rows_with_zeros_and_keep_the_newest():
    previous = torch.ones(1, 1, 2, 2)
    new = torch.full((1, 1, 1, 3), 0.5)
    rows = keep_recent_rows(previous, new, rows=2)
    torch.testing.assert_close(rows, torch.tensor([[[[1.0, 1.0, 0.0], [0.5, 0.5, 0.5]]]]))


def test_snapkv_pools_votes_over_neighbours():
    window = torch.zeros(1, 1, 2, 7)
    window[..., 0, 3] = 1.0
    window[..., 1, 3] = 2.0
    pooled = snapkv_score(window, kernel_size=3)
    torch.testing.assert_close(pooled, torch.tensor([[[0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]]]))


def test_key_scores():
    keys = torch.tensor([[[[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]]])
    torch.testing.assert_close(knorm_score(keys), -torch.tensor([[[1.0, 2.0, 2**0.5]]]))
    keydiff = keydiff_score(keys)
    assert keydiff.argmax(-1).item() == 0  # (1, 0) is farthest in angle from the mean key (2/3, 1)


@pytest.mark.parametrize("how,expected", [("rss", 5.0), ("mean", 3.5), ("max", 4.0)])
def test_group_aggregations(how, expected):
    grouped = torch.tensor([3.0, 4.0]).view(1, 1, 2, 1)
    assert aggregate_groups(grouped, how).item() == pytest.approx(expected)
