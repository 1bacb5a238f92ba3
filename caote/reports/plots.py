"""Plots of rows and summary records (matplotlib, written as PNG): metric versus budget for every metric, plus the
task-specific `FIGURES` a `caote.evaluation.tasks.Task` names."""

from __future__ import annotations

import math
from pathlib import Path

from caote.evaluation.reference import FULL
from caote.policies import is_auto, parse_policy
from caote.reports.tables import policy_order


def _pyplot():
    # optional dependency (the eval extra), and slow to import: loaded only when a plot is drawn
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
        axis.set_title(policy if policy == FULL else f"{policy} (b={budget})", fontsize=9)
        axis.set_xticks(range(len(lengths)), [str(x) for x in lengths], fontsize=7)
        axis.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths], fontsize=7)
        axis.set_xlabel("context tokens", fontsize=7)
        axis.set_ylabel("depth", fontsize=7)
    for index in range(len(policies), rows_count * columns):
        axes[index // columns][index % columns].axis("off")
    if image is not None:
        figure.colorbar(image, ax=axes, shrink=0.6, label="accuracy (higher is better)")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def plot_metric_vs_budget(records: list[dict], path: Path, ylabel: str, title: str) -> Path | None:
    """One line per policy (mean with its 95 % interval as error bars); the full cache as a dashed line, the oracle
    dashed with stars.

    Policies with equal values would draw on top of each other, so each line is shifted sideways by a small fixed
    fraction of a budget step (`_dodge`) and plain / +caote / +fastcaote get their own marker and line style; the
    legend sits outside the axes so it hides no error bar."""
    if not budgets_of(records):
        return None
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    _draw_metric_vs_budget(axis, records, ylabel, title)
    return _save_with_legend(plt, figure, axis, path)


def plot_panels_vs_budget(panels: list[tuple[str, list[dict]]], path: Path, ylabel: str) -> Path | None:
    """`plot_metric_vs_budget` side by side: one panel per ``(title, records)`` (e.g. per model and kind of text),
    one legend for all."""
    panels = [(title, records) for title, records in panels if budgets_of(records)]
    if not panels:
        return None
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    for axis, (title, records) in zip(axes[0], panels):
        _draw_metric_vs_budget(axis, records, ylabel, title)
        axis.grid(alpha=0.3)
    handles = {label: handle for axis in axes[0] for handle, label in zip(*axis.get_legend_handles_labels())}
    figure.legend(handles.values(), handles.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 0.95))
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def budgets_of(records: list[dict]) -> list[int]:
    return sorted({r["budget"] for r in records if r["budget"] != ""})


# one colour per base in every plot, `caote eval`'s and `caote bench`'s (its +caote / +fastcaote variants by line
# style and marker): `policy_colour`
BASE_COLOURS = {
    "streamingllm": "tab:gray",
    "h2o": "tab:blue",
    "tova": "tab:orange",
    "tova-layer": "goldenrod",
    "snapkv": "tab:green",
    "keydiff": "tab:pink",
    "knorm": "tab:olive",
    "random": "silver",
    "oracle": "black",
    # ours, beyond the paper: thick lines in colours no paper base uses
    "caote-window": "tab:purple",
    "caote-block": "tab:red",
    "caote-ahead": "tab:brown",
    "learned": "tab:cyan",
    "learned-block": "darkcyan",
}
FULL_COLOUR = "navy"  # the full cache (dotted, or in `caote bench` its three configurations by line style)
MARKERS = {"none": "o", "caote": "s", "fastcaote": "^"}  # plain / +caote / +fastcaote
# auto, a choice among the policies drawn (per model and budget): black and thick, with its own marker
AUTO_LINE = {"color": "black", "linestyle": "-", "linewidth": 2.2}


def policy_colour(policy: str) -> str:
    """``policy``'s colour in every plot: its base's (`BASE_COLOURS`), black for auto, `FULL_COLOUR` for the full
    cache."""
    if is_auto(policy):
        return AUTO_LINE["color"]
    parsed = parse_policy(policy)
    return BASE_COLOURS[parsed.base_name] if parsed.evicts else FULL_COLOUR


def policy_line(policy: str) -> dict:
    """How ``policy``'s line is drawn in every plot: `policy_colour`, plain / +caote / +fastcaote by marker and line
    style, ours thick, the oracle dashed with stars, auto black and thick."""
    if is_auto(policy):
        return {"label": policy, "marker": "D", "markersize": 4, **AUTO_LINE}
    parsed = parse_policy(policy)
    oracle = parsed.base.hindsight
    return {
        "label": "oracle (hindsight ceiling)" if oracle else policy,
        "color": policy_colour(policy),
        "marker": "*" if oracle else MARKERS[parsed.transform],
        "markersize": 7 if oracle else 4,
        "linestyle": "--" if oracle else _linestyle(parsed),
        "linewidth": 2.2 if parsed.base.about.paper_base else 1.2,  # ours, beyond the paper
    }


def _draw_metric_vs_budget(axis, records: list[dict], ylabel: str, title: str) -> None:
    budgets = budgets_of(records)
    drawn = [p for p in policy_order({r["policy"] for r in records}) if p != FULL]
    for policy in policy_order({r["policy"] for r in records}):
        chosen = sorted((r for r in records if r["policy"] == policy and r["budget"] != ""), key=lambda r: r["budget"])
        if policy == FULL:
            full = [r for r in records if r["policy"] == FULL]
            if full:
                axis.axhline(full[0]["mean"], color=policy_colour(FULL), linestyle=":", linewidth=1, label="full cache")
            continue
        if not chosen:
            continue
        x = [r["budget"] * _dodge(drawn.index(policy), len(drawn)) for r in chosen]
        y = [r["mean"] for r in chosen]
        error = [
            [max(0.0, r["mean"] - r["ci_low"]) for r in chosen],
            [max(0.0, r["ci_high"] - r["mean"]) for r in chosen],
        ]
        axis.errorbar(x, y, yerr=error, capsize=2, alpha=0.85, **policy_line(policy))
    axis.set_xscale("log", base=2)
    axis.set_xticks(budgets, [str(b) for b in budgets])
    axis.set_xlabel("KV budget (tokens per layer)")
    axis.set_ylabel(ylabel)
    axis.set_title(title, fontsize=10)


def _linestyle(policy) -> str:
    """A policy's line: solid when plain, dashed / dotted with CAOTE / FastCAOTE, dash-dotted with its own GQA
    aggregation (an ablation)."""
    return "-." if policy.gqa else {"none": "-", "caote": "--", "fastcaote": ":"}[policy.transform]


def _dodge(index: int, count: int, spread: float = 0.18) -> float:
    """Factor that shifts line ``index`` of ``count`` sideways on a log2 budget axis: the lines fan out over
    ``spread`` of one doubling, centred on the true budget (1.0 for a single line)."""
    if count <= 1:
        return 1.0
    return 2.0 ** (spread * (index / (count - 1) - 0.5))


def _save_with_legend(plt, figure, axis, path: Path) -> Path:
    """Legend (outside the axes, to the right, so it covers no data) and grid on ``axis``, then write ``figure`` to
    ``path`` (creating its folder) and free it."""
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    axis.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def plot_fidelity_layers(rows: list[dict], path: Path, budget: int) -> Path | None:
    """Relative attention-output error per layer at one budget, averaged over texts, one line per policy (drawn as in
    every plot: `policy_line`)."""
    chosen = [r for r in rows if r.get("budget") == budget and r.get("fidelity_layers")]
    if not chosen:
        return None
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7.5, 4))
    for policy in policy_order({r["policy"] for r in chosen}):
        layers = [r["fidelity_layers"] for r in chosen if r["policy"] == policy]
        mean = [sum(values) / len(values) for values in zip(*layers)]
        axis.plot(range(len(mean)), mean, **policy_line(policy))
    axis.set_xlabel("layer")
    axis.set_ylabel("||O_policy − O_full|| / ||O_full|| (lower is better)")
    axis.set_title(f"Attention-output relative error per layer, b={budget}", fontsize=10)
    return _save_with_legend(plt, figure, axis, path)


def _budgets(rows: list[dict]) -> list[int]:
    return sorted({row["budget"] for row in rows if row.get("budget") is not None})


def niah_heatmaps(rows: list[dict], out: Path, prefix: str = "") -> list[tuple[str, Path]]:
    """`plot_niah_heatmaps` at every budget: ``(caption, path)`` pairs."""
    figures = []
    for budget in _budgets(rows):
        path = plot_niah_heatmaps(rows, out / f"{prefix}niah_heatmap_b{budget}.png", budget)
        if path:
            figures.append((f"NIAH accuracy, context length × depth, b={budget}", path))
    return figures


def fidelity_layers(rows: list[dict], out: Path, prefix: str = "") -> list[tuple[str, Path]]:
    """`plot_fidelity_layers` at the smallest budget: ``(caption, path)`` pairs."""
    budgets = _budgets(rows)
    if not budgets:
        return []
    path = plot_fidelity_layers(rows, out / f"{prefix}fidelity_layers_b{budgets[0]}.png", budgets[0])
    return [(f"attention-output error per layer, b={budgets[0]}", path)] if path else []


# extra figures a task can ask for by name (`Task.figures`): (rows, out folder, file prefix) -> [(caption, path)]
FIGURES = {"niah_heatmaps": niah_heatmaps, "fidelity_layers": fidelity_layers}
