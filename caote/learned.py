"""The ``learned`` base score: each token's *future* attention, predicted from what the cache knows when it evicts.

The hindsight oracle (`caote.future`) keeps the tokens later queries will attend to; no causal score sees those
queries. A per-(layer, KV head) linear map from causal features ``x_j`` of a token to the log of the attention it
will receive from all later queries, fitted once per model to the oracle's targets (``caote calibrate``,
`caote.evaluation.calibration`), predicts it instead:

    log F_j ~ w_h . x_j          learned:  h_j = exp(w_h . x_j)          learned+caote:  a = h / sum(h)

The features (`FEATURE_GROUPS`) are what an evicting layer already holds: H2O's running sum, the newest prompt
block's mean and maximum attention (a decode step: those of the newest decoded queries), the newest 16 rows, the
token's age and position, its value norm and CAOTE error, and its key with RoPE undone by position; a few squares and
products let a linear map bend. Only the ranking inside one (layer, head, step) matters, so targets and features are
demeaned per group when fitting, and no intercept is kept. Unlike every other base this one is not training-free: a
model needs a predictor file (`caote.predictor.Predictor`; the bundled models ship one).

Calibration evicts after prompt blocks only (teacher-forced texts), so the features of a decode step, whose
"block" is the newest decoded queries and whose candidates are never new, are read with weights fitted on prompt
blocks: the policy runs there, uncalibrated for that case. A decode step predicts afresh only every
`PREDICTION_REFRESH` steps (or when a token would leave the protected window unpredicted); in between, each token
keeps its last prediction (rows of the layer's history that travel with it) and the tokens that arrived since, all
protected, weigh nothing in the transform. Prompt blocks always predict afresh.

``learned-block`` (`learned_block_score`) reads the same predictor and multiplies learned+caote's score at prompt
blocks by the exact output change over the block's queries (caote-block's), floored at a low quantile so that it
cannot veto a token those queries do not read, to a small power; the validation of a
predictor (`caote.evaluation.validation`) names which of the learned policies helps.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from caote.history import (
    KEY_TERM,
    KEY_TERM_POSITION,
    NEWEST,
    PREDICTION,
    PREDICTION_POSITION,
    RECENT_START,
    newest_recent_rows,
)
from caote.positions import held
from caote.value_aware import (
    aggregate_groups,
    caote_errors,
    caote_score,
    group_query_heads,
    group_size,
    multi_row_caote_score,
    normalise_weights,
)

FEATURE_SET = "caote-learned-1"  # bump when the features below change: a predictor of another set is refused
RECENT_ROWS = 16  # the newest query rows the features read
# newest tokens the learned policies protect (and calibration assumes): 16 gave lower KL than H2O's half budget on
# held-out dev essays at budgets 128 and 256 (docs/learned.md, "Features and protected window")
LEARNED_RECENT = 16
# a decode step predicts every held token afresh once in this many steps (when a token has waited one step fewer for
# a prediction, or would leave the protected window without one); in between it reuses each token's last prediction
# (from the history, so a base reading a gathered copy of it would predict afresh every step), and the tokens
# not yet predicted (all protected) take no part in the transform. 1: every step predicts afresh. 16 (the protected
# window) gave the lowest decode-step KL of 1 / 4 / 8 / 16 on 12 dev essays at budgets 128 and 256, besides the
# lowest cost (docs/performance.md, "The learned policy's decode step")
PREDICTION_REFRESH = 16
EPSILON = 1e-6  # inside every log of an attention mass (the target's too)
# learned-block's exponent of the block's exact output change: of 0.25 / 0.5 / 1, the lowest KL on Gemma-3's 6
# held-out dev essays of 2,048 tokens at budgets 128 and 512 (docs/learned.md, "The block's output change")
BLOCK_EXPONENT = 0.25
# learned-block's floor: a head's block errors below this quantile of its held tokens' count as that quantile, so a
# token the block's queries do not read (a needle, to a haystack's queries) is ranked by its prediction rather than
# dropped for the block's silence. Of none / 0.25 / 0.5, 0.25 had the lowest KL at budget 128 on the 6 dev essays
# above (at 512 +1 % against no floor, lower on 3 of 6), and at 128 it found 8 · 6 of 10 · 10 pass keys on dev
# haystacks where no floor found 3 · 2 (0.1: 7 · 5; docs/learned.md, "A floor under the block's output change")
BLOCK_FLOOR_QUANTILE = 0.25
SCALARS = (
    "log_sum",
    "log_sum_per_query",
    "log_block_mean",
    "log_block_max",
    "log_recent_mean",
    "log_recent_max",
    "log_newest",
    "log_age",
    "log_position",
    "log_value_norm",
    "log_caote",
    "new",
    "sink",
)
SQUARED = SCALARS[:11]  # the continuous scalars, squared
PRODUCTS = (("log_sum", "log_age"), ("log_block_mean", "log_age"), ("log_sum", "log_block_mean"),
            ("log_value_norm", "log_sum"))  # fmt: skip
# feature groups (`caote.defaults.FEATURE_GROUPS`): the scalars with their squares and products; the pre-RoPE key and
# its squares; the value vector


def feature_names(groups: tuple[str, ...], head_dim: int) -> list[str]:
    """Names of the feature columns of ``groups``, in column order."""
    names = []
    if "scalars" in groups:
        names += list(SCALARS) + [f"{name}^2" for name in SQUARED] + [f"{a}*{b}" for a, b in PRODUCTS]
    if "key" in groups:
        names += [f"key{i}" for i in range(head_dim)] + [f"key{i}^2" for i in range(head_dim)]
    if "value" in groups:
        names += [f"value{i}" for i in range(head_dim)]
    return names


def _log(mass: torch.Tensor) -> torch.Tensor:
    return torch.log(mass.clamp_min(0.0) + EPSILON)


@functools.lru_cache(maxsize=8)
def _product_columns(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The scalar columns multiplied in `PRODUCTS`: the first factors', the second factors' (made once per device)."""
    return tuple(torch.tensor([SCALARS.index(pair[side]) for pair in PRODUCTS], device=device) for side in (0, 1))


def scalar_features(inputs, sink_tokens: int) -> torch.Tensor:
    """``(B, H_kv, 28, N)``, feature axis before the token axis: the 13 scalars (`token_features`), the squares of
    the 11 continuous ones and the 4 products, each kind of operation applied to all its columns at once, every
    column a contiguous row of tokens (a decode step runs this for every held token)."""
    history = inputs.history.float()
    kv_heads = inputs.values.shape[1]
    positions = inputs.positions
    newest = positions.amax(-1, keepdim=True)
    seen_by = (newest + 1 - positions).clamp_min(1).float()  # queries that have seen the token (itself included)
    recent = newest_recent_rows(history, positions, RECENT_ROWS)  # the newest 16 of learned-block's 128 too
    # the KV group's mean of: the running sum, the block's sum and maximum, the recent rows' sum and maximum, the
    # newest row
    statistics = [
        history[:, :, :3],
        recent.sum(2, keepdim=True),
        recent.amax(2, keepdim=True),
        history[:, :, NEWEST : NEWEST + 1],
    ]
    rows = group_query_heads(torch.cat(statistics, 2), kv_heads).mean(2)
    total, block_sum, block_max, recent_sum, recent_max, newest_row = rows.unbind(2)
    recent_mean = recent_sum / seen_by.clamp_max(recent.shape[2])
    if inputs.new_tokens > 1:  # a prompt block: its own mean and maximum over the queries that see the token
        block_mean = block_sum / seen_by.clamp_max(inputs.new_tokens)
    else:  # a decode step: the newest decoded queries stand in for the block
        block_mean, block_max = recent_mean, recent_max
    sums = group_query_heads(history[:, :, 0], kv_heads)
    if inputs.real is not None:
        sums = sums.masked_fill(~inputs.real.unsqueeze(2), float("-inf"))
    weights = normalise_weights(sums, padded=inputs.real is not None, positive=True)
    caote = aggregate_groups(caote_errors(weights, inputs.values.unsqueeze(2)), "rss")
    value_norm = torch.linalg.vector_norm(inputs.values.float(), dim=-1)
    masses = [total, total / seen_by, block_mean, block_max, recent_mean, recent_max, newest_row, value_norm, caote]
    logged = _log(torch.stack(masses, 2))
    counts = torch.log1p(torch.stack([newest - positions, positions], 2).clamp_min(0).float())  # age, position
    flags = torch.stack([positions > newest - inputs.new_tokens, positions < sink_tokens], 2).float()
    scalars = torch.cat([logged[:, :, :7], counts, logged[:, :, 7:], flags], 2)  # SCALARS order
    first, second = _product_columns(scalars.device)
    products = scalars.index_select(2, first) * scalars.index_select(2, second)
    return torch.cat([scalars, scalars[:, :, : len(SQUARED)].square(), products], 2)


def token_features(inputs, groups: tuple[str, ...], unrotate: Callable | None, sink_tokens: int) -> torch.Tensor:
    """``(B, H_kv, N, F)`` float32 features of every token a layer holds (`caote.policies.ScoreInputs`, whose
    ``history`` is `caote.history.SumAndRecent`'s), columns as `feature_names`. With ``t`` tokens seen, token ``j``
    at position ``p_j`` has been seen by ``n_j = t - p_j`` queries; every attention statistic is the mean over the
    KV group's query heads, and ``log`` is ``log(x + 1e-6)``:

        log_sum = log S_j (H2O's sum)       log_sum_per_query = log(S_j / n_j)
        log_block_mean = log(sum of the block's rows / min(n_j, block))
        log_block_max = log(max of the block's rows)
        log_recent_mean / log_recent_max: the same over the newest 16 rows     log_newest: the newest row
        log_age = log(1 + t - 1 - p_j)    log_position = log(1 + p_j)    log_value_norm = log ||v_j||
        log_caote = log c_j (CAOTE over the normalised H2O sums, rss over the group)
        new = [p_j >= t - block]          sink = [p_j < sinks] (always 0 on candidates: sinks are protected)
    """
    stacked = [scalar_features(inputs, sink_tokens).transpose(-1, -2)] if "scalars" in groups else []
    if "key" in groups:
        key = unrotate(inputs.keys.float(), inputs.positions.clamp_min(0))
        stacked += [key, key.square()]
    if "value" in groups:
        stacked.append(inputs.values.float())
    return torch.cat(stacked, dim=-1)


def linear_map(features: torch.Tensor, weights: torch.Tensor, feature_major: bool = False) -> torch.Tensor:
    """``(B, H_kv, N, F)`` features (``feature_major``: ``(B, H_kv, F, N)``), ``(H_kv, F)`` weights (or ``(B, H_kv,
    F)``: a stack of layers, `Predictor.stacked`) -> ``(B, H_kv, N)``: each head's weights dotted with its tokens'
    features (a product and a sum: fewer operators than a batched matrix product at these sizes)."""
    weights = weights.to(features.device)
    if feature_major:
        return (features * weights.unsqueeze(-1)).sum(-2)
    return (features * weights.unsqueeze(-2)).sum(-1)


def marked(history: torch.Tensor, row: int, positions: torch.Tensor) -> torch.Tensor:
    """``(B, H_kv, N)`` bool: the tokens for which ``row`` of the history (a remembered key term's or prediction's
    position plus one, equal over a KV head's query heads) was written."""
    group = group_size(history.shape[1], positions.shape[1])
    return history[:, ::group, row] == positions + 1


class LayerPredictor:
    """One layer's map from features to predicted log future mass: ``(B, H_kv, N, F) @ (H_kv, F)`` (or a stack of
    layers' with weights ``(B, H_kv, F)``, `Predictor.stacked`, which remembers the keys of the stack's layers).

    The key's part of the sum, ``w_key . [k_j, k_j^2]`` with RoPE undone, never changes for a token, so it is
    computed once per token (`remember_keys`, when the token is first predicted) and kept in the layer's history; a
    step that predicts computes the other columns, and a decode step that reuses predictions computes nothing."""

    def __init__(self, weights: torch.Tensor, groups: tuple[str, ...], unrotate: Callable | None, sink_tokens: int):
        self.weights, self.groups, self.unrotate, self.sink_tokens = weights, groups, unrotate, sink_tokens

    def features(self, inputs) -> torch.Tensor:
        return token_features(inputs, self.groups, self.unrotate, self.sink_tokens)

    def _key_columns(self, head_dim: int) -> slice:
        """The columns of the key features (`feature_names` order: scalars, key, value)."""
        start = len(feature_names(("scalars",), head_dim)) if "scalars" in self.groups else 0
        return slice(start, start + 2 * head_dim)

    def remember_keys(self, inputs) -> None:
        """Write the key term of every real token of ``inputs`` (a layer's, or a stack of layers', `caote.stacking`:
        their history is the layers' own storage) that lacks one (new since the last prediction) into the history
        (`caote.history.SumAndRecent`: rows ``KEY_TERM`` and ``KEY_TERM_POSITION``)."""
        if "key" not in self.groups:
            return
        history, positions = inputs.history, inputs.positions
        group = group_size(history.shape[1], positions.shape[1])
        missing = ~marked(history, KEY_TERM_POSITION, positions) & held(positions)
        least, most = torch.stack(torch.aminmax(missing.sum(-1))).tolist()  # one read back
        if most == 0:
            return
        tokens = positions.shape[-1]
        if least == most and bool(missing[..., tokens - most :].all()):  # the newest slots (a prompt block's tokens)
            slots = torch.arange(tokens - most, tokens, device=positions.device).expand(*positions.shape[:2], most)
            chosen, keys = positions[..., tokens - most :], inputs.keys[:, :, tokens - most :]
        else:
            if least == most == 1:  # one in every KV head (a decode step in place): that one
                slots = missing.to(torch.int8).argmax(dim=-1, keepdim=True)
            elif least == most:  # as many in every KV head: just those
                slots = missing.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :most]
            else:
                slots = torch.arange(tokens, device=positions.device).expand_as(positions)
            chosen = positions.gather(2, slots)
            keys = inputs.keys.gather(2, slots.unsqueeze(-1).expand(-1, -1, -1, inputs.keys.shape[-1]))
        key = self.unrotate(keys.float(), chosen.clamp_min(0))
        term = linear_map(torch.cat([key, key.square()], dim=-1), self.weights[..., self._key_columns(key.shape[-1])])
        grouped = group_query_heads(history, positions.shape[1])  # a view: a KV head's value reaches its group
        index = slots.unsqueeze(2).expand(-1, -1, group, -1)
        for row, value in ((KEY_TERM, term), (KEY_TERM_POSITION, chosen + 1)):
            grouped[:, :, :, row].scatter_(-1, index, value.to(history.dtype).unsqueeze(2).expand(-1, -1, group, -1))

    def predict(self, inputs) -> torch.Tensor:
        """``(B, H_kv, N)`` predicted log future mass of every token held: fresh (`fresh`, then kept in the history's
        prediction rows), or at a decode step whose tokens are not yet due (`PREDICTION_REFRESH`), each token's
        last prediction, ``-inf`` for the tokens not yet predicted (all of them protected)."""
        history = inputs.history
        group = group_size(history.shape[1], inputs.positions.shape[1])
        if inputs.new_tokens == 1 and PREDICTION_REFRESH > 1 and inputs.protected is not None:
            predicted = marked(history, PREDICTION_POSITION, inputs.positions)
            waiting = ~predicted & held(inputs.positions)
            newest = inputs.positions.amax(-1, keepdim=True)
            overdue = ~inputs.protected | (inputs.positions <= newest - PREDICTION_REFRESH + 1)
            if not bool((waiting & overdue).any()):
                return history[:, ::group, PREDICTION].float().masked_fill(~predicted, -math.inf)
        self.remember_keys(inputs)
        fresh = self.fresh(inputs)
        grouped = group_query_heads(history, inputs.positions.shape[1])
        grouped[:, :, :, PREDICTION] = fresh.unsqueeze(2)
        grouped[:, :, :, PREDICTION_POSITION] = (inputs.positions + 1).unsqueeze(2)
        return fresh

    def fresh(self, inputs) -> torch.Tensor:
        """``(B, H_kv, N)`` predicted log future mass of every token held, from this step's features (the key terms
        from the history: call `remember_keys` first, as `predict` does)."""
        if "key" not in self.groups:
            return linear_map(self.features(inputs), self.weights)
        group = group_size(inputs.history.shape[1], inputs.positions.shape[1])
        remembered = inputs.history[:, ::group, KEY_TERM].float()
        rows = [scalar_features(inputs, self.sink_tokens)] if "scalars" in self.groups else []
        if "value" in self.groups:
            rows.append(inputs.values.float().transpose(-1, -2))
        if not rows:  # a predictor of the key alone
            return remembered
        columns = self._key_columns(inputs.values.shape[-1])  # keys and values share the head size
        weights = torch.cat([self.weights[..., : columns.start], self.weights[..., columns.stop :]], dim=-1)
        features = rows[0] if len(rows) == 1 else torch.cat(rows, 2)  # (B, H_kv, F, N): a contiguous row per feature
        return linear_map(features, weights, feature_major=True) + remembered


def learned_score(inputs) -> torch.Tensor:
    """The predicted future mass ``exp(w_h . x_j)`` ``(B, H_kv, N)``, scaled so that its largest entry is 1."""
    predicted = inputs.predictor.predict(inputs)
    if inputs.real is not None:
        predicted = predicted.masked_fill(~inputs.real, float("-inf"))
    return torch.exp(predicted - predicted.amax(-1, keepdim=True))


def learned_block_score(inputs) -> torch.Tensor:
    """``learned-block``: CAOTE over the predicted future mass (learned+caote's score) times the exact output
    change over the newest prompt block's queries (caote-block's score, `caote.value_aware.multi_row_caote_score`),
    floored at the head's `BLOCK_FLOOR_QUANTILE` ``q`` of it, to the power `BLOCK_EXPONENT`:

        s_j = c_j(h / sum h) * max(e_j, e_(q))^beta

    The prediction ranks by what later queries will want, the block by what the queries of this block would lose,
    and the floor keeps the block from vetoing a token they do not read. A decode step scores as learned+caote (the
    block error over the newest 128 decoded queries costs what makes caote-block decode at a tenth of a full
    cache's speed)."""
    predicted = caote_score(learned_score(inputs), inputs.values, inputs.real)
    if inputs.new_tokens == 1:
        return predicted
    block = multi_row_caote_score(inputs.history[:, :, RECENT_START:].float(), inputs.values)
    return predicted * floored(block, inputs.real, BLOCK_FLOOR_QUANTILE) ** BLOCK_EXPONENT


def floored(errors: torch.Tensor, real: torch.Tensor | None, quantile: float) -> torch.Tensor:
    """``errors`` ``(B, H_kv, N)`` lifted to their ``quantile`` over each head's ``real`` tokens (padding neither
    sets the floor nor matters; an infinite error counts as the largest float there, so that a head of mostly
    infinite errors still gets a floor), and to the smallest positive float so that a power of them stays
    positive. The quantile is taken in float32 or wider (`torch.nanquantile` takes no half precision)."""
    counted = errors.to(torch.promote_types(errors.dtype, torch.float32))
    counted = counted.clamp_max(torch.finfo(counted.dtype).max)
    if real is not None:
        counted = counted.masked_fill(~real, float("nan"))
    floor = torch.nanquantile(counted, quantile, dim=-1, keepdim=True).nan_to_num(0.0).to(errors.dtype)
    return errors.maximum(floor).clamp_min(torch.finfo(errors.dtype).tiny)
