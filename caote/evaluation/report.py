"""The two ``caote eval`` runs: one task (`run_benchmark`: rows, then ``<out>/summary.md``) and a report grid
(`run_report`: every part of a grid, then results.md, a compact table and a plot's path). Both load the model, write
this process's rows, wait for every process and summarise on process 0. The one module of `caote.evaluation` that
imports `caote.reports`; ``caote eval`` imports it inside its command function (`caote.evaluation.cli.run`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from caote.arguments import check_loaded_predictor
from caote.evaluation.config import EvalConfig
from caote.evaluation.grids import GRIDS, Grid, part_configs, planned_rows
from caote.evaluation.registry import TASKS
from caote.evaluation.rows import load_rows
from caote.evaluation.runner import distributed_state, run_rows
from caote.models import load_model
from caote.reports.document import write_results_md
from caote.reports.glance import glance_table
from caote.reports.long_results import write_long_md
from caote.reports.summary import summarise_benchmark, summarise_rows

# the plot printed at the end of a report: KL from the full cache against the budget (every setting on the same
# texts, so the variants and their bases stay apart even on the try grid's one text, where NIAH has 2 examples a
# cell); the first plot when a grid has no texts task
PRINTED_PLOT = ("perplexity", "kl")


def _load(config: EvalConfig, state):
    device = None if state.device.type == "cpu" else str(state.device)
    return load_model(config.model, device=device)


def run_parts(configs: dict[str, EvalConfig], state, rank: int, world: int, progress: bool, description: str) -> None:
    """The rows of every part, in order, with one overall progress bar (rows saved / planned); each part's model is
    loaded when its first part starts (parts of one model are run together by the grids)."""
    planned = planned_rows(configs)
    done = sum(len(load_rows(part.out)) for part in configs.values()) if world == 1 else 0
    total = sum(planned.values()) if world == 1 and len(planned) == len(configs) else None
    bar = tqdm(
        total=total,
        initial=done,
        desc=description,
        unit="row",
        disable=not progress or rank != 0,
        dynamic_ncols=True,
        bar_format="{desc}: {n_fmt}/{total_fmt} {bar} [{elapsed} elapsed, {remaining} remaining]",
    )
    loaded, model, tokenizer = None, None, None
    for part in configs.values():
        if part.model != loaded:
            model = tokenizer = None  # the previous model's memory goes before the next one loads
            model, tokenizer = _load(part, state)
            loaded = part.model
        run_rows(part, model, tokenizer, rank, world, bar=bar)
    bar.close()


def run_benchmark(config: EvalConfig) -> int:
    """Run ``config.benchmark`` (this process's shard), then summarise on process 0."""
    if config.threads:
        torch.set_num_threads(config.threads)
    state, rank, world = distributed_state()
    model, tokenizer = _load(config, state)
    check_loaded_predictor(config.predictor, model)
    run_rows(config, model, tokenizer, rank, world)
    state.wait_for_everyone()
    if rank == 0:
        summarise_benchmark(config)
    return 0


def report_paths(config: EvalConfig, grid: Grid) -> tuple[Path, Path, Path]:
    """``(results.md, folder of tables and plots, folder of the rows)``: under ``config.out`` (a folder of the
    user's), or with ``config.docs`` the committed documents (``<docs>/results.md``, ``<docs>/results/``,
    ``<docs>/results/runs/<grid>``)."""
    if config.docs is not None:
        docs = Path(config.docs)
        document = docs / "results" / grid.own_document if grid.own_document else docs / "results.md"
        return document, docs / "results", docs / "results" / "runs" / grid.name
    out = Path(config.out)
    return out / "results.md", out, out / "runs"


def run_report(config: EvalConfig) -> int:
    """Run the grid ``config.grid`` with one overall progress bar (rows saved / planned), summarise it into
    results.md, tables and plots (under ``config.out``, or the committed documents with ``config.docs``), then print
    the compact table and a plot's path. With ``summarise_only``, only summarise the rows already there."""
    grid = GRIDS[config.grid]
    if config.threads:
        torch.set_num_threads(config.threads)
    document, results, runs = report_paths(config, grid)
    configs = part_configs(grid, config, runs)
    planned = planned_rows(configs)
    state, rank, world = distributed_state()
    if not config.summarise_only:
        run_parts(configs, state, rank, world, config.progress, f"{grid.name} grid, rows")
    state.wait_for_everyone()
    if rank != 0:
        return 0
    rows = {name: load_rows(part.out) for name, part in configs.items()}
    if grid.own_document:
        docs = Path(config.docs) if config.docs is not None else None
        write_long_md(document, grid, configs, rows, planned, results, docs)
        for key, part in configs.items():
            print(f"{key} ({part.model}, {part.benchmark}):")
            print(glance_table({"perplexity" if TASKS[part.benchmark].texts else "niah": rows[key]}))
        print(f"tables and plot: {document}")
        return 0
    prefix = f"{grid.name}_" if config.docs is not None else ""
    summaries = {name: summarise_rows(rows[name], name, results, plot_prefix=prefix) for name in configs}
    # compute time actually spent on the rows (sum over rows and processes), not this call's wall time
    seconds = {name: sum(float(r.get("seconds") or 0) for r in value) for name, value in rows.items()}
    write_results_md(document, grid, config, configs, summaries, rows, seconds, planned, runs=runs)
    print(glance_table(rows))
    plot = printed_plot(summaries)
    if plot:
        print(f"plot: {plot}")
    print(f"tables and plots: {document}")
    return 0


def printed_plot(summaries: dict[str, dict]) -> Path | None:
    """The `PRINTED_PLOT` of a report's summaries, else its first plot (None: no plot)."""
    task, metric = PRINTED_PLOT
    chosen = summaries.get(task, {}).get("metric_plots", {}).get(metric)
    plots = [path for summary in summaries.values() for _, path in summary.get("plots", [])]
    return chosen or next(iter(plots), None)
