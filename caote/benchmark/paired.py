"""Decoding speed side by side: the configurations of a (context, budget) cell prefill first, then their decode steps
are interleaved, one step of each in turn in an order rotated at every step, so that every configuration sees the
same moment's machine. On a shared CPU, configurations timed one after another spread 0.6-1.4x per round even on a
quiet machine; interleaved, per-round ratios mostly agree within +-0.03 (docs/performance.md). `caote bench` runs
these rounds for its decode targets; ``benchmarks/decode_paired.py`` runs them for other budgets and checkouts."""

from __future__ import annotations

import statistics
import time

import torch

from caote.benchmark.config import FULL_AT_BUDGET
from caote.benchmark.sample import configuration_cache
from caote.cache import EvictionCache


def cell_key(context: int, budget: int, configuration: str) -> str:
    """How a round names one configuration of one cell: ``"<context>/<budget>/<configuration>"``."""
    return f"{context}/{budget}/{configuration}"


def interleaved_decode(
    model,
    ids: torch.Tensor,
    contexts,
    budgets,
    configurations,
    steps: int = 64,
    timed: int = 56,
    block: int = 128,
    interval: int = 1,
    progress=None,
) -> dict[str, float]:
    """One round: ``{cell_key: ms per decode step}`` of the last ``timed`` of ``steps`` greedy steps (`per_step`), for
    every configuration (``full@b`` or a policy, `configuration_cache`) after the first ``context`` tokens of
    ``ids``, at every budget, prompts fed in blocks of ``block``, decoding evicting every ``interval`` steps.
    ``progress`` (optional) is called with the cell's key when a cell starts.

    While any caote cache is alive, full@b's layers pass caote's attention dispatcher (one Python call per layer,
    to the same kernel), which favours caote by well under 1 %."""
    if timed > steps:
        raise ValueError(f"timed steps ({timed}) cannot exceed the decoded steps ({steps})")
    results = {}
    with torch.no_grad():
        for context in contexts:
            for budget in budgets:
                if progress is not None:
                    progress(cell_key(context, budget, "*"))
                caches, outputs, times = {}, {}, {configuration: [] for configuration in configurations}
                for configuration in configurations:
                    cache, prompt, step = configuration_cache(
                        model, configuration, ids[:, :context], budget, block, interval
                    )
                    for start in range(0, prompt.shape[1], step):
                        outputs[configuration] = model(
                            input_ids=prompt[:, start : start + step], cache=cache, logits_to_keep=1
                        )
                    caches[configuration] = cache
                for number in range(steps):
                    turn = number % len(configurations)
                    for configuration in configurations[turn:] + configurations[:turn]:
                        token = outputs[configuration].logits[:, -1:].argmax(-1)
                        began = time.perf_counter()
                        outputs[configuration] = model(input_ids=token, cache=caches[configuration])
                        times[configuration].append(time.perf_counter() - began)
                for configuration in configurations:
                    ms = 1000 * per_step(times[configuration][-timed:], interval)
                    results[cell_key(context, budget, configuration)] = ms
                    if isinstance(caches[configuration], EvictionCache):
                        caches[configuration].close()
    return results


def per_step(seconds: list[float], interval: int) -> float:
    """Seconds per decode step: the median over windows of ``interval`` consecutive steps (each holding one
    evicting step when decoding evicts every ``interval`` steps) of the window's mean, so that the scored steps
    count whatever the interval (with interval 1, the median step)."""
    windows = [seconds[start : start + interval] for start in range(0, len(seconds) - interval + 1, interval)]
    return statistics.median(sum(window) / interval for window in windows)


def round_ratios(rounds: list[dict], context: int, budget: int, policy: str) -> list[float]:
    """Per round, the policy's decode speed against full@b of the same round (ms of full@b over the policy's);
    ``rounds`` are dicts whose ``"ms"`` holds `interleaved_decode`'s results."""
    full, own = cell_key(context, budget, FULL_AT_BUDGET), cell_key(context, budget, policy)
    return [r["ms"][full] / r["ms"][own] for r in rounds if full in r["ms"] and own in r["ms"]]
