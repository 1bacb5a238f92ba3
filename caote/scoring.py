"""The eviction math as pure tensor functions: no model, no cache.

Shapes follow one vocabulary:

* ``attention``  ``(batch, heads, rows, tokens)``: softmax probabilities of some query rows over the cached tokens.
* ``keys`` / ``values``  ``(batch, kv_heads, tokens, head_dim)``.
* a score  ``(batch, heads, tokens)``: higher = keep.

``heads`` is the number of query heads for attention-based scores and the number of KV heads for key-based ones.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# A token with at least this share of the attention mass is treated as holding "all" of it (see `caote_score`).
NEARLY_ALL_MASS = 1.0 - 1e-3


# ---------------------------------------------------------------------------------------------------------------
# Value-aware transforms (CAOTE, arXiv 2504.14051)
# ---------------------------------------------------------------------------------------------------------------


def normalise_weights(weights: torch.Tensor, signed: bool = False) -> torch.Tensor:
    """Turn a base score into a distribution over tokens (float32, sums to 1 over the last axis).

    Non-negative scores are divided by their sum (the paper's ``f_norm`` for H2O and SnapKV). Signed scores
    (KeyDiff, K-norm) are first shifted so that their minimum is zero, which keeps the ranking.
    Masked-out tokens may carry ``-inf``; they get weight 0.
    """
    weights = weights.float()
    finite = torch.isfinite(weights)
    weights = torch.where(finite, weights, torch.zeros_like(weights))
    if signed:
        floor = torch.where(finite, weights, torch.full_like(weights, math.inf)).amin(-1, keepdim=True)
        weights = torch.where(finite, weights - floor, torch.zeros_like(weights))
    weights = weights.clamp_min(0.0)
    return weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def _eviction_error(weights: torch.Tensor, values: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """``w_j / (1 - w_j) * ||output - v_j||_2`` with a safe denominator (float32)."""
    distance = torch.linalg.vector_norm(output.unsqueeze(-2) - values, dim=-1)
    rest = (1.0 - weights).clamp_min(torch.finfo(torch.float32).eps)
    error = weights / rest * distance
    # A token holding (nearly) all the mass: 1 - w_j and ||X - v_j|| both vanish and their ratio is lost to rounding.
    # Evicting it replaces the output by the average of a handful of near-zero-weight tokens, so it must rank first.
    dominant = weights >= NEARLY_ALL_MASS
    return torch.where(dominant, error.amax(-1, keepdim=True) * 2.0 + 1.0, error)


def caote_score(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """CAOTE eviction error of every token (Goel et al., arXiv 2504.14051, Thm. 3.2).

    ``c_j = w_j / (1 - w_j) * || sum_i w_i v_i - v_j ||_2``: the exact change of the attention output when token j
    alone is evicted and the softmax renormalised. ``weights`` ``(..., N)`` are normalised to sum to 1 first;
    ``values`` ``(..., N, d)`` broadcast against them (GQA: weights ``(B, H_kv, g, N)``, values
    ``(B, H_kv, 1, N, d)``). Computed in float32 whatever the input dtype; never NaN or inf.
    """
    weights, values = normalise_weights(weights), values.float()
    output = torch.einsum("...n,...nd->...d", weights, values)
    return _eviction_error(weights, values, output)


def fast_caote_score(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """FastCAOTE (arXiv 2504.14051, §3): CAOTE with the plain mean of the values in place of ``sum_i w_i v_i``.

    ``c_j = w_j / (1 - w_j) * || mean_i v_i - v_j ||_2``; shapes as in `caote_score`.
    """
    weights, values = normalise_weights(weights), values.float()
    return _eviction_error(weights, values, values.mean(-2))


# ---------------------------------------------------------------------------------------------------------------
# Base scores, higher = keep
# ---------------------------------------------------------------------------------------------------------------


def accumulate_attention(previous: torch.Tensor | None, attention: torch.Tensor) -> torch.Tensor:
    """H2O running sum (Zhang et al., arXiv 2306.14048): ``previous`` ``(B, H, N_old)`` plus every row of
    ``attention`` ``(B, H, R, N)``; tokens newer than ``previous`` start at zero."""
    total = attention.sum(-2)
    if previous is not None:
        total[..., : previous.shape[-1]] += previous
    return total


def keep_recent_rows(previous: torch.Tensor | None, attention: torch.Tensor, rows: int) -> torch.Tensor:
    """The last ``rows`` attention rows seen, ``(B, H, <=rows, N)``: older rows get zero attention on newer tokens
    (they could not see them)."""
    if previous is not None and attention.shape[-2] < rows:  # else the new rows fill the window: skip pad + copy
        previous = F.pad(previous, (0, attention.shape[-1] - previous.shape[-1]))
        attention = torch.cat([previous, attention], dim=-2)
    return attention[..., -rows:, :]


def h2o_score(accumulated: torch.Tensor) -> torch.Tensor:
    """H2O heavy hitters (Zhang et al., arXiv 2306.14048): attention accumulated over every query seen so far,
    carried across prefill blocks and decode steps for the tokens still cached. ``(B, H_q, N)`` in, out."""
    return accumulated


def tova_score(recent_rows: torch.Tensor) -> torch.Tensor:
    """TOVA (Oren et al., arXiv 2401.06104): the attention of the newest query. ``(B, H_q, R, N) -> (B, H_q, N)``."""
    return recent_rows[..., -1, :]


def snapkv_score(window_rows: torch.Tensor, kernel_size: int = 5) -> torch.Tensor:
    """SnapKV (Li et al., arXiv 2404.14469): attention of the last ``w`` queries (default 32, the observation window),
    summed, then average-pooled over ``kernel_size`` (default 5) neighbouring tokens so that neighbours of a hit
    survive with it. ``(B, H_q, w, N) -> (B, H_q, N)``."""
    votes = window_rows.sum(-2)
    if kernel_size <= 1:
        return votes
    batch, heads, tokens = votes.shape
    pooled = F.avg_pool1d(votes.reshape(batch * heads, 1, tokens), kernel_size, stride=1, padding=kernel_size // 2)
    return pooled.view(batch, heads, -1)[..., :tokens]


def streamingllm_score(positions: torch.Tensor) -> torch.Tensor:
    """StreamingLLM (Xiao et al., arXiv 2309.17453): the most recent tokens; the attention sinks are kept by the
    cache's sink protection (4 tokens by default). ``positions`` ``(B, H_kv, N)``."""
    return positions.float()


def keydiff_score(keys: torch.Tensor) -> torch.Tensor:
    """KeyDiff (Park et al., arXiv 2504.15364): keys far from the mean key are distinctive, so
    ``score_j = -cos(k_j, mean_i k_i)`` per KV head. ``(B, H_kv, N, d) -> (B, H_kv, N)``."""
    keys = keys.float()
    anchor = keys.mean(-2, keepdim=True)
    return -F.cosine_similarity(keys, anchor, dim=-1)


def knorm_score(keys: torch.Tensor) -> torch.Tensor:
    """K-norm (Devoto et al., arXiv 2406.11430): keys with a small L2 norm attract attention, so
    ``score_j = -||k_j||_2``. ``(B, H_kv, N, d) -> (B, H_kv, N)``."""
    return -torch.linalg.vector_norm(keys.float(), dim=-1)


def random_score(keys: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Uniform random scores in [0, 1): the floor any real policy must beat. ``(B, H_kv, N, d) -> (B, H_kv, N)``."""
    return torch.rand(keys.shape[:-1], generator=generator, device=keys.device)


# ---------------------------------------------------------------------------------------------------------------
# Grouped-query attention: from query heads to the KV head that stores the token
# ---------------------------------------------------------------------------------------------------------------

GQA_AGGREGATIONS = ("rss", "mean", "max")


def group_query_heads(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(B, H_q, ...)`` -> ``(B, H_kv, g, ...)``: the query heads of each KV head side by side."""
    batch, heads = scores.shape[:2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot be grouped over {kv_heads} KV heads")
    return scores.view(batch, kv_heads, heads // kv_heads, *scores.shape[2:])


def aggregate_groups(grouped: torch.Tensor, how: str) -> torch.Tensor:
    """Reduce the group axis of ``(B, H_kv, g, N)`` scores to ``(B, H_kv, N)``.

    ``rss`` (root of the sum of squares) of per-head CAOTE errors is exactly the error of the group's concatenated
    attention output when the shared token is evicted; ``mean`` is what kvpress uses for attention scores.
    """
    if how == "rss":
        return torch.linalg.vector_norm(grouped, dim=2)
    if how == "mean":
        return grouped.mean(2)
    if how == "max":
        return grouped.amax(2)
    raise ValueError(f"unknown GQA aggregation {how!r}; expected one of {', '.join(GQA_AGGREGATIONS)}")
