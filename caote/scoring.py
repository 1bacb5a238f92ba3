"""The eviction math as pure tensor functions: no model, no cache.

Shapes follow one vocabulary:

* ``attention``  ``(batch, heads, rows, tokens)``: softmax probabilities of some query rows over the cached tokens.
* ``keys`` / ``values``  ``(batch, kv_heads, tokens, head_dim)``.
* a score  ``(batch, heads, tokens)``: higher = keep.

``heads`` is the number of query heads for attention-based scores and the number of KV heads for key-based ones.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------------------
# Value-aware transforms (CAOTE, arXiv 2504.14051)
# ---------------------------------------------------------------------------------------------------------------


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


def eviction_error(
    weights: torch.Tensor,
    values: torch.Tensor,
    output: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
    fused: bool = False,
) -> torch.Tensor:
    """``w_j / (1 - w_j) * ||output - v_j||_2`` for every token j, exact for every weight.

    ``weights`` ``(..., N)`` sum to 1; ``values`` ``(..., N, d)`` broadcast against them; ``output`` ``(..., d)``
    (None: the weighted output ``sum_i w_i v_i``). The formula is well conditioned as written for ``w_j <= 1/2``; the
    (at most one) heavier token gets `heaviest_token_error`'s stable form, unless ``kept`` ``(..., N)`` (bool,
    broadcast against the weights) marks it as a token the cache keeps whatever its score (a sink, the recent
    window): its entry is then finite but not its exact error, which nothing reads. ``fused``: the output, the
    distances and the formula in one compiled kernel (`compiled`)."""
    if values.dim() < weights.dim() + 1:  # leading axes the broadcast would add
        values = values[(None,) * (weights.dim() + 1 - values.dim())]
    if fused:
        if output is None:
            error = compiled(fused_caote_error)(weights, values)
        else:
            error = compiled(fused_eviction_error)(weights, values, output)
    else:
        distance = distances(weighted_values(weights, values) if output is None else output, values)
        if not may_hold_heavy_token(weights):  # every 1 - w_j >= 1/2: the formula as written, no clamp needed
            return weights / (1.0 - weights) * distance
        error = weights / (1.0 - weights).clamp_min(0.5) * distance
    if (fused or kept is not None) and not may_hold_heavy_token(weights, kept):  # no heavy token, or all kept
        return error
    return heaviest_token_error(error, weights, values, kept)


def fused_eviction_error(weights: torch.Tensor, values: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """The clamped formula ``w_j / max(1 - w_j, 1/2) * ||output - v_j||_2`` as one expression, for `torch.compile`
    to fuse into a single pass over the values (`compiled`); eager, it would hold a ``(..., N, d)`` difference."""
    distance = (output.unsqueeze(-2) - values).pow(2).sum(-1).sqrt()
    return weights / (1.0 - weights).clamp_min(0.5) * distance


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


def may_hold_heavy_token(weights: torch.Tensor, kept: torch.Tensor | None = None) -> bool:
    """Whether a row of ``weights`` may give one token more than half its weight (`heaviest_token_error`), not
    counting the tokens ``kept`` marks (bool, broadcast against the weights). On the CPU, where reading a number back
    costs nothing, the answer is exact, so the ~30 operators of the stable form are skipped on most decode steps
    (and on the steps of H2O's sums, whose heavy token is a protected sink); on an accelerator it is always yes, so
    that nothing waits for the device."""
    if weights.device.type != "cpu" or weights.numel() == 0:
        return True
    if kept is None:
        return weights.max().item() > 0.5
    return ((weights > 0.5) & ~kept).any().item()


def heaviest_token_error(
    error: torch.Tensor, weights: torch.Tensor, values: torch.Tensor, kept: torch.Tensor | None = None
) -> torch.Tensor:
    """``error`` ``(..., N)`` with the entry of the token holding more than half of a row's weight recomputed stably.

    For ``w_j > 1/2``, ``1 - w_j`` and ``output - v_j`` lose digits to cancellation, so the error comes from the
    other tokens directly: with ``X_-j = sum_{i != j} w_i v_i`` and ``rest = sum_{i != j} w_i``,
    ``c_j = w_j * ||X_-j / rest - v_j||``. When every other weight is exactly zero, evicting j leaves nothing to
    renormalise: its error is ``+inf`` (it always ranks first). ``weights`` ``(..., N)`` sum to 1, ``values``
    ``(..., N, d)`` with as many axes as ``weights`` plus one (size-1 axes broadcast). Callers skip it when
    `may_hold_heavy_token` says no row has such a token; a heavy token ``kept`` marks keeps its entry as given."""
    heaviest, heavy, stable = heaviest_token(weights, values, kept)
    return error.scatter(-1, heaviest, torch.where(heavy, stable, error.gather(-1, heaviest)))


def heaviest_token(weights: torch.Tensor, values: torch.Tensor, kept: torch.Tensor | None = None) -> tuple:
    """Each row's heaviest token: its index, whether it holds more than half the row and is not ``kept`` (bool,
    broadcast against the weights), and its error in `heaviest_token_error`'s stable form (read only where it
    does), each ``(..., 1)``: ``w_j * ||X_-j / rest - v_j||`` with ``X_-j`` and ``rest`` the weighted sum and the
    weight of the other tokens, ``+inf`` when they have none. On the CPU, when such rows are few (a decode step's
    unkept heavy tokens), only their values are read (elsewhere the error is 0)."""
    top_weight, heaviest, heavy = heavy_rows(weights, kept)
    return heaviest, heavy, heavy_stable_errors(weights, values, top_weight, heaviest, heavy)


def heavy_rows(weights: torch.Tensor, kept: torch.Tensor | None = None) -> tuple:
    """Each row's heaviest token, ``(..., 1)`` each: its weight, its index, and whether it holds more than half the
    row and is not ``kept`` (bool, broadcast against the weights)."""
    top_weight, heaviest = weights.max(-1, keepdim=True)
    heavy = top_weight > 0.5
    if kept is not None:
        heavy &= ~kept.expand_as(weights).gather(-1, heaviest)
    return top_weight, heaviest, heavy


def heavy_stable_errors(
    weights: torch.Tensor, values: torch.Tensor, top_weight: torch.Tensor, heaviest: torch.Tensor, heavy: torch.Tensor
) -> torch.Tensor:
    """`heaviest_token`'s stable errors ``(..., 1)`` given `heavy_rows`' answer, read only where ``heavy``."""
    if weights.device.type == "cpu" and weights.dim() > 1:  # reading back which rows is free on the CPU
        rows = torch.nonzero(heavy.flatten()).squeeze(-1)
        if 2 * rows.numel() <= values.shape[:-2].numel():  # few: copying their values costs less than reading all
            at = torch.unravel_index(rows, heavy.shape[:-1])
            own = values.expand(*weights.shape[:-1], *values.shape[-2:])[at]  # (R, N, d)
            stable = stable_error(weights[at], own, top_weight[at], heaviest[at])
            return torch.zeros_like(top_weight).index_put_(at, stable)
    return stable_error(weights, values, top_weight, heaviest)


def stable_error(
    weights: torch.Tensor, values: torch.Tensor, top_weight: torch.Tensor, heaviest: torch.Tensor
) -> torch.Tensor:
    """`heaviest_token`'s stable form for the rows of ``weights`` ``(..., N)`` over ``values`` ``(..., N, d)``
    (broadcast against them), given each row's ``top_weight`` and ``heaviest`` index ``(..., 1)``."""
    others = weights.scatter(-1, heaviest, 0.0)
    rest = others.sum(-1, keepdim=True)
    without = weighted_values(others, values)  # broadcast, not expanded: no copy of the values
    top_value = torch.take_along_dim(values, heaviest.unsqueeze(-1), dim=-2).squeeze(-2)
    moved = torch.linalg.vector_norm(without / rest - top_value, dim=-1, keepdim=True)
    return torch.where(rest > 0, top_weight * moved, torch.full_like(moved, math.inf))


def caote_errors(
    weights: torch.Tensor,
    values: torch.Tensor,
    real: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
    fused: bool = False,
) -> torch.Tensor:
    """CAOTE eviction error of every token (Goel et al., arXiv 2504.14051, Thm. 3.2), from a distribution.

    ``c_j = w_j / (1 - w_j) * || sum_i w_i v_i - v_j ||_2``: the exact change of the attention output when token j
    alone is evicted and the softmax renormalised. ``weights`` ``(..., N)`` already sum to 1 (`normalise_weights`:
    float32, or float64; padding has weight 0); ``values`` ``(..., N, d)`` broadcast against them (GQA: weights
    ``(B, H_kv, g, N)``, values ``(B, H_kv, 1, N, d)``). ``real`` is accepted for the same signature as
    `fast_caote_errors`; ``kept`` marks tokens whose own error nothing reads (`eviction_error`); ``fused``
    computes the weighted output, the distances and the formula in one compiled kernel (`compiled`). Never NaN.
    `Policy.scores` calls this after its one normalisation.
    """
    weights = weights.to(compute_dtype(weights))
    values = values.to(weights.dtype)
    return eviction_error(weights, values, None, kept, fused)


def weighted_values(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i v_i``: ``weights`` ``(..., N)``, ``values`` ``(..., N, d)`` broadcast against them -> ``(..., d)``.
    A KV group's weights ``(B, H_kv, g, N)`` over its shared values ``(B, H_kv, 1, N, d)`` are one batched matrix
    product, the values not copied per query head."""
    if values.dim() == 5 and weights.dim() == 4 and values.shape[2] == 1 and values.shape[:2] == weights.shape[:2]:
        batch, kv_heads, group, tokens = weights.shape
        output = torch.bmm(weights.reshape(-1, group, tokens), values.reshape(-1, tokens, values.shape[-1]))
        return output.view(batch, kv_heads, group, -1)
    return torch.einsum("...n,...nd->...d", weights, values)


def fast_caote_errors(
    weights: torch.Tensor,
    values: torch.Tensor,
    real: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
    fused: bool = False,
) -> torch.Tensor:
    """FastCAOTE (arXiv 2504.14051, §3): CAOTE with the plain mean of the values in place of ``sum_i w_i v_i``.

    ``c_j = w_j / (1 - w_j) * || mean_i v_i - v_j ||_2``; weights and values as in `caote_errors`. ``real``
    ``(..., N)`` (broadcast like the weights' leading axes) marks the tokens that are not padding: the mean is over
    those only; ``kept`` and ``fused`` as in `caote_errors`.
    """
    weights = weights.to(compute_dtype(weights))
    values = values.to(weights.dtype)
    return eviction_error(weights, values, masked_mean(values, real), kept, fused)


def caote_output(weights: torch.Tensor, values: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """The point CAOTE measures every value from: the weighted output ``sum_i w_i v_i`` (`caote_errors`)."""
    return weighted_values(weights, values)


def fast_caote_output(weights: torch.Tensor, values: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """The point FastCAOTE measures every value from: the mean of the real values (`fast_caote_errors`)."""
    return masked_mean(values, real)


# The float32 rounding of a computed norm, as a share of the norm, per unit of head_dim: a length-n sum of squares
# is off by at most gamma_n = n u (u = 2^-24) whatever the order of addition, its square root halves that, and the
# norms of the output and of a value, their difference and the direct distance each add a few roundings; doubled.
NORM_ROUNDING = 2 * 2.0**-24
# the relative margin of every bound: covers the direct path's own rounding (the distance's sum over head_dim, the
# formula, the group's aggregation: under 100 u) and that of the bounds' arithmetic many times over
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
    kept: torch.Tensor,
    count: int,
    how: str,
    weighted: bool,
    value_norms: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Aggregated CAOTE / FastCAOTE errors ``(B, H_kv, N)`` for a caller that evicts the ``count`` lowest tokens not
    ``kept``, computed directly only for the tokens that can be among them (a decode step: one or a few of N).

    Every distance is first bounded by the triangle inequality, ``| ||x|| - ||v|| | <= ||x - v|| <= ||x|| + ||v||``,
    from the norms alone (``value_norms`` ``(B, H_kv, 1, N)``, which a layer decoding in place keeps per slot:
    then no value is read), each side moved by ``n * NORM_ROUNDING * (||x|| + ||v||)`` for head_dim n (what float32
    norms may be off by), then carried through ``w / (1 - w)`` and the group's aggregation (rss, mean and max are
    monotone in every input) and widened by `BOUND_MARGIN`. A token whose lower bound exceeds the ``count``-th
    lowest upper bound cannot be evicted; its entry is that lower bound. The others (the candidates: a few per row,
    the rows of nearly even weight more) get the direct path's exact arithmetic, bit for bit (`distances`' `cdist`
    pair by pair, `eviction_error`'s formula, and `aggregate_groups` over a tensor of the direct path's shape, since the
    order of a reduction's additions depends on the layout), so the ``count`` lowest entries, ties included, are
    those of the direct path.

    A token not kept that holds more than half a row's weight has `heaviest_token_error`'s stable form as its
    error, ``w ||Y - v||`` with ``Y`` the others' weighted mean. Since ``Y - v = (X - S v) / (S - w)`` for the
    weighted output ``X`` and the row's sum ``S`` (1 up to rounding), it is bounded below from the same norms,
    less what float32 may be off by in ``X``, ``S`` and the stable form itself (`heavy_lower_bound`); its upper
    bound certifies nothing, and only where it is a candidate is the stable form computed. ``weighted``: ``output``
    is the weighted output (CAOTE); FastCAOTE's mean is not, nor is an output whose products ran in a lower
    precision (`full_float32_products`): the heavy token's own entry then bounds nothing (0).

    ``output`` ``(B, H_kv, g or 1, d)`` (`caote_output` / `fast_caote_output`), ``weights`` ``(B, H_kv, g, N)`` float32
    summing to 1, ``values`` ``(B, H_kv, 1, N, d)`` float32, ``kept`` ``(B, H_kv, 1, N)`` bool. None where the
    direct path must run: another dtype or device (an accelerator would wait for the read-back of the candidates),
    fewer than `BOUNDED_FROM` (row, token) pairs, a non-finite bound, fewer than ``count`` tokens not kept, or more
    than `MOST_CANDIDATES` of the pairs candidates."""
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
    factor = weights / (1.0 - weights).clamp_min(0.5)
    upper, lower = factor * reach.mul_(1 + rounding), factor * nearest  # (B, H_kv, g, N), per query head
    top_weight, heaviest, heavier = heavy_rows(weights, kept)  # (B, H_kv, g, 1)
    heavy = bool(heavier.any())  # on the CPU the read-back is free
    if heavy:  # its stable form: bounded below (CAOTE's weighted output), its upper bound certifies nothing
        upper.scatter_(-1, heaviest, torch.where(heavier, math.inf, upper.gather(-1, heaviest)))
        bound = 0.0  # the heavy token's own entry, where the bound below does not hold
        if weighted and full_float32_products():
            bound = heavy_lower_bound(weights, top_weight, heaviest, output_norms, value_norms, rounding)
        lower.scatter_(-1, heaviest, torch.where(heavier, bound, lower.gather(-1, heaviest)))
    entries = lower  # per query head: the candidates' exact errors are written here and aggregated as direct
    upper = aggregate_groups(upper, how).mul_(1 + BOUND_MARGIN)
    lower = aggregate_groups(lower, how).mul_(1 - BOUND_MARGIN)
    upper.masked_fill_(kept.squeeze(2), math.inf)
    lower.masked_fill_(kept.squeeze(2), math.inf)
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
    error = chosen_weights / (1.0 - chosen_weights).clamp_min(0.5) * distance
    if heavy:  # a heavy candidate gets the stable form, as `heaviest_token_error` gives it
        own = (heaviest.view(-1, group)[rows] == token.unsqueeze(1)) & heavier.view(-1, group)[rows]
        if own.any():
            stable = heavy_stable_errors(weights, values, top_weight, heaviest, heavier)
            error = torch.where(own, stable.view(-1, group)[rows], error)
    entries.view(batch * kv_heads, group, tokens).transpose(1, 2).index_put_((rows, token), error)
    return torch.where(candidates, aggregate_groups(entries, how), lower)


def full_float32_products() -> bool:
    """Whether float32 matrix products on the CPU run in float32, with no bfloat16 or TF32 inside them
    (`torch.backends.mkldnn.matmul.fp32_precision`, which `torch.set_float32_matmul_precision` sets too): what
    `heavy_lower_bound` assumes of the weighted outputs it is taken against."""
    return torch.backends.mkldnn.matmul.fp32_precision in ("none", "ieee")


def heavy_lower_bound(
    weights: torch.Tensor,
    top_weight: torch.Tensor,
    heaviest: torch.Tensor,
    output_norms: torch.Tensor,
    value_norms: torch.Tensor,
    rounding: float,
) -> torch.Tensor:
    """A lower bound ``(B, H_kv, g, 1)`` of each row's heaviest token's error in `stable_error`'s form as float32
    computes it, from norms. Exactly, ``w ||Y - v|| = w ||X - S v|| / (S - w)`` for the weighted output ``X`` and
    the row's sum ``S``, and ``||X - S v|| >= | ||X|| - S ||v|| |``. Less what float32 may be off by: the norms
    (``rounding``, relative), the computed ``X`` and ``S`` (``gamma_N S M``, M the row's largest value norm,
    ``gamma_N = N u`` for N tokens, u = 2^-24) and the stable form itself (``(2 gamma_N + 5u) M``, and a relative
    ``gamma_n`` under `BOUND_MARGIN`), each taken at least twice over."""
    sum_rounding = 2 * (weights.shape[-1] + 8) * 2.0**-24  # >= 2 gamma_N
    total = weights.sum(-1, keepdim=True)  # S
    largest = value_norms.amax(-1, keepdim=True) * (1 + rounding)  # (B, H_kv, 1, 1): M
    norm = value_norms.expand(*top_weight.shape[:-1], -1).gather(-1, heaviest).mul_(total)  # S ||v||
    near = (output_norms - norm).abs_().sub_((output_norms + norm) * rounding + 3 * sum_rounding * total * largest)
    spare = total * (1 + sum_rounding) - top_weight  # >= S - w
    moved = near.clamp_min_(0.0).div_(spare).sub_(3 * sum_rounding * largest)
    return moved.clamp_min_(0.0).mul_(top_weight)


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
    the token holding more than half of a row's mass gets `heaviest_token_error`'s stable form.
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
    error = weights / (1.0 - weights).clamp_min(0.5) * squared.clamp_min(0.0).sqrt()
    if not may_hold_heavy_token(weights):
        return error
    return heaviest_token_error(error, weights, values.unsqueeze(3))  # values (B, H_kv, 1, 1, N, d)


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


def masked_mean(values: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``values`` ``(..., N, d)`` over the tokens ``real`` ``(..., N)`` marks (all when None)."""
    if real is None:
        return values.mean(-2)
    real = real.to(values.dtype).unsqueeze(-1)
    return (values * real).sum(-2) / real.sum(-2).clamp_min(1.0)


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
    new = attention.shape[-2]
    if new == rows:  # the new rows are the window
        return attention
    if new > rows:  # the newest of them (cloned: a slice of a larger tensor)
        return attention[..., -rows:, :].clone()
    if previous is None:
        return attention
    previous = F.pad(previous[..., -(rows - new) :, :], (0, attention.shape[-1] - previous.shape[-1]))
    return torch.cat([previous, attention], dim=-2)


def h2o_score(accumulated: torch.Tensor) -> torch.Tensor:
    """H2O heavy hitters (Zhang et al., arXiv 2306.14048): attention accumulated over every query seen so far,
    carried across prefill blocks and decode steps for the tokens still cached. ``(B, H_q, N)`` in, out."""
    return accumulated


def tova_score(recent_rows: torch.Tensor) -> torch.Tensor:
    """TOVA (Oren et al., arXiv 2401.06104): the attention of the newest query. ``(B, H_q, R, N) -> (B, H_q, N)``."""
    return recent_rows[..., -1, :]


def snapkv_score(window_rows: torch.Tensor, kernel_size: int = 5) -> torch.Tensor:
    """SnapKV (Li et al., arXiv 2404.14469): attention of the last ``w`` queries (default 32, the observation window)
    summed over the tokens *before* the window, then average-pooled over ``kernel_size`` (default 5) neighbouring
    tokens so that neighbours of a hit survive with it, as the original pools ``attn[..., -w:, :-w]``. The window's
    own tokens are kept anyway (they are the protected recent window); they get their summed votes, unpooled, so that
    a value-aware transform still sees their share of the mass. ``(B, H_q, w, N) -> (B, H_q, N)``."""
    votes = window_rows.sum(-2)
    window = window_rows.shape[-2]
    batch, heads, tokens = votes.shape
    if kernel_size <= 1 or tokens <= window:
        return votes
    before = votes[..., : tokens - window].reshape(batch * heads, 1, tokens - window)
    pooled = F.avg_pool1d(before, kernel_size, stride=1, padding=kernel_size // 2)[..., : tokens - window]
    return torch.cat([pooled.view(batch, heads, -1), votes[..., tokens - window :]], dim=-1)


def oldest_after_sinks_dropped(positions: torch.Tensor, kept: int, sink_tokens: int) -> torch.Tensor:
    """StreamingLLM without scoring: the ``kept`` slots ``(B, H, kept)`` left when the oldest tokens after the sinks
    go, for a cache whose slots hold tokens in arrival order (so those are the slots right after the sinks). Assumes
    no padding and positions rising with the slot (true unless a caller passes ``position_ids`` that go
    backwards)."""
    sinks = (positions < sink_tokens).sum(-1, keepdim=True)
    slots = torch.arange(kept, device=positions.device)
    return slots + (positions.shape[-1] - kept) * (slots >= sinks)


def oldest_after_sinks(positions: torch.Tensor, count: int, sink_tokens: int) -> torch.Tensor:
    """StreamingLLM without scoring, for slots in any order (decoding in place): the ``count`` slots ``(B, H, count)``
    holding the oldest tokens after the sinks. Assumes no padding (and no free slot)."""
    after_sinks = positions.masked_fill(positions < sink_tokens, torch.iinfo(positions.dtype).max)
    if count == 1:
        return after_sinks.argmin(dim=-1, keepdim=True)
    return after_sinks.topk(count, dim=-1, largest=False).indices


def streamingllm_score(positions: torch.Tensor) -> torch.Tensor:
    """StreamingLLM (Xiao et al., arXiv 2309.17453): the most recent tokens; the attention sinks are kept by the
    cache's sink protection (4 tokens by default). ``positions`` ``(B, H_kv, N)``."""
    return positions.float()


def keydiff_score(keys: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """KeyDiff (Park et al., arXiv 2504.15364): keys far from the mean key are distinctive, so
    ``score_j = -cos(k_j, mean_i k_i)`` per KV head, the mean over the tokens ``real`` ``(B, H_kv, N)`` marks (not
    padding; all when None). ``(B, H_kv, N, d) -> (B, H_kv, N)``."""
    keys = keys.to(compute_dtype(keys))
    anchor = masked_mean(keys, real).unsqueeze(-2)
    return -F.cosine_similarity(keys, anchor, dim=-1)


def knorm_score(keys: torch.Tensor) -> torch.Tensor:
    """K-norm (Devoto et al., arXiv 2406.11430): keys with a small L2 norm attract attention, so
    ``score_j = -||k_j||_2``. ``(B, H_kv, N, d) -> (B, H_kv, N)``."""
    return -torch.linalg.vector_norm(keys.to(compute_dtype(keys)), dim=-1)


def random_score(keys: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Uniform random scores in [0, 1): the floor any real policy must beat. ``(B, H_kv, N, d) -> (B, H_kv, N)``.
    Drawn on the generator's device (the CPU by default) and moved to the keys' device, so one generator serves
    layers on any number of devices."""
    device = generator.device if generator is not None else keys.device
    return torch.rand(keys.shape[:-1], generator=generator, device=device).to(keys.device)


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
    if how == "rss":  # as a sum of squares: a norm over a middle axis takes a slow strided path on the CPU
        return grouped.pow(2).sum(2).sqrt()
    if how == "mean":
        return grouped.mean(2)
    if how == "max":
        return grouped.amax(2)
    raise ValueError(f"unknown GQA aggregation {how!r}; expected one of {', '.join(GQA_AGGREGATIONS)}")
