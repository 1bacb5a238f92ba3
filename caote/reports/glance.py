"""The compact table ``caote eval report`` prints at the end: one line per policy x budget, full cache first, with
NIAH hits, KL from the full cache and the KV memory saved, read from the rows (no torch)."""

from __future__ import annotations

from caote.evaluation.examples import row_protocol
from caote.evaluation.reference import FULL
from caote.reports.tables import policy_order


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def glance_rows(rows: dict[str, list[dict]]) -> list[dict]:
    """``{"policy", "budget", "hits", "examples", "kl", "kv_saved"}`` per setting found in the rows of a report;
    ``kv_saved`` is 1 - peak KV bytes / the full cache's peak on the same NIAH prompts (else 1 - budget / tokens of
    the perplexity texts); None where a task has no row for the setting. NIAH counts the in-prompt protocol."""
    niah = [r for r in rows.get("niah", []) if row_protocol(r) == "in-prompt"]  # one protocol
    texts = rows.get("perplexity", [])
    full_peak = {r["example_id"]: r.get("peak_kv_bytes") for r in niah if r["policy"] == FULL}
    settings = {(r["policy"], r.get("budget")) for value in (niah, texts) for r in value}
    order = {policy: index for index, policy in enumerate(policy_order({p for p, _ in settings}))}
    result = []
    for policy, budget in sorted(settings, key=lambda s: (order[s[0]], s[1] or 0)):
        mine = [r for r in niah if r["policy"] == policy and r.get("budget") == budget]
        text_rows = [r for r in texts if r["policy"] == policy and r.get("budget") == budget]
        saved = None
        pairs = [(r.get("peak_kv_bytes"), full_peak.get(r["example_id"])) for r in mine]
        pairs = [(held, full) for held, full in pairs if held and full]
        if policy == FULL:
            saved = 0.0
        elif pairs:
            saved = 1.0 - sum(held for held, _ in pairs) / sum(full for _, full in pairs)
        elif budget and text_rows and text_rows[0].get("tokens"):
            saved = max(0.0, 1.0 - budget / float(_mean([float(r["tokens"]) for r in text_rows])))
        kls = [float(r["kl"]) for r in text_rows if r.get("kl") is not None]
        result.append(
            {
                "policy": policy,
                "budget": budget,
                "hits": sum(float(r["score"]) for r in mine) if mine else None,
                "examples": len(mine),
                "kl": 0.0 if policy == FULL and text_rows else _mean(kls),
                "kv_saved": saved,
            }
        )
    return result


def glance_table(rows: dict[str, list[dict]]) -> str:
    """`glance_rows` as aligned text columns (``-`` where a value is missing)."""
    header = ("policy", "budget", "NIAH hits", "KL from full", "KV saved")
    lines = [header]
    for item in glance_rows(rows):
        hits = "-" if item["hits"] is None else f"{item['hits']:g}/{item['examples']}"
        kl = "-" if item["kl"] is None else f"{item['kl']:.3f}"
        saved = "-" if item["kv_saved"] is None else f"{100 * item['kv_saved']:.0f}%"
        budget = "all" if item["budget"] is None else str(item["budget"])
        lines.append((item["policy"], budget, hits, kl, saved))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        for line in lines
    )
