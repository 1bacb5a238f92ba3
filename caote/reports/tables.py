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
from caote.policies import expand_policies, parse_policy, policy_name


def policy_order(policies) -> list[str]:
    """The paper's policies in their group order (full, streamingllm, then each base with its transforms), then
    anything else sorted."""
    wanted = expand_policies("paper")
    present = list(dict.fromkeys(policies))
    return [p for p in wanted if p in present] + sorted(p for p in present if p not in wanted)


def values_by_cell(rows: list[dict], field: str, task: str | None = None) -> dict[tuple[str, int | None], dict]:
    """``{(policy, budget): {unit: value}}`` for ``field`` (optionally one task only). The unit is the row's
    ``unit`` (a text's essay) or else its example: rows sharing a unit are averaged, since they are not
    independent."""
    grouped: dict[tuple[str, int | None], dict] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if task is not None and row.get("task") != task:
            continue
        value = row.get(field)
        if value is None:
            continue
        grouped[(row["policy"], row["budget"])][row.get("unit") or row["example_id"]].append(float(value))
    return {cell: {unit: sum(v) / len(v) for unit, v in units.items()} for cell, units in grouped.items()}


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
    paper = [parse_policy(name) for name in expand_policies("paper")]
    return [(policy.base_name, policy.transform) for policy in paper if policy.value_aware]


def verdict(est: Estimate, higher_is_better: bool) -> str:
    """``helps`` / ``hurts`` when the paired 95 % interval excludes zero, else ``no clear difference``; a verdict
    needs at least `MIN_PAIRED_UNITS` pairs."""
    if est.n < MIN_PAIRED_UNITS:
        return f"too few pairs (n < {MIN_PAIRED_UNITS})"
    better = est.low > 0 if higher_is_better else est.high < 0
    worse = est.high < 0 if higher_is_better else est.low > 0
    return "helps" if better else "hurts" if worse else "no clear difference"


def comparison_records(
    rows: list[dict], metric: MetricSpec, benchmark: str, task: str | None = None, blocks: bool = False
) -> list[dict]:
    """Base+CAOTE / +FastCAOTE minus the plain base at every budget, paired per unit (an example, or a text's
    essay). ``blocks``: paired per text block instead (the per-block series of PPL / KL / fidelity rows), a
    secondary view: blocks of one text are correlated, so their intervals are optimistic."""
    field = metric.name
    block_field = metric.blocks if blocks and metric.blocks and any(r.get(metric.blocks) for r in rows) else None
    if blocks and block_field is None:
        return []
    cells = block_values_by_cell(rows, block_field) if block_field else values_by_cell(rows, field, task)
    budgets = sorted({budget for (_, budget) in cells if budget is not None})
    records = []
    for base, transform in variants():
        for budget in budgets:
            plain, treated = cells.get((base, budget)), cells.get((policy_name(base, transform), budget))
            if not plain or not treated:
                continue
            est = paired_difference(treated, plain)
            if est.n == 0:
                continue
            records.append(
                {
                    "benchmark": benchmark,
                    "task": task or "all",
                    "metric": field,
                    "unit": "text block" if block_field else _unit_name(rows),
                    "compared": (metric.blocks_label or field) if block_field else field,
                    "base": base,
                    "transform": transform,
                    "budget": budget,
                    "n": est.n,
                    "delta": est.mean,
                    "ci_low": est.low,
                    "ci_high": est.high,
                    "verdict": verdict(est, metric.higher_is_better),
                }
            )
    return records


def _unit_name(rows: list[dict]) -> str:
    return "essay" if any(row.get("unit") for row in rows) else "example"


def best_base_records(rows: list[dict], metric: MetricSpec, benchmark: str, task: str | None = None) -> list[dict]:
    """Every evicting policy minus the best plain base of its budget (the base policy with the best mean, CAOTE
    variants excluded), paired per unit, with the share of the gap between the best paper policy and the ``oracle``
    that the policy closes (1: reaches the oracle; negative: worse than the best paper policy)."""
    cells = values_by_cell(rows, metric.name, task)
    sign = 1.0 if metric.higher_is_better else -1.0
    paper = [p for p in expand_policies("paper") if p != FULL]
    records = []
    for budget in sorted({budget for (_, budget) in cells if budget is not None}):
        at = {policy: values for (policy, b), values in cells.items() if b == budget and values}

        def mean(policy):
            return sum(at[policy].values()) / len(at[policy])

        bases = [p for p in paper if not parse_policy(p).value_aware and p in at]
        papers = [p for p in paper if p in at]
        if not bases:
            continue
        best_base = max(bases, key=lambda p: sign * mean(p))
        best_paper = max(papers, key=lambda p: sign * mean(p))
        for policy in policy_order(list(at)):
            if policy == FULL:
                continue
            est = paired_difference(at[policy], at[best_base])
            closed = gap_closed(at, policy, best_paper, sign)
            records.append(
                {
                    "benchmark": benchmark,
                    "task": task or "all",
                    "metric": metric.name,
                    "budget": budget,
                    "policy": policy,
                    "best_base": best_base,
                    "best_paper": best_paper,
                    "mean": mean(policy),
                    "n": est.n,
                    "delta": est.mean,
                    "ci_low": est.low,
                    "ci_high": est.high,
                    "verdict": "reference" if policy == best_base else verdict(est, metric.higher_is_better),
                    "gap_closed": closed,
                }
            )
    return records


def gap_closed(cells: dict[str, dict], policy: str, best_paper: str, sign: float) -> float | None:
    """``(policy − best paper) / (oracle − best paper)`` on the units all three share; None without an oracle, or
    where the oracle is not better than the best paper policy (the share would have no meaning)."""
    if "oracle" not in cells:
        return None
    units = cells[policy].keys() & cells[best_paper].keys() & cells["oracle"].keys()
    if not units:
        return None

    def mean(name):
        return sum(cells[name][unit] for unit in units) / len(units)

    gap = mean("oracle") - mean(best_paper)
    if sign * gap <= 0:
        return None
    return (mean(policy) - mean(best_paper)) / gap + 0.0  # + 0.0: no "-0 %"


def best_base_table(records: list[dict], digits: int = 3) -> str:
    """Policies as rows, budgets as columns: ``Δ vs best base [CI]`` and the share of the oracle gap closed."""
    if not records:
        return "_no comparison (plain bases needed)_"
    budgets = sorted({r["budget"] for r in records})
    best = {r["budget"]: r["best_base"] for r in records}
    lines = [
        "| policy | " + " | ".join(f"b={b}: Δ vs {best[b]} [95 % CI]; oracle gap closed" for b in budgets) + " |",
        "|---|" + "---|" * len(budgets),
    ]
    by_policy: dict[str, dict] = defaultdict(dict)
    for r in records:
        by_policy[r["policy"]][r["budget"]] = r
    for policy in policy_order(list(by_policy)):
        cells = []
        for budget in budgets:
            r = by_policy[policy].get(budget)
            if r is None:
                cells.append("–")
                continue
            closed = "–" if r["gap_closed"] is None else f"{r['gap_closed']:+.0%}"
            delta = (
                "(best base)"
                if r["verdict"] == "reference"
                else f"{r['delta']:+.{digits}f} [{r['ci_low']:+.{digits}f}, {r['ci_high']:+.{digits}f}]"
            )
            cells.append(f"{delta}; {closed}")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


# the columns of the CSV files, one tuple per kind of record (the keys its records function writes)
SUMMARY_FIELDS = (
    "benchmark", "task", "metric", "policy", "budget", "n", "mean", "ci_low", "ci_high", "ci_method", "full_mean"
)  # fmt: skip
COMPARISON_FIELDS = (
    "benchmark", "task", "metric", "unit", "compared", "base", "transform", "budget", "n", "delta", "ci_low", "ci_high",
    "verdict",
)  # fmt: skip
BEST_BASE_FIELDS = (
    "benchmark", "task", "metric", "budget", "policy", "best_base", "best_paper", "mean", "n", "delta", "ci_low",
    "ci_high", "verdict", "gap_closed",
)  # fmt: skip


def write_csv(path: Path, records: list[dict], fields: tuple[str, ...]) -> None:
    """``records`` under the header ``fields``, written even when there is no record (a record with a key outside
    ``fields`` is an error)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for record in records:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in record.items()})
