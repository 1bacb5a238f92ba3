"""docs/results/long.md, written from the rows of the long grid: one section per part (model x kind of text x
length), each with its headline table, the oracle gap per budget, the claims re-decided on its own units and our
policies against the paper's; one plot of KL against budget with a panel per part; the hand-written reading kept in
``results/long_reading.md``. docs/results.md links this document rather than repeating it
(`caote.reports.document.own_document_lines`).
"""

from __future__ import annotations

from pathlib import Path

from caote.evaluation.grids import Grid
from caote.evaluation.registry import TASKS
from caote.evaluation.rows import row_commits
from caote.reports.beyond import best_policy, beyond_records, beyond_table
from caote.reports.claims import claims, claims_table
from caote.reports.document import headline_table
from caote.reports.plots import budgets_of, plot_panels_vs_budget
from caote.reports.summary import INTERVAL_NOTE, summarise_rows
from caote.reports.tables import values_by_cell

MODEL_TITLES = {"smollm2-135m": "SmolLM2-135M-Instruct", "gemma3-270m": "Gemma-3 270M (base)"}
TEXT_TITLES = {
    "perplexity": "essays",
    "perplexity-joined": "essays (joined)",
    "perplexity-code": "Python code",
    "niah": "NIAH (in-prompt)",
}
# our policies in this grid, judged against the paper's in each part (learned-block: Gemma-3's parts only)
OURS = ("caote-block", "learned+caote", "learned-block")
PLOT = "long_kl_vs_budget.png"
NIAH_PLOT = "long_niah_vs_budget.png"  # hits against budget, a panel per NIAH part and protocol


def part_title(config) -> str:
    """``model · kind of text · length``, e.g. ``SmolLM2-135M-Instruct · Python code · 4096 tokens``."""
    lengths = ", ".join(map(str, config.lengths))
    what = TEXT_TITLES.get(config.benchmark, config.benchmark)
    return f"{MODEL_TITLES.get(config.model, config.model)} · {what} · {lengths} tokens"


def oracle_gap_table(rows: list[dict], budgets: list[int]) -> str:
    """Per budget: the best paper policy (lowest mean KL), its KL, the oracle's and how many times lower it is."""
    kl = values_by_cell(rows, "kl")
    lines = ["| budget | best paper policy | its KL | oracle KL | best paper / oracle |", "|---|---|---|---|---|"]

    def mean(name: str, budget: int) -> float:
        return sum(kl[(name, budget)].values()) / len(kl[(name, budget)])

    for budget in budgets:
        best = best_policy(kl, budget, -1.0)
        if best is None or not kl.get(("oracle", budget)):
            lines.append(f"| {budget} | – | – | – | – |")
            continue
        paper, oracle = mean(best, budget), mean("oracle", budget)
        ratio = f"{paper / oracle:.1f}x" if oracle > 0 else "–"
        lines.append(f"| {budget} | {best} | {paper:.4f} | {oracle:.4f} | {ratio} |")
    return "\n".join(lines)


def _part_section(key: str, config, rows: list[dict], pieces: dict, planned: int | None) -> list[str]:
    budgets = list(config.budgets)
    texts = TASKS[config.benchmark].texts is not None
    seconds = sum(float(row.get("seconds") or 0) for row in rows)
    present = f"{len(rows)} of {planned} planned rows" if planned is not None else f"{len(rows)} rows"
    tested = claims({"perplexity" if texts else "niah": rows}, budgets)
    decided = [claim for claim in tested if claim.verdict != "not tested (no rows)"]
    ours = [name for name in OURS if name in config.policies] if texts else []
    lines = [
        f"## {part_title(config)}",
        "",
        f"Part `{key}`: {present}, {seconds / 60:.1f} min of rows (summed row seconds); rows under "
        f"`{Path(config.out).as_posix()}/`.",
        "",
        headline_table({config.benchmark: pieces}),
        "",
    ]
    if texts:
        lines += ["Oracle gap (mean KL over the part's texts):", "", oracle_gap_table(rows, budgets), ""]
    lines += [
        f"Claims, decided on this part's {'texts' if texts else 'examples'} (paired 95 % intervals, every budget):",
        "",
        claims_table(decided),
        "",
    ]
    if ours:
        lines += [
            "Our policies against every paper policy (as in the standard grid's *Beyond the paper*):",
            "",
            beyond_table(beyond_records({"perplexity": rows}, ours, budgets)),
            "",
        ]
    return lines


def long_sections(grid: Grid, configs: dict, rows: dict, planned: dict, results: Path) -> list[str]:
    """The long grid's document body (setup, one section per part, the plot, the reading), its image linked from
    ``results``, where its tables and the plot are written."""
    counts = {key: len(value) for key, value in rows.items()}
    missing = [f"{key} has {counts.get(key, 0)} of {n}" for key, n in planned.items() if counts.get(key, 0) < n]
    commits = ", ".join(f"`{commit}`" for commit in row_commits(r for value in rows.values() for r in value))
    budgets = sorted({budget for config in configs.values() for budget in config.budgets})
    lines = [
        f"Rows computed with the code at {commits or '`none`'} (as stored in each row).",
        "",
        ("**Incomplete run:** " + "; ".join(missing) + " rows; the tables show the rows that exist.")
        if missing
        else f"All planned rows present ({', '.join(f'{k}: {v}' for k, v in counts.items())}).",
        "",
        "Setup:",
        "",
        f"- Budgets {', '.join(map(str, budgets))} tokens per layer and KV head (a hybrid model's sliding-window "
        "layers keep their own window); blocks of 128 with eviction after every block.",
        *(f"- {part_title(config)}: {_described(config, rows.get(key, []))}" for key, config in configs.items()),
        *(f"- {note}" for note in grid.notes),
        f"- {INTERVAL_NOTE}",
        "",
    ]
    panels, niah_panels = [], []
    for key, config in configs.items():
        part_rows = rows.get(key, [])
        pieces = summarise_rows(part_rows, config.benchmark, results / "long", plot_prefix=f"{key}_", plots=False)
        lines += _part_section(key, config, part_rows, pieces, planned.get(key))
        title = part_title(config).replace(" (in-prompt)", "").replace(" · ", "\n", 1)
        kl = [r for r in pieces["records"] if r["metric"] == "kl" and r["task"] == "all"]
        if kl:
            panels.append((title, kl))
        scores = [r for r in pieces["records"] if r["metric"] == "score"]
        for protocol in sorted({r["task"] for r in scores}):
            named = "" if protocol == "all" else f", {protocol}"
            niah_panels.append((title + named, [r for r in scores if r["task"] == protocol]))
    plot = plot_panels_vs_budget(panels, results / PLOT, "KL(full ‖ policy), nats/token (lower is better)")
    if plot is not None:
        lines += ["## KL against budget", "", f"![KL from the full cache vs budget, one panel per part]({PLOT})", ""]
    niah_panels = [(title, records) for title, records in niah_panels if len(budgets_of(records)) > 1]
    if plot_panels_vs_budget(niah_panels, results / NIAH_PLOT, "NIAH hits, share of examples (higher is better)"):
        lines += [
            "## NIAH hits against budget",
            "",
            f"![NIAH hits vs budget, one panel per part and protocol]({NIAH_PLOT})",
            "",
        ]
    reading = results / "long_reading.md"
    if reading.is_file():
        lines += [reading.read_text(encoding="utf-8").strip(), ""]
    return lines


def _described(config, rows: list[dict]) -> str:
    task = TASKS[config.benchmark]
    return task.describe(config, rows) if task.describe is not None else task.title


def write_long_md(
    path: Path, grid: Grid, configs: dict, rows: dict, planned: dict, results: Path, docs: Path | None
) -> None:
    """``path``, the long grid's document (``docs``: the committed documents' folder, else None for ``--out``)."""
    where = f"--docs {docs}" if docs is not None else f"--out {path.parent}"
    command = f"caote eval report --grid long {where}"
    heading = [
        "# Long contexts: eviction at 4k-8k tokens, two models, two kinds of text",
        "",
        f"Regenerate with `{command}` (resumable: finished rows are kept).",
        "",
    ]
    body = "\n".join(long_sections(grid, configs, rows, planned, results))
    for name in (PLOT, NIAH_PLOT):
        body = body.replace(f"]({name})", f"]({(results / name).relative_to(path.parent).as_posix()})")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(heading) + "\n" + body, encoding="utf-8")
