"""The paper's claims that the bundled model can test, and ours, each with the paired interval that decides it.

Every claim is checked at every budget of the grid with a paired bootstrap over independent units (essays for PPL /
KL, examples for NIAH; `caote.evaluation.stats`). A claim is **reproduced** when the interval favours it at every
budget, **refuted** when it never favours it and goes against it at one budget or more, **inconclusive** otherwise
(the evidence column says where it holds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from caote.defaults import PAPER_BASES
from caote.evaluation.examples import row_protocol
from caote.evaluation.stats import Estimate, paired_difference
from caote.policies import expand_policies, policy_name
from caote.reports.tables import MIN_PAIRED_UNITS, values_by_cell

PAPER_POLICIES = [name for name in expand_policies("paper") if name != "full"]
EQUIVALENCE_SHARE = 0.10  # "FastCAOTE ≈ CAOTE": their KL differs by less than 10 % of the plain base's KL


@dataclass
class Claim:
    """One line of the claims table."""

    claim: str
    source: str
    test: str
    evidence: str
    verdict: str


def _cell(est: Estimate, digits: int = 3) -> str:
    return f"{est.mean:+.{digits}f} [{est.low:+.{digits}f}, {est.high:+.{digits}f}]"


def _verdict(outcomes: dict) -> str:
    """``{budget: "for" | "against" | "unclear" | "too few" | "no rows"}`` -> the claim's verdict: reproduced only
    when it holds at every budget."""
    if not outcomes or all(outcome == "no rows" for outcome in outcomes.values()):
        return "not tested (no rows)"
    if "too few" in outcomes.values() and "for" not in outcomes.values() and "against" not in outcomes.values():
        return f"inconclusive (fewer than {MIN_PAIRED_UNITS} units)"
    if all(outcome == "for" for outcome in outcomes.values()):
        return "reproduced"
    if "for" not in outcomes.values() and "against" in outcomes.values():
        return "refuted" if set(outcomes.values()) <= {"against", "unclear"} else "refuted where tested"
    return "inconclusive"


def _paired_claim(
    claim: str,
    source: str,
    test: str,
    budgets: list[int],
    pairs: Callable[[int], tuple],
    favours_lower: bool,
    digits: int = 4,
) -> Claim:
    """A claim that ``treated − control`` moves in one direction at every budget (``pairs(budget)`` gives the two
    cells' ``{unit: value}``; ``favours_lower``: the claim holds when the difference is below zero)."""
    outcomes, evidence = {}, []
    for budget in budgets:
        treated, control = pairs(budget)
        if not treated or not control:
            outcomes[budget] = "no rows"
            evidence.append(f"b={budget}: no rows")
            continue
        est = paired_difference(treated, control)
        if est.n == 0:
            continue
        below, above = est.high < 0, est.low > 0
        holds = below if favours_lower else above
        outcomes[budget] = "for" if holds else "against" if (below or above) else "unclear"
        if est.n < MIN_PAIRED_UNITS:
            outcomes[budget] = "too few"
        evidence.append(f"b={budget}: {_cell(est, digits)} (n={est.n})")
    return Claim(claim, source, test, "; ".join(evidence) or "–", _verdict(outcomes))


def _budgets(*cell_maps: dict) -> list[int]:
    return sorted({budget for cells in cell_maps for (_, budget) in cells if budget is not None})


def _caote_gain(cells: dict, base: str, budget: int) -> dict[str, float]:
    """Relative KL reduction of ``base+caote`` over ``base`` per unit."""
    plain, treated = cells.get((base, budget), {}), cells.get((policy_name(base, "caote"), budget), {})
    return {unit: (plain[unit] - treated[unit]) / plain[unit] for unit in plain.keys() & treated.keys() if plain[unit]}


def _equivalence_claim(cells: dict, budgets: list[int]) -> Claim:
    """FastCAOTE ≈ CAOTE: for every base and budget, the interval of (fast − caote) KL lies within ±10 % of the plain
    base's mean KL (reproduced), entirely outside it (refuted), or straddles its edge (inconclusive)."""
    outcomes, evidence = {}, []
    for base in [b for b in PAPER_BASES if any(policy == policy_name(b, "fastcaote") for policy, _ in cells)]:
        for budget in budgets:
            names = (policy_name(base, "fastcaote"), policy_name(base, "caote"), base)
            fast, exact, plain = (cells.get((name, budget)) for name in names)
            if not fast or not exact or not plain:
                outcomes[(base, budget)] = "no rows"
                continue
            est = paired_difference(fast, exact)
            if est.n < MIN_PAIRED_UNITS:
                outcomes[(base, budget)] = "too few"
                continue
            band = EQUIVALENCE_SHARE * sum(plain.values()) / len(plain)
            inside = -band < est.low and est.high < band
            outside = est.low >= band or est.high <= -band
            outcomes[(base, budget)] = "for" if inside else "against" if outside else "unclear"
            evidence.append(f"{base} b={budget}: {_cell(est, 4)} vs ±{band:.4f}")
    return Claim(
        "FastCAOTE ≈ CAOTE",
        "Tables 1–4",
        f"paired Δ KL (fastcaote − caote) per essay within ±{EQUIVALENCE_SHARE:.0%} of the plain base's KL, every "
        "base × budget",
        "; ".join(evidence) or "–",
        _verdict(outcomes),
    )


def _lowering_claims(ppl: dict, kl: dict, budgets: list[int]) -> list[Claim]:
    """CAOTE lowers the perplexity (Table 4) and the KL from the full cache (ours) of every paper base."""
    result = []
    lowered = (
        ("perplexity", "PPL", ppl, "Table 4", 3),
        ("the KL from the full cache", "KL", kl, "ours (the premise of §3: a smaller attention-output change)", 4),
    )
    for what, short, cells, source, digits in lowered:
        for base in PAPER_BASES:
            result.append(
                _paired_claim(
                    f"CAOTE lowers {what} for {base.upper() if base == 'h2o' else base}",
                    source,
                    f"paired Δ {short} ({base}+caote − {base}) per essay < 0 at every budget",
                    budgets,
                    lambda b, base=base, cells=cells: (
                        cells.get((policy_name(base, "caote"), b)),
                        cells.get((base, b)),
                    ),
                    favours_lower=True,
                    digits=digits,
                )
            )
    return result


def _niah_claims(niah_rows: list[dict], budgets: list[int]) -> list[Claim]:
    """CAOTE raises H2O's NIAH score (Fig. 2), one claim per protocol in the rows."""
    result = []
    for protocol in sorted({row_protocol(row) for row in niah_rows}):
        scores = values_by_cell([r for r in niah_rows if row_protocol(r) == protocol], "score")
        result.append(
            _paired_claim(
                f"CAOTE raises H2O's NIAH score ({protocol})",
                "Fig. 2",
                "paired Δ accuracy (h2o+caote − h2o) per example > 0 at every budget",
                budgets,
                lambda b, scores=scores: (scores.get(("h2o+caote", b)), scores.get(("h2o", b))),
                favours_lower=False,
                digits=2,
            )
        )
    return result


def _gain_claims(kl: dict, budgets: list[int]) -> list[Claim]:
    """CAOTE's relative KL gain is larger for H2O than for TOVA and for SnapKV (Tables 2–3)."""
    return [
        _paired_claim(
            f"CAOTE's gain is larger for H2O than for {other}",
            "Tables 2–3 (LongBench averages)",
            f"paired Δ of relative KL gains (h2o − {other}) per essay > 0 at every budget",
            budgets,
            lambda b, other=other: (_caote_gain(kl, "h2o", b), _caote_gain(kl, other, b)),
            favours_lower=False,
            digits=3,
        )
        for other in ("tova", "snapkv")
    ]


def _aggregation_claims(kl: dict, budgets: list[int]) -> list[Claim]:
    """rss aggregation of a KV group's CAOTE errors beats the mean, for every base the rows ablate (else the
    first paper base)."""
    ablated = [base for base in PAPER_BASES if any(policy == policy_name(base, "caote", "mean") for policy, _ in kl)]
    return [
        _paired_claim(
            f"rss aggregation of a KV group's CAOTE errors beats the mean ({base}+caote)",
            "ours (`gqa='rss'`, the default)",
            f"paired Δ KL ({base}+caote − {base}+caote/mean) per essay < 0 at every budget",
            budgets,
            lambda b, base=base: (
                kl.get((policy_name(base, "caote"), b)),
                kl.get((policy_name(base, "caote", "mean"), b)),
            ),
            favours_lower=True,
        )
        for base in ablated or PAPER_BASES[:1]
    ]


def _best_paper_kl(kl: dict, budgets: list[int]) -> dict[int, dict[str, float]]:
    """``{budget: {unit: KL}}`` of the paper policy with the lowest mean KL at each budget that has one."""
    best = {}
    for budget in budgets:
        papers = [(p, v) for (p, b), v in kl.items() if b == budget and p in PAPER_POLICIES and v]
        if papers:
            best[budget] = min(papers, key=lambda item: sum(item[1].values()) / len(item[1]))[1]
    return best


def _oracle_claim(kl: dict, budgets: list[int]) -> Claim:
    """The oracle (future attention) has a lower KL than the best paper policy of every budget."""
    best = _best_paper_kl(kl, budgets)
    return _paired_claim(
        "The oracle (future attention) has the lowest KL",
        "ours (the ceiling)",
        "paired Δ KL (oracle − best paper policy) per essay < 0 at every budget",
        budgets,
        lambda b: (kl.get(("oracle", b)), best.get(b)),
        favours_lower=True,
    )


def claims(rows: dict[str, list[dict]], budgets: list[int] | None = None) -> list[Claim]:
    """Every claim the rows can test (perplexity rows for PPL / KL, NIAH rows per protocol) at ``budgets`` (the
    grid's; by default every budget in the rows): a budget without rows keeps a claim from being reproduced."""
    text_rows = rows.get("perplexity", [])
    ppl, kl = values_by_cell(text_rows, "ppl_delta"), values_by_cell(text_rows, "kl")
    niah_rows = rows.get("niah", [])
    budgets = list(budgets) if budgets else _budgets(kl, values_by_cell(niah_rows, "score"))
    return [
        *_lowering_claims(ppl, kl, budgets),
        *_niah_claims(niah_rows, budgets),
        _equivalence_claim(kl, budgets),
        *_gain_claims(kl, budgets),
        *_aggregation_claims(kl, budgets),
        _oracle_claim(kl, budgets),
    ]


def claims_table(items: list[Claim]) -> str:
    lines = ["| claim | source | test | evidence (mean [95 % CI]) | verdict |", "|---|---|---|---|---|"]
    lines += [f"| {c.claim} | {c.source} | {c.test} | {c.evidence} | **{c.verdict}** |" for c in items]
    return "\n".join(lines)
