"""The two ``caote eval`` runs: one task (`run_benchmark`: rows, then ``<out>/summary.md``) and the report grid
(`run_report`: every part of a grid, then docs/results.md). Both load the model, write this process's rows, wait for
every process and summarise on process 0.
"""

from __future__ import annotations

from pathlib import Path

import torch

from caote.evaluation.config import EvalConfig
from caote.evaluation.document import write_results_md
from caote.evaluation.grids import FULL_GRID, QUICK_GRID, part_configs, planned_rows
from caote.evaluation.rows import load_rows
from caote.evaluation.runner import distributed_state, run_rows
from caote.evaluation.summary import summarise_benchmark, summarise_rows
from caote.models import load_model


def _load(config: EvalConfig, state):
    device = None if state.device.type == "cpu" else str(state.device)
    return load_model(config.model, device=device)


def run_benchmark(config: EvalConfig) -> int:
    """Run ``config.benchmark`` (this process's shard), then summarise on process 0."""
    if config.threads:
        torch.set_num_threads(config.threads)
    state, rank, world = distributed_state()
    model, tokenizer = _load(config, state)
    run_rows(config, model, tokenizer, rank, world)
    state.wait_for_everyone()
    if rank == 0:
        summarise_benchmark(config)
    return 0


def run_report(config: EvalConfig) -> int:
    """Run the default grid (``--quick``: the small one) and write ``<docs>/results.md``; with ``summarise_only``
    rewrite it from the rows already under ``<docs>/results/runs/<grid>``."""
    grid = QUICK_GRID if config.quick else FULL_GRID
    if config.threads:
        torch.set_num_threads(config.threads)
    docs = Path(config.docs)
    results = docs / "results"
    configs = part_configs(grid, config, results / "runs" / grid.name)
    state, rank, world = distributed_state()
    if not config.summarise_only:
        model, tokenizer = _load(config, state)
        for part in configs.values():
            run_rows(part, model, tokenizer, rank, world)
    state.wait_for_everyone()
    if rank != 0:
        return 0
    rows = {name: load_rows(part.out) for name, part in configs.items()}
    summaries = {name: summarise_rows(rows[name], name, results, plot_prefix=f"{grid.name}_") for name in configs}
    # compute time actually spent on the rows (sum over rows and processes), not this call's wall time
    seconds = {name: sum(float(r.get("seconds") or 0) for r in value) for name, value in rows.items()}
    write_results_md(docs / "results.md", grid, config, configs, summaries, rows, seconds, planned_rows(configs))
    print(f"wrote {docs / 'results.md'}")
    return 0
