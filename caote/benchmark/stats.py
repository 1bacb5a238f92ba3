"""The summary of a run: medians per configuration and context, ratios of samples taken in the same round, and
a verdict per target."""

from __future__ import annotations

import statistics

from caote.benchmark.config import BASELINE_POLICY, FULL_AT_BUDGET, FULL_BLOCKS, FULL_CONFIGURATIONS, FULL_SDPA
from caote.benchmark.paired import round_ratios
from caote.policies import parse_policy

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


def summarise(document: dict) -> dict:
    """Medians per configuration and context, the ratios the targets are stated in, and a verdict per target."""
    samples = document["samples"]
    config = document["meta"]["config"]
    budget, block = config["budget"], config["block_size"]
    configurations = document["meta"]["configurations"]
    contexts = sorted({s["context"] for s in samples})
    weights = document["meta"]["weight_bytes"]
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

    targets: list[dict] = []
    ratios: dict[str, dict] = {}
    policies = [name for name in configurations if name not in FULL_CONFIGURATIONS]
    for context in contexts:
        at = str(context)
        full = medians.get(FULL_BLOCKS, {}).get(at) or medians.get(FULL_SDPA, {}).get(at)
        row: dict[str, dict] = {}
        for name in policies:
            if at not in medians.get(name, {}):
                continue
            entry = {}
            if full and full["kv_peak_bytes"]:
                entry["kv_peak_vs_full"] = medians[name][at]["kv_peak_bytes"] / full["kv_peak_bytes"]
                entry["kv_peak_bound"] = (budget + block) / context
                targets.append(
                    _target(f"KV peak {name} @ {context}", entry["kv_peak_vs_full"], "<=", entry["kv_peak_bound"])
                )
            if name != BASELINE_POLICY and BASELINE_POLICY in medians:
                entry["time_vs_streamingllm"] = _paired_ratio(samples, "prefill_s", name, BASELINE_POLICY, context)
                targets.append(
                    _target(
                        f"{name} / streamingllm time @ {context}",
                        entry["time_vs_streamingllm"],
                        "<=",
                        SCORING_OVERHEAD_LIMIT,
                    )
                )
            base, limit = _cost_reference(name)
            if base in medians:
                entry["time_vs_base"] = _paired_ratio(samples, "prefill_s", name, base, context)
                targets.append(_target(f"{name} / {base} time @ {context}", entry["time_vs_base"], "<=", limit))
            if FULL_SDPA in medians:
                entry["prefill_vs_full_sdpa"] = _paired_ratio(samples, "prefill_s", name, FULL_SDPA, context)
            decode = medians[name][at].get("decode_tokens_per_s")
            full_decode = medians.get(FULL_SDPA, {}).get(at, {}).get("decode_tokens_per_s")
            if decode and full_decode:
                entry["decode_speedup"] = _paired_ratio(samples, "decode_tokens_per_s", name, FULL_SDPA, context)
                full_read = medians[FULL_SDPA][at]["decode_kv_bytes_per_token"]
                own_read = medians[name][at]["decode_kv_bytes_per_token"]
                entry["decode_speedup_bound"] = (weights + full_read) / (weights + own_read)
            interleaved = round_ratios(document.get("decode_rounds", []), context, budget, name)
            if interleaved:  # the decode rounds, steps interleaved beside full@b (`caote.benchmark.paired`)
                entry["decode_vs_full_at_budget"] = statistics.median(interleaved)
                entry["decode_vs_full_at_budget_rounds"] = interleaved
            elif decode and medians.get(FULL_AT_BUDGET, {}).get(at, {}).get("decode_tokens_per_s"):
                entry["decode_vs_full_at_budget"] = _paired_ratio(
                    samples, "decode_tokens_per_s", name, FULL_AT_BUDGET, context
                )
            if entry.get("decode_vs_full_at_budget") is not None:
                targets.append(
                    _target(
                        f"decode {name} / full@b @ {context}",
                        entry["decode_vs_full_at_budget"],
                        ">=",
                        DECODE_VS_FULL_AT_BUDGET_TARGETS.get(name, DECODE_VS_FULL_AT_BUDGET_TARGET),
                    )
                )
            row[name] = entry
        ratios[at] = row
    if contexts:
        largest = str(contexts[-1])
        for name in policies:
            entry = ratios[largest].get(name, {})
            if entry.get("prefill_vs_full_sdpa") is not None:
                targets.append(
                    _target(f"prefill {name} vs full-sdpa @ {largest}", entry["prefill_vs_full_sdpa"], "<", 1.0)
                )
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
    operators = (document.get("operators") or {}).get("counts", {})
    for name, limit in OPERATOR_LIMITS.items():
        if name in operators:
            targets.append(
                _target(f"decode operators per evicting layer: {name}", operators[name]["extra_per_layer"], "<=", limit)
            )
    growth = {name: growth_fit(medians.get(name, {})) for name in configurations if name != FULL_AT_BUDGET}
    growth = {name: fit for name, fit in growth.items() if fit is not None}
    for name, fit in growth.items():
        if name in FULL_CONFIGURATIONS:
            continue
        targets.append(
            _target(f"prefill grows linearly: {name}", fit["marginal_cost_ratio"], "<=", LINEAR_GROWTH_LIMIT)
        )
        targets.append(_target(f"peak RSS stays flat: {name}", fit["peak_rss_ratio"], "<=", FLAT_MEMORY_LIMIT))
    return {
        "medians": medians,
        "ratios": ratios,
        "growth": growth,
        "targets": targets,
        "targets_met": sum(t["met"] for t in targets),
        "targets_total": len(targets),
    }


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
    paper policy's ``+caote`` / ``+fastcaote`` against its plain base."""
    base, _, transform = name.partition("+")
    paper_base = parse_policy(name).base.about.paper_base
    if paper_base:
        return f"{paper_base}+caote", BEYOND_OVERHEAD_LIMIT
    return (base, TRANSFORM_OVERHEAD_LIMIT) if transform else (None, BEYOND_OVERHEAD_LIMIT)


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
