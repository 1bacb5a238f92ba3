"""Perplexity, next-token KL and attention-output fidelity under eviction, computed in lockstep with the full cache.

A text is consumed in blocks of 128 tokens. For each block the model runs once with a full (non-evicting) cache
and once per policy x budget, each with its own `EvictionCache` (a forward evicts only in the cache it is given,
so any number of caches can share one model). From every forward we read the next-token log-probabilities:

* PPL = exp(mean negative log-likelihood of tokens 2..T) — the paper's Table 4 reports PPL(policy) − PPL(full);
* KL = mean over the same predictions of KL(p_full || p_policy), in nats — 0 for a cache that changes nothing;
  ``kl_evicted`` averages only the predictions made by blocks that attend an evicted cache;
* fidelity (optional, see `caote.evaluation.fidelity`): the relative error of every layer's attention output.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from caote.cache import DEFAULT_BLOCK_SIZE, EvictionCache
from caote.evaluation.fidelity import AttentionCapture, FidelityMeter, measured
from caote.evaluation.reference import FULL, cache_budget


@dataclass
class _Track:
    """One policy x budget riding along the full cache."""

    policy: str
    budget: int | None
    cache: EvictionCache
    meter: FidelityMeter | None
    nll: float = 0.0
    kl: float = 0.0
    kl_evicted: float = 0.0
    evicted_predictions: int = 0
    predictions: int = 0
    seconds: float = 0.0
    last: torch.Tensor | None = field(default=None, repr=False)  # log-probs at the previous block's last token
    last_evicted: bool = False
    block_nll: list = field(default_factory=list)  # per block: mean NLL of its predictions
    block_kl: list = field(default_factory=list)  # per block: mean KL of its predictions


def _forward(model, block: torch.Tensor, cache: EvictionCache, seen: int) -> torch.Tensor:
    """Log-probabilities ``(q, V)`` of one block run against ``cache`` (which already holds ``seen`` tokens)."""
    mask = torch.ones(1, seen + block.shape[1], dtype=torch.long, device=block.device)
    output = model(input_ids=block, attention_mask=mask, cache=cache, use_cache=True)
    return F.log_softmax(output.logits[0].float(), dim=-1)


def lockstep(
    model,
    input_ids: torch.Tensor,
    runs: list[tuple[str, int | None]],
    block_size: int = DEFAULT_BLOCK_SIZE,
    fidelity: bool = False,
    progress=None,
) -> list[dict]:
    """PPL, KL from the full cache and (optionally) attention fidelity of every ``(policy, budget)`` in ``runs`` on
    ``input_ids`` ``(1, T)``, plus the full cache's own PPL as ``ppl_full`` in every result."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 2:
        raise ValueError("input_ids must have shape (1, T) with T >= 2")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    with ExitStack() as stack:  # every cache's hooks (and the capture's) come off the model on the way out
        reference = stack.enter_context(
            EvictionCache(model, budget=cache_budget(None), policy=FULL, block_size=block_size)
        )
        caches = [
            stack.enter_context(EvictionCache(model, budget=cache_budget(budget), policy=policy, block_size=block_size))
            for policy, budget in runs
        ]
        capture = stack.enter_context(AttentionCapture(model)) if fidelity else None
        tracks = [
            _Track(policy, budget, cache, FidelityMeter(len(capture.modules)) if capture is not None else None)
            for (policy, budget), cache in zip(runs, caches)
        ]
        with torch.no_grad():
            full_nll = _run_blocks(model, input_ids, reference, tracks, capture, block_size, progress)
    return _results(tracks, full_nll, input_ids.shape[1])


def _run_blocks(model, input_ids, reference, tracks, capture, block_size, progress) -> float:
    """Feed ``input_ids`` block by block to the full cache and every track; returns the full cache's total NLL."""
    full_nll, full_last = 0.0, None
    total = input_ids.shape[1]
    for start in range(0, total, block_size):
        block = input_ids[:, start : start + block_size]
        # predictions of this step: the previous block's last row predicts token `start`, row i predicts i+1
        targets = input_ids[0, max(start, 1) : start + block.shape[1]].view(-1, 1)
        full_lp = _forward(model, block, reference, start)
        full_outputs = capture.take() if capture is not None else None
        full_pred = _predictions(full_last, full_lp)
        full_nll -= full_pred.gather(1, targets).sum().item()
        for track in tracks:
            began = time.perf_counter()
            lp = _forward(model, block, track.cache, start)
            track.seconds += time.perf_counter() - began
            if capture is not None:
                outputs = capture.take()
                if measured(start, track.budget):
                    track.meter.add(outputs, full_outputs)
            pred = _predictions(track.last, lp)
            nll = -pred.gather(1, targets).sum().item()
            track.nll += nll
            kl = (full_pred.exp() * (full_pred - pred)).sum(-1)
            track.kl += kl.sum().item()
            track.predictions += kl.shape[0]
            # which predictions came from a forward over an evicted cache
            flags = torch.full((kl.shape[0],), measured(start, track.budget) and track.budget is not None)
            if track.last is not None:
                flags[0] = track.last_evicted
            track.kl_evicted += kl[flags].sum().item()
            track.evicted_predictions += int(flags.sum())
            # per-block series (paired units of the summaries): blocks predicted from an evicted cache only
            if kl.shape[0] and (track.budget is None or bool(flags.any())):
                track.block_nll.append(nll / kl.shape[0])
                track.block_kl.append(kl.mean().item())
            track.last, track.last_evicted = (
                lp[-1],
                bool(measured(start, track.budget) and track.budget is not None),
            )
        full_last = full_lp[-1]
        if progress is not None:
            progress.update(1)
    return full_nll


def _results(tracks: list[_Track], full_nll: float, total: int) -> list[dict]:
    """One result per track (PPL, KL, fidelity, per-block series), next to the full cache's PPL."""
    predictions = total - 1
    ppl_full = float(torch.tensor(full_nll / predictions).exp())
    results = []
    for track in tracks:
        ppl = float(torch.tensor(track.nll / predictions).exp())
        results.append(
            {
                "policy": track.policy,
                "budget": track.budget,
                "tokens": total,
                "predictions": predictions,
                "ppl": ppl,
                "ppl_full": ppl_full,
                "ppl_delta": ppl - ppl_full,
                "nll": track.nll / predictions,
                "kl": track.kl / predictions,
                "kl_evicted": track.kl_evicted / track.evicted_predictions if track.evicted_predictions else None,
                "fidelity": track.meter.mean() if track.meter is not None else None,
                "fidelity_layers": track.meter.per_layer() if track.meter is not None else None,
                "fidelity_blocks": track.meter.blocks if track.meter is not None else 0,
                "fidelity_per_block": track.meter.per_block if track.meter is not None else None,
                "nll_blocks": track.block_nll,
                "kl_blocks": track.block_kl,
                "seconds": round(track.seconds, 3),
            }
        )
    return results


def _predictions(last: torch.Tensor | None, log_probs: torch.Tensor) -> torch.Tensor:
    """Log-prob rows predicting the block's tokens: its token 0 from the previous block's last row (when there is
    one), token i + 1 from row i; the block's last row is kept for the next block."""
    return log_probs[:-1] if last is None else torch.cat([last[None], log_probs[:-1]])


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
