"""Pure analysis of rows: per-cell means with 95 % intervals, paired variant-versus-base comparisons, Markdown
tables and CSV. Reads rows only; `caote.evaluation.stats` holds the interval math."""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path

from caote.evaluation.reference import FULL
from caote.evaluation.stats import Estimate, estimate, paired_difference
from caote.evaluation.tasks import MetricSpec
from caote.policies import expand_policies


def policy_order(policies) -> list[str]:
    """The paper's policies in their group order (full, streamingllm, then each base with its transforms), then
    anything else sorted."""
    wanted = expand_policies("paper")
    present = list(dict.fromkeys(policies))
    return [p for p in wanted if p in present] + sorted(p for p in present if p not in wanted)


def values_by_cell(rows: list[dict], field: str, task: str | None = None) -> dict[tuple[str, int | None], dict]:
    """``{(policy, budget): {example_id: value}}`` for ``field`` (optionally one task only)."""
    cells: dict[tuple[str, int | None], dict] = defaultdict(dict)
    for row in rows:
        if task is not None and row.get("task") != task:
            continue
        value = row.get(field)
        if value is None:
            continue
        cells[(row["policy"], row["budget"])][row["example_id"]] = float(value)
    return cells


def summary_records(rows: list[dict], metric: MetricSpec, benchmark: str, task: str | None = None) -> list[dict]:
    """One record per (policy, budget): mean, interval, n, method, and the full cache's mean on the same examples.

    Wilson intervals when the metric is declared binary and every value is 0 or 1, else the bootstrap."""
    field = metric.name
    cells = values_by_cell(rows, field, task)
    full = cells.get((FULL, None), {})
    binary = metric.binary and all(v in (0.0, 1.0) for values in cells.values() for v in values.values())
    records = []
    for (policy, budget), values in cells.items():
        est = estimate(list(values.values()), binary)
        reference = [full[key] for key in values if key in full]
        records.append(
            {
                "benchmark": benchmark,
                "task": task or "all",
                "metric": field,
                "policy": policy,
                "budget": "" if budget is None else budget,
                "n": est.n,
                "mean": est.mean,
                "ci_low": est.low,
                "ci_high": est.high,
                "ci_method": est.method,
                "full_mean": sum(reference) / len(reference) if reference else math.nan,
            }
        )
    order = {p: i for i, p in enumerate(policy_order([r["policy"] for r in records]))}
    records.sort(key=lambda r: (order[r["policy"]], -1 if r["budget"] == "" else r["budget"]))
    return records


MIN_PAIRED_UNITS = 5


def block_values_by_cell(rows: list[dict], field: str) -> dict[tuple[str, int | None], dict]:
    """``{(policy, budget): {(text id, block): value}}`` from a row's per-block list ``field``."""
    cells: dict[tuple[str, int | None], dict] = defaultdict(dict)
    for row in rows:
        for index, value in enumerate(row.get(field) or []):
            cells[(row["policy"], row["budget"])][(row["example_id"], index)] = float(value)
    return cells


def variants() -> list[tuple[str, str]]:
    """``(base, transform)`` of every value-aware variant in the paper's policy group, in group order."""
    return [tuple(name.split("+")) for name in expand_policies("paper") if "+" in name]


def comparison_records(rows: list[dict], metric: MetricSpec, benchmark: str, task: str | None = None) -> list[dict]:
    """Base+CAOTE / +FastCAOTE minus the plain base, paired per example (per text block when the metric has a
    per-block series in the rows: NLL per token for PPL, KL, fidelity), at every budget. A verdict needs at least
    `MIN_PAIRED_UNITS` pairs."""
    field, higher_is_better = metric.name, metric.higher_is_better
    block_field = metric.blocks if metric.blocks and any(r.get(metric.blocks) for r in rows) else None
    cells = block_values_by_cell(rows, block_field) if block_field else values_by_cell(rows, field, task)
    budgets = sorted({budget for (_, budget) in cells if budget is not None})
    records = []
    for base, transform in variants():
        for budget in budgets:
            plain, treated = cells.get((base, budget)), cells.get((f"{base}+{transform}", budget))
            if not plain or not treated:
                continue
            est = paired_difference(treated, plain)
            if est.n == 0:
                continue
            better = est.low > 0 if higher_is_better else est.high < 0
            worse = est.high < 0 if higher_is_better else est.low > 0
            verdict = "helps" if better else "hurts" if worse else "no clear difference"
            if est.n < MIN_PAIRED_UNITS:
                verdict = f"too few pairs (n < {MIN_PAIRED_UNITS})"
            records.append(
                {
                    "benchmark": benchmark,
                    "task": task or "all",
                    "metric": field,
                    "unit": "text block" if block_field else "example",
                    "compared": (metric.blocks_label or field) if block_field else field,
                    "base": base,
                    "transform": transform,
                    "budget": budget,
                    "n": est.n,
                    "delta": est.mean,
                    "ci_low": est.low,
                    "ci_high": est.high,
                    "verdict": verdict,
                }
            )
    return records


def markdown_table(records: list[dict], digits: int = 2, title: str = "policy") -> str:
    """Policies as rows, budgets as columns, ``mean [low, high]`` cells; the full cache gets one row."""
    budgets = sorted({r["budget"] for r in records if r["budget"] != ""})
    lines = [f"| {title} | " + " | ".join(f"b={b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    by_policy: dict[str, dict] = defaultdict(dict)
    for r in records:
        by_policy[r["policy"]][r["budget"]] = Estimate(r["mean"], r["ci_low"], r["ci_high"], r["n"], r["ci_method"])
    for policy in policy_order(list(by_policy)):
        if policy == FULL:
            est = by_policy[policy].get("")
            text = est.cell(digits) if est else "–"
            lines.append("| **full (reference)** | " + " | ".join(text for _ in budgets) + " |")
            continue
        lines.append(
            f"| {policy} | "
            + " | ".join(by_policy[policy][b].cell(digits) if b in by_policy[policy] else "–" for b in budgets)
            + " |"
        )
    return "\n".join(lines)


def comparison_table(records: list[dict], digits: int = 3) -> str:
    if not records:
        return "_no paired comparisons (plain base and its CAOTE variant both needed)_"
    lines = [
        "| base | +transform | budget | compared | n (unit) | Δ (variant − plain) [95 % CI] | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['base']} | +{r['transform']} | {r['budget']} | {r['compared']} | {r['n']} ({r['unit']}) | "
            f"{r['delta']:+.{digits}f} [{r['ci_low']:+.{digits}f}, {r['ci_high']:+.{digits}f}] | {r['verdict']} |"
        )
    return "\n".join(lines)


def write_csv(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not records:
        path.write_text("")
        return
    fields = list(dict.fromkeys(key for record in records for key in record))
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for record in records:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in record.items()})
