"""The summary of a run: medians per configuration and context, ratios of samples taken in the same round, and
a verdict per target."""

from __future__ import annotations

import statistics
from typing import NamedTuple

from caote.benchmark.config import BASELINE_POLICY, FULL_AT_BUDGET, FULL_BLOCKS, FULL_CONFIGURATIONS, FULL_SDPA
from caote.benchmark.paired import round_ratios
from caote.policies import parse_policy, policy_name

# Target thresholds (ratios from the same run): +caote / +fastcaote over their base, every scored policy over
# streamingllm (prefill); decoding with a bounded cache against a full cache of the same size (full@b); decoding
# against the full cache of the whole context, at the largest context.
TRANSFORM_OVERHEAD_LIMIT = 1.05
SCORING_OVERHEAD_LIMIT = 1.10
BEYOND_OVERHEAD_LIMIT = 1.10  # a policy beyond the paper against its paper base's +caote (same kind of query rows)
DECODE_VS_FULL_AT_BUDGET_TARGET = 0.9
DECODE_VS_FULL_AT_BUDGET_TARGETS = {BASELINE_POLICY: 0.95}  # it scores nothing: only its bookkeeping is overhead
DECODE_SPEEDUP_TARGET = 1.5
# How cost grows with the context (from the smallest to the largest measured, at least 3 contexts): prefill is linear
# when the time per extra token of the last step in context is at most this much above the first step's (a
# quadratic cost doubles it per doubling); process peak memory is flat within this ratio of the smallest context's.
LINEAR_GROWTH_LIMIT = 1.25
FLAT_MEMORY_LIMIT = 1.10
# ATen operators (views included) an evicting layer may add to a decode step on the exact eager path
OPERATOR_LIMITS = {"tova+caote": 35, "h2o+caote": 45}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _paired_ratio(samples: list[dict], key: str, numerator: str, denominator: str, context: int):
    """Median over repeats of ``numerator / denominator`` for samples taken in the same round."""
    by = {(s["configuration"], s["repeat"]): s for s in samples if s["context"] == context and key in s}
    ratios = [
        by[(numerator, r)][key] / by[(denominator, r)][key]
        for (name, r) in list(by)
        if name == numerator and (denominator, r) in by and by[(denominator, r)][key]
    ]
    return _median(ratios)


class _Run(NamedTuple):
    """What a run's ratios are computed from: its samples, their medians and the run's settings."""

    samples: list[dict]
    medians: dict[str, dict[str, dict]]
    budget: int
    block: int
    weights: int
    decode_rounds: list


def summarise(document: dict) -> dict:
    """Medians per configuration and context, the ratios the targets are stated in, and a verdict per target."""
    samples = document["samples"]
    config = document["meta"]["config"]
    configurations = document["meta"]["configurations"]
    contexts = sorted({s["context"] for s in samples})
    medians = _medians(samples, configurations, contexts)
    run = _Run(
        samples,
        medians,
        config["budget"],
        config["block_size"],
        document["meta"]["weight_bytes"],
        document.get("decode_rounds", []),
    )
    policies = [name for name in configurations if name not in FULL_CONFIGURATIONS]
    ratios, targets = _ratios(run, policies, contexts)
    targets += _largest_context_targets(ratios, policies, contexts)
    targets += _operator_targets(document)
    growth = _growth(medians, configurations)
    targets += _growth_targets(growth)
    return {
        "medians": medians,
        "ratios": ratios,
        "growth": growth,
        "targets": targets,
        "targets_met": sum(t["met"] for t in targets),
        "targets_total": len(targets),
    }


def _medians(samples: list[dict], configurations: list[str], contexts: list[int]) -> dict[str, dict[str, dict]]:
    """Per configuration and context measured: the sample count and the median of each measured quantity."""
    medians: dict[str, dict[str, dict]] = {}
    for name in configurations:
        for context in contexts:
            rows = [s for s in samples if s["configuration"] == name and s["context"] == context]
            if not rows:
                continue
            entry = {"samples": len(rows)}
            for key in (
                "prefill_s",
                "kv_peak_bytes",
                "peak_rss_bytes",
                "baseline_rss_bytes",
                "prefill_rss_bytes",
                "decode_tokens_per_s",
                "decode_kv_bytes_per_token",
            ):
                entry[key] = _median([s.get(key) for s in rows])
            medians.setdefault(name, {})[str(context)] = entry
    return medians


def _ratios(run: _Run, policies: list[str], contexts: list[int]) -> tuple[dict[str, dict], list[dict]]:
    """Per context, the ratios of each policy measured there; with the targets they are held to, in order."""
    ratios: dict[str, dict] = {}
    targets: list[dict] = []
    for context in contexts:
        row: dict[str, dict] = {}
        for name in policies:
            if str(context) not in run.medians.get(name, {}):
                continue
            prefill, prefill_targets = _prefill_ratios(run, name, context)
            decode, decode_targets = _decode_ratios(run, name, context)
            row[name] = {**prefill, **decode}
            targets += prefill_targets + decode_targets
        ratios[str(context)] = row
    return ratios, targets


def _prefill_ratios(run: _Run, name: str, context: int) -> tuple[dict, list[dict]]:
    """``name``'s KV peak over the full cache's, its prefill time over streamingllm's, its cost reference's and
    full-sdpa's at ``context``; with the targets on all but the last."""
    at, medians = str(context), run.medians
    full = medians.get(FULL_BLOCKS, {}).get(at) or medians.get(FULL_SDPA, {}).get(at)
    entry: dict = {}
    targets: list[dict] = []
    if full and full["kv_peak_bytes"]:
        entry["kv_peak_vs_full"] = medians[name][at]["kv_peak_bytes"] / full["kv_peak_bytes"]
        entry["kv_peak_bound"] = (run.budget + run.block) / context
        targets.append(_target(f"KV peak {name} @ {context}", entry["kv_peak_vs_full"], "<=", entry["kv_peak_bound"]))
    if name != BASELINE_POLICY and BASELINE_POLICY in medians:
        entry["time_vs_streamingllm"] = _paired_ratio(run.samples, "prefill_s", name, BASELINE_POLICY, context)
        label = f"{name} / streamingllm time @ {context}"
        targets.append(_target(label, entry["time_vs_streamingllm"], "<=", SCORING_OVERHEAD_LIMIT))
    base, limit = _cost_reference(name)
    if base in medians:
        entry["time_vs_base"] = _paired_ratio(run.samples, "prefill_s", name, base, context)
        targets.append(_target(f"{name} / {base} time @ {context}", entry["time_vs_base"], "<=", limit))
    if FULL_SDPA in medians:
        entry["prefill_vs_full_sdpa"] = _paired_ratio(run.samples, "prefill_s", name, FULL_SDPA, context)
    return entry, targets


def _decode_ratios(run: _Run, name: str, context: int) -> tuple[dict, list[dict]]:
    """``name``'s decode speed-up over full-sdpa (with its memory-traffic bound) and its decode speed over full@b's
    at ``context``, from the interleaved decode rounds when there are any; with the target on the last."""
    at, medians = str(context), run.medians
    entry: dict = {}
    decode = medians[name][at].get("decode_tokens_per_s")
    full_decode = medians.get(FULL_SDPA, {}).get(at, {}).get("decode_tokens_per_s")
    if decode and full_decode:
        entry["decode_speedup"] = _paired_ratio(run.samples, "decode_tokens_per_s", name, FULL_SDPA, context)
        full_read = medians[FULL_SDPA][at]["decode_kv_bytes_per_token"]
        own_read = medians[name][at]["decode_kv_bytes_per_token"]
        entry["decode_speedup_bound"] = (run.weights + full_read) / (run.weights + own_read)
    interleaved = round_ratios(run.decode_rounds, context, run.budget, name)
    if interleaved:  # the decode rounds, steps interleaved beside full@b (`caote.benchmark.paired`)
        entry["decode_vs_full_at_budget"] = statistics.median(interleaved)
        entry["decode_vs_full_at_budget_rounds"] = interleaved
    elif decode and medians.get(FULL_AT_BUDGET, {}).get(at, {}).get("decode_tokens_per_s"):
        entry["decode_vs_full_at_budget"] = _paired_ratio(
            run.samples, "decode_tokens_per_s", name, FULL_AT_BUDGET, context
        )
    if entry.get("decode_vs_full_at_budget") is None:
        return entry, []
    limit = DECODE_VS_FULL_AT_BUDGET_TARGETS.get(name, DECODE_VS_FULL_AT_BUDGET_TARGET)
    return entry, [_target(f"decode {name} / full@b @ {context}", entry["decode_vs_full_at_budget"], ">=", limit)]


def _largest_context_targets(ratios: dict[str, dict], policies: list[str], contexts: list[int]) -> list[dict]:
    """At the largest context: each policy's prefill against full-sdpa's and its decode speed-up over it."""
    if not contexts:
        return []
    largest = str(contexts[-1])
    targets: list[dict] = []
    for name in policies:
        entry = ratios[largest].get(name, {})
        if entry.get("prefill_vs_full_sdpa") is not None:
            targets.append(_target(f"prefill {name} vs full-sdpa @ {largest}", entry["prefill_vs_full_sdpa"], "<", 1.0))
        if entry.get("decode_speedup") is not None:
            targets.append(
                _target(
                    f"decode speed-up {name} @ {largest}",
                    entry["decode_speedup"],
                    ">=",
                    DECODE_SPEEDUP_TARGET,
                    bound=entry["decode_speedup_bound"],
                )
            )
    return targets


def _operator_targets(document: dict) -> list[dict]:
    """The ATen operators an evicting layer adds to a decode step, for the policies counted, against their limits."""
    operators = (document.get("operators") or {}).get("counts", {})
    return [
        _target(f"decode operators per evicting layer: {name}", operators[name]["extra_per_layer"], "<=", limit)
        for name, limit in OPERATOR_LIMITS.items()
        if name in operators
    ]


def _growth(medians: dict[str, dict[str, dict]], configurations: list[str]) -> dict[str, dict]:
    """`growth_fit` of each configuration but full@b, for those measured at enough contexts."""
    growth = {name: growth_fit(medians.get(name, {})) for name in configurations if name != FULL_AT_BUDGET}
    return {name: fit for name, fit in growth.items() if fit is not None}


def _growth_targets(growth: dict[str, dict]) -> list[dict]:
    """Per policy fitted (the full caches are references): prefill grows linearly and peak RSS stays flat."""
    targets: list[dict] = []
    for name, fit in growth.items():
        if name in FULL_CONFIGURATIONS:
            continue
        targets.append(
            _target(f"prefill grows linearly: {name}", fit["marginal_cost_ratio"], "<=", LINEAR_GROWTH_LIMIT)
        )
        targets.append(_target(f"peak RSS stays flat: {name}", fit["peak_rss_ratio"], "<=", FLAT_MEMORY_LIMIT))
    return targets


def growth_fit(by_context: dict[str, dict]) -> dict | None:
    """How prefill time and peak RSS grow over the contexts measured (None with fewer than 3): the least-squares line
    ``time = a + b * tokens`` (``b`` in seconds per 1k tokens, ``r2``), the time per extra token between the two
    largest contexts over that between the two smallest (``marginal_cost_ratio``: 1 for a linear cost; for a quadratic
    one ``(c_3 + c_4) / (c_1 + c_2)``, 4 over 2k..16k; None when either step got cheaper, i.e. noise) and the peak
    RSS at the largest context over the smallest's."""
    points = sorted((int(c), m) for c, m in by_context.items() if m.get("prefill_s") is not None)
    if len(points) < 3:
        return None
    tokens = [c for c, _ in points]
    seconds = [m["prefill_s"] for _, m in points]
    slope, intercept = statistics.linear_regression(tokens, seconds)
    first = (seconds[1] - seconds[0]) / (tokens[1] - tokens[0])
    last = (seconds[-1] - seconds[-2]) / (tokens[-1] - tokens[-2])
    rss = [m.get("peak_rss_bytes") for _, m in points]
    return {
        "contexts": tokens,
        "seconds_per_1k_tokens": slope * 1000,
        "intercept_s": intercept,
        "r2": statistics.correlation(tokens, seconds) ** 2 if len(set(seconds)) > 1 else 1.0,  # of a line fit
        "marginal_cost_ratio": last / first if first > 0 and last > 0 else None,
        "peak_rss_ratio": rss[-1] / rss[0] if rss[0] and rss[-1] else None,
    }


def _cost_reference(name: str) -> tuple[str | None, float]:
    """The configuration whose prefill time ``name``'s is held against, with the limit: a policy beyond the paper
    (plain or value-aware) against its paper base's ``+caote`` (``learned+caote`` against ``h2o+caote``), a
    paper policy's ``+caote`` / ``+fastcaote`` against its plain base, a paged policy against itself unpaged."""
    policy = parse_policy(name)
    if policy.page is not None:
        return policy_name(policy.base_name, policy.transform, policy.gqa), TRANSFORM_OVERHEAD_LIMIT
    if policy.base.about.paper_base:
        return policy_name(policy.base.about.paper_base, "caote"), BEYOND_OVERHEAD_LIMIT
    return (policy.base_name, TRANSFORM_OVERHEAD_LIMIT) if policy.value_aware else (None, BEYOND_OVERHEAD_LIMIT)


def _target(name: str, value, relation: str, limit: float, bound: float | None = None) -> dict:
    if value is None:
        met = False
    elif relation == "<=":
        met = value <= limit
    elif relation == "<":
        met = value < limit
    else:
        met = value >= limit
    target = {"target": name, "value": value, "relation": relation, "limit": limit, "met": bool(met)}
    if bound is not None:
        target["memory_traffic_bound"] = bound
    return target
