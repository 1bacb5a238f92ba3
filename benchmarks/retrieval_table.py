"""docs/results/retrieval.md's table, generated from the committed runs under docs/results/retrieval/: pass keys found
(of the examples each cell ran) per policy, prefill mode, question protocol and budget, beside the KL from the full
cache on the standard grid's 20 test essays at 1k. ``python benchmarks/retrieval_table.py`` prints it; a test keeps
the page's copy equal to this output."""

from __future__ import annotations

import csv
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results" / "retrieval"
# (folder, column label): each a `caote eval passkey` run (its summary CSV) or the KL run (`caote eval perplexity`)
PASSKEY_RUNS = (
    ("compress-in", "compress, question in prompt"),
    ("compress-qa", "compress, question after"),
    ("blocks-in", "blocks, question in prompt"),
    ("blocks-qa", "blocks, question after"),
)
KL_RUN = ("kl", "KL 1k essays")


def summary(path: Path, metric: str) -> dict[tuple[str, str], tuple[float, int]]:
    """``{(policy, budget): (mean, n)}`` of ``metric`` over every task of a summary CSV (budget "": the full cache)."""
    with path.open(encoding="utf-8") as handle:
        return {
            (row["policy"], row["budget"]): (float(row["mean"]), int(row["n"]))
            for row in csv.DictReader(handle)
            if row["metric"] == metric and row["task"] == "all"
        }


def table(results: Path = RESULTS) -> str:
    """The markdown table: a row per policy (the full cache first), a column per run and budget."""
    runs = [(label, summary(results / name / "passkey_summary.csv", "score")) for name, label in PASSKEY_RUNS]
    runs.append((KL_RUN[1], summary(results / KL_RUN[0] / "perplexity_summary.csv", "kl")))
    budgets = sorted({int(budget) for _, cells in runs for _, budget in cells if budget})
    policies = ["full"] + sorted({policy for _, cells in runs for policy, _ in cells} - {"full"})
    header = [f"{label}, b={budget}" for label, _ in runs for budget in budgets]
    lines = ["| policy | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
    for policy in policies:
        cells = []
        for label, found in runs:
            for budget in budgets:
                value = found.get((policy, "" if policy == "full" else str(budget)))
                if value is None:
                    cells.append("–")
                elif label == KL_RUN[1]:
                    cells.append(f"{value[0]:.4f}")
                else:
                    cells.append(f"{round(value[0] * value[1])}/{value[1]}")
        lines.append(f"| `{policy}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
