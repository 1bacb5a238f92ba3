"""Run benchmarks over examples x policies x budgets: resumable JSONL rows, sharded over processes.

Rows: one JSON object per line in ``<out>/rows.<rank>.jsonl``, one per (model, example id, policy, budget). Each row
is written, flushed and fsynced before the next one starts, so a killed run loses at most the row in flight; a
rerun reads every shard, skips the keys already present and cuts a torn last line off its own shard before
appending. The full cache is run once per example (``budget`` null) and is the reference of every cell.

Sharding: `accelerate.PartialState` gives ``process_index`` / ``num_processes``; examples are dealt round-robin
(example ``i`` goes to process ``i % num_processes``), each process appends to its own shard, and after a barrier
process 0 summarises from all shards. Rows do not depend on the sharding (greedy decoding, one example at a time).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from caote.cache import DEFAULT_BLOCK_SIZE, DEFAULT_SINK_TOKENS, EvictionCache
from caote.evaluation.examples import Example
from caote.policies import expand_policies, parse_policy

FULL = "full"
# budget handed to the non-evicting cache: large enough never to matter
UNBOUNDED = 1 << 40
# fields that depend on the machine or the sharding, not on the computation (ignored when rows are compared)
VOLATILE_FIELDS = ("seconds", "rank", "num_processes", "finished_at")


@dataclass
class EvalConfig:
    """Everything a benchmark run needs; built from the command line by `config_from_args`."""

    benchmark: str
    model: str = "smollm2-135m"
    policies: list[str] = field(default_factory=lambda: expand_policies("paper"))
    budgets: list[int] = field(default_factory=lambda: [128, 256, 512])
    lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    samples: int | None = None
    seed: int = 0
    split: str = "test"
    out: Path = Path("results")
    data_dir: Path | None = None
    tasks: list[str] | None = None
    depths: list[float] | None = None
    quick: bool = False
    docs: Path = Path("docs")
    progress: bool = True
    block_size: int = DEFAULT_BLOCK_SIZE
    max_new_tokens: int | None = None
    threads: int | None = None
    summarise_only: bool = False


# -- argument parsing ------------------------------------------------------------------------------------------------


def _usage_error(message: str):
    from caote.cli import UsageError

    return UsageError(message)


def parse_int_list(option: str, text: str, minimum: int = 1) -> list[int]:
    """``"128,256"`` -> ``[128, 256]``; anything else raises a one-line usage error naming the option."""
    values = []
    for item in (part.strip() for part in str(text).split(",")):
        if not item:
            continue
        try:
            value = int(item)
        except ValueError:
            raise _usage_error(f"{option}: {item!r} is not an integer") from None
        if value < minimum:
            raise _usage_error(f"{option}: {value} is below the minimum {minimum}")
        if value not in values:
            values.append(value)
    if not values:
        raise _usage_error(f"{option}: no value given in {text!r}")
    return values


def check_budgets(policies: list[str], budgets: list[int]) -> None:
    """Every evicting policy must leave room to choose at every budget (budget > sinks + its recent window)."""
    for name in policies:
        policy = parse_policy(name)
        if not policy.evicts:
            continue
        for budget in budgets:
            window = policy.base.recent_window
            window = int(window * budget) if isinstance(window, float) else window
            if budget <= DEFAULT_SINK_TOKENS + window:
                raise _usage_error(
                    f"--budgets: {budget} is too small for {name} (it keeps {DEFAULT_SINK_TOKENS} "
                    f"sink + {window} recent tokens; use a budget above {DEFAULT_SINK_TOKENS + window})"
                )


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """Validate the ``caote eval`` arguments (one-line `UsageError` on anything wrong) into an `EvalConfig`."""
    from caote.evaluation.cli import BENCHMARKS, DEFAULT_BUDGETS, DEFAULT_LENGTHS, DEFAULT_POLICIES

    benchmark = str(args.benchmark).strip().lower()
    if benchmark not in BENCHMARKS:
        raise _usage_error(f"unknown benchmark {args.benchmark!r} (choose from {', '.join(BENCHMARKS)})")
    try:
        policies = expand_policies(args.policies or DEFAULT_POLICIES)
    except ValueError as error:
        raise _usage_error(f"--policies: {error}") from None
    budgets = parse_int_list("--budgets", args.budgets or DEFAULT_BUDGETS)
    check_budgets(policies, budgets)
    lengths = parse_int_list("--lengths", args.lengths or DEFAULT_LENGTHS, minimum=16)
    samples = None if args.samples is None else parse_int_list("--samples", args.samples)[0]
    try:
        seed = int(args.seed)
    except ValueError:
        raise _usage_error(f"--seed: {args.seed!r} is not an integer") from None
    if args.split not in ("dev", "test"):
        raise _usage_error(f"--split: {args.split!r} is not 'dev' or 'test'")
    data_dir = args.data_dir
    if benchmark == "longbench":
        if data_dir is None:
            raise _usage_error("longbench needs --data-dir: a folder of LongBench <task>.jsonl files")
        if not Path(data_dir).is_dir():
            raise _usage_error(f"--data-dir: {str(data_dir)!r} is not a folder")
    if args.quick and benchmark != "report":
        raise _usage_error("--quick applies to 'report' only")
    if getattr(args, "summarise_only", False) and benchmark != "report":
        raise _usage_error("--summarise-only applies to 'report' only")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    depths = None
    if getattr(args, "depths", None):
        try:
            depths = [float(d) for d in args.depths.split(",") if d.strip()]
        except ValueError:
            raise _usage_error(f"--depths: {args.depths!r} is not a comma list of numbers") from None
        if not depths or any(not 0 <= d <= 100 for d in depths):
            raise _usage_error(f"--depths: {args.depths!r} must be percentages in 0..100")
    max_new_tokens = None if args.max_new_tokens is None else parse_int_list("--max-new-tokens", args.max_new_tokens)[0]
    threads = None if args.threads is None else parse_int_list("--threads", args.threads)[0]
    out = Path(args.out) if args.out is not None else Path("results") / benchmark
    return EvalConfig(
        benchmark=benchmark,
        model=args.model,
        policies=policies,
        budgets=budgets,
        lengths=lengths,
        samples=samples,
        seed=seed,
        split=args.split,
        out=out,
        data_dir=data_dir,
        tasks=tasks,
        depths=depths,
        max_new_tokens=max_new_tokens,
        threads=threads,
        summarise_only=bool(getattr(args, "summarise_only", False)),
        quick=bool(args.quick),
        docs=Path(args.docs),
        progress=not args.no_progress,
    )


# -- resumable rows --------------------------------------------------------------------------------------------------


def row_key(model: str, example_id: str, policy: str, budget: int | None) -> str:
    return f"{model}\t{example_id}\t{policy}\t{FULL if budget is None else int(budget)}"


def read_rows(path: Path) -> list[dict]:
    """The rows of one shard; an undecodable line (a torn write) is skipped."""
    rows = []
    if not path.is_file():
        return rows
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def shard_paths(out: Path) -> list[Path]:
    return sorted(Path(out).glob("rows.*.jsonl"))


def load_rows(out: Path) -> list[dict]:
    """Every row of every shard under ``out``, once per key (the first written wins), in a stable order."""
    seen: dict[str, dict] = {}
    for path in shard_paths(out):
        for row in read_rows(path):
            seen.setdefault(row["key"], row)
    return [seen[key] for key in sorted(seen)]


def _cut_torn_tail(path: Path) -> None:
    """Drop a last line that was cut mid-write (no trailing newline) so that appends start on a fresh line."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as handle:
        data = handle.read()
        if data.endswith(b"\n"):
            return
        handle.truncate(data.rfind(b"\n") + 1)


class RowStore:
    """This process's shard plus the keys done by every shard; `append` is durable before it returns."""

    def __init__(self, out: Path, rank: int = 0):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / f"rows.{rank}.jsonl"
        _cut_torn_tail(self.path)
        self.rows: dict[str, dict] = {row["key"]: row for row in load_rows(self.out)}

    def __contains__(self, key: str) -> bool:
        return key in self.rows

    def get(self, key: str) -> dict | None:
        return self.rows.get(key)

    def append(self, row: dict) -> None:
        if row["key"] in self.rows:
            return
        line = json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n"
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
        self.rows[row["key"]] = row


# -- answering one example -------------------------------------------------------------------------------------------


def prompt_ids(tokenizer, example: Example) -> torch.Tensor:
    """``(1, T)`` ids of `caote.evaluation.data.prompt_text`: the chat template with the assistant turn opened, then
    ``answer_prefix``; with ``meta["raw_prompt"]`` true the message contents as they are (no template)."""
    from caote.evaluation.data import prompt_text

    text = prompt_text(tokenizer, example.messages, example.answer_prefix, bool(example.meta.get("raw_prompt")))
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


def answer(
    model,
    tokenizer,
    input_ids: torch.Tensor,
    policy: str,
    budget: int | None,
    max_new_tokens: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> tuple[str, dict]:
    """Greedy answer under ``policy`` at ``budget`` (block-wise prefill); returns the text and cache statistics."""
    cache = EvictionCache(model, budget=UNBOUNDED if budget is None else budget, policy=policy, block_size=block_size)
    input_ids = input_ids.to(model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            cache=cache,
            prefill_chunk_size=block_size,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
        )
    new_ids = output[0, input_ids.shape[1] :].tolist()
    stats = cache.stats()
    return tokenizer.decode(new_ids, skip_special_tokens=True), {
        "new_tokens": len(new_ids),
        "tokens_kept": stats.tokens_kept,
        "peak_kv_bytes": stats.peak_kv_bytes,
    }


def settings(policies: list[str]) -> list[str]:
    """The policies to run: ``full`` first (the reference), then the rest in the given order."""
    return [FULL] + [policy for policy in policies if policy != FULL]


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
) -> int:
    """Answer this process's share of ``examples`` under full + ``policies`` x ``budgets``; returns rows written.

    When a budget is at least the prompt plus the answer, nothing can be evicted: the full cache's row is reused
    (marked ``"evicted": false``) instead of recomputing the same greedy answer. ``max_new_tokens`` caps every
    example's own answer length.
    """
    from caote.evaluation.metrics import score_example

    store = RowStore(out, rank)
    mine = examples[rank::num_processes]
    work = [
        (example, policy, None if policy == FULL else budget)
        for example in mine
        for policy in settings(policies)
        for budget in ([None] if policy == FULL else budgets)
    ]
    bar = _progress(len(work), f"{benchmark} [{rank}]", progress, rank)
    written = 0
    ids_cache: dict[str, torch.Tensor] = {}
    for example, policy, budget in work:
        key = row_key(model_name, example.id, policy, budget)
        bar.update(1)
        if key in store:
            continue
        if example.id not in ids_cache:
            ids_cache = {example.id: prompt_ids(tokenizer, example)}
        input_ids = ids_cache[example.id]
        new_tokens = min(example.max_new_tokens, max_new_tokens or example.max_new_tokens)
        full_row = store.get(row_key(model_name, example.id, FULL, None))
        started = time.perf_counter()
        if budget is not None and full_row is not None and budget >= input_ids.shape[1] + new_tokens:
            prediction, stats, evicted = full_row["prediction"], {}, False
        else:
            prediction, stats = answer(model, tokenizer, input_ids, policy, budget, new_tokens, block_size)
            evicted = budget is not None
        row = {
            "key": key,
            "benchmark": benchmark,
            "model": model_name,
            "example_id": example.id,
            "task": example.task,
            "policy": policy,
            "budget": budget,
            "block_size": block_size,
            "metric": example.metric,
            "prompt_tokens": int(input_ids.shape[1]),
            "max_new_tokens": new_tokens,
            "prediction": prediction,
            "answers": list(example.answers),
            "score": float(score_example(example, prediction)),
            "evicted": evicted,
            "meta": example.meta,
            "seconds": round(time.perf_counter() - started, 3),
            "rank": rank,
            "num_processes": num_processes,
            **stats,
            **(extra or {}),
        }
        if full_row is not None:
            row["full_score"] = full_row["score"]
        elif policy == FULL:
            row["full_score"] = row["score"]
        store.append(row)
        written += 1
    bar.close()
    return written


def _progress(total: int, description: str, enabled: bool, rank: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, disable=not enabled, position=rank, leave=True, dynamic_ncols=True)


# -- benchmarks ------------------------------------------------------------------------------------------------------


def build_examples(config: EvalConfig, tokenizer) -> list[Example]:
    """The examples of a generation benchmark, from the task generators of `caote.evaluation`."""
    samples = config.samples or 1
    if config.benchmark == "niah":
        from caote.evaluation import niah

        depths = config.depths or (10, 50, 90)
        return niah.niah_examples(
            tokenizer,
            context_lengths=config.lengths,
            depths=depths,
            samples_per_cell=samples,
            seed=config.seed,
            split=config.split,
        )
    if config.benchmark == "ruler":
        from caote.evaluation import ruler

        tasks = config.tasks or tuple(ruler.RULER_TASKS)
        unknown = sorted(set(tasks) - set(ruler.RULER_TASKS))
        if unknown:
            raise _usage_error(f"--tasks: unknown RULER tasks {unknown} (choose from {', '.join(ruler.RULER_TASKS)})")
        return ruler.ruler_examples(
            tokenizer,
            tasks=tasks,
            context_lengths=config.lengths,
            samples=samples,
            seed=config.seed,
            split=config.split,
        )
    if config.benchmark == "longbench":
        from caote.evaluation import longbench

        function = getattr(longbench, "longbench_examples", None) or getattr(longbench, "examples")
        kwargs = {
            "data_dir": config.data_dir,
            "tasks": config.tasks,
            "samples": config.samples,
            "seed": config.seed,
            "max_length": max(config.lengths),
        }
        accepted = inspect.signature(function).parameters
        return function(tokenizer, **{k: v for k, v in kwargs.items() if k in accepted and v is not None})
    raise ValueError(f"{config.benchmark!r} is not a generation benchmark")


def distributed_state():
    """``(state, rank, num_processes)`` from accelerate (a single process when not launched). Without a GPU the
    processes that ``torchrun`` (or ``accelerate launch`` on GPUs) started join a gloo group on the CPU."""
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    return state, state.process_index, state.num_processes


def run_benchmark(config: EvalConfig) -> int:
    """Run ``config.benchmark`` (this process's shard), then summarise on process 0."""
    if config.threads:
        torch.set_num_threads(config.threads)
    if config.benchmark == "report":
        from caote.evaluation import report

        return report.run_report(config)
    from caote.models import load_model

    state, rank, world = distributed_state()
    device = None if state.device.type == "cpu" else str(state.device)
    model, tokenizer = load_model(config.model, device=device)
    run_rows(config, model, tokenizer, rank, world)
    state.wait_for_everyone()
    if rank == 0:
        from caote.evaluation import report

        report.summarise_benchmark(config)
    return 0


def run_rows(config: EvalConfig, model, tokenizer, rank: int = 0, world: int = 1) -> int:
    """The rows of one benchmark for this process (no summary)."""
    if config.benchmark in ("perplexity", "fidelity"):
        from caote.evaluation import perplexity

        return perplexity.run_texts(config, model, tokenizer, rank, world, fidelity=True, benchmark=config.benchmark)
    examples = build_examples(config, tokenizer)
    return run_examples(
        model,
        tokenizer,
        examples,
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
    )
