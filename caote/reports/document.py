"""docs/results.md, written from the summaries of a report grid: every task-specific line comes from the task
registry (Setup lines, headline columns, section titles)."""

from __future__ import annotations

from pathlib import Path

from caote.evaluation.grids import GRIDS, Grid
from caote.evaluation.reference import FULL
from caote.evaluation.registry import TASKS
from caote.evaluation.rows import row_commits
from caote.evaluation.stats import Estimate
from caote.reports.beyond import GAP_TARGET, beyond_records, beyond_table, target_lines
from caote.reports.claims import claims, claims_table
from caote.reports.summary import INTERVAL_NOTE, render_pieces
from caote.reports.tables import policy_order


def headline_columns(summaries: dict) -> list[tuple[str, str, str, str, int]]:
    """``(task, metric, view, column label, digits)`` of every headline metric of the summarised tasks, registry
    order; a task summarised per protocol gets one column per protocol."""
    columns = []
    for task in TASKS.values():
        if task.name not in summaries:
            continue
        records = summaries[task.name].get("records", [])
        for metric in task.metrics:
            if not metric.headline:
                continue
            tasks = {r["task"] for r in records if r["metric"] == metric.name}
            if not tasks:  # not measured (the long grid has no fidelity)
                continue
            if "all" in tasks:
                columns.append((task.name, metric.name, "all", metric.headline, metric.digits))
            else:
                columns += [
                    (task.name, metric.name, v, f"{metric.headline} ({v})", metric.digits) for v in sorted(tasks)
                ]
    return columns


def headline_table(summaries: dict) -> str:
    """One row per policy x budget (the full cache first) with the mean [95 % CI] of every headline metric of the
    summarised tasks, in registry order."""
    columns = headline_columns(summaries)
    cells = {}
    for benchmark, field, view, _, _ in columns:
        for r in summaries.get(benchmark, {}).get("records", []):
            if r["metric"] == field and r["task"] == view:
                cells[(benchmark, field, view, r["policy"], r["budget"])] = Estimate(
                    r["mean"], r["ci_low"], r["ci_high"], r["n"], r["ci_method"]
                )
    order = policy_order([key[3] for key in cells])
    settings = sorted(
        {(key[3], key[4]) for key in cells},
        key=lambda pb: (order.index(pb[0]), -1 if pb[1] == "" else pb[1]),
    )
    lines = [
        "| policy | budget | " + " | ".join(label for *_, label, _ in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for policy, budget in settings:
        values = [
            cells[(b, f, v, policy, budget)].cell(d) if (b, f, v, policy, budget) in cells else "–"
            for b, f, v, _, d in columns
        ]
        name = "**full (reference)**" if policy == FULL else policy
        lines.append(f"| {name} | {budget if budget != '' else 'all'} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def setup_lines(configs: dict, rows: dict) -> list[str]:
    """One Setup line per task of the grid that can describe itself, in registry order."""
    return [
        f"- {task.describe(configs[task.name], rows.get(task.name, []))}"
        for task in TASKS.values()
        if task.name in configs and task.describe is not None
    ]


def verdict_lines(summaries: dict) -> list[str]:
    """Plain-language lines: for every benchmark metric, which CAOTE comparisons helped or hurt."""
    lines = []
    for name, pieces in summaries.items():
        records = pieces["comparison_records"]
        for metric, view in dict.fromkeys((r["metric"], r["task"]) for r in records):
            chosen = [r for r in records if r["metric"] == metric and r["task"] == view]
            if view != "all":
                metric = f"{metric} ({view})"
            helps = [
                f"{r['base']}+{r['transform']} b={r['budget']} ({r['delta']:+.3g})"
                for r in chosen
                if r["verdict"] == "helps"
            ]
            hurts = [
                f"{r['base']}+{r['transform']} b={r['budget']} ({r['delta']:+.3g})"
                for r in chosen
                if r["verdict"] == "hurts"
            ]
            unclear = sum(r["verdict"] not in ("helps", "hurts") for r in chosen)
            lines.append(
                f"- **{name} / {metric}**: CI excludes zero in favour of the variant in {len(helps)} of "
                f"{len(chosen)} comparisons"
                + (f": {', '.join(helps)}" if helps else "")
                + f"; against it in {len(hurts)}"
                + (f": {', '.join(hurts)}" if hurts else "")
                + f"; {unclear} inconclusive."
            )
    return lines


def provenance_line(docs: Path, runs: Path, grid: Grid, config, rows: dict, seconds: dict) -> str:
    """How to regenerate the document, the settings and commits of its rows, their wall time and where they are
    kept."""
    committed = runs.is_relative_to(docs / "results")  # the committed documents (--docs) or a user's --out
    command = f"caote eval report --grid {grid.name} " + (f"--docs {docs}" if committed else f"--out {docs}")
    commits = row_commits(row for value in rows.values() for row in value)
    provenance = ", ".join(f"`{commit}`" for commit in commits) or "`none`"
    return (
        f"Regenerate with `{command}` (grid `{grid.name}`, model `{config.model}`, essay split `{config.split}`, "
        f"seed {config.seed}; rows computed with the code at commit{'s' if len(commits) > 1 else ''} {provenance}, "
        "as stored in each row). Wall time summed over rows (over all processes): "
        + ", ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items())
        + ". "
        f"Rows are kept under `{runs}/` and a rerun resumes from them (delete the folder to recompute)."
    )


def completeness_line(rows: dict, planned: dict) -> str:
    """Whether every planned row is there: the rows each task misses, else the counts (and the rows beyond the
    plan)."""
    counts = {name: len(value) for name, value in rows.items()}
    missing = {name: planned[name] - counts.get(name, 0) for name in planned if counts.get(name, 0) < planned[name]}
    if missing:
        return (
            "**Incomplete run:** "
            + ", ".join(f"{name} is missing {count} of {planned[name]} rows" for name, count in missing.items())
            + "; the tables show the rows that exist."
        )
    extra = {name: counts[name] - planned[name] for name in planned if counts.get(name, 0) > planned[name]}
    return f"All planned rows present ({', '.join(f'{k}: {v}' for k, v in counts.items())})." + (
        " **Rows beyond the plan:** "
        + ", ".join(f"{name} has {count} more" for name, count in extra.items())
        + " (rows of other settings in the folder, summarised with the rest; use a fresh folder to exclude them)."
        if extra
        else ""
    )


def setup_section(grid: Grid, configs: dict, rows: dict) -> list[str]:
    """The Setup section: policies, budgets and prefill, one line per task, the grid's notes and the intervals."""
    policies = list(dict.fromkeys(p for part in configs.values() for p in part.policies))
    return [
        "## Setup",
        "",
        f"- Policies: {', '.join(policy_order(policies))} (hindsight and ablation policies on the texts only); budgets "
        f"{', '.join(map(str, grid.budgets))} tokens per layer and KV head; prompts consumed in blocks of 128 with "
        "eviction after every block, greedy decoding.",
        *setup_lines(configs, rows),
        *(f"- {note}" for note in grid.notes),
        f"- {INTERVAL_NOTE}",
        "",
    ]


def write_results_md(
    path: Path,
    grid: Grid,
    config,
    configs: dict,
    summaries: dict,
    rows: dict,
    seconds: dict,
    planned: dict,
    runs: Path | None = None,
) -> None:
    """docs/results.md, tables first: provenance, setup (one line per task), the headline table, the claims, the
    verdicts and our policies against the paper's; then the hand-written readings (``results/<grid>_conclusions.md``,
    ``results/<grid>_beyond.md``), a link to each grid's own document, and one section per task in grid order."""
    docs = path.parent
    runs = Path(runs) if runs is not None else docs / "results" / "runs"
    lines = [
        "# Results: what eviction costs on the bundled SmolLM2-135M-Instruct",
        "",
        provenance_line(docs, runs, grid, config, rows, seconds),
        "",
        completeness_line(rows, planned),
        "",
        *setup_section(grid, configs, rows),
        "## Headline: every policy × budget (mean [95 % CI]; full cache first)",
        "",
        "NIAH and RULER: higher is better (the interval shows how many examples a cell has: few make it wide). "
        "PPL − full, KL (nats per token, from the full cache's next-token distribution) and attention-output error "
        "(‖O − O_full‖/‖O_full‖, mean over layers): lower is better, over the essay texts.",
        "",
        headline_table(summaries),
        "",
        "## Claims",
        "",
        "Each claim is decided by paired 95 % intervals over independent units (essays, NIAH examples) at every "
        "budget: reproduced when the interval favours it at every budget, refuted when it never does and goes "
        "against it somewhere, inconclusive otherwise.",
        "",
        claims_table(claims(rows, list(grid.budgets))),
        "",
        "## Where CAOTE helps and where it does not",
        "",
        "A comparison counts only when the 95 % paired interval of (variant − plain base) excludes zero.",
        "",
        *verdict_lines(summaries),
        "",
        *beyond_section(grid, summaries, rows, docs),
        _hand_written(docs, grid, "conclusions"),
        "",
        _hand_written(docs, grid, "beyond"),
        "",
        *own_document_lines(docs),
    ]
    for name, pieces in summaries.items():
        lines += [f"## {TASKS[name].title}", "", render_pieces(name, pieces, relative_to=docs), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip("\n") + "\n", encoding="utf-8")


def _hand_written(docs: Path, grid: Grid, part: str) -> str:
    """The hand-written ``results/<grid>_<part>.md`` (the reading of the numbers), or nothing."""
    file = docs / "results" / f"{grid.name}_{part}.md"
    return file.read_text(encoding="utf-8").strip() if file.is_file() else ""


def own_document_lines(docs: Path) -> list[str]:
    """A link to each grid's own document under ``docs/results/`` that exists (the long grid's results/long.md),
    named by its title: its tables and reading are linked from results.md, not repeated there."""
    links = []
    for grid in GRIDS.values():
        file = docs / "results" / grid.own_document if grid.own_document else None
        if file is not None and file.is_file():
            title = file.read_text(encoding="utf-8").splitlines()[0].lstrip("# ").strip()
            link = f"[{title}](results/{grid.own_document})"
            links.append(f"- {link} (grid `{grid.name}`): its tables, plots and reading.")
    return ["## Other grids", "", *links, ""] if links else []


def beyond_section(grid: Grid, summaries: dict, rows: dict, docs: Path) -> list[str]:
    """ "Beyond the paper": our policies (``grid.beyond``) against every paper policy and the oracle, their targets
    and the KL-vs-budget plot (every policy and the oracle); the hand-written reading follows the section."""
    if not grid.beyond:
        return []
    records = beyond_records(rows, list(grid.beyond), list(grid.budgets))
    plots = [
        Path(plot).relative_to(docs).as_posix()
        for _, plot in summaries.get("perplexity", {}).get("plots", [])
        if Path(plot).name.endswith("_kl_vs_budget.png")
    ]
    return [
        "## Beyond the paper",
        "",
        "Our policies (`caote policies` lists their formula and cost) against the policies of the CAOTE paper on the "
        "same units. The best paper policy of a budget is the plain / +caote / +fastcaote policy with the lowest mean "
        "KL there; *beats every paper policy* asks for a paired 95 % interval below zero against each of them and "
        "StreamingLLM; the oracle gap closed is (policy − best paper) / (oracle − best paper) in mean KL. NIAH: the "
        "paired difference from the paper policy with the best NIAH score at that budget and protocol.",
        "",
        beyond_table(records),
        "",
        f"Targets (lower KL than every paper policy, at least {GAP_TARGET:.0%} of the oracle gap, no NIAH loss):",
        "",
        *target_lines(records, list(grid.budgets)),
        "",
        *(f"![KL from the full cache vs budget, every policy and the oracle]({plot})" for plot in plots),
        "",
    ]
