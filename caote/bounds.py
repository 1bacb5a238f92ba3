"""Float32 bounds of the CAOTE / FastCAOTE errors, so that a decode step computes exactly only the few it can evict.

A decode step evicts the ``count`` tokens of lowest aggregated error that the cache does not keep anyway (sinks,
the recent window). `lowest_errors` bounds every token's error from norms alone, certifies most tokens as out of
reach, and computes only the others (the candidates) with the direct path's arithmetic, bit for bit.

Why the bounds hold
-------------------

*The errors.* Per query head, token j's error is ``e_j = f(w_j) ||x - v_j||`` with ``f(w) = w / max(1 - w, 1/2)``
(`caote.value_aware.eviction_weight`) and ``x`` the output: the weighted output ``X = sum_i w_i v_i`` (CAOTE) or
the mean value (FastCAOTE). A KV group's errors are then aggregated per token (rss, mean or max).

*The triangle inequality.* ``| ||x|| - ||v_j|| | <= ||x - v_j|| <= ||x|| + ||v_j||``: both sides need only the norms,
one per output and one per value (a layer decoding in place keeps its values' norms per slot, so no value is read).

*The float32 slack.* Computed norms are not exact: a length-n sum of squares is off by at most ``gamma_n = n u``
(``u = 2^-24``) whatever the order of addition, its square root halves that, and the norms of the output and of a
value, their difference and the direct distance each add a few roundings. So each side moves outward by
``rounding * (||x|| + ||v_j||)`` with ``rounding = max(n, 8) * NORM_ROUNDING`` for head_dim n (the floor of 8 for
tiny head_dims): the upper side is ``(||x|| + ||v_j||) (1 + rounding)``, the lower side is floored at 0.

*Through ``w / (1 - w)`` and the aggregation.* ``f(w_j) >= 0`` multiplies both sides, computed from the same weights
by the same expression as the direct path, so the order of the bounds and the exact error is kept. Every GQA
aggregation (rss, mean, max) is monotone in each of its non-negative inputs, so the aggregated lower (upper) bounds
bound the aggregated error from below (above). What the direct path's own rounding adds (the distance's sum over
head_dim, the formula, the aggregation: under 100 u) and the bounds' arithmetic adds is covered many times over
by widening both aggregated bounds by the relative `BOUND_MARGIN`.

*The certificate.* Let ``t`` be the ``count``-th lowest upper bound among the tokens not protected. At least ``count``
tokens have an exact error ``<= t``; a token whose lower bound exceeds ``t`` has an exact error above theirs and
cannot be evicted: its entry is that lower bound. Every other token (``lower <= t``, ties included) is a candidate
and gets the direct path's exact arithmetic: `torch.cdist` in its direct mode pair by pair, the same formula, and
`aggregate_groups` over a tensor of the direct path's shape (the order of a reduction's additions depends on the
layout). The ``count`` lowest entries, ties included, are therefore the direct path's.

*The heavy token.* A heavy token (``w > 1/2``, not protected) has the stable form as its error,
``w ||Y - v||`` with ``Y`` the other tokens' weighted mean (`caote.value_aware.heavy_token_errors`), not
``f(w) ||x - v||``: its upper bound certifies nothing (``+inf``). For its lower bound, with the row's sum
``S = sum_i w_i`` (1 up to rounding), ``Y - v = (X - S v) / (S - w)``, so ``w ||Y - v|| = w ||X - S v|| / (S - w)``
and ``||X - S v|| >= | ||X|| - S ||v|| |`` (`heavy_token_lower_bound`). Less what float32 may be off by: the norms
(``rounding``, relative), the computed ``X`` and ``S`` (``gamma_N S M``, M the row's largest value norm,
``gamma_N = N u`` for N tokens) and the stable form itself (``(2 gamma_N + 5u) M``, and a relative ``gamma_n``
under `BOUND_MARGIN`), each taken at least twice over. This needs ``x`` to be the weighted output ``X`` computed with
float32 products (`full_float32_products`); FastCAOTE's mean is not, nor is an output of bfloat16 or TF32
products: the heavy token's own entry then bounds nothing (0). Only where it is a candidate is its stable form
computed.

*When the direct path runs instead.* Another dtype than float32 or another device than the CPU (an accelerator
would wait for the read-back of the candidates), fewer than `BOUNDED_FROM` (row, token) pairs, a non-finite norm
or bound, fewer than ``count`` tokens not protected, or more than `MOST_CANDIDATES` of the pairs candidates.
"""

from __future__ import annotations

import math

import torch

from caote.value_aware import aggregate_groups, eviction_weight, heavy_token_errors, heavy_tokens

# The float32 rounding of a computed norm, as a share of the norm, per unit of head_dim (see "The float32 slack").
NORM_ROUNDING = 2 * 2.0**-24
# the relative margin of every aggregated bound (see "Through w / (1 - w) and the aggregation")
BOUND_MARGIN = 1e-4
# past this share of candidate (KV row, token) pairs the bounds save nothing: the direct path scores every token
MOST_CANDIDATES = 0.25
# below this many (KV row, token) pairs the bounds' ~35 extra operators cost about what the distances they save do
# (one CPU thread, 3 query heads per KV head, head_dim 64, cached value norms, synthetic softmax rows: direct /
# bounded 0.34 / 0.48 ms at 4 x 3 x 65 pairs, 0.57 / 0.40 at 8 x 3 x 129, 1.18 / 0.51 at 30 x 3 x 129, 3.81 / 1.13
# at 30 x 3 x 513)
BOUNDED_FROM = 2**12


def lowest_errors(
    output: torch.Tensor,
    weights: torch.Tensor,
    values: torch.Tensor,
    protected: torch.Tensor,
    count: int,
    how: str,
    weighted: bool,
    value_norms: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Aggregated CAOTE / FastCAOTE errors ``(B, H_kv, N)`` for a caller that evicts the ``count`` lowest tokens not
    ``protected``, computed directly only for the tokens that can be among them (the module's argument); the others get
    a lower bound of their error above the ``count`` evicted ones. None where the direct path must run instead.

    ``output`` ``(B, H_kv, g or 1, d)`` (`caote_output` / `fast_caote_output`), ``weights`` ``(B, H_kv, g, N)`` float32
    summing to 1, ``values`` ``(B, H_kv, 1, N, d)`` float32, ``protected`` ``(B, H_kv, 1, N)`` bool, ``how`` the GQA
    aggregation, ``weighted``: ``output`` is the weighted output (CAOTE), ``value_norms`` ``(B, H_kv, 1, N)`` the
    values' norms where the caller keeps them (else computed here)."""
    if weights.dtype != torch.float32 or weights.device.type != "cpu":
        return None
    batch, kv_heads, group, tokens = weights.shape
    if batch * kv_heads * tokens < BOUNDED_FROM:
        return None
    dim = values.shape[-1]
    if value_norms is None:
        value_norms = torch.linalg.vector_norm(values, dim=-1)
    output_norms = torch.linalg.vector_norm(output, dim=-1, keepdim=True)  # (B, H_kv, g or 1, 1)
    if not torch.isfinite(value_norms.sum() + output_norms.sum()):  # a non-finite value or output bounds nothing
        return None
    rounding = max(dim, 8) * NORM_ROUNDING  # a few roundings beyond the sum's n u: a floor for tiny head_dims
    reach = output_norms + value_norms  # (B, H_kv, g or 1, N)
    nearest = (output_norms - value_norms).abs_().sub_(reach, alpha=rounding).clamp_min_(0.0)
    factor = eviction_weight(weights)
    upper, lower = factor * reach.mul_(1 + rounding), factor * nearest  # (B, H_kv, g, N), per query head
    top_weight, heaviest, heavier = heavy_tokens(weights, protected)  # (B, H_kv, g, 1)
    heavy = bool(heavier.any())  # on the CPU the read-back is free
    if heavy:  # its stable form: bounded below (CAOTE's weighted output), its upper bound certifies nothing
        upper.scatter_(-1, heaviest, torch.where(heavier, math.inf, upper.gather(-1, heaviest)))
        bound = 0.0  # the heavy token's own entry, where the bound below does not hold
        if weighted and full_float32_products():
            bound = heavy_token_lower_bound(weights, top_weight, heaviest, output_norms, value_norms, rounding)
        lower.scatter_(-1, heaviest, torch.where(heavier, bound, lower.gather(-1, heaviest)))
    entries = lower  # per query head: the candidates' exact errors are written here and aggregated as direct
    upper = aggregate_groups(upper, how).mul_(1 + BOUND_MARGIN)
    lower = aggregate_groups(lower, how).mul_(1 - BOUND_MARGIN)
    upper.masked_fill_(protected.squeeze(2), math.inf)
    lower.masked_fill_(protected.squeeze(2), math.inf)
    threshold = upper.amin(-1, keepdim=True) if count == 1 else upper.kthvalue(count, dim=-1, keepdim=True).values
    if not torch.isfinite(threshold).all():  # fewer than ``count`` tokens to certify against
        return None
    candidates = lower <= threshold  # (B, H_kv, N)
    pairs = candidates.view(-1).nonzero().squeeze(-1)  # (P,) flat over (B * H_kv * N)
    if pairs.numel() > MOST_CANDIDATES * lower.numel():
        return None
    rows, token = pairs.div(tokens, rounding_mode="floor"), pairs.remainder(tokens)
    chosen_values = values.reshape(-1, dim).index_select(0, pairs).unsqueeze(1)  # (P, 1, d)
    chosen_outputs = output.reshape(batch * kv_heads, -1, dim).index_select(0, rows)  # (P, g or 1, d)
    chosen_weights = weights.reshape(batch * kv_heads, group, tokens).transpose(1, 2)[rows, token]  # (P, g)
    # `distances`' direct mode, pair by pair: the same sum over head_dim as the direct path's
    distance = torch.cdist(chosen_outputs, chosen_values, compute_mode="donot_use_mm_for_euclid_dist").squeeze(-1)
    error = eviction_weight(chosen_weights) * distance
    if heavy:  # a heavy candidate gets the stable form, as `stabilise_heavy_tokens` gives it
        own = (heaviest.view(-1, group)[rows] == token.unsqueeze(1)) & heavier.view(-1, group)[rows]
        if own.any():
            stable = heavy_token_errors(weights, values, top_weight, heaviest, heavier)
            error = torch.where(own, stable.view(-1, group)[rows], error)
    entries.view(batch * kv_heads, group, tokens).transpose(1, 2).index_put_((rows, token), error)
    return torch.where(candidates, aggregate_groups(entries, how), lower)


def full_float32_products() -> bool:
    """Whether float32 matrix products on the CPU run in float32, with no bfloat16 or TF32 inside them
    (`torch.backends.mkldnn.matmul.fp32_precision`, which `torch.set_float32_matmul_precision` sets too): what
    `heavy_token_lower_bound` assumes of the weighted outputs it is taken against."""
    return torch.backends.mkldnn.matmul.fp32_precision in ("none", "ieee")


def heavy_token_lower_bound(
    weights: torch.Tensor,
    top_weight: torch.Tensor,
    heaviest: torch.Tensor,
    output_norms: torch.Tensor,
    value_norms: torch.Tensor,
    rounding: float,
) -> torch.Tensor:
    """A lower bound ``(B, H_kv, g, 1)`` of each row's heavy token's stable error as float32 computes it, from norms:
    ``w * ((| ||X|| - S ||v|| | - slack) / (S - w) - slack')``, each slack what float32 may be off by (the module's
    "The heavy token")."""
    sum_rounding = 2 * (weights.shape[-1] + 8) * 2.0**-24  # >= 2 gamma_N
    total = weights.sum(-1, keepdim=True)  # S
    largest = value_norms.amax(-1, keepdim=True) * (1 + rounding)  # (B, H_kv, 1, 1): M
    norm = value_norms.expand(*top_weight.shape[:-1], -1).gather(-1, heaviest).mul_(total)  # S ||v||
    near = (output_norms - norm).abs_().sub_((output_norms + norm) * rounding + 3 * sum_rounding * total * largest)
    spare = total * (1 + sum_rounding) - top_weight  # >= S - w
    moved = near.clamp_min_(0.0).div_(spare).sub_(3 * sum_rounding * largest)
    return moved.clamp_min_(0.0).mul_(top_weight)
