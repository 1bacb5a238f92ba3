"""Summaries with 95 % confidence intervals, plots, and the ``caote eval report`` grid that writes docs/results.md.

Intervals (95 %):
* a mean of hit-or-miss scores (metrics in `BINARY_METRICS`: NIAH's substring match) gets the **Wilson score
  interval**;
* any other mean (RULER's string_match_all fractions, PPL deltas, KL, fidelity) gets a **percentile bootstrap**
  over examples (2,000 resamples, fixed seed); with fewer than 2 examples the interval is the single value;
* CAOTE/FastCAOTE against its plain base is a **paired bootstrap** of the per-example differences (same examples,
  same budget), which is much tighter than comparing two independent intervals.
"""

from __future__ import annotations

import csv
import math
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

Z95 = 1.959963984540054
BOOTSTRAP_RESAMPLES = 2000
# metrics whose score is 0 or 1 per example (hit or miss): their means get Wilson intervals
BINARY_METRICS = {"substring_match", "string_match_part"}
BASES = ("h2o", "tova", "snapkv")
TRANSFORMS = ("caote", "fastcaote")


# -- interval math -----------------------------------------------------------------------------------------------


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``successes / n``."""
    if n <= 0:
        return (math.nan, math.nan)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # clamp to [0, 1] and keep the estimate inside despite rounding (p = 1 gives a high end of 0.9999...)
    return (max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half)))


def bootstrap_interval(
    values: list[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values``."""
    n = len(values)
    if n == 0:
        return (math.nan, math.nan)
    if n == 1:
        return (values[0], values[0])
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    low_index = int(math.floor((1 - level) / 2 * resamples))
    high_index = min(resamples - 1, int(math.ceil((1 + level) / 2 * resamples)) - 1)
    return (means[low_index], means[high_index])


@dataclass
class Estimate:
    """A mean with its 95 % interval and how the interval was computed."""

    mean: float
    low: float
    high: float
    n: int
    method: str

    def cell(self, digits: int = 2) -> str:
        if self.n == 0 or math.isnan(self.mean):
            return "–"
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def estimate(values: list[float], binary: bool | None = None) -> Estimate:
    """Mean and 95 % interval: Wilson for 0/1 scores (``binary``; by default: every value is 0 or 1), else the
    percentile bootstrap. Pass ``binary=False`` for continuous measures that happen to be 0 (the full cache's KL)."""
    values = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    n = len(values)
    if n == 0:
        return Estimate(math.nan, math.nan, math.nan, 0, "none")
    mean = sum(values) / n
    if binary is None:
        binary = all(v in (0.0, 1.0) for v in values)
    if binary:
        low, high = wilson_interval(sum(values), n)
        return Estimate(mean, low, high, n, "wilson")
    low, high = bootstrap_interval(values)
    return Estimate(mean, low, high, n, "bootstrap")


def paired_difference(treated: dict[str, float], control: dict[str, float]) -> Estimate:
    """Mean of ``treated[id] - control[id]`` over the shared ids, with a percentile-bootstrap 95 % interval."""
    shared = sorted(set(treated) & set(control))
    differences = [treated[key] - control[key] for key in shared]
    if not differences:
        return Estimate(math.nan, math.nan, math.nan, 0, "none")
    low, high = bootstrap_interval(differences)
    return Estimate(sum(differences) / len(differences), low, high, len(differences), "paired bootstrap")


# -- summaries ---------------------------------------------------------------------------------------------------


def policy_order(policies) -> list[str]:
    """full, streamingllm, then each base with its transforms, then anything else."""
    wanted = ["full", "streamingllm"] + [f"{b}{t}" for b in BASES for t in ("", "+caote", "+fastcaote")]
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


def summary_records(rows: list[dict], field: str, benchmark: str, task: str | None = None) -> list[dict]:
    """One record per (policy, budget): mean, interval, n, method, and the full cache's mean on the same examples."""
    cells = values_by_cell(rows, field, task)
    full = cells.get(("full", None), {})
    # only answer scores of hit-or-miss metrics are proportions (a lockstep measure or an F1 of 0 is not one)
    metrics = {row.get("metric") for row in rows if task is None or row.get("task") == task}
    binary = (
        field == "score"
        and metrics <= BINARY_METRICS
        and all(v in (0.0, 1.0) for values in cells.values() for v in values.values())
    )
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


# per-block series used as the paired units of the lockstep metrics (a text gives one value per block)
BLOCK_FIELDS = {"ppl_delta": "nll_blocks", "kl": "kl_blocks", "fidelity": "fidelity_per_block"}
MIN_PAIRED_UNITS = 5


def block_values_by_cell(rows: list[dict], field: str) -> dict[tuple[str, int | None], dict]:
    """``{(policy, budget): {(text id, block): value}}`` from a row's per-block list ``field``."""
    cells: dict[tuple[str, int | None], dict] = defaultdict(dict)
    for row in rows:
        for index, value in enumerate(row.get(field) or []):
            cells[(row["policy"], row["budget"])][(row["example_id"], index)] = float(value)
    return cells


def comparison_records(
    rows: list[dict], field: str, benchmark: str, higher_is_better: bool, task: str | None = None
) -> list[dict]:
    """Base+CAOTE / +FastCAOTE minus the plain base, paired per example (per text block for the lockstep metrics:
    NLL per token for PPL, KL, fidelity), at every budget. A verdict needs at least `MIN_PAIRED_UNITS` pairs."""
    block_field = BLOCK_FIELDS.get(field) if any(r.get(BLOCK_FIELDS.get(field, "")) for r in rows) else None
    cells = block_values_by_cell(rows, block_field) if block_field else values_by_cell(rows, field, task)
    budgets = sorted({budget for (_, budget) in cells if budget is not None})
    records = []
    for base in BASES:
        for transform in TRANSFORMS:
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
                        "compared": "NLL/token" if block_field == "nll_blocks" else field,
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
        if policy == "full":
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


# -- plots -------------------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_niah_heatmaps(rows: list[dict], path: Path, budget: int) -> Path | None:
    """CAOTE-paper Fig. 2 style: one panel per policy, context length (x) x needle depth (y), mean accuracy."""
    chosen = [r for r in rows if r["budget"] in (budget, None) and "depth" in r.get("meta", {})]
    if not chosen:
        return None
    policies = policy_order({r["policy"] for r in chosen})
    lengths = sorted({r["meta"]["context_length"] for r in chosen})
    depths = sorted({r["meta"]["depth"] for r in chosen})
    plt = _pyplot()
    columns = min(4, len(policies))
    rows_count = math.ceil(len(policies) / columns)
    figure, axes = plt.subplots(rows_count, columns, figsize=(3.2 * columns, 3.0 * rows_count), squeeze=False)
    figure.subplots_adjust(hspace=0.55, wspace=0.35)
    image = None
    for index, policy in enumerate(policies):
        axis = axes[index // columns][index % columns]
        grid = [[math.nan] * len(lengths) for _ in depths]
        for i, depth in enumerate(depths):
            for j, length in enumerate(lengths):
                scores = [
                    r["score"]
                    for r in chosen
                    if r["policy"] == policy and r["meta"]["depth"] == depth and r["meta"]["context_length"] == length
                ]
                if scores:
                    grid[i][j] = sum(scores) / len(scores)
        image = axis.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto", origin="upper")
        axis.set_title(policy if policy == "full" else f"{policy} (b={budget})", fontsize=9)
        axis.set_xticks(range(len(lengths)), [str(x) for x in lengths], fontsize=7)
        axis.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths], fontsize=7)
        axis.set_xlabel("context tokens", fontsize=7)
        axis.set_ylabel("depth", fontsize=7)
    for index in range(len(policies), rows_count * columns):
        axes[index // columns][index % columns].axis("off")
    if image is not None:
        figure.colorbar(image, ax=axes, shrink=0.6, label="accuracy")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def plot_metric_vs_budget(records: list[dict], path: Path, ylabel: str, title: str) -> Path | None:
    """One line per policy (mean with its 95 % interval as error bars); the full cache as a dashed line."""
    budgets = sorted({r["budget"] for r in records if r["budget"] != ""})
    if not budgets:
        return None
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    styles = {"": "-", "+caote": "--", "+fastcaote": ":"}
    colours = {"streamingllm": "tab:gray", "h2o": "tab:blue", "tova": "tab:orange", "snapkv": "tab:green"}
    for policy in policy_order({r["policy"] for r in records}):
        chosen = sorted((r for r in records if r["policy"] == policy and r["budget"] != ""), key=lambda r: r["budget"])
        if policy == "full":
            full = [r for r in records if r["policy"] == "full"]
            if full:
                axis.axhline(full[0]["mean"], color="black", linestyle="--", linewidth=1, label="full cache")
            continue
        if not chosen:
            continue
        base, plus, transform = policy.partition("+")
        x = [r["budget"] for r in chosen]
        y = [r["mean"] for r in chosen]
        error = [
            [max(0.0, r["mean"] - r["ci_low"]) for r in chosen],
            [max(0.0, r["ci_high"] - r["mean"]) for r in chosen],
        ]
        axis.errorbar(
            x,
            y,
            yerr=error,
            label=policy,
            color=colours.get(base),
            capsize=2,
            marker="o",
            markersize=3,
            linestyle=styles.get(plus + transform, "-"),
            linewidth=1.2,
            alpha=0.85,
        )
    axis.set_xscale("log", base=2)
    axis.set_xticks(budgets, [str(b) for b in budgets])
    axis.set_xlabel("KV budget (tokens per layer)")
    axis.set_ylabel(ylabel)
    axis.set_title(title, fontsize=10)
    return _save_with_legend(plt, figure, axis, path)


def _save_with_legend(plt, figure, axis, path: Path) -> Path:
    """Legend and grid on ``axis``, then write ``figure`` to ``path`` (creating its folder) and free it."""
    axis.legend(fontsize=7, ncol=2)
    axis.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def plot_fidelity_layers(rows: list[dict], path: Path, budget: int) -> Path | None:
    """Relative attention-output error per layer at one budget, averaged over texts, one line per policy."""
    chosen = [r for r in rows if r.get("budget") == budget and r.get("fidelity_layers")]
    if not chosen:
        return None
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7.5, 4))
    for policy in policy_order({r["policy"] for r in chosen}):
        layers = [r["fidelity_layers"] for r in chosen if r["policy"] == policy]
        mean = [sum(values) / len(values) for values in zip(*layers)]
        base, plus, transform = policy.partition("+")
        axis.plot(
            range(len(mean)),
            mean,
            label=policy,
            linestyle={"": "-", "+caote": "--", "+fastcaote": ":"}[plus + transform],
        )
    axis.set_xlabel("layer")
    axis.set_ylabel("||O_policy − O_full|| / ||O_full||")
    axis.set_title(f"Attention-output relative error per layer, b={budget}", fontsize=10)
    return _save_with_legend(plt, figure, axis, path)


# -- per-benchmark summaries -------------------------------------------------------------------------------------

# (row field, label, digits, higher is better) per benchmark
FIELDS = {
    "niah": [("score", "accuracy", 2, True)],
    "ruler": [("score", "score (string_match_all)", 2, True)],
    "longbench": [("score", "score", 3, True)],
    "perplexity": [
        ("ppl_delta", "PPL − PPL(full)", 3, False),
        ("kl", "KL(full ‖ policy), nats/token", 4, False),
        ("fidelity", "attention-output relative error (mean over layers)", 3, False),
    ],
    "fidelity": [("fidelity", "attention-output relative error (mean over layers)", 3, False)],
}


def summarise_rows(rows: list[dict], benchmark: str, out: Path, plot_prefix: str = "") -> dict:
    """Tables, CSV and plots of one benchmark's rows under ``out``; returns the pieces for the docs writer."""
    pieces = {"tables": [], "comparisons": [], "plots": [], "records": [], "comparison_records": []}
    tasks = sorted({r.get("task") for r in rows if r.get("task")})
    for field, label, digits, higher in FIELDS[benchmark]:
        records = summary_records(rows, field, benchmark)
        if not records:
            continue
        comparisons = comparison_records(rows, field, benchmark, higher)
        pieces["records"] += records
        pieces["comparison_records"] += comparisons
        pieces["tables"].append((label, markdown_table(records, digits)))
        pieces["comparisons"].append((label, comparison_table(comparisons, digits + 1)))
        name = f"{plot_prefix}{benchmark}_{field}_vs_budget.png"
        plot = plot_metric_vs_budget(records, out / name, label, f"{benchmark}: {label} (95 % CI)")
        if plot:
            pieces["plots"].append((f"{benchmark}: {label} vs budget", plot))
        if len(tasks) > 1 and benchmark in ("ruler", "longbench"):
            for task in tasks:
                task_records = summary_records(rows, field, benchmark, task)
                pieces["records"] += task_records
                pieces["tables"].append((f"{label} — {task}", markdown_table(task_records, digits)))
    budgets = sorted({r["budget"] for r in rows if r.get("budget") is not None})
    if benchmark == "niah":
        for budget in budgets:
            plot = plot_niah_heatmaps(rows, out / f"{plot_prefix}niah_heatmap_b{budget}.png", budget)
            if plot:
                pieces["plots"].append((f"NIAH accuracy, context length × depth, b={budget}", plot))
    if benchmark in ("perplexity", "fidelity") and budgets:
        plot = plot_fidelity_layers(rows, out / f"{plot_prefix}fidelity_layers_b{budgets[0]}.png", budgets[0])
        if plot:
            pieces["plots"].append((f"attention-output error per layer, b={budgets[0]}", plot))
    write_csv(out / f"{plot_prefix}{benchmark}_summary.csv", pieces["records"])
    write_csv(out / f"{plot_prefix}{benchmark}_caote_vs_plain.csv", pieces["comparison_records"])
    return pieces


def render_pieces(benchmark: str, pieces: dict, relative_to: Path | None = None) -> str:
    lines = []
    for label, table in pieces["tables"]:
        lines += [f"**{benchmark} — {label}** (mean [95 % CI])", "", table, ""]
    for label, table in pieces["comparisons"]:
        lines += [f"**{benchmark} — {label}: variant − plain base, paired per example**", "", table, ""]
    for caption, path in pieces["plots"]:
        link = Path(path).relative_to(relative_to) if relative_to else Path(Path(path).name)
        lines += [f"![{caption}]({link.as_posix()})", ""]
    return "\n".join(lines)


def summarise_benchmark(config) -> Path:
    """``<out>/summary.md`` (+ CSV and PNGs) from every shard under ``config.out``; returns the Markdown path."""
    from caote.evaluation.runner import load_rows

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


INTERVAL_NOTE = (
    "Intervals are 95 %: Wilson for means of hit-or-miss scores (NIAH), percentile bootstrap (2,000 "
    "resamples) over examples otherwise (RULER; PPL/KL/fidelity over texts); CAOTE-vs-plain "
    "differences use a paired bootstrap over the same examples (over text blocks for PPL/KL/fidelity)."
)


# -- the report grid ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    """Sizes of the ``caote eval report`` grid."""

    name: str
    budgets: tuple[int, ...]
    niah_lengths: tuple[int, ...]
    niah_depths: tuple[float, ...]
    niah_samples: int
    ruler_lengths: tuple[int, ...]
    ruler_tasks: tuple[str, ...]
    ruler_samples: int
    text_lengths: tuple[int, ...]
    text_samples: int
    max_new_tokens: int


# quick: about 15 min on 2 idle cores (31 policy x budget settings: ~124 answers of ~1k-token prompts plus two
# 1k-token texts in lockstep); the full grid takes hours on CPU
QUICK_GRID = Grid(
    "quick",
    budgets=(128, 256, 512),
    niah_lengths=(1024,),
    niah_depths=(50, 90),
    niah_samples=1,
    ruler_lengths=(1024,),
    ruler_tasks=("niah_multikey", "variable_tracking"),
    ruler_samples=1,
    text_lengths=(1024,),
    text_samples=2,
    max_new_tokens=24,
)
FULL_GRID = Grid(
    "full",
    budgets=(128, 256, 512),
    niah_lengths=(1024, 2048),
    niah_depths=(10, 30, 50, 70, 90),
    niah_samples=2,
    ruler_lengths=(1024, 2048),
    ruler_tasks=("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words"),
    ruler_samples=3,
    text_lengths=(2048,),
    text_samples=6,
    max_new_tokens=64,
)


def run_report(config) -> int:
    """Run the default grid (NIAH, RULER-style, perplexity/KL/fidelity) and write ``<docs>/results.md``."""
    from caote.evaluation.runner import EvalConfig, distributed_state, load_rows, run_rows
    from caote.models import load_model

    grid = QUICK_GRID if config.quick else FULL_GRID
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    policies = config.policies
    budgets = list(grid.budgets)
    docs = Path(config.docs)
    results = docs / "results"
    runs = results / "runs" / grid.name
    summarise_only = getattr(config, "summarise_only", False)
    state, rank, world = distributed_state()
    if not summarise_only:
        device = None if state.device.type == "cpu" else str(state.device)
        model, tokenizer = load_model(config.model, device=device)
    parts = {
        "perplexity": EvalConfig(
            "perplexity",
            config.model,
            policies,
            budgets,
            list(grid.text_lengths),
            grid.text_samples,
            config.seed,
            config.split,
            runs / "perplexity",
            progress=config.progress,
        ),
        "niah": EvalConfig(
            "niah",
            config.model,
            policies,
            budgets,
            list(grid.niah_lengths),
            grid.niah_samples,
            config.seed,
            config.split,
            runs / "niah",
            depths=list(grid.niah_depths),
            progress=config.progress,
            max_new_tokens=grid.max_new_tokens,
        ),
        "ruler": EvalConfig(
            "ruler",
            config.model,
            policies,
            budgets,
            list(grid.ruler_lengths),
            grid.ruler_samples,
            config.seed,
            config.split,
            runs / "ruler",
            tasks=list(grid.ruler_tasks),
            progress=config.progress,
            max_new_tokens=grid.max_new_tokens,
        ),
    }
    for name, part in parts.items():
        if not summarise_only:
            run_rows(part, model, tokenizer, rank, world)
    state.wait_for_everyone()
    if rank != 0:
        return 0
    rows = {name: load_rows(part.out) for name, part in parts.items()}
    summaries = {name: summarise_rows(rows[name], name, results, plot_prefix=f"{grid.name}_") for name in parts}
    # compute time actually spent on the rows (sum over rows and processes), not this call's wall time
    seconds = {name: sum(float(r.get("seconds") or 0) for r in value) for name, value in rows.items()}
    planned = planned_rows(grid, config.policies)
    write_results_md(docs / "results.md", grid, config, summaries, rows, seconds, planned)
    print(f"wrote {docs / 'results.md'}")
    return 0


HEADLINE_COLUMNS = (
    ("niah", "score", "NIAH acc", 2),
    ("ruler", "score", "RULER score", 2),
    ("perplexity", "ppl_delta", "PPL − full", 3),
    ("perplexity", "kl", "KL", 4),
    ("perplexity", "fidelity", "attn-output error", 3),
)


def headline_table(summaries: dict) -> str:
    """One row per policy x budget (the full cache first) with every benchmark's mean [95 % CI]."""
    cells = {}
    for benchmark, field, _, _ in HEADLINE_COLUMNS:
        for r in summaries.get(benchmark, {}).get("records", []):
            if r["metric"] == field and r["task"] == "all":
                cells[(benchmark, field, r["policy"], r["budget"])] = Estimate(
                    r["mean"], r["ci_low"], r["ci_high"], r["n"], r["ci_method"]
                )
    order = policy_order([policy for (_, _, policy, _) in cells])
    settings = sorted(
        {(policy, budget) for (_, _, policy, budget) in cells},
        key=lambda pb: (order.index(pb[0]), -1 if pb[1] == "" else pb[1]),
    )
    lines = [
        "| policy | budget | " + " | ".join(label for _, _, label, _ in HEADLINE_COLUMNS) + " |",
        "|---|---|" + "---|" * len(HEADLINE_COLUMNS),
    ]
    for policy, budget in settings:
        values = [
            cells[(b, f, policy, budget)].cell(d) if (b, f, policy, budget) in cells else "–"
            for b, f, _, d in HEADLINE_COLUMNS
        ]
        name = "**full (reference)**" if policy == "full" else policy
        lines.append(f"| {name} | {budget if budget != '' else 'all'} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def planned_rows(grid: Grid, policies: list[str]) -> dict[str, int]:
    """Rows a complete run of ``grid`` writes per benchmark (full once per example + evicting policies x budgets)."""
    per_example = 1 + len([p for p in policies if p != "full"]) * len(grid.budgets)
    return {
        "perplexity": per_example * len(grid.text_lengths) * grid.text_samples,
        "niah": per_example * len(grid.niah_lengths) * len(grid.niah_depths) * grid.niah_samples,
        "ruler": per_example * len(grid.ruler_lengths) * len(grid.ruler_tasks) * grid.ruler_samples,
    }


def _headline(summaries: dict) -> list[str]:
    """Plain-language lines: for every benchmark metric, which CAOTE comparisons helped or hurt."""
    lines = []
    for name, pieces in summaries.items():
        records = pieces["comparison_records"]
        for metric in dict.fromkeys(r["metric"] for r in records):
            chosen = [r for r in records if r["metric"] == metric]
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


def write_results_md(path: Path, grid: Grid, config, summaries: dict, rows: dict, seconds: dict, planned: dict) -> None:
    import subprocess

    command = "caote eval report --quick" if grid.name == "quick" else "caote eval report"
    counts = {name: len(value) for name, value in rows.items()}
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=path.parent, timeout=10
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        commit = "unknown"
    missing = {name: planned[name] - counts.get(name, 0) for name in planned if counts.get(name, 0) < planned[name]}
    full_ppl = [r["ppl_full"] for r in rows.get("perplexity", []) if r["policy"] == "full"]
    lines = [
        "# Results: what eviction costs on the bundled SmolLM2-135M-Instruct",
        "",
        f"Regenerate with `{command}` (grid `{grid.name}`, model `{config.model}`, essay split `{config.split}`, "
        f"seed {config.seed}, code at commit `{commit}`). Wall time summed over rows (over all processes): "
        + ", ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items())
        + ". "
        "Rows are kept under `docs/results/runs/` and a rerun resumes from them (delete the folder to recompute).",
        "",
        (
            "**Incomplete run:** "
            + ", ".join(f"{name} is missing {count} of {planned[name]} rows" for name, count in missing.items())
            + "; the tables show the rows that exist."
        )
        if missing
        else f"All planned rows present ({', '.join(f'{k}: {v}' for k, v in counts.items())}).",
        "",
        "## Setup",
        "",
        f"- Policies: {', '.join(policy_order(config.policies))}; budgets {', '.join(map(str, grid.budgets))} tokens "
        "per layer and KV head; prompts consumed in blocks of 128 with eviction after every block, greedy decoding.",
        f"- NIAH: passkey in repetitive filler, context {', '.join(map(str, grid.niah_lengths))} tokens × depths "
        f"{', '.join(f'{d:g}%' for d in grid.niah_depths)} × {grid.niah_samples} sample(s); substring match "
        f"({counts.get('niah', 0)} rows).",
        f"- RULER-style: {', '.join(grid.ruler_tasks)} at {', '.join(map(str, grid.ruler_lengths))} tokens × "
        f"{grid.ruler_samples} sample(s); string_match_all ({counts.get('ruler', 0)} rows).",
        f"- Perplexity / KL / fidelity: {grid.text_samples} Paul Graham essay excerpts (test split) of "
        f"{', '.join(map(str, grid.text_lengths))} tokens, each policy in lockstep with the full cache "
        f"({counts.get('perplexity', 0)} rows). Full-cache PPL per text: "
        + ", ".join(f"{p:.2f}" for p in full_ppl)
        + ".",
        f"- {INTERVAL_NOTE}",
        "",
        "## Headline: every policy × budget (mean [95 % CI]; full cache first)",
        "",
        "NIAH and RULER: higher is better (one or two examples per cell in the quick grid: the intervals are wide). "
        "PPL − full, KL (nats per token, from the full cache's next-token distribution) and attention-output error "
        "(‖O − O_full‖/‖O_full‖, mean over layers): lower is better, over the essay texts.",
        "",
        headline_table(summaries),
        "",
        "## Where CAOTE helps and where it does not",
        "",
        "A comparison counts only when the 95 % paired interval of (variant − plain base) excludes zero.",
        "",
        *_headline(summaries),
        "",
        "CONCLUSIONS_PLACEHOLDER",
        "",
    ]
    titles = {
        "niah": "Needle in a haystack",
        "ruler": "RULER-style tasks",
        "perplexity": "Perplexity, KL from the full cache, attention-output fidelity",
    }
    for name, pieces in summaries.items():
        lines += [f"## {titles.get(name, name)}", "", render_pieces(name, pieces, relative_to=path.parent), ""]
    text = "\n".join(lines)
    conclusions = path.parent / "results" / f"{grid.name}_conclusions.md"
    text = text.replace(
        "CONCLUSIONS_PLACEHOLDER", conclusions.read_text(encoding="utf-8").strip() if conclusions.is_file() else ""
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
