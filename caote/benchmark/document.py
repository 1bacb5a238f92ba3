"""The run as documents: results.md (medians, ratios, growth with the context, targets), results.png and
growth.png, also from a partial results.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

from caote.benchmark.config import COMPILED, DECODE_WARM_UP, FULL_AT_BUDGET, FULL_BLOCKS, FULL_SDPA
from caote.benchmark.stats import summarise


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _num(value, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def markdown_report(document: dict) -> str:
    """The summary as Markdown: medians per context, ratios, targets met or not."""
    meta, summary = document["meta"], document.get("summary") or summarise(document)
    lines = _header_lines(meta)
    for context, rows in summary["ratios"].items():
        lines += _context_section(context, rows, summary["medians"], meta["configurations"])
    lines += _growth_section(summary.get("growth") or {})
    lines += _operators_section(document.get("operators"))
    rounds = document.get("decode_rounds")
    if rounds:
        lines += decode_rounds_section(rounds, summary, meta)
    lines += _targets_section(summary)
    return "\n".join(lines)


def _header_lines(meta: dict) -> list[str]:
    """The title and the run's setting: model, prompt, budget, machine, load, memory method, what "vs base" means."""
    config = meta["config"]
    return [
        f"# caote benchmark: {meta['model']}",
        "",
        f"- model: {meta['model_type']}, {meta['layers']} layers, {meta['query_heads']} query / {meta['kv_heads']} KV "
        f"heads, head_dim {meta['head_dim']}, {meta['dtype']}, weights {meta['weight_bytes'] / 1e9:.3f} GB",
        f"- prompt: {meta['prompt']}",
        *([f"- position limit raised {meta['position_limit_raised']}"] if meta.get("position_limit_raised") else []),
        f"- budget {config['budget']} tokens, block {config['block_size']}, {config['new_tokens']} decoded tokens, "
        f"repeats per context {config['repeats']} (round-robin over configurations; ratios are medians of "
        "same-round ratios)",
        f"- {meta['machine']}; torch {meta['torch']}, transformers {meta['transformers']}, python {meta['python']}",
        f"- load average (1/5/15 min) at start {meta['load_average_start']}, at end "
        f"{meta.get('load_average_end', '-')}; per sample in results.json",
        f"- memory: {meta['memory_method']}",
        "- vs base: prefill time of a +caote / +fastcaote policy over its plain base, of a policy beyond the paper "
        "over its paper base's +caote (caote-window: snapkv+caote; caote-block, caote-ahead: h2o+caote); decode vs "
        "full@b: decoding speed over a full cache holding the budget's tokens (from the interleaved decode rounds "
        "where they ran, below)",
        f"- run {meta['started']} .. {meta.get('finished', '(unfinished)')}",
        "",
    ]


def _context_section(context: str, rows: dict, medians: dict, configurations: list[str]) -> list[str]:
    """One context's table: each measured configuration's medians and its ratios to the references."""
    lines = [
        f"## Context {context} tokens",
        "",
        "| configuration | n | prefill s | vs full-sdpa | vs streamingllm | vs base | KV peak MiB | "
        "KV peak / full (bound) | RSS peak MiB | prefill RSS MiB | decode tok/s | decode vs full@b | "
        "decode speed-up (traffic bound) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in configurations:
        median = medians.get(name, {}).get(context)
        if median is not None:
            lines.append(_configuration_row(name, median, rows.get(name, {})))
    lines.append("")
    return lines


def _configuration_row(name: str, median: dict, ratio: dict) -> str:
    """A configuration's row of its context's table."""
    kv_ratio = (
        "-" if "kv_peak_vs_full" not in ratio else f"{ratio['kv_peak_vs_full']:.3f} ({ratio['kv_peak_bound']:.3f})"
    )
    speedup = (
        "-"
        if ratio.get("decode_speedup") is None
        else f"{ratio['decode_speedup']:.2f} ({ratio['decode_speedup_bound']:.2f})"
    )
    return (
        f"| {name} | {median['samples']} | {_num(median['prefill_s'])} "
        f"| {_num(ratio.get('prefill_vs_full_sdpa'))} "
        f"| {_num(ratio.get('time_vs_streamingllm'), 3)} | {_num(ratio.get('time_vs_base'), 3)} "
        f"| {_mib(median['kv_peak_bytes'])} | {kv_ratio} | {_mib(median['peak_rss_bytes'])} "
        f"| {_mib(median['prefill_rss_bytes'])} | {_num(median['decode_tokens_per_s'])} "
        f"| {_num(ratio.get('decode_vs_full_at_budget'))} | {speedup} |"
    )


def _growth_section(growth: dict) -> list[str]:
    """How the prefill time and peak RSS grow with the context (none when fewer than 3 contexts were measured)."""
    if not growth:
        return []
    lines = [
        "## How cost grows with the context",
        "",
        "Least-squares line of the median prefill time over the contexts (growth.png); marginal cost: seconds per "
        "extra token between the two largest contexts over those between the two smallest (1 = linear; a "
        "quadratic cost gives 4 over 2k, 4k, 8k, 16k).",
        "",
        "| configuration | contexts | prefill s per 1k tokens | r² | marginal cost last / first | "
        "peak RSS largest / smallest |",
        "|---|---|---|---|---|---|",
    ]
    for name, fit in growth.items():
        contexts = ", ".join(f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in fit["contexts"])
        lines.append(
            f"| {name} | {contexts} | {_num(fit['seconds_per_1k_tokens'])} | {_num(fit['r2'], 4)} "
            f"| {_num(fit['marginal_cost_ratio'])} | {_num(fit['peak_rss_ratio'])} |"
        )
    lines.append("")
    return lines


def _operators_section(operators: dict | None) -> list[str]:
    """The ATen operators a decode step adds per evicting layer, beside full@b (none when they were not counted)."""
    if not operators:
        return []
    counts = operators["counts"]
    lines = [
        "## Operators per decode step",
        "",
        f"ATen operators (views included, a `TorchDispatchMode`) of one decode step evicting one token after a "
        f"{operators['prompt_tokens']}-token prompt, beside full@b (whose layer runs "
        f"{counts[FULL_AT_BUDGET]['per_layer']:.0f}): what the step adds per evicting layer (over the "
        f"{operators['evicting_layers']} evicting layers, the work they share included), what one layer's "
        "attention adds (the median) and what the forward adds once (the shared positions, the eviction of a "
        "decode step's layers together). The count does not depend on the machine's load.",
        "",
        "| configuration | extra per evicting layer | in a layer | per forward |",
        "|---|---|---|---|",
    ]
    for name, entry in counts.items():
        if name != FULL_AT_BUDGET:
            in_layer = entry.get("extra_in_layer")  # not counted apart before layers were evicted together
            in_layer = "-" if in_layer is None else f"{in_layer:.1f}"
            lines.append(f"| {name} | {entry['extra_per_layer']:.1f} | {in_layer} | {entry['extra_per_forward']:.1f} |")
    lines.append("")
    return lines


def _targets_section(summary: dict) -> list[str]:
    """The targets, each with its value, limit and whether it was met."""
    lines = [
        f"## Targets: {summary['targets_met']} of {summary['targets_total']} met",
        "",
        "| target | value | limit | met |",
        "|---|---|---|---|",
    ]
    for target in summary["targets"]:
        value = _num(target["value"], 3)
        if "memory_traffic_bound" in target:
            value += f" (traffic bound {target['memory_traffic_bound']:.2f})"
        lines.append(
            f"| {target['target']} | {value} | {target['relation']} {target['limit']:.3g} "
            f"| {'yes' if target['met'] else '**no**'} |"
        )
    lines.append("")
    return lines


def _load(averages: list[float]) -> str:
    """The 1-minute load average, or "n/a" where the machine did not say (`memory.load_average`)."""
    return f"{averages[0]:.2f}" if averages else "n/a"


def decode_rounds_section(rounds: list[dict], summary: dict, meta: dict) -> list[str]:
    """The decode rounds (`caote.benchmark.paired`): each policy's decode speed over full@b per round, steps
    interleaved, and the median the targets read."""
    loads = ", ".join(f"{_load(r['load_start'])} -> {_load(r['load_end'])}" for r in rounds)
    lines = [
        "## Decoding beside full@b, steps interleaved",
        "",
        f"{len(rounds)} rounds; in each, every decode configuration prefills, then their "
        f"{meta['config']['new_tokens']} timed decode steps (after {DECODE_WARM_UP} untimed ones) are interleaved one "
        "step of each in turn, in an order rotated at every step, so that all see the same moment's machine; "
        "a configuration's ms per step is the median over windows of decode-interval steps of their mean (at interval "
        "1 the median step), the ratio full@b's ms over its own, per round "
        f"(load average at each round's start -> end: {loads}). The decode-vs-full@b targets read these medians.",
        "",
        "| context | policy | decode vs full@b (median) | per round |",
        "|---|---|---|---|",
    ]
    for context, rows in summary["ratios"].items():
        for name, ratio in rows.items():
            if ratio.get("decode_vs_full_at_budget_rounds"):
                each = ", ".join(f"{value:.2f}" for value in ratio["decode_vs_full_at_budget_rounds"])
                lines.append(f"| {context} | {name} | {ratio['decode_vs_full_at_budget']:.2f} | {each} |")
    return lines + [""]


def _pyplot():
    try:
        # optional dependency (the eval extra), and slow to import: loaded only when a plot is drawn
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "the benchmark plots need matplotlib: pip install matplotlib (JSON and Markdown are written without it)"
        ) from error
    return plt


# the full cache's three configurations, in its colour, told apart by line style and marker
FULL_LINES = {
    FULL_SDPA: {"linestyle": "--", "marker": "x"},
    FULL_BLOCKS: {"linestyle": "-.", "marker": "+"},
    FULL_AT_BUDGET: {"linestyle": ":", "marker": "v"},
}


def _line(name: str) -> dict:
    """How configuration ``name`` is drawn: a policy as in every plot (`policy_line`; compiled: hollow markers),
    the full cache in `FULL_COLOUR` with the line style and marker of its configuration."""
    # the evaluation's plot styles: caote.reports loads when a plot is drawn, not when the run imports this module
    from caote.reports.plots import FULL_COLOUR, policy_line

    if name in FULL_LINES:
        return {"label": name, "color": FULL_COLOUR, **FULL_LINES[name]}
    policy = name.removesuffix(COMPILED)
    return {**policy_line(policy), "label": name, **({"markerfacecolor": "none"} if policy != name else {})}


def plot(document: dict, path: str | Path) -> Path:
    """Prefill time, KV peak, process peak memory and decode speed versus context, one line per configuration."""
    plt = _pyplot()
    summary = document.get("summary") or summarise(document)
    panels = (
        ("prefill_s", "prefill wall time (s), lower is better", 1),
        ("kv_peak_bytes", "KV cache at peak (MiB), lower is better", 2**20),
        ("peak_rss_bytes", "process peak RSS (MiB), lower is better", 2**20),
        ("decode_tokens_per_s", "decode tokens/s, higher is better", 1),
    )
    figure, axes = plt.subplots(2, 2, figsize=(13, 9))
    for axis, (key, title, scale) in zip(axes.flat, panels):
        for name in document["meta"]["configurations"]:
            points = sorted(
                (int(c), m[key] / scale) for c, m in summary["medians"].get(name, {}).items() if m.get(key) is not None
            )
            if points:
                axis.plot(*zip(*points), **_line(name))
        axis.set_title(title)
        axis.set_xlabel("context (tokens)")
        axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7, ncol=2)
    config = document["meta"]["config"]
    figure.suptitle(
        f"{document['meta']['model']}: budget {config['budget']}, block {config['block_size']} "
        f"(medians; load avg start {document['meta']['load_average_start']})"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return Path(path)


def plot_growth(document: dict, path: str | Path) -> Path | None:
    """Prefill time and process peak RSS versus context on linear axes, with each configuration's fitted line:
    straight lines are linear cost, the full cache's bends upward. None when fewer than 3 contexts were measured."""
    summary = document.get("summary") or summarise(document)
    growth = summary.get("growth") or {}
    if not growth:
        return None
    plt = _pyplot()
    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(13, 5))
    for name, fit in growth.items():
        medians = summary["medians"][name]
        contexts = fit["contexts"]
        seconds = [medians[str(c)]["prefill_s"] for c in contexts]
        line = _line(name)
        time_axis.plot(contexts, seconds, **{**line, "linestyle": "none"})
        ends = [contexts[0], contexts[-1]]
        fitted = [fit["intercept_s"] + fit["seconds_per_1k_tokens"] * c / 1000 for c in ends]
        time_axis.plot(ends, fitted, color=line["color"], linestyle=line["linestyle"], linewidth=1)
        rss = [medians[str(c)].get("peak_rss_bytes") for c in contexts]
        if all(value is not None for value in rss):
            memory_axis.plot(contexts, [v / 2**20 for v in rss], **line)
    time_axis.set_title("prefill wall time (s), lower is better: points = medians, lines = least-squares fits")
    memory_axis.set_title("process peak RSS after the prefill (MiB), lower is better")
    for axis in (time_axis, memory_axis):
        axis.set_xlabel("context (tokens)")
        axis.grid(alpha=0.3)
    time_axis.legend(fontsize=7, ncol=2)
    memory_axis.set_ylim(bottom=0)
    config = document["meta"]["config"]
    figure.suptitle(
        f"{document['meta']['model']}: how cost grows (budget {config['budget']}, block {config['block_size']})"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return Path(path)


def report_from_json(path: str | Path, log=print) -> dict:
    """Rewrite results.md (and the plots) next to a results.json, also one left by an unfinished run."""
    path = Path(path)
    document = json.loads(path.read_text())
    document["summary"] = summarise(document)
    write_documents(document, path.parent, log)
    return document


def write_documents(document: dict, out: Path, log=print) -> None:
    """results.md and (when matplotlib is installed) results.png and growth.png under ``out``."""
    (out / "results.md").write_text(markdown_report(document))
    try:
        plot(document, out / "results.png")
        if plot_growth(document, out / "growth.png") is None:
            (out / "growth.png").unlink(missing_ok=True)  # fewer than 3 contexts: no growth to draw
    except ImportError as error:
        log(f"no plot: {error}")
