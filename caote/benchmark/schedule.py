"""The run: every configuration at every context, round-robin per repeat, into one results document
(``meta`` + ``samples`` + ``summary``), rewritten to results.json after every sample."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import transformers

from caote.arguments import warn_if_threads_share_cores
from caote.benchmark.config import (
    DECODE_ROUNDS_UP_TO,
    DECODE_WARM_UP,
    DEFAULT_POLICIES,
    FULL_AT_BUDGET,
    BenchConfig,
    validate_config,
)
from caote.benchmark.document import write_documents
from caote.benchmark.inputs import allow_positions, prompt_ids
from caote.benchmark.memory import load_average, weight_bytes
from caote.benchmark.operators import operator_counts
from caote.benchmark.paired import interleaved_decode
from caote.benchmark.sample import model_for, run_isolated, run_sample
from caote.benchmark.stats import summarise
from caote.predictor import Predictor


def run_benchmark(config: BenchConfig, out_dir: str | Path | None = None, log=print) -> dict:
    """Measure every configuration at every context (round-robin per repeat) and return the results document.

    With ``out_dir`` the JSON is rewritten after every sample (a partial run is never lost) and the Markdown
    summary (and the plot, when matplotlib is installed) are written at the end."""
    validate_config(config)
    threads = torch.get_num_threads()
    try:
        return _run(config, out_dir, log)
    finally:
        torch.set_num_threads(threads)


def _served_by_predictors(config: BenchConfig, model, log) -> BenchConfig:
    """``config`` as ``model`` can run it: the default run leaves out the learned policy (said in one line) when the
    model ships no predictor; a learned policy named with ``--policies`` is then refused in one line, before any
    sample."""
    learned = [name for name in config.policies if config.settings(name).policy.reads_predictor]
    if not learned or Predictor.shipped_for(model) is not None:
        return config
    if config.policies != DEFAULT_POLICIES:
        raise ValueError(f"{', '.join(learned)} needs a predictor, and none ships for {config.model!r}")
    log(f"{config.model} ships no predictor: the run leaves out {', '.join(learned)}")
    return dataclasses.replace(
        config,
        policies=tuple(name for name in config.policies if name not in learned),
        decode_policies=tuple(name for name in config.decode_policies if name not in learned),
    )


def _run(config: BenchConfig, out_dir, log) -> dict:
    torch.set_num_threads(config.threads)
    model, tokenizer = model_for(config.model, config.seed)
    config = _served_by_predictors(config, model, log)
    warn_if_threads_share_cores(config.threads)  # after every check, so that a refusal stays one line
    ids, source = prompt_ids(tokenizer, max(config.contexts), config.text, model.config.vocab_size, config.seed)
    position_limit = allow_positions(model, max(config.contexts) + config.new_tokens)
    configurations = config.configurations()
    document = {"meta": _meta(config, model, source, position_limit, configurations), "samples": []}
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    evicting = [context for context in sorted(config.contexts) if context > config.budget]  # every step evicts
    if config.new_tokens and config.decode_policies and evicting:
        prompt = ids[:, : evicting[0]]
        document["operators"] = operator_counts(model, prompt, config.decode_policies, config.budget, config.block_size)
        log(_operators_line(document["operators"]))
    _measure_samples(config, ids, configurations, document, out, log)
    decoded = [context for context in evicting if context <= DECODE_ROUNDS_UP_TO]
    if config.new_tokens and config.decode_policies and decoded and config.decode_rounds:
        _decode_rounds(config, model, ids, decoded, document, out, log)
    document["meta"]["load_average_end"] = load_average()
    document["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    document["summary"] = summarise(document)
    if out is not None:
        _write_json(document, out / "results.json")
        write_documents(document, out, log)
    return document


def _meta(config: BenchConfig, model, source: str, position_limit, configurations: list[str]) -> dict:
    """The run's ``meta``: the model's shape, the prompt, the configuration, the software, the machine and its load
    at the start."""
    return {
        "model": config.model,
        "model_type": model.config.model_type,
        "layers": model.config.num_hidden_layers,
        "query_heads": model.config.num_attention_heads,
        "kv_heads": model.config.num_key_value_heads,
        "head_dim": getattr(model.config, "head_dim", None)
        or model.config.hidden_size // model.config.num_attention_heads,
        "dtype": str(next(model.parameters()).dtype),
        "weight_bytes": weight_bytes(model),
        "prompt": source,
        "position_limit_raised": None
        if position_limit is None
        else f"from {position_limit} to {model.config.max_position_embeddings} (same weights; timing only, "
        f"predictions past {position_limit} tokens mean nothing)",
        "config": dataclasses.asdict(config),
        "configurations": configurations,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs visible, torch threads {config.threads}",
        "memory_method": (
            "VmHWM (peak resident set) read right after the prefill, "
            + (
                "in a fresh process per sample"
                if config.isolate
                else "after malloc_trim(0) and a VmHWM reset (/proc/self/clear_refs = 5) per sample"
            )
            + "; baseline VmRSS after loading and a 16-token warm-up"
        ),
        "load_average_start": load_average(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _measure_samples(
    config: BenchConfig, ids: torch.Tensor, configurations: list[str], document: dict, out: Path | None, log
) -> None:
    """Every configuration at every context, round-robin per repeat (the order rotated at each repeat), each sample
    appended to ``document["samples"]`` (and results.json rewritten) as soon as it is measured."""
    rounds = max(config.repeats_for(context) for context in config.contexts)
    with tempfile.TemporaryDirectory(prefix="caote-bench-") as workdir:
        ids_path = str(Path(workdir) / "ids.pt")
        torch.save(ids, ids_path)
        for repeat in range(rounds):
            for context in config.contexts:
                if repeat >= config.repeats_for(context):
                    continue
                shift = repeat % len(configurations)
                for configuration in configurations[shift:] + configurations[:shift]:
                    settings = _sample_settings(config, configuration)
                    load = load_average()
                    if config.isolate:
                        sample = run_isolated(configuration, context, ids_path, settings, workdir)
                    else:
                        sample = run_sample(configuration, ids[:, :context], settings)
                    sample.update(configuration=configuration, context=context, repeat=repeat, load_average=load)
                    document["samples"].append(sample)
                    log(_sample_line(sample))
                    if out is not None:
                        _write_json(document, out / "results.json")


def _sample_settings(config: BenchConfig, configuration: str) -> dict:
    """What one sample of ``configuration`` needs of the run's configuration (also passed to an isolated worker)."""
    return {
        "model": config.model,
        "seed": config.seed,
        "threads": config.threads,
        "budget": config.budget,
        "block_size": config.block_size,
        "new_tokens": config.new_tokens,
        "decode": config.decodes(configuration),
        "decode_eviction_interval": config.decode_eviction_interval,
    }


def _decode_rounds(
    config: BenchConfig, model, ids: torch.Tensor, decoded: list[int], document: dict, out: Path | None, log
) -> None:
    """``config.decode_rounds`` rounds of every decode policy's steps interleaved beside full@b at the ``decoded``
    contexts (`interleaved_decode`), into ``document["decode_rounds"]`` (results.json rewritten after each)."""
    document["decode_rounds"] = []
    for number in range(config.decode_rounds):
        started = load_average()
        ms = interleaved_decode(
            model,
            ids,
            decoded,
            [config.budget],
            [FULL_AT_BUDGET, *config.decode_policies],
            steps=config.new_tokens + DECODE_WARM_UP,
            timed=config.new_tokens,
            block=config.block_size,
            interval=config.decode_eviction_interval,
            progress=lambda cell, number=number: log(f"decode round {number + 1}: {cell}"),
        )
        document["decode_rounds"].append({"load_start": started, "load_end": load_average(), "ms": ms})
        if out is not None:
            _write_json(document, out / "results.json")


def _sample_line(sample: dict) -> str:
    line = (
        f"[{sample['context']:>6} r{sample['repeat']}] {sample['configuration']:<18} "
        f"prefill {sample['prefill_s']:7.2f} s  kv peak {sample['kv_peak_bytes'] / 2**20:8.1f} MiB  "
        f"rss peak {sample['peak_rss_bytes'] / 2**20:7.0f} MiB"
    )
    if "decode_tokens_per_s" in sample:
        line += f"  decode {sample['decode_tokens_per_s']:6.2f} tok/s"
    return line + f"  load {sample['load_average'][:1]}"


def _operators_line(operators: dict) -> str:
    counts = operators["counts"]
    extra = ", ".join(
        f"{name} {entry['extra_per_layer']:.1f}" for name, entry in counts.items() if name != FULL_AT_BUDGET
    )
    own = counts[FULL_AT_BUDGET]["per_layer"]
    return f"ATen operators an evicting layer adds to a decode step: {extra} (a full@b layer's own: {own:.1f})"


def _write_json(document: dict, path: Path) -> None:
    staging = path.with_suffix(".json.tmp")
    staging.write_text(json.dumps(document, indent=1))
    staging.replace(path)
