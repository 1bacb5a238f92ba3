"""One task's summary from its rows: tables, paired comparisons, CSV and plots, as the task's spec asks.

`summarise_rows` produces the pieces (written under an output folder) and `render_pieces` their Markdown;
`summarise_benchmark` writes ``<out>/summary.md`` after a ``caote eval BENCHMARK`` run. Reads rows only.
"""

from __future__ import annotations

from pathlib import Path

from caote.evaluation.examples import row_protocol
from caote.evaluation.registry import TASKS
from caote.evaluation.rows import load_rows
from caote.reports.plots import FIGURES, plot_metric_vs_budget
from caote.reports.tables import (
    BEST_BASE_FIELDS,
    COMPARISON_FIELDS,
    SUMMARY_FIELDS,
    best_base_records,
    best_base_table,
    comparison_records,
    comparison_table,
    markdown_table,
    summary_records,
    write_csv,
)

INTERVAL_NOTE = (
    "Intervals are 95 % (scipy.stats): Wilson for means of hit-or-miss scores (NIAH), percentile bootstrap (2,000 "
    "resamples) over independent units otherwise: examples (RULER), essays (PPL / KL / fidelity). Differences "
    "(variant − plain base, policy − best plain base) use a paired bootstrap over the same units; pairing over text "
    "blocks is shown only as a secondary view (blocks of one text are correlated, so those intervals are optimistic)."
)


def views(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows to summarise apart: one view per question protocol when the rows have several (their numbers answer
    different questions and must not be averaged together), else ``{"all": rows}``."""
    if not any(row.get("protocol") for row in rows):
        return {"all": rows}
    protocols = sorted({row_protocol(row) for row in rows})
    if len(protocols) < 2:
        return {"all": rows}
    return {protocol: [row for row in rows if row_protocol(row) == protocol] for protocol in protocols}


def summarise_rows(rows: list[dict], benchmark: str, out: Path, plot_prefix: str = "", plots: bool = True) -> dict:
    """Tables, CSV and (unless ``plots`` is false) plots of one task's rows under ``out``, one set per `views`
    entry; returns the pieces for the docs writer."""
    task = TASKS[benchmark]
    pieces = {
        "tables": [],
        "comparisons": [],
        "block_comparisons": [],
        "best_base": [],
        "plots": [],
        "metric_plots": {},  # metric name -> its plot against the budget, over all rows (no protocol view)
        "records": [],
        "comparison_records": [],
        "best_base_records": [],
    }
    for view, view_rows in views(rows).items():
        named = "" if view == "all" else f" ({view})"
        prefix = plot_prefix if view == "all" else f"{plot_prefix}{view}_"
        subtasks = sorted({r.get("task") for r in view_rows if r.get("task")})
        for metric in task.metrics:
            records = _in_view(summary_records(view_rows, metric, benchmark), view)
            if not records:
                continue
            comparisons = _in_view(comparison_records(view_rows, metric, benchmark), view)
            pieces["records"] += records
            pieces["comparison_records"] += comparisons
            label = metric.label + named
            pieces["tables"].append((label, markdown_table(records, metric.digits)))
            pieces["comparisons"].append((label, comparison_table(comparisons, metric.digits + 1)))
            by_block = _in_view(comparison_records(view_rows, metric, benchmark, blocks=True), view)
            if by_block:
                pieces["block_comparisons"].append((label, comparison_table(by_block, metric.digits + 1)))
            against_best = _in_view(best_base_records(view_rows, metric, benchmark), view)
            pieces["best_base_records"] += against_best
            pieces["best_base"].append((label, best_base_table(against_best, metric.digits + 1)))
            name = f"{prefix}{benchmark}_{metric.name}_vs_budget.png"
            title = f"{benchmark}{named}: {metric.label} (95 % CI)"
            better = f"{metric.label} ({'higher' if metric.higher_is_better else 'lower'} is better)"
            plot = plot_metric_vs_budget(records, out / name, better, title) if plots else None
            if plot:
                pieces["plots"].append((f"{benchmark}{named}: {metric.label} vs budget", plot))
                if view == "all":
                    pieces["metric_plots"][metric.name] = plot
            if len(subtasks) > 1 and task.subtasks:
                for subtask in subtasks:
                    subtask_records = summary_records(view_rows, metric, benchmark, subtask)
                    pieces["records"] += subtask_records
                    table = markdown_table(subtask_records, metric.digits)
                    pieces["tables"].append((f"{metric.label} — {subtask}{named}", table))
        for figure in task.figures if plots else ():
            pieces["plots"] += [(caption + named, path) for caption, path in FIGURES[figure](view_rows, out, prefix)]
    write_csv(out / f"{plot_prefix}{benchmark}_summary.csv", pieces["records"], SUMMARY_FIELDS)
    write_csv(out / f"{plot_prefix}{benchmark}_caote_vs_plain.csv", pieces["comparison_records"], COMPARISON_FIELDS)
    write_csv(out / f"{plot_prefix}{benchmark}_vs_best_base.csv", pieces["best_base_records"], BEST_BASE_FIELDS)
    return pieces


def _in_view(records: list[dict], view: str) -> list[dict]:
    """Records labelled with their view (``task`` is ``"all"`` or the protocol)."""
    return [{**record, "task": view} for record in records]


def render_pieces(benchmark: str, pieces: dict, relative_to: Path | None = None) -> str:
    lines = []
    for label, table in pieces["tables"]:
        lines += [f"**{benchmark} — {label}** (mean [95 % CI])", "", table, ""]
    for label, table in pieces["comparisons"]:
        lines += [f"**{benchmark} — {label}: variant − plain base, paired per unit**", "", table, ""]
    for label, table in pieces["best_base"]:
        lines += [
            f"**{benchmark} — {label}: policy − best plain base, paired per unit; share of the gap between the best "
            "paper policy and the oracle closed**",
            "",
            table,
            "",
        ]
    for label, table in pieces["block_comparisons"]:
        lines += [f"**{benchmark} — {label}: variant − plain base, paired per text block (secondary view)**", "", table]
        lines.append("")
    for caption, path in pieces["plots"]:
        link = Path(path).relative_to(relative_to) if relative_to else Path(Path(path).name)
        lines += [f"![{caption}]({link.as_posix()})", ""]
    return "\n".join(lines)


def summarise_benchmark(config) -> Path:
    """``<out>/summary.md`` (+ CSV and PNGs) from every shard under ``config.out``; returns the Markdown path."""
    rows = load_rows(config.out)
    pieces = summarise_rows(rows, config.benchmark, Path(config.out))
    path = Path(config.out) / "summary.md"
    text = (
        f"# {config.benchmark} — {config.model}\n\n{len(rows)} rows from {Path(config.out)}. "
        f"{INTERVAL_NOTE}\n\n" + render_pieces(config.benchmark, pieces)
    )
    path.write_text(text, encoding="utf-8")
    print(text)
    return path
