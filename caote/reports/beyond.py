"""Beyond the paper: how a grid's own policies (``Grid.beyond``) do against every policy of the CAOTE paper.

For each of our policies and budgets: the KL from the full cache, its paired difference from the best paper policy
(plain, +caote, +fastcaote, the lowest mean KL at that budget), whether its paired interval beats *every* paper
policy and StreamingLLM, the share of the gap between the best paper policy and the hindsight ``oracle`` it closes,
and its NIAH score against the best paper policy of that budget in each question protocol. Units are essays (KL)
and NIAH examples, as everywhere in docs/results.md (`caote.evaluation.stats`).
"""

from __future__ import annotations

from caote.evaluation.examples import row_protocol
from caote.evaluation.stats import Estimate, estimate, paired_difference
from caote.policies import parse_policy
from caote.reports.claims import PAPER_POLICIES
from caote.reports.tables import MIN_PAIRED_UNITS, gap_closed, values_by_cell, verdict

GAP_TARGET = 0.25  # the share of the oracle gap a policy must close at every budget (our moonshot: half)


def best_policy(cells: dict, budget: int, sign: float, among: list[str] = PAPER_POLICIES) -> str | None:
    """The policy of ``among`` (default: StreamingLLM and every paper variant) with the best mean at ``budget``
    (``sign`` +1: higher is better)."""
    present = [name for name in among if cells.get((name, budget))]
    if not present:
        return None
    return max(present, key=lambda name: sign * sum(cells[(name, budget)].values()) / len(cells[(name, budget)]))


def _difference(cells: dict, policy: str, other: str, budget: int) -> Estimate:
    return paired_difference(cells.get((policy, budget), {}), cells.get((other, budget), {}))


def beyond_records(rows: dict[str, list[dict]], policies: list[str], budgets: list[int]) -> list[dict]:
    """One record per policy of ``policies`` x budget: KL, its comparison with the paper's policies and the oracle,
    and NIAH against the best paper policy per protocol (None where the rows lack a task)."""
    kl = values_by_cell(rows.get("perplexity", []), "kl")
    niah_rows = rows.get("niah", [])
    protocols = sorted({row_protocol(row) for row in niah_rows})
    niah = {p: values_by_cell([r for r in niah_rows if row_protocol(r) == p], "score") for p in protocols}
    records = []
    for policy in policies:
        for budget in budgets:
            record = {"policy": policy, "budget": budget, "niah": {}}
            values = kl.get((policy, budget))
            best = best_policy(kl, budget, -1.0)
            if values and best:
                record["kl"] = estimate(list(values.values()), binary=False)
                record["best_paper"] = best
                record["vs_best"] = _difference(kl, policy, best, budget)
                unbeaten = [
                    name
                    for name in PAPER_POLICIES
                    if kl.get((name, budget))
                    and not ((est := _difference(kl, policy, name, budget)).n >= MIN_PAIRED_UNITS and est.high < 0)
                ]
                record["unbeaten"] = unbeaten
                at = {name: cell for (name, b), cell in kl.items() if b == budget and cell}
                record["gap_closed"] = gap_closed(at, policy, best, -1.0)
                base = parse_policy(policy).base.about.paper_base
                variants = [name for name in PAPER_POLICIES if parse_policy(name).base_name == base]
                own = best_policy(kl, budget, -1.0, variants)
                if own:
                    record["base_variant"] = own
                    record["vs_base"] = _difference(kl, policy, own, budget)
            for protocol, cells in niah.items():
                best_niah = best_policy(cells, budget, 1.0)
                if cells.get((policy, budget)) and best_niah:
                    record["niah"][protocol] = (
                        estimate(list(cells[(policy, budget)].values())),
                        best_niah,
                        _difference(cells, policy, best_niah, budget),
                    )
            records.append(record)
    return records


def _delta(est: Estimate, digits: int) -> str:
    return f"{est.mean:+.{digits}f} [{est.low:+.{digits}f}, {est.high:+.{digits}f}]"


def beyond_table(records: list[dict]) -> str:
    """Markdown: one row per policy x budget."""
    protocols = sorted({p for r in records for p in r["niah"]})
    columns = [
        "policy",
        "budget",
        "KL [95 % CI]",
        "Δ KL vs best variant of its paper base [95 % CI]",
        "Δ KL vs best paper policy [95 % CI]",
        "beats every paper policy and StreamingLLM",
        "oracle gap closed",
        *(f"NIAH {p}: score; Δ vs best paper policy [95 % CI]" for p in protocols),
    ]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in records:
        if "kl" in r:
            kl, versus = r["kl"].cell(4), f"{_delta(r['vs_best'], 4)} vs {r['best_paper']}"
            own = f"{_delta(r['vs_base'], 4)} vs {r['base_variant']}" if "vs_base" in r else "–"
            beats = "yes" if not r["unbeaten"] else f"no ({', '.join(r['unbeaten'])} not beaten)"
            closed = "–" if r["gap_closed"] is None else f"{r['gap_closed']:+.0%}"
        else:
            kl = own = versus = beats = closed = "–"
        cells = []
        for protocol in protocols:
            if protocol not in r["niah"]:
                cells.append("–")
                continue
            score, best, est = r["niah"][protocol]
            cells.append(f"{score.mean:.2f}; {_delta(est, 2)} vs {best}")
        lines.append("| " + " | ".join([r["policy"], str(r["budget"]), kl, own, versus, beats, closed, *cells]) + " |")
    return "\n".join(lines)


def target_lines(records: list[dict], budgets: list[int]) -> list[str]:
    """The issue's targets for each policy: lower KL than every paper policy and StreamingLLM at every budget, at
    least `GAP_TARGET` of the oracle gap at every budget, no NIAH loss against the best paper policy."""
    lines = []
    for policy in dict.fromkeys(r["policy"] for r in records):
        mine = {r["budget"]: r for r in records if r["policy"] == policy}
        if not all("kl" in mine.get(b, {}) for b in budgets):
            lines.append(f"- **{policy}**: KL rows missing at some budget; no verdict.")
            continue
        beats = [b for b in budgets if not mine[b]["unbeaten"]]
        shares = {b: mine[b]["gap_closed"] for b in budgets}
        enough = [b for b in budgets if shares[b] is not None and shares[b] >= GAP_TARGET]
        losses = [
            f"{protocol} b={b}"
            for b in budgets
            for protocol, (_, _, est) in mine[b]["niah"].items()
            if verdict(est, True) == "hurts"
        ]
        share_text = ", ".join(f"b={b} {'–' if s is None else f'{s:.0%}'}" for b, s in shares.items())
        lines.append(
            f"- **{policy}**: lower KL than every paper policy and StreamingLLM (paired intervals) at "
            f"{len(beats)} of {len(budgets)} budgets"
            + (f" ({', '.join(map(str, beats))})" if beats and len(beats) < len(budgets) else "")
            + f" — {'met' if len(beats) == len(budgets) else 'not met'}; oracle gap closed {share_text} — "
            f"{'met' if len(enough) == len(budgets) else 'not met'} (target {GAP_TARGET:.0%} at every budget); "
            + (
                "NIAH: no loss against the best paper policy in any protocol — met."
                if not losses
                else f"NIAH: loses against the best paper policy at {', '.join(losses)} — not met."
            )
        )
    return lines
