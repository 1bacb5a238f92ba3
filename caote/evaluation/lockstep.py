"""Perplexity, next-token KL and attention-output fidelity under eviction, each policy against one full-cache pass.

A text is consumed in blocks of 128 tokens. The full (non-evicting) cache reads it once (`reference_pass`), keeping
per block its next-token log-probabilities, its state and, when asked, every layer's attention output and the
attention each token receives from later queries (`caote.future`, for the ``oracle`` policy). Every policy x budget
then reads the same blocks under its own `EvictionCache` (`track`) and is compared with that reference:

* PPL = exp(mean negative log-likelihood of tokens 2..T) — the paper's Table 4 reports PPL(policy) − PPL(full);
* KL = mean over the same predictions of KL(p_full || p_policy), in nats — 0 for a cache that changes nothing;
  ``kl_evicted`` averages only the predictions made by blocks that attend an evicted cache;
* fidelity (optional, see `caote.evaluation.fidelity`): the relative error of every layer's attention output.

With ``scored_tail`` only the predictions of a text's last ``scored_tail`` tokens (rounded up to whole blocks) are
scored, in every pass, the reference's included: the blocks before them run the model body and keep one row of
logits, which at 4k-8k tokens and a 262k vocabulary is most of the saving (`scored_blocks`).

Blocks before a policy's first eviction are not recomputed when the policy carries no state into that eviction
(every base but H2O's running sum): their forwards equal the full cache's, so the policy's cache starts from the
reference's state at that block (`skippable_blocks`); the result is identical (tested), at a fraction of the cost.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from caote.attention import AttentionCall, attention_probabilities
from caote.cache import CacheSnapshot, EvictionCache
from caote.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_PREFILL
from caote.evaluation.fidelity import AttentionCapture, FidelityMeter, measured
from caote.evaluation.reference import FULL, UNBOUNDED
from caote.future import FutureAttention, received
from caote.layer import EvictionLayer
from caote.policies import hindsight_policies, is_auto, parse_policy
from caote.settings import CacheSettings

# evaluation follows the paper: every decoded token evicts one (the rows do not depend on the library's default)
EVAL_DECODE_EVICTION_INTERVAL = 1


def cell_settings(
    policy: str,
    budget: int | None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    predictor: str | None = None,
    prefill: str = DEFAULT_PREFILL,
) -> CacheSettings:
    """The cache settings of one policy x budget cell, for texts and examples alike: `UNBOUNDED` for the reference
    (``None``), the paper's one token evicted per decode step, the library's defaults otherwise (``predictor``: the
    file of the learned policies and auto, None for the model's committed one; ``prefill``: the prompt read in
    blocks or whole, then compressed, `caote.settings.CacheSettings.prefill`)."""
    # auto reads the model's predictor only while it reads the prompt in blocks (`CacheSettings.for_model`)
    reads_predictor = (prefill == "blocks") if is_auto(policy) else parse_policy(policy).reads_predictor
    return CacheSettings(
        budget=UNBOUNDED if budget is None else budget,
        policy=policy,
        block_size=block_size,
        prefill=prefill,
        decode_eviction_interval=EVAL_DECODE_EVICTION_INTERVAL,
        predictor=predictor if reads_predictor else None,  # a grid's other policies read none
    )


def resolution(settings: CacheSettings) -> dict:
    """What a row records of the policy its cell ran beyond its name: ``{"resolved": <policy>}`` for auto (its
    settings resolved for the model), nothing for any other, so rows written before auto and their summaries stay
    as they are."""
    return {"resolved": settings.policy.name} if settings.auto else {}


class _ReferenceCache(EvictionCache):
    """The full cache, which also records the attention every block's queries give each token (`FutureAttention`)."""

    def __init__(self, model, block_size: int, future: FutureAttention | None):
        super().__init__(model, cell_settings(FULL, None, block_size))
        self.future_attention = future

    def after_attention(self, call: AttentionCall) -> None:
        super().after_attention(call)
        layer = self.layers[call.module.layer_idx]
        if self.future_attention is None or not isinstance(layer, EvictionLayer):
            return
        probabilities = attention_probabilities(
            call.module, call.queries, layer.keys, layer.values, call.mask, call.kwargs
        )
        given = received(probabilities, layer.values, self.future_attention.target)  # (B, H_kv, N)
        self.future_attention.add(call.module.layer_idx, layer.cumulative_length, given[0])


@dataclass
class Reference:
    """The full cache's pass over one text, shared by every policy compared with it (per block: log-probs, the
    cache state after it and, for fidelity, every layer's attention output)."""

    block_size: int
    log_probs: list[torch.Tensor]
    snapshots: list[CacheSnapshot]
    outputs: list[list[torch.Tensor]] | None
    future: FutureAttention | None
    nll: float
    first_scored: int = 0  # index of the first block whose predictions are scored (`scored_blocks`)

    def predictions(self, index: int) -> torch.Tensor:
        """Log-prob rows of the full cache predicting the tokens of block ``index`` (a scored block)."""
        assert index >= self.first_scored, f"block {index} is not scored (from block {self.first_scored} on)"
        return _predictions(self.log_probs[index - 1][-1] if index else None, self.log_probs[index])


def _forward(model, block: torch.Tensor, cache: EvictionCache, seen: int, every_row: bool = True) -> torch.Tensor:
    """Log-probabilities ``(q, V)`` of one block run against ``cache`` (which already holds ``seen`` tokens); only
    the last row's ``(1, V)`` unless ``every_row``."""
    mask = torch.ones(1, seen + block.shape[1], dtype=torch.long, device=block.device)
    output = model(
        input_ids=block, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=0 if every_row else 1
    )
    return F.log_softmax(output.logits[0].float(), dim=-1)


def scored_blocks(tokens: int, block_size: int, scored_tail: int | None) -> int:
    """Index of the first block whose predictions are scored: 0 (every prediction) without ``scored_tail``, else the
    block holding token ``tokens - scored_tail`` (so at least the last ``scored_tail`` tokens are scored; the
    previous block's last row predicts that block's first token)."""
    if scored_tail is not None and scored_tail < 1:
        raise ValueError(f"scored_tail must be at least 1 token, got {scored_tail}")
    if scored_tail is None or scored_tail >= tokens - 1:
        return 0
    return (tokens - scored_tail) // block_size


def _scored_predictions(tokens: int, block_size: int, first_scored: int) -> int:
    """How many tokens are predicted and scored: tokens 2..T, or from block ``first_scored`` on."""
    return tokens - 1 if first_scored == 0 else tokens - first_scored * block_size


def _blocks(input_ids: torch.Tensor, block_size: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(start, block, targets)`` per block: row i of a block predicts token i + 1, and the previous block's last row
    predicts the block's first token."""
    total = input_ids.shape[1]
    return [
        (
            start,
            input_ids[:, start : start + block_size],
            input_ids[0, max(start, 1) : min(start + block_size, total)].view(-1, 1),
        )
        for start in range(0, total, block_size)
    ]


def _check_ids(model, input_ids: torch.Tensor) -> torch.Tensor:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 2:
        raise ValueError("input_ids must have shape (1, T) with T >= 2")
    return input_ids.to(next(model.parameters()).device)


def reference_pass(
    model,
    input_ids: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    fidelity: bool = False,
    future: bool = False,
    states: set[int] | None = None,
    scored_tail: int | None = None,
    future_target: str = "mass",
) -> Reference:
    """The full cache over ``input_ids`` ``(1, T)``: per-block log-probs, attention outputs when ``fidelity``, the
    attention received from later queries (for ``oracle``) when ``future``, and the cache state after each block in
    ``states`` (None: every block; each state holds its own keys and values, so keep only those a track starts
    from). ``scored_tail``: score only the last tokens (`scored_blocks`); earlier blocks keep their last row.
    ``future_target``: what the future records (`caote.future.received`: attention ``mass`` or output ``change``)."""
    input_ids = _check_ids(model, input_ids)
    first_scored = scored_blocks(input_ids.shape[1], block_size, scored_tail)
    recorder = FutureAttention(future_target) if future else None
    log_probs, snapshots, outputs, nll = [], [], [] if fidelity else None, 0.0
    with ExitStack() as stack, torch.no_grad():
        cache = stack.enter_context(_ReferenceCache(model, block_size, recorder))
        capture = stack.enter_context(AttentionCapture(model)) if fidelity else None
        for index, (start, block, targets) in enumerate(_blocks(input_ids, block_size)):
            log_probs.append(_forward(model, block, cache, start, index >= first_scored))
            snapshots.append(cache.snapshot() if states is None or index in states else None)
            if capture is not None:
                outputs.append(capture.take())
            if index >= first_scored:
                predictions = _predictions(log_probs[index - 1][-1] if index else None, log_probs[index])
                nll -= predictions.gather(1, targets).sum().item()
    future_attention = recorder.finish() if recorder else None
    return Reference(block_size, log_probs, snapshots, outputs, future_attention, nll, first_scored)


def block_count(tokens: int, block_size: int) -> int:
    """How many blocks of ``block_size`` a ``tokens``-long text is read in (the last may be shorter)."""
    return -(-tokens // block_size)


def skippable_blocks(policy: str, budget: int | None, block_size: int, tokens: int) -> int:
    """How many leading blocks of a ``tokens``-long text a policy reads exactly as the full cache does, and can take
    from the reference: all of them for the full cache; for an evicting policy the blocks before its first
    eviction, provided it carries no state into that eviction (not H2O's running sum, nor a query window longer
    than the block that first evicts)."""
    blocks = block_count(tokens, block_size)
    base = parse_policy(policy).base
    if budget is None or base is None:
        return blocks
    first = budget // block_size  # block k is the first to overflow the budget when (k + 1) * block_size > budget
    if first >= blocks:
        return blocks
    if base.memory is not None and base.memory.carries_over(min(block_size, tokens - first * block_size)):
        return 0
    return first


@dataclass
class _Tally:
    """What one policy x budget accumulates block by block."""

    meter: FidelityMeter | None
    nll: float = 0.0
    kl: float = 0.0
    kl_evicted: float = 0.0
    evicted_predictions: int = 0
    block_nll: list = field(default_factory=list)  # per block predicted from an evicted cache: mean NLL
    block_kl: list = field(default_factory=list)  # the same blocks: mean KL


def track(
    model,
    input_ids: torch.Tensor,
    reference: Reference,
    policy: str,
    budget: int | None,
    skip_prefix: bool = True,
    predictor: str | None = None,
    cache_class: type[EvictionCache] = EvictionCache,
) -> dict:
    """One policy x budget over ``input_ids`` against ``reference``: PPL, KL, fidelity and per-block series.
    ``skip_prefix`` takes the blocks before the first eviction from the reference (see `skippable_blocks`);
    ``cache_class`` is the cache built (a probe's subclass that watches or changes its layers)."""
    input_ids = _check_ids(model, input_ids)
    blocks = _blocks(input_ids, reference.block_size)
    settings = cell_settings(policy, budget, reference.block_size, predictor).for_model(model)
    ran = settings.policy.name  # auto's choice for the model
    skipped = skippable_blocks(ran, budget, reference.block_size, input_ids.shape[1]) if skip_prefix else 0
    fidelity = reference.outputs is not None
    began = time.perf_counter()
    with ExitStack() as stack, torch.no_grad():
        cache = stack.enter_context(cache_class(model, settings, future=reference.future))
        capture = stack.enter_context(AttentionCapture(model)) if fidelity else None
        tally = _Tally(FidelityMeter(len(capture.modules)) if capture is not None else None)
        if 0 < skipped < len(blocks):
            cache.restore(reference.snapshots[skipped - 1])
        last, last_evicted = None, False
        for index, (start, block, targets) in enumerate(blocks):
            scored = index >= reference.first_scored
            if index < skipped:
                lp, outputs = reference.log_probs[index], reference.outputs[index] if fidelity else None
            else:
                lp = _forward(model, block, cache, start, scored)
                outputs = capture.take() if fidelity else None
            evicted = budget is not None and measured(start, budget)
            if fidelity and measured(start, budget):
                tally.meter.add(outputs, reference.outputs[index])
            if not scored:
                last, last_evicted = lp[-1], evicted
                continue
            full_pred, pred = reference.predictions(index), _predictions(last, lp)
            nll = -pred.gather(1, targets).sum().item()
            kl = (full_pred.exp() * (full_pred - pred)).sum(-1)
            tally.nll += nll
            tally.kl += kl.sum().item()
            flags = torch.full((kl.shape[0],), evicted)  # which predictions came from an evicted cache
            if last is not None:
                flags[0] = last_evicted
            tally.kl_evicted += kl[flags].sum().item()
            tally.evicted_predictions += int(flags.sum())
            if kl.shape[0] and (budget is None or bool(flags.any())):  # the paired units of the summaries
                tally.block_nll.append(nll / kl.shape[0])
                tally.block_kl.append(kl.mean().item())
            last, last_evicted = lp[-1], evicted
    total = input_ids.shape[1]
    predictions = _scored_predictions(total, reference.block_size, reference.first_scored)
    result = _result(policy, budget, tally, reference.nll, total, predictions, time.perf_counter() - began, skipped)
    return {**result, **resolution(settings)}


def _result(
    policy, budget, tally: _Tally, full_nll: float, total: int, predictions: int, seconds: float, skipped: int
) -> dict:
    ppl = float(torch.tensor(tally.nll / predictions).exp())
    ppl_full = float(torch.tensor(full_nll / predictions).exp())
    meter = tally.meter
    return {
        "policy": policy,
        "budget": budget,
        "tokens": total,
        "predictions": predictions,
        "ppl": ppl,
        "ppl_full": ppl_full,
        "ppl_delta": ppl - ppl_full,
        "nll": tally.nll / predictions,
        "kl": tally.kl / predictions,
        "kl_evicted": tally.kl_evicted / tally.evicted_predictions if tally.evicted_predictions else None,
        "fidelity": meter.mean() if meter is not None else None,
        "fidelity_layers": meter.per_layer() if meter is not None else None,
        "fidelity_blocks": meter.blocks if meter is not None else 0,
        "fidelity_per_block": meter.per_block if meter is not None else None,
        "nll_blocks": tally.block_nll,
        "kl_blocks": tally.block_kl,
        "blocks_from_reference": skipped,
        "seconds": round(seconds, 3),
    }


def _predictions(last: torch.Tensor | None, log_probs: torch.Tensor) -> torch.Tensor:
    """Log-prob rows predicting the block's tokens: its token 0 from the previous block's last row (when there is
    one), token i + 1 from row i; the block's last row is kept for the next block."""
    return log_probs[:-1] if last is None else torch.cat([last[None], log_probs[:-1]])


def lockstep_results(
    model,
    input_ids: torch.Tensor,
    runs: list[tuple[str, int | None]],
    block_size: int = DEFAULT_BLOCK_SIZE,
    fidelity: bool = False,
    skip_prefix: bool = True,
    predictor: str | None = None,
    scored_tail: int | None = None,
) -> Iterator[dict]:
    """One full-cache pass over ``input_ids`` ``(1, T)``, then the result of every ``(policy, budget)`` in ``runs``,
    yielded as soon as it is computed (so a caller can save each one), each with the full cache's PPL (over the
    last ``scored_tail`` tokens' predictions when given: `scored_blocks`)."""
    needs_future = bool(hindsight_policies([policy for policy, _ in runs]))
    tokens = input_ids.shape[-1]
    ran = {run: cell_settings(*run, block_size, predictor).for_model(model).policy.name for run in runs}
    starts = {skippable_blocks(ran[run], run[1], block_size, tokens) for run in runs} if skip_prefix else set()
    began = time.perf_counter()
    states = {s - 1 for s in starts if s}
    reference = reference_pass(model, input_ids, block_size, fidelity, needs_future, states, scored_tail)
    reference_seconds = time.perf_counter() - began
    for policy, budget in runs:
        result = track(model, input_ids, reference, policy, budget, skip_prefix, predictor)
        if budget is None:  # the full row carries the cost of the shared full-cache pass
            result["seconds"] = round(result["seconds"] + reference_seconds, 3)
        yield result


def lockstep(
    model,
    input_ids: torch.Tensor,
    runs: list[tuple[str, int | None]],
    block_size: int = DEFAULT_BLOCK_SIZE,
    fidelity: bool = False,
    skip_prefix: bool = True,
) -> list[dict]:
    """PPL, KL from the full cache and (optionally) attention fidelity of every ``(policy, budget)`` in ``runs``."""
    return list(lockstep_results(model, input_ids, runs, block_size, fidelity, skip_prefix))


def fidelity(
    model, input_ids: torch.Tensor, policies: list[str], budgets: list[int], block_size: int = 128
) -> list[dict]:
    """Per-layer and mean relative attention-output error of each policy x budget on ``input_ids`` ``(1, T)``."""
    runs = lockstep(
        model,
        input_ids,
        [(policy, budget) for policy in policies for budget in budgets],
        block_size=block_size,
        fidelity=True,
    )
    return [
        {
            "policy": run["policy"],
            "budget": run["budget"],
            "fidelity": run["fidelity"],
            "fidelity_layers": run["fidelity_layers"],
        }
        for run in runs
    ]
