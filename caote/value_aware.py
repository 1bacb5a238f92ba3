"""The value-aware eviction math of CAOTE (Goel et al., arXiv 2504.14051) as pure tensor functions: no model, no cache.

Shapes follow one vocabulary:

* ``weights``  ``(..., N)``: a distribution over the N cached tokens (`normalise_weights`), e.g. ``(B, H_kv, g, N)``
  for the ``g`` query heads of each KV head (`group_query_heads`).
* ``values``  ``(B, H_kv, N, d)``, or ``(..., N, d)`` broadcast against the weights.
* an error  ``(..., N)``: what evicting token j alone changes in the attention output, lower = evict first.

The error of token j is ``c_j = w_j / (1 - w_j) * ||X - v_j||_2`` (Thm. 3.2) for the output ``X = sum_i w_i v_i``
(CAOTE) or the mean value (FastCAOTE, §3); `eviction_weight` is its factor. A **heavy token** holds more than half
of its row's weight (``w_j > 1/2``, at most one per row): there ``1 - w_j`` and ``X - v_j`` lose digits to
cancellation, so its error is computed in the stable form ``w_j * ||X_-j / rest - v_j||_2`` from the other tokens
alone (`heavy_tokens`, `heavy_token_errors`, `stabilise_heavy_tokens`).

The query heads sharing a KV head combine their errors per token (`aggregate_groups`, ``GQA_AGGREGATIONS``).
"""

from __future__ import annotations

import functools
import math

import torch

GQA_AGGREGATIONS = ("rss", "mean", "max")


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (a researcher checking the math keeps full precision); anything else runs in float32."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def normalise_weights(
    weights: torch.Tensor, signed: bool = False, padded: bool = True, positive: bool = False
) -> torch.Tensor:
    """Turn a base score into a distribution over tokens (sums to 1 over the last axis; float32, or float64 input).

    Non-negative scores are divided by their sum (the paper's ``f_norm`` for H2O and SnapKV). Signed scores
    (KeyDiff, K-norm) are first shifted so that their minimum is zero, which keeps the ranking.
    Masked-out tokens (padding) carry ``-inf``: they get weight 0 and take no part in the minimum. ``padded=False``
    promises finite non-negative scores (no padding, not signed): the division alone, the same numbers;
    ``positive=True`` further promises every row a positive sum (attention rows), so the sum needs no floor.
    """
    weights = weights.to(compute_dtype(weights))
    if not padded and not signed:
        total = weights.sum(-1, keepdim=True)
        return weights / (total if positive else total.clamp_min(torch.finfo(weights.dtype).tiny))
    finite = torch.isfinite(weights)
    weights = torch.where(finite, weights, torch.zeros_like(weights))
    if signed:
        floor = torch.where(finite, weights, torch.full_like(weights, math.inf)).amin(-1, keepdim=True)
        weights = torch.where(finite, weights - floor, torch.zeros_like(weights))
    weights = weights.clamp_min(0.0)
    return weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)


def eviction_weight(weights: torch.Tensor, clamp: bool = True) -> torch.Tensor:
    """``w_j / (1 - w_j)``: the factor of token j's eviction error (arXiv 2504.14051, Thm. 3.2), by which the others'
    renormalised weights grow when j goes. ``1 - w_j`` is floored at 1/2, where only a heavy token reaches, whose
    entry `stabilise_heavy_tokens` replaces: the floor keeps it finite. ``clamp=False`` for weights known to be at
    most 1/2 (``1 - w_j >= 1/2`` already): the same numbers, one operator fewer."""
    if not clamp:
        return weights / (1.0 - weights)
    return weights / (1.0 - weights).clamp_min(0.5)


def eviction_error(
    weights: torch.Tensor,
    values: torch.Tensor,
    output: torch.Tensor | None = None,
    protected: torch.Tensor | None = None,
    fused: bool = False,
) -> torch.Tensor:
    """``w_j / (1 - w_j) * ||output - v_j||_2`` for every token j, exact for every weight.

    ``weights`` ``(..., N)`` sum to 1; ``values`` ``(..., N, d)`` broadcast against them; ``output`` ``(..., d)``
    (None: the weighted output ``sum_i w_i v_i``). The formula is well conditioned as written for ``w_j <= 1/2``; a
    heavy token gets the stable form (`stabilise_heavy_tokens`), unless ``protected`` ``(..., N)`` (bool, broadcast
    against the weights) marks it as a token the cache keeps whatever its score (a sink, the recent window): its
    entry is then finite but not its exact error, which nothing reads. ``fused``: the output, the distances and the
    formula in one compiled kernel (`compiled`)."""
    if values.dim() < weights.dim() + 1:  # leading axes the broadcast would add
        values = values[(None,) * (weights.dim() + 1 - values.dim())]
    if fused:
        if output is None:
            error = compiled(fused_caote_error)(weights, values)
        else:
            error = compiled(fused_eviction_error)(weights, values, output)
    else:
        distance = distances(weighted_values(weights, values) if output is None else output, values)
        if not may_hold_heavy_token(weights):  # every w_j <= 1/2: the formula as written, no clamp needed
            return eviction_weight(weights, clamp=False) * distance
        error = eviction_weight(weights) * distance
    if (fused or protected is not None) and not may_hold_heavy_token(weights, protected):  # no heavy token, or all kept
        return error
    return stabilise_heavy_tokens(error, weights, values, protected)


def fused_eviction_error(weights: torch.Tensor, values: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """The clamped formula ``w_j / max(1 - w_j, 1/2) * ||output - v_j||_2`` as one expression, for `torch.compile`
    to fuse into a single pass over the values (`compiled`); eager, it would hold a ``(..., N, d)`` difference."""
    distance = (output.unsqueeze(-2) - values).pow(2).sum(-1).sqrt()
    return eviction_weight(weights) * distance


def fused_caote_error(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`fused_eviction_error` about the weighted output ``sum_i w_i v_i``, computed in the same expression."""
    return fused_eviction_error(weights, values, (weights.unsqueeze(-1) * values).sum(-2))


@functools.cache
def compiled(function):
    """``function`` compiled by `torch.compile` (once per process; recompiled by torch for a new shape): the opt-in
    fused kernels of a decode step (``CacheSettings.compile_decode``). Float32 sums in another order than the eager
    `torch.cdist` and `torch.bmm`: the errors differ from the eager ones by float32 rounding (~1e-7 relative)."""
    return torch.compile(function)


def distances(output: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``||output - v_j||_2`` for every token j: ``output`` ``(..., d)``, ``values`` ``(..., N, d)`` with as many
    axes plus one, broadcast against it -> ``(..., N)``. One `torch.cdist` in its direct mode (the difference is
    squared and summed per pair, never held as a ``(..., N, d)`` tensor, nor expanded into matrix products); a KV
    group's outputs ``(..., g, d)`` over its shared values ``(..., 1, N, d)`` are its rows, the values not copied
    where their leading axes match the outputs' (`torch.cdist` copies broadcast ones). Devices `torch.cdist`'s
    direct mode does not run on take the norm of the difference."""
    if values.device.type not in ("cpu", "cuda"):
        return torch.linalg.vector_norm(output.unsqueeze(-2) - values, dim=-1)
    if values.dim() >= 3 and values.shape[-3] == 1 and output.dim() == values.dim() - 1:
        rows, others = output, values.squeeze(-3)
    else:
        rows, others = output.unsqueeze(-2), values
    distance = torch.cdist(rows, others, compute_mode="donot_use_mm_for_euclid_dist")
    return distance if rows is output else distance.squeeze(-2)


def may_hold_heavy_token(weights: torch.Tensor, protected: torch.Tensor | None = None) -> bool:
    """Whether a row of ``weights`` may hold a heavy token (more than half its weight) that ``protected`` (bool,
    broadcast against the weights) does not mark. On the CPU, where reading a number back costs nothing, the answer
    is exact, so the ~30 operators of the stable form are skipped on most decode steps (and on the steps of H2O's
    sums, whose heavy token is a protected sink); on an accelerator it is always yes, so that nothing waits for the
    device."""
    if weights.device.type != "cpu" or weights.numel() == 0:
        return True
    if protected is None:
        return weights.max().item() > 0.5
    return ((weights > 0.5) & ~protected).any().item()


def heavy_tokens(weights: torch.Tensor, protected: torch.Tensor | None = None) -> tuple:
    """Each row's heaviest token, ``(..., 1)`` each: its weight, its index, and whether it is a heavy token (more
    than half the row) that ``protected`` (bool, broadcast against the weights) does not mark."""
    top_weight, heaviest = weights.max(-1, keepdim=True)
    heavy = top_weight > 0.5
    if protected is not None:
        heavy &= ~protected.expand_as(weights).gather(-1, heaviest)
    return top_weight, heaviest, heavy


def heavy_token_errors(
    weights: torch.Tensor,
    values: torch.Tensor,
    top_weight: torch.Tensor,
    heaviest: torch.Tensor,
    heavy: torch.Tensor | None = None,
) -> torch.Tensor:
    """The stable error ``(..., 1)`` of each row's heaviest token (`heavy_tokens`): with ``X_-j = sum_{i != j} w_i v_i``
    and ``rest = sum_{i != j} w_i``, ``c_j = w_j * ||X_-j / rest - v_j||_2``, ``+inf`` when every other weight is
    exactly zero (evicting j leaves nothing to renormalise: it always ranks first). ``weights`` ``(..., N)`` sum to
    1, ``values`` ``(..., N, d)`` broadcast against them. Given ``heavy``, on the CPU, when such rows are few (a
    decode step's unkept heavy tokens), only their values are read (elsewhere the error is 0)."""
    if heavy is not None and weights.device.type == "cpu" and weights.dim() > 1:  # reading back which rows is free
        rows = torch.nonzero(heavy.flatten()).squeeze(-1)
        if 2 * rows.numel() <= values.shape[:-2].numel():  # few: copying their values costs less than reading all
            at = torch.unravel_index(rows, heavy.shape[:-1])
            own = values.expand(*weights.shape[:-1], *values.shape[-2:])[at]  # (R, N, d)
            stable = heavy_token_errors(weights[at], own, top_weight[at], heaviest[at])
            return torch.zeros_like(top_weight).index_put_(at, stable)
    others = weights.scatter(-1, heaviest, 0.0)
    rest = others.sum(-1, keepdim=True)
    without = weighted_values(others, values)  # broadcast, not expanded: no copy of the values
    top_value = torch.take_along_dim(values, heaviest.unsqueeze(-1), dim=-2).squeeze(-2)
    moved = torch.linalg.vector_norm(without / rest - top_value, dim=-1, keepdim=True)
    return torch.where(rest > 0, top_weight * moved, torch.full_like(moved, math.inf))


def stabilise_heavy_tokens(
    error: torch.Tensor, weights: torch.Tensor, values: torch.Tensor, protected: torch.Tensor | None = None
) -> torch.Tensor:
    """``error`` ``(..., N)`` with each heavy token's entry replaced by its stable form (`heavy_token_errors`); a heavy
    token ``protected`` marks keeps its entry as given. ``values`` ``(..., N, d)`` with as many axes as ``weights`` plus
    one (size-1 axes broadcast). Callers skip it when `may_hold_heavy_token` says no row has one."""
    top_weight, heaviest, heavy = heavy_tokens(weights, protected)
    stable = heavy_token_errors(weights, values, top_weight, heaviest, heavy)
    return error.scatter(-1, heaviest, torch.where(heavy, stable, error.gather(-1, heaviest)))


def weighted_values(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i v_i``: ``weights`` ``(..., N)``, ``values`` ``(..., N, d)`` broadcast against them -> ``(..., d)``.
    A KV group's weights ``(B, H_kv, g, N)`` over its shared values ``(B, H_kv, 1, N, d)`` are one batched matrix
    product, the values not copied per query head."""
    if values.dim() == 5 and weights.dim() == 4 and values.shape[2] == 1 and values.shape[:2] == weights.shape[:2]:
        batch, kv_heads, group, tokens = weights.shape
        output = torch.bmm(weights.reshape(-1, group, tokens), values.reshape(-1, tokens, values.shape[-1]))
        return output.view(batch, kv_heads, group, -1)
    return torch.einsum("...n,...nd->...d", weights, values)


def masked_mean(values: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``values`` ``(..., N, d)`` over the tokens ``real`` ``(..., N)`` marks (all when None)."""
    if real is None:
        return values.mean(-2)
    real = real.to(values.dtype).unsqueeze(-1)
    return (values * real).sum(-2) / real.sum(-2).clamp_min(1.0)


def caote_errors(
    weights: torch.Tensor,
    values: torch.Tensor,
    real: torch.Tensor | None = None,
    protected: torch.Tensor | None = None,
    fused: bool = False,
) -> torch.Tensor:
    """CAOTE eviction error of every token (Goel et al., arXiv 2504.14051, Thm. 3.2), from a distribution.

    ``c_j = w_j / (1 - w_j) * || sum_i w_i v_i - v_j ||_2``: the exact change of the attention output when token j
    alone is evicted and the softmax renormalised. ``weights`` ``(..., N)`` already sum to 1 (`normalise_weights`:
    float32, or float64; padding has weight 0); ``values`` ``(..., N, d)`` broadcast against them (GQA: weights
    ``(B, H_kv, g, N)``, values ``(B, H_kv, 1, N, d)``). ``real`` is accepted for the same signature as
    `fast_caote_errors`; ``protected`` marks tokens whose own error nothing reads (`eviction_error`); ``fused``
    computes the weighted output, the distances and the formula in one compiled kernel (`compiled`). Never NaN.
    `Policy.scores` calls this after its one normalisation.
    """
    weights = weights.to(compute_dtype(weights))
    values = values.to(weights.dtype)
    return eviction_error(weights, values, None, protected, fused)


def fast_caote_errors(
    weights: torch.Tensor,
    values: torch.Tensor,
    real: torch.Tensor | None = None,
    protected: torch.Tensor | None = None,
    fused: bool = False,
) -> torch.Tensor:
    """FastCAOTE (arXiv 2504.14051, §3): CAOTE with the plain mean of the values in place of ``sum_i w_i v_i``.

    ``c_j = w_j / (1 - w_j) * || mean_i v_i - v_j ||_2``; weights and values as in `caote_errors`. ``real``
    ``(..., N)`` (broadcast like the weights' leading axes) marks the tokens that are not padding: the mean is over
    those only; ``protected`` and ``fused`` as in `caote_errors`.
    """
    weights = weights.to(compute_dtype(weights))
    values = values.to(weights.dtype)
    return eviction_error(weights, values, masked_mean(values, real), protected, fused)


def caote_output(weights: torch.Tensor, values: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """The point CAOTE measures every value from: the weighted output ``sum_i w_i v_i`` (`caote_errors`)."""
    return weighted_values(weights, values)


def fast_caote_output(weights: torch.Tensor, values: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """The point FastCAOTE measures every value from: the mean of the real values (`fast_caote_errors`)."""
    return masked_mean(values, real)


def caote_score(weights: torch.Tensor, values: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """`caote_errors` of any non-negative scores: ``weights`` ``(..., N)`` are normalised to sum to 1 first
    (``-inf`` marks padding, which gets weight 0). Never NaN."""
    return caote_errors(normalise_weights(weights), values, real)


def fast_caote_score(weights: torch.Tensor, values: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """`fast_caote_errors` of any non-negative scores, normalised first as in `caote_score`."""
    return fast_caote_errors(normalise_weights(weights), values, real)


def row_eviction_errors(rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Exact output change ``e_rj = a_rj / (1 - a_rj) * ||X_r - v_j||`` of every query row r when token j alone is
    evicted and row r renormalised, for many rows at once: ``rows`` ``(B, H_kv, g, R, N)`` attention (each row is
    renormalised over its support first), ``values`` ``(B, H_kv, N, d)``; returns ``(B, H_kv, g, R, N)``.

    ``||X_r - v_j||^2`` is expanded into matrix products (one batched matmul per term, no ``R x N x d`` tensor);
    a row's heavy token gets the stable form (`stabilise_heavy_tokens`).
    """
    weights = rows.to(compute_dtype(rows))
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
    values = values.to(weights.dtype).unsqueeze(2)  # (B, H_kv, 1, N, d): shared by the group's query heads
    output = weights @ values  # (B, H_kv, g, R, d)
    squared = (
        output.pow(2).sum(-1, keepdim=True)
        - 2 * output @ values.transpose(-1, -2)
        + values.pow(2).sum(-1).unsqueeze(-2)
    )
    error = eviction_weight(weights) * squared.clamp_min(0.0).sqrt()
    if not may_hold_heavy_token(weights):
        return error
    return stabilise_heavy_tokens(error, weights, values.unsqueeze(3))  # values (B, H_kv, 1, 1, N, d)


def multi_row_caote_score(rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Exact CAOTE error of every token over many real query rows (beyond the paper: arXiv 2504.14051 scores one
    query). ``rows`` ``(B, H_q, R, N)``: the attention of the newest R queries (zero on tokens a row could not see),
    ``values`` ``(B, H_kv, N, d)``. For each row the exact output change `row_eviction_errors`; per KV group

        c_j = sqrt( sum_{q in group} sum_r e_{q,r,j}^2 / n_j )

    with ``n_j`` the rows that attend to token j: the root-mean-square over the queries that could see j of the
    group's exact output change (rss over heads, as `aggregate_groups`), so that the newest tokens, seen by few rows,
    are not ranked low merely for being new. Returns ``(B, H_kv, N)``."""
    kv_heads = values.shape[1]
    grouped = group_query_heads(rows, kv_heads)  # (B, H_kv, g, R, N)
    errors = row_eviction_errors(grouped, values)
    seen = (grouped > 0).any(2).sum(-2).clamp_min(1)  # (B, H_kv, N) rows attending to each token
    return (errors.pow(2).sum((2, 3)) / seen).sqrt()


# ---------------------------------------------------------------------------------------------------------------
# Grouped-query attention: from query heads to the KV head that stores the token
# ---------------------------------------------------------------------------------------------------------------


def group_size(query_heads: int, kv_heads: int) -> int:
    """``g``, the query heads that share each KV head under grouped-query attention: ``H_q / H_kv``, refused
    (ValueError) when ``H_kv`` does not divide ``H_q``."""
    if query_heads % kv_heads:
        raise ValueError(f"{query_heads} query heads cannot be grouped over {kv_heads} KV heads")
    return query_heads // kv_heads


def group_index(slots: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """Slot indices ``(B, H_kv, k)`` as an index into a per-query-head ``history`` ``(B, H_q, [R,] N)``: each KV
    head's slots repeated over its query group (and over the rows)."""
    index = slots.repeat_interleave(group_size(history.shape[1], slots.shape[1]), dim=1)
    return index.unsqueeze(2).expand(-1, -1, history.shape[2], -1) if history.dim() == 4 else index


def clear_history(history: torch.Tensor, slots: torch.Tensor) -> None:
    """Zero, in place, what every query head's ``history`` ``(B, H_q, [R,] N)`` holds of the ``slots``
    ``(B, H_kv, k)`` (a KV head's query heads side by side, so the slots broadcast over the group as a view)."""
    batch, kv_heads, count = slots.shape
    grouped = history.view(batch, kv_heads, -1, *history.shape[2:])
    index = slots.view(batch, kv_heads, *(1,) * (history.dim() - 2), count).expand(*grouped.shape[:-1], count)
    grouped.scatter_(-1, index, 0.0)


def group_query_heads(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(B, H_q, ...)`` -> ``(B, H_kv, g, ...)``: the query heads of each KV head side by side."""
    batch, heads = scores.shape[:2]
    return scores.view(batch, kv_heads, group_size(heads, kv_heads), *scores.shape[2:])


def aggregate_groups(grouped: torch.Tensor, how: str) -> torch.Tensor:
    """Reduce the group axis of ``(B, H_kv, g, N)`` scores to ``(B, H_kv, N)``.

    ``rss`` (root of the sum of squares) of per-head CAOTE errors is exactly the error of the group's concatenated
    attention output when the shared token is evicted; ``mean`` is what kvpress uses for attention scores.
    """
    if how == "rss":  # as a sum of squares: a norm over a middle axis takes a slow strided path on the CPU
        return grouped.pow(2).sum(2).sqrt()
    if how == "mean":
        return grouped.mean(2)
    if how == "max":
        return grouped.amax(2)
    raise ValueError(f"unknown GQA aggregation {how!r}; expected one of {', '.join(GQA_AGGREGATIONS)}")
