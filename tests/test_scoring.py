"""The eviction math against brute force."""

import math
from fractions import Fraction

import pytest
import torch
from conftest import needs_compiler

from caote import bounds, value_aware
from caote.base_scores import (
    accumulate_attention,
    keep_recent_rows,
    keydiff_score,
    knorm_score,
    random_score,
    snapkv_score,
)
from caote.policies import ScoreInputs, parse_policy
from caote.value_aware import (
    aggregate_groups,
    caote_score,
    fast_caote_score,
    group_query_heads,
    group_size,
    normalise_weights,
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
    padded = torch.tensor([[2.0, 1.0, 1.0, float("-inf")]])  # public scores: padding marked -inf, never NaN
    assert torch.isfinite(caote_score(padded, torch.randn(1, 4, 3, generator=generator))).all()


@pytest.mark.parametrize("padded", [False, True])
def test_a_policy_normalises_its_base_score_once_and_the_transform_reads_it_as_is(monkeypatch, padded):
    generator = torch.Generator().manual_seed(3)
    sums = torch.rand(1, 4, 20, generator=generator) * 7.5  # H2O's attention sums of 4 query heads
    values = torch.randn(1, 2, 20, 8, generator=generator)
    real = torch.ones(1, 2, 20, dtype=torch.bool)
    real[..., :3] = False
    calls = []
    normalise = value_aware.normalise_weights
    monkeypatch.setattr(value_aware, "normalise_weights", lambda *a, **k: calls.append(1) or normalise(*a, **k))
    inputs = ScoreInputs(
        keys=values, values=values, positions=torch.arange(20).expand(1, 2, 20), real=real if padded else None,
        history=sums,
    )  # fmt: skip
    got = parse_policy("h2o+caote").scores(inputs)
    assert len(calls) == 1
    weights = group_query_heads(sums, 2)
    if padded:
        weights = weights.masked_fill(~real.unsqueeze(2), 0.0)
    expected = aggregate_groups(caote_score(weights / weights.sum(-1, keepdim=True), values.unsqueeze(2)), "rss")
    torch.testing.assert_close(got[real] if padded else got, expected[real] if padded else expected)


def test_an_attention_row_is_read_as_the_distribution_it_is_and_its_output_as_the_weighted_output(monkeypatch):
    generator = torch.Generator().manual_seed(5)
    rows = torch.softmax(torch.randn(1, 4, 1, 20, generator=generator) * 2, -1)  # TOVA's newest row
    values = torch.randn(1, 2, 20, 8, generator=generator)
    calls = []
    normalise = value_aware.normalise_weights
    monkeypatch.setattr(value_aware, "normalise_weights", lambda *a, **k: calls.append(1) or normalise(*a, **k))
    inputs = ScoreInputs(keys=None, values=values, positions=torch.arange(20).expand(1, 2, 20), real=None, history=rows)
    got = parse_policy("tova+caote").scores(inputs)
    assert not calls  # a softmax row is not divided by its sum again
    weights = group_query_heads(rows[:, :, -1], 2)
    torch.testing.assert_close(got, aggregate_groups(value_aware.caote_errors(weights, values.unsqueeze(2)), "rss"))
    # a decode step that attended once hands its output on: the bounded scoring reads it as the weighted output
    monkeypatch.setattr(bounds, "BOUNDED_FROM", 0)
    kept = torch.zeros(1, 2, 20, dtype=torch.bool)
    output = value_aware.weighted_values(weights, values.unsqueeze(2))
    seen = []
    lowest = bounds.lowest_errors
    monkeypatch.setattr(bounds, "lowest_errors", lambda *a: seen.append(a[0]) or lowest(*a))
    told = ScoreInputs(**{**inputs.__dict__, "protected": kept, "output": output.clone()})
    parse_policy("tova+caote").scores(told, lowest=1)
    assert torch.equal(seen[-1], output) and seen[-1] is not output
    parse_policy("h2o+caote").scores(ScoreInputs(**{**told.__dict__, "history": rows[:, :, -1]}), lowest=1)
    assert seen[-1] is not told.output  # a sum of rows is no attention row: its own weighted output


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


def brute_force_from_weights(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """||X - X_{-j}|| for every j from the weights themselves: drop j, renormalise the rest, recompute the output.

    In exact rational arithmetic (the inputs' binary values as fractions), so near-one-hot rows, where float64
    itself cancels, are checked too; only the final square root is rounded."""
    weights, values = weights.double(), values.double()
    flat_w = weights.reshape(-1, weights.shape[-1]).tolist()
    flat_v = values.expand(*weights.shape, values.shape[-1]).reshape(len(flat_w), weights.shape[-1], -1).tolist()
    errors = []
    for row_w, row_v in zip(flat_w, flat_v):
        w = [Fraction(x) for x in row_w]
        v = [[Fraction(x) for x in vector] for vector in row_v]
        total = sum(w)
        output = [sum(w[i] * v[i][k] for i in range(len(w))) / total for k in range(len(v[0]))]
        row = []
        for j in range(len(w)):
            rest = total - w[j]
            if rest == 0:
                row.append(math.inf)
                continue
            without = [sum(w[i] * v[i][k] for i in range(len(w)) if i != j) / rest for k in range(len(v[0]))]
            row.append(math.sqrt(float(sum((a - b) ** 2 for a, b in zip(output, without)))))
        errors.append(row)
    return torch.tensor(errors, dtype=torch.float64).view(weights.shape)


def near_one_hot(heads: int, tokens: int, generator: torch.Generator) -> torch.Tensor:
    """Rows whose heaviest token holds 1 - 1e-2 ... 1 - 1e-12 of the mass (float64)."""
    rest = torch.rand(heads, tokens, generator=generator, dtype=torch.float64)
    rest[:, 3] = 0
    rest = rest / rest.sum(-1, keepdim=True) * torch.logspace(-2, -12, heads, dtype=torch.float64).unsqueeze(-1)
    rest[:, 3] = 1 - rest.sum(-1)
    return rest


@pytest.mark.parametrize("seed", [0, 1])
def test_caote_is_exact_for_every_token_including_near_one_hot_rows(seed):
    generator = torch.Generator().manual_seed(seed)
    heads, tokens, dim = 6, 21, 8
    weights = torch.cat(
        [
            torch.softmax(torch.randn(heads, tokens, generator=generator, dtype=torch.float64) * 4, -1),
            near_one_hot(heads, tokens, generator),
        ]
    )
    values = torch.randn(2 * heads, tokens, dim, generator=generator, dtype=torch.float64)
    expected = brute_force_from_weights(weights, values)
    got64 = caote_score(weights, values)
    assert got64.dtype == torch.float64
    torch.testing.assert_close(got64, expected, rtol=1e-5, atol=0)
    got32 = caote_score(weights.float(), values.float())
    assert got32.dtype == torch.float32
    # float32 inputs round the weights themselves to ~1e-7 relative; the heaviest token's error stays accurate too
    torch.testing.assert_close(got32.double(), expected, rtol=1e-3, atol=1e-6)


def test_a_token_with_most_but_not_all_mass_gets_its_exact_error_not_a_made_up_one():
    weights = torch.tensor([0.9995, 0.0002, 0.0003])
    values = torch.tensor([[1.0, 0.0], [0.0, 40.0], [30.0, 20.0]])
    expected = brute_force_from_weights(weights, values)
    got = caote_score(weights, values)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)
    assert got[0] == pytest.approx(float(expected[0]), rel=1e-5)  # 50.21..., not 2 * max + 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("score", [caote_score, fast_caote_score])
def test_a_token_holding_all_the_mass_ranks_first_and_nothing_is_nan(dtype, score):
    generator = torch.Generator().manual_seed(6)
    weights = torch.zeros(2, 16)
    weights[:, 5] = 1.0
    values = torch.randn(2, 16, 8, generator=generator)
    got = score(weights.to(dtype), values.to(dtype))
    assert not torch.isnan(got).any()
    assert (got[:, 5] == float("inf")).all()  # evicting it leaves nothing to renormalise: undefined, so kept
    assert torch.isfinite(got[:, [i for i in range(16) if i != 5]]).all()
    assert got.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_are_scored_in_float32(dtype):
    generator = torch.Generator().manual_seed(8)
    weights = torch.softmax(torch.randn(3, 10, generator=generator), -1)
    values = torch.randn(3, 10, 4, generator=generator)
    got = caote_score(normalise_weights(weights.to(dtype)), values.to(dtype))
    assert got.dtype == torch.float32
    expected = brute_force_from_weights(weights.to(dtype), values.to(dtype))
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)


def test_padding_takes_no_part_in_fastcaote_mean_nor_keydiff_anchor():
    generator = torch.Generator().manual_seed(9)
    values = torch.randn(1, 1, 6, 4, generator=generator)
    real = torch.tensor([[[False, False, True, True, True, True]]])
    weights = torch.tensor([[[0.0, 0.0, 0.1, 0.2, 0.3, 0.4]]])
    padded = fast_caote_score(weights, values, real)
    alone = fast_caote_score(weights[..., 2:], values[..., 2:, :])
    torch.testing.assert_close(padded[..., 2:], alone)
    torch.testing.assert_close(keydiff_score(values, real)[..., 2:], keydiff_score(values[..., 2:, :]))


def test_random_scores_come_from_a_cpu_generator_on_any_device():
    keys = torch.zeros(1, 2, 5, 4)
    first = random_score(keys, torch.Generator().manual_seed(0))
    again = random_score(keys, torch.Generator().manual_seed(0))
    torch.testing.assert_close(first, again)
    if not torch.cuda.is_available():
        pytest.skip("no second device type here (CUDA absent): the cross-device draw is untested on this machine")
    on_gpu = random_score(keys.cuda(), torch.Generator().manual_seed(0))
    assert on_gpu.device.type == "cuda"
    torch.testing.assert_close(on_gpu.cpu(), first)


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
    window = torch.zeros(1, 1, 2, 9)
    window[..., 0, 3] = 1.0
    window[..., 1, 3] = 2.0
    window[..., 1, 8] = 1.0  # a vote for the window's own token: kept as is, never pooled onto its neighbours
    pooled = snapkv_score(window, kernel_size=3)
    torch.testing.assert_close(pooled, torch.tensor([[[0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]]]))


def test_snapkv_pools_only_the_tokens_before_the_window_like_the_original():
    generator = torch.Generator().manual_seed(10)
    rows = torch.softmax(torch.randn(1, 2, 4, 20, generator=generator), -1)
    got = snapkv_score(rows, kernel_size=5)
    # SnapKV: attn[..., -w:, :-w].sum(-2), then avg_pool1d(kernel 5, padding 2, stride 1)
    votes = rows[..., :-4].sum(-2)
    expected = torch.nn.functional.avg_pool1d(votes.view(2, 1, 16), 5, stride=1, padding=2).view(1, 2, 16)
    torch.testing.assert_close(got[..., :16], expected)
    torch.testing.assert_close(got[..., 16:], rows[..., 16:].sum(-2))


def test_key_scores():
    keys = torch.tensor([[[[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]]])
    torch.testing.assert_close(knorm_score(keys), -torch.tensor([[[1.0, 2.0, 2**0.5]]]))
    keydiff = keydiff_score(keys)
    assert keydiff.argmax(-1).item() == 0  # (1, 0) is farthest in angle from the mean key (2/3, 1)


@pytest.mark.parametrize("how,expected", [("rss", 5.0), ("mean", 3.5), ("max", 4.0)])
def test_group_aggregations(how, expected):
    grouped = torch.tensor([3.0, 4.0]).view(1, 1, 2, 1)
    assert aggregate_groups(grouped, how).item() == pytest.approx(expected)


@pytest.mark.parametrize("score", [caote_score, fast_caote_score])
def test_values_broadcast_over_leading_axes_the_weights_have(score):
    generator = torch.Generator().manual_seed(12)
    weights = torch.softmax(torch.randn(2, 3, 50, generator=generator), -1)
    weights[0, 0, 7] = 0.9  # one token above half the mass: the stable form of the heaviest token runs too
    values = torch.randn(50, 8, generator=generator)
    torch.testing.assert_close(score(weights, values), score(weights, values.expand(2, 3, 50, 8)))


def heavy_case(seed: int):
    """Weights (B, H_kv, g, N) whose first token holds more than half of every row, and values (B, H_kv, 1, N, d)."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(2, 2, 3, 12, generator=generator)
    weights[..., 0] = 20.0
    weights = weights / weights.sum(-1, keepdim=True)
    return weights, torch.randn(2, 2, 1, 12, 5, generator=generator)


@pytest.mark.parametrize("errors", [value_aware.caote_errors, value_aware.fast_caote_errors])
def test_a_kept_heavy_token_skips_the_stable_form_and_leaves_every_other_error_alone(errors):
    weights, values = heavy_case(3)
    stable = errors(weights, values)
    kept = torch.zeros(2, 2, 1, 12, dtype=torch.bool)
    assert torch.equal(errors(weights, values, protected=kept), stable)  # nothing kept: the stable form as before
    kept[..., 0] = True
    skipped = errors(weights, values, protected=kept)
    assert torch.equal(skipped[..., 1:], stable[..., 1:]) and torch.isfinite(skipped).all()
    assert not torch.equal(skipped[..., 0], stable[..., 0])  # the heavy entry, which the cache never reads
    kept[0, 0, 0, 0] = False  # one row's heavy token may be evicted: its rows get the stable form, no other
    partly = errors(weights, values, protected=kept)
    assert torch.equal(partly[0, 0], stable[0, 0]) and torch.equal(partly[..., 1:], stable[..., 1:])
    assert torch.equal(partly[1:, ..., 0], skipped[1:, ..., 0])


@needs_compiler
@pytest.mark.parametrize("errors", [value_aware.caote_errors, value_aware.fast_caote_errors])
def test_the_fused_compiled_errors_equal_the_eager_ones_up_to_float32_rounding(errors):
    generator = torch.Generator().manual_seed(4)
    weights = torch.softmax(torch.randn(2, 3, 2, 40, generator=generator) * 3, -1)
    values = torch.randn(2, 3, 1, 40, 16, generator=generator)
    eager = errors(weights, values)
    fused = errors(weights, values, fused=True)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-7)
    exact = errors(weights.double(), values.double())
    assert ((fused.double() - exact).abs() / exact).max() < 1e-5  # both are float32 results of the same formula
    weights, values = heavy_case(5)  # the heavy token still gets the stable form
    torch.testing.assert_close(errors(weights, values, fused=True), errors(weights, values), rtol=1e-5, atol=1e-7)


def bounded_case(seed: int, tokens: int = 300, near: int = 0, heavy: bool = False, ties: bool = False, group: int = 3):
    """Decode-step inputs of `bounds.lowest_errors`: softmax weights over ``tokens``, values ``(2, 3, 1, N, 16)``
    with an output of ``group`` query heads per KV head; ``near`` values put within 1e-5 of the output (where the
    norms' difference is far below their size), a heavy unkept token, or every value equal to another's (exact
    ties)."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.softmax(torch.randn(2, 3, group, tokens, generator=generator) * 2.5, -1)
    if heavy:
        weights[0, 1, 2, 7] = 40.0  # unkept (not a sink, not the newest)
        weights = weights / weights.sum(-1, keepdim=True)
    values = torch.randn(2, 3, 1, tokens, 16, generator=generator) * 4 + 3
    if ties:
        values[..., tokens // 2 :, :] = values[..., : tokens - tokens // 2, :]
        weights[..., tokens // 2 :] = weights[..., : tokens - tokens // 2]
    output = value_aware.weighted_values(weights, values)
    for token in range(10, 10 + near):  # a value at the output: ||x - v|| ~ 1e-5 beside norms of ~20
        values[:, :, 0, token] = output[:, :, token % group] + 1e-5 * torch.randn(2, 3, 16, generator=generator)
    output = value_aware.weighted_values(weights, values)
    kept = torch.zeros(2, 3, 1, tokens, dtype=torch.bool)
    kept[..., :4] = True  # sinks
    kept[..., -1] = True  # the newest
    return weights, values, output, kept


def victims(scores: torch.Tensor, kept: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` lowest unkept entries, ties to the lowest index (as `EvictionLayer._lowest`)."""
    return scores.masked_fill(kept.squeeze(2), math.inf).argsort(dim=-1, stable=True)[..., :count]


@pytest.mark.parametrize("output", [value_aware.caote_output, value_aware.fast_caote_output])
@pytest.mark.parametrize("how", value_aware.GQA_AGGREGATIONS)
@pytest.mark.parametrize(
    "case",
    [{}, {"near": 12}, {"heavy": True}, {"ties": True}, {"near": 6, "heavy": True}, {"group": 5, "ties": True}]
    + [{"group": 8, "heavy": True}, {"group": 7, "near": 6}],
)
@pytest.mark.parametrize("count", [1, 3])
def test_bounded_errors_evict_what_the_direct_errors_evict(output, how, case, count, monkeypatch):
    monkeypatch.setattr(bounds, "BOUNDED_FROM", 0)  # small cases: the bounds would give way to the direct path
    monkeypatch.setattr(bounds, "MOST_CANDIDATES", 1.0)  # and so might these synthetic rows (10-26 % candidates)
    for seed in range(3):
        weights, values, _, kept = bounded_case(seed, **case)
        errors = value_aware.caote_errors if output is value_aware.caote_output else value_aware.fast_caote_errors
        direct = aggregate_groups(errors(weights, values, protected=kept), how)
        weighted = output is value_aware.caote_output
        bounded = bounds.lowest_errors(output(weights, values), weights, values, kept, count, how, weighted)
        assert bounded is not None
        unkept = ~kept.squeeze(2)
        assert (bounded[unkept] <= direct[unkept]).all()  # every entry is a lower bound
        chosen = victims(bounded, kept, count)
        assert torch.equal(chosen, victims(direct, kept, count))
        assert torch.equal(bounded.gather(-1, chosen), direct.gather(-1, chosen))  # exact, bit for bit
        assert (bounded == direct).sum() < 0.3 * bounded.numel()  # most tokens were never scored directly


@pytest.mark.parametrize("how", value_aware.GQA_AGGREGATIONS)
def test_a_heavy_token_whose_value_is_the_others_mean_is_evicted_by_the_bounded_errors_too(how, monkeypatch):
    """A token holding 90 % of every row of a group, its value within 1e-6 of the others' mean: its stable
    error is the group's lowest, so its bound must let it through as a candidate and its exact error be the
    stable form's; elsewhere the heavy tokens' bounds are lower bounds of their stable errors."""
    monkeypatch.setattr(bounds, "BOUNDED_FROM", 0)
    weights, values, _, kept = bounded_case(4)
    heavy = 150
    weights[0, 1] = 0.1 / (weights.shape[-1] - 1)  # the others share a tenth evenly
    weights[0, 1, :, heavy] = 0.9
    others = weights[0, 1, 0].clone()
    others[heavy] = 0.0
    mean = (others / others.sum()) @ values[0, 1, 0]
    values[0, 1, 0, heavy] = mean + 1e-6 * torch.randn(16, generator=torch.Generator().manual_seed(3))
    output = value_aware.weighted_values(weights, values)
    direct = aggregate_groups(value_aware.caote_errors(weights, values, protected=kept), how)
    assert victims(direct, kept, 1)[0, 1, 0] == heavy
    bounded = bounds.lowest_errors(output, weights, values, kept, 1, how, True)
    unkept = ~kept.squeeze(2)
    assert (bounded[unkept] <= direct[unkept]).all()
    assert torch.equal(victims(bounded, kept, 1), victims(direct, kept, 1))
    assert bounded[0, 1, heavy] == direct[0, 1, heavy]


def test_bounded_errors_give_way_to_the_direct_ones_where_their_premises_fail(monkeypatch):
    monkeypatch.setattr(bounds, "BOUNDED_FROM", 0)
    weights, values, output, kept = bounded_case(0)
    assert bounds.lowest_errors(output.double(), weights.double(), values.double(), kept, 1, "rss", True) is None
    assert bounds.lowest_errors(output, weights, values, torch.ones_like(kept), 1, "rss", True) is None  # all kept
    flat = torch.full_like(weights, 1.0 / weights.shape[-1])  # every token alike: all of them candidates
    same = torch.ones_like(values)
    assert bounds.lowest_errors(value_aware.weighted_values(flat, same), flat, same, kept, 1, "rss", True) is None
    broken = values.clone()
    broken[1, 2, 0, 50, 3] = math.inf  # a non-finite value: its norm bounds nothing
    broken_output = value_aware.weighted_values(weights, broken)
    assert bounds.lowest_errors(broken_output, weights, broken, kept, 1, "rss", True) is None


def test_bounded_errors_read_the_value_norms_they_are_given():
    """The bounds come from norms alone (a layer decoding in place hands its cached ones): given norms, the same
    entries."""
    weights, values, output, kept = bounded_case(3, near=4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bounds, "BOUNDED_FROM", 0)
        computed = bounds.lowest_errors(output, weights, values, kept, 2, "rss", True)
        norms = torch.linalg.vector_norm(values, dim=-1)
        assert torch.equal(bounds.lowest_errors(output, weights, values, kept, 2, "rss", True, norms), computed)


def test_the_heavy_token_is_bounded_only_under_float32_products(monkeypatch):
    """`heavy_token_lower_bound` assumes the weighted output came from float32 products: under bfloat16 ones (set by
    either precision API) the heavy token's own entry bounds nothing, and the same tokens still go."""
    monkeypatch.setattr(bounds, "BOUNDED_FROM", 0)
    assert bounds.full_float32_products()
    torch.set_float32_matmul_precision("medium")
    try:
        assert not bounds.full_float32_products()
    finally:
        torch.set_float32_matmul_precision("highest")
    assert bounds.full_float32_products()
    weights, values, output, kept = bounded_case(5, heavy=True)
    direct = aggregate_groups(value_aware.caote_errors(weights, values, protected=kept), "rss")
    calls = []
    bound = bounds.heavy_token_lower_bound
    monkeypatch.setattr(bounds, "heavy_token_lower_bound", lambda *a: calls.append(1) or bound(*a))
    for full in (True, False):
        monkeypatch.setattr(bounds, "full_float32_products", lambda: full)
        bounded = bounds.lowest_errors(output, weights, values, kept, 1, "rss", True)
        assert torch.equal(victims(bounded, kept, 1), victims(direct, kept, 1))
        assert len(calls) == 1


def test_the_triangle_bounds_need_their_rounding_slack_where_they_are_tight(monkeypatch):
    """Values parallel to the output make ``| ||x|| - ||v|| | = ||x - v||`` exact: only the slack for float32 norms
    keeps the computed lower bounds below the computed distances, and without it some bound lies above."""
    monkeypatch.setattr(bounds, "BOUNDED_FROM", 0)
    generator = torch.Generator().manual_seed(11)
    weights = torch.softmax(torch.randn(2, 4, 1, 400, generator=generator) * 2, -1)
    direction = torch.randn(2, 4, 1, 1, 64, generator=generator)
    values = direction * (torch.rand(2, 4, 1, 400, 1, generator=generator) * 6 + 1)  # v_j = s_j u
    kept = torch.zeros(2, 4, 1, 400, dtype=torch.bool)
    output = value_aware.weighted_values(weights, values)
    direct = aggregate_groups(value_aware.caote_errors(weights, values, protected=kept), "rss")
    bounded = bounds.lowest_errors(output, weights, values, kept, 1, "rss", True)
    assert (bounded <= direct).all()
    assert torch.equal(victims(bounded, kept, 1), victims(direct, kept, 1))
    monkeypatch.setattr(bounds, "NORM_ROUNDING", 0.0)
    monkeypatch.setattr(bounds, "BOUND_MARGIN", 0.0)
    assert not (bounds.lowest_errors(output, weights, values, kept, 1, "rss", True) <= direct).all()


def test_bounded_errors_give_way_to_the_direct_ones_below_their_size(monkeypatch):
    weights, values, output, kept = bounded_case(2)  # 2 x 3 rows of 300 tokens
    assert bounds.lowest_errors(output, weights, values, kept, 1, "rss", True) is None
    monkeypatch.setattr(bounds, "BOUNDED_FROM", 2 * 3 * 300)
    assert bounds.lowest_errors(output, weights, values, kept, 1, "rss", True) is not None


def test_a_policy_told_how_many_go_scores_only_the_candidates_and_evicts_the_same(monkeypatch):
    monkeypatch.setattr(bounds, "BOUNDED_FROM", 0)
    weights, values, _, kept = bounded_case(1, heavy=True)
    rows = weights.view(2, 9, 1, -1)
    inputs = ScoreInputs(
        keys=None, values=values.squeeze(2), positions=torch.arange(300).expand(2, 3, 300), real=None,
        history=rows, protected=kept.squeeze(2),
    )  # fmt: skip
    for name in ("tova+caote", "tova+fastcaote", "tova+caote/max"):
        policy = parse_policy(name)
        direct, bounded = policy.scores(inputs), policy.scores(inputs, lowest=2)
        assert not torch.equal(direct, bounded)
        assert torch.equal(victims(bounded, kept, 2), victims(direct, kept, 2))


def test_the_stable_form_of_a_few_heavy_rows_reads_only_their_values_and_agrees_with_every_row_read():
    generator = torch.Generator().manual_seed(7)
    weights = torch.softmax(torch.randn(3, 4, 3, 12, generator=generator) * 0.3, -1)  # no token above 1/2
    values = torch.randn(3, 4, 1, 12, 5, generator=generator)
    weights[0, 1, 2] = torch.full((12,), 1.0).index_fill_(0, torch.tensor([3]), 30.0) / 41.0
    weights[2, 0, 0] = torch.full((12,), 1.0).index_fill_(0, torch.tensor([0]), 30.0) / 41.0
    kept = torch.zeros(3, 4, 1, 12, dtype=torch.bool)
    kept[2, 0, 0, 0] = True  # that row's heavy token stays: it needs no stable form
    top_weight, heaviest, heavy = value_aware.heavy_tokens(weights, kept)
    stable = value_aware.heavy_token_errors(weights, values, top_weight, heaviest, heavy)
    assert heavy.sum() == 1 and heavy[0, 1, 2]  # 1 row of 12 value rows: only its values are read
    every = value_aware.heavy_token_errors(weights, values, top_weight, heaviest)  # an accelerator's way: every row
    torch.testing.assert_close(stable[heavy], every[heavy], rtol=1e-6, atol=0)
    assert (stable[~heavy] == 0).all()
    weights[:, :, :, 5] = 2.0  # every row heavy: every row read
    weights = weights / weights.sum(-1, keepdim=True)
    top_weight, heaviest, heavy = value_aware.heavy_tokens(weights)
    stable = value_aware.heavy_token_errors(weights, values, top_weight, heaviest, heavy)
    assert torch.equal(stable, value_aware.heavy_token_errors(weights, values, top_weight, heaviest))


def test_group_size_refuses_kv_heads_that_do_not_divide_the_query_heads():
    assert group_size(12, 4) == 3 and group_size(8, 8) == 1
    with pytest.raises(ValueError, match="6 query heads cannot be grouped over 4 KV heads"):
        group_size(6, 4)
    with pytest.raises(ValueError, match="cannot be grouped"):
        group_query_heads(torch.zeros(1, 6, 5), 4)
