"""Write the rows of one task: every example (or text) x policy x budget, resumable and sharded over processes.

Examples tasks: each example is answered greedily under the full cache (``budget`` None, the reference of every
cell) and under every evicting policy x budget, then scored by its answer metric. Texts tasks: each text runs once
through `caote.evaluation.lockstep`: one full-cache pass, then every pending policy x budget against it, each row
saved as it finishes. Rows go to `caote.evaluation.rows`.

Sharding: `accelerate.PartialState` gives ``process_index`` / ``num_processes``; examples are dealt round-robin
(example ``i`` goes to process ``i % num_processes``) and each process appends to its own shard. Rows do not depend
on the sharding (greedy decoding, one example at a time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from caote.arguments import warn_once_if_threads_share_cores
from caote.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_PREFILL
from caote.evaluation.config import EvalConfig
from caote.evaluation.data import prompt_text
from caote.evaluation.examples import PROTOCOLS, Example
from caote.evaluation.lockstep import cell_settings, lockstep_results, resolution
from caote.evaluation.metrics import score_example
from caote.evaluation.reference import FULL, with_reference
from caote.evaluation.registry import TASKS
from caote.evaluation.rows import RowStore, code_commit, row_key
from caote.evaluation.splits import check_disjoint
from caote.evaluation.tasks import Text
from caote.generation import announce_predictor, generate_ids
from caote.pipeline import CaoteTextGenerationPipeline
from caote.predictor import Predictor
from caote.settings import CacheSettings


def progress_bar(total: int, description: str, enabled: bool, rank: int):
    return tqdm(total=total, desc=description, disable=not enabled, position=rank, leave=True, dynamic_ncols=True)


def distributed_state():
    """``(state, rank, num_processes)`` from accelerate (a single process when not launched). Without a GPU the
    processes that ``torchrun`` (or ``accelerate launch`` on GPUs) started join a gloo group on the CPU."""
    # optional dependency (the models extra); importing it also costs seconds
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    return state, state.process_index, state.num_processes


def run_rows(config: EvalConfig, model, tokenizer, rank: int = 0, world: int = 1, bar=None) -> int:
    """The rows of ``config.benchmark`` for this process (no summary); returns the number written. ``bar``: an
    overall progress bar (rows), advanced once per row saved or found done, instead of the task's own bars."""
    task = TASKS[config.benchmark]
    if task.texts is not None:
        return run_texts(config, model, tokenizer, task.texts(config, tokenizer), rank, world, bar=bar)
    return run_examples(
        model,
        tokenizer,
        task.examples(config, tokenizer),
        config.policies,
        config.budgets,
        config.out,
        config.model,
        config.benchmark,
        rank,
        world,
        config.progress,
        config.block_size,
        extra={"seed": config.seed, "split": config.split},
        max_new_tokens=config.max_new_tokens,
        bar=bar,
        prefill=config.prefill,
    )


# -- examples tasks --------------------------------------------------------------------------------------------------


def prompt_ids(tokenizer, example: Example) -> torch.Tensor:
    """``(1, T)`` ids of `caote.evaluation.data.prompt_text`: the chat template with the assistant turn opened, then
    ``answer_prefix``; with ``meta["raw_prompt"]`` true the message contents as they are (no template)."""
    text = prompt_text(tokenizer, example.messages, example.answer_prefix, bool(example.meta.get("raw_prompt")))
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


def answer(model, tokenizer, input_ids: torch.Tensor, settings: CacheSettings, max_new_tokens: int) -> tuple[str, dict]:
    """Greedy answer under the cell's ``settings`` (its prefill mode included); returns the text and cache
    statistics."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    new_ids, stats = generate_ids(model, input_ids, settings, max_new_tokens, pad_token_id=pad)
    return tokenizer.decode(new_ids, skip_special_tokens=True), {
        "new_tokens": len(new_ids),
        "tokens_kept": stats.tokens_kept,
        "peak_kv_bytes": stats.peak_kv_bytes,
    }


def answer_after_context(pipe, example: Example, settings: CacheSettings, max_new_tokens: int) -> tuple[str, dict]:
    """Greedy answer under a question-after protocol: the context compressed first, then the question appended
    (uncompressed or within the budget, as `caote.evaluation.examples.PROTOCOLS` says), through the
    ``caote-text-generation`` pipeline ``pipe``."""
    output = pipe(
        example.context(),
        question=example.question,
        answer_prefix=example.answer_prefix,
        chat=False if example.meta.get("raw_prompt") else None,
        settings=settings,
        max_new_tokens=max_new_tokens,
        compress=PROTOCOLS[example.protocol],
        return_stats=True,
    )
    stats = output["stats"][-1]
    return output["answer"], {"tokens_kept": stats.tokens_kept, "peak_kv_bytes": stats.peak_kv_bytes}


def refuse_other_prefill(store: RowStore, out: Path, prefill: str) -> None:
    """Refuse a shard holding rows read with another prefill mode than ``prefill``: its summaries would average the
    two modes' rows of a cell."""
    modes = {row.get("prefill", DEFAULT_PREFILL) for row in store.rows.values()} - {prefill}
    if modes:
        raise ValueError(
            f"{out} holds rows read with prefill {', '.join(sorted(modes))}; write prefill {prefill}'s to another "
            "output folder"
        )


@dataclass
class ExampleRows:
    """The rows of one `run_examples` call: an example answered under one cell, with what every row shares (the
    model, the run's settings, the process and the commit)."""

    model: Any
    tokenizer: Any
    model_name: str
    benchmark: str
    block_size: int
    prefill: str
    rank: int
    num_processes: int
    extra: dict | None
    max_new_tokens: int | None
    commit: str = field(default_factory=code_commit)  # of the code computing the rows
    pipe: CaoteTextGenerationPipeline | None = None  # built on the first question-after example

    def answer(self, example: Example, input_ids: torch.Tensor, settings: CacheSettings, new_tokens: int):
        """``(prediction, stats)`` of ``example`` under ``settings``, by its protocol: the question in the prompt
        (`answer`) or after the compressed context (`answer_after_context`)."""
        if example.protocol == "in-prompt":
            return answer(self.model, self.tokenizer, input_ids, settings, new_tokens)
        self.pipe = self.pipe or CaoteTextGenerationPipeline(model=self.model, tokenizer=self.tokenizer)
        return answer_after_context(self.pipe, example, settings, new_tokens)

    def row(self, example: Example, policy: str, budget: int | None, settings: CacheSettings, input_ids, full_row):
        """The row of ``example`` under ``policy`` at ``budget`` (its ``settings``). When the budget is at least the
        prompt plus the answer, nothing can be evicted: the full cache's row ``full_row`` is reused (marked
        ``"evicted": false``) instead of recomputing the same greedy answer."""
        new_tokens = min(example.max_new_tokens, self.max_new_tokens or example.max_new_tokens)
        started = time.perf_counter()
        if budget is not None and full_row is not None and budget >= input_ids.shape[1] + new_tokens:
            prediction, stats, evicted = full_row["prediction"], {}, False
        else:
            prediction, stats = self.answer(example, input_ids, settings, new_tokens)
            evicted = budget is not None
        row = {
            "key": row_key(self.model_name, example.id, policy, budget),
            "benchmark": self.benchmark,
            "model": self.model_name,
            "example_id": example.id,
            "task": example.task,
            "protocol": example.protocol,
            "policy": policy,
            "budget": budget,
            "block_size": self.block_size,
            "prefill": self.prefill,
            "metric": example.metric,
            "prompt_tokens": int(input_ids.shape[1]),
            "max_new_tokens": new_tokens,
            "prediction": prediction,
            "answers": list(example.answers),
            "score": float(score_example(example, prediction)),
            "evicted": evicted,
            "meta": example.meta,
            "seconds": round(time.perf_counter() - started, 3),
            "rank": self.rank,
            "num_processes": self.num_processes,
            "commit": self.commit,
            **resolution(settings),
            **stats,
            **(self.extra or {}),
        }
        if full_row is not None:
            row["full_score"] = full_row["score"]
        elif policy == FULL:
            row["full_score"] = row["score"]
        return row


def run_examples(
    model,
    tokenizer,
    examples: list[Example],
    policies: list[str],
    budgets: list[int],
    out: Path,
    model_name: str,
    benchmark: str,
    rank: int = 0,
    num_processes: int = 1,
    progress: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    extra: dict | None = None,
    max_new_tokens: int | None = None,
    bar=None,
    prefill: str = DEFAULT_PREFILL,
) -> int:
    """Answer this process's share of ``examples`` under full + ``policies`` x ``budgets``; returns rows written.

    A budget that holds the prompt plus the answer reuses the full cache's row (`ExampleRows.row`).
    ``max_new_tokens`` caps every example's own answer length. ``bar`` (see `run_rows`) advances when a row is saved
    (or found done).
    """
    mine = examples[rank::num_processes]
    cells = [
        (policy, budget) for policy in with_reference(policies) for budget in ([None] if policy == FULL else budgets)
    ]
    settings_of = {cell: cell_settings(*cell, block_size, prefill=prefill).for_model(model) for cell in cells}
    announce_predictor(model, *settings_of.values())
    work = [(example, *cell) for example in mine for cell in cells]
    with RowStore(out, rank) as store:
        refuse_other_prefill(store, out, prefill)
        warn_once_if_threads_share_cores()  # the shard is ours: no refusal can follow the hint
        own_bar = bar is None
        if own_bar:
            bar = progress_bar(len(work), f"{benchmark} [{rank}]", progress, rank)
        written = 0
        rows = ExampleRows(
            model, tokenizer, model_name, benchmark, block_size, prefill, rank, num_processes, extra, max_new_tokens
        )
        ids_cache: dict[str, torch.Tensor] = {}
        for example, policy, budget in work:
            if row_key(model_name, example.id, policy, budget) in store:
                if own_bar:  # a bar handed in counts the stored rows in its start (`caote.evaluation.report.run_parts`)
                    bar.update(1)
                continue
            if example.id not in ids_cache:
                ids_cache = {example.id: prompt_ids(tokenizer, example)}
            full_row = store.get(row_key(model_name, example.id, FULL, None))
            store.append(
                rows.row(example, policy, budget, settings_of[policy, budget], ids_cache[example.id], full_row)
            )
            bar.update(1)  # after the row is saved: the bar never counts a row still running
            written += 1
        if own_bar:
            bar.close()
    return written


# -- texts tasks -----------------------------------------------------------------------------------------------------


def run_texts(config: EvalConfig, model, tokenizer, texts: list[Text], rank: int = 0, world: int = 1, bar=None) -> int:
    """Rows of a texts task for this process's share of ``texts``: one full-cache pass per text with a pending row,
    then every pending policy x budget against it, each row saved as soon as it is computed (a killed run keeps
    every finished row). ``bar`` (see `run_rows`) advances per row saved or found done."""
    mine = texts[rank::world]
    policies = with_reference(config.policies)
    predictor = None if config.predictor is None else str(config.predictor)
    runs = [(policies[0], None)] + [(policy, budget) for policy in policies[1:] for budget in config.budgets]
    cells = [cell_settings(*run, config.block_size, predictor).for_model(model) for run in runs]
    if any(settings.policy.reads_predictor for settings in cells):  # a learned policy, or auto's choice
        for budget in config.budgets:  # every predictor a budget reads was never calibrated on these texts
            check_disjoint(Predictor.for_model(model, predictor, budget), [text.id for text in texts], config.split)
    announce_predictor(model, *cells)  # after the checks: a refusal stays one line
    with RowStore(config.out, rank) as store:
        warn_once_if_threads_share_cores()  # the shard is ours: no refusal can follow the hint
        own_bar = bar is None
        if own_bar:
            bar = progress_bar(len(mine) * len(runs), f"{config.benchmark} [{rank}]", config.progress, rank)
        written = 0
        commit = code_commit()
        for text_id, length, text, unit in mine:
            pending = [run for run in runs if row_key(config.model, text_id, *run) not in store]
            if own_bar:  # as in `run_examples`
                bar.update(len(runs) - len(pending))
            if not pending:
                continue
            ids = tokenizer(text, return_tensors="pt").input_ids
            results = lockstep_results(
                model,
                ids,
                pending,
                block_size=config.block_size,
                fidelity=config.fidelity,
                predictor=predictor,
                scored_tail=config.scored_tail,
            )
            for result in results:
                store.append(
                    {
                        "key": row_key(config.model, text_id, result["policy"], result["budget"]),
                        "benchmark": config.benchmark,
                        "model": config.model,
                        "example_id": text_id,
                        "task": "code" if text_id.startswith("code-") else "essays",
                        "block_size": config.block_size,
                        "split": config.split,
                        "seed": config.seed,
                        "meta": {"length": length},
                        "unit": unit,
                        "predictor": None if predictor is None else Path(predictor).name,
                        "scored_tail": config.scored_tail,
                        "rank": rank,
                        "num_processes": world,
                        "commit": commit,
                        **result,
                    }
                )
                bar.update(1)  # after the row is saved
                written += 1
        if own_bar:
            bar.close()
    return written
