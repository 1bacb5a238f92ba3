"""The speed issue's accelerator check in one run: a random-weight model with the shapes of Llama-3.1-8B in bf16
(no weights need to travel), a long random prompt, a bounded `EvictionCache` against `DynamicCache`.

Measured per configuration: prefill wall time, the accelerator's peak memory over the weights during the prefill
(``max_memory_allocated`` after a reset; not measured on a CPU), the KV bytes at their peak during the prefill, and
decoding tokens/s. Configurations:

* ``full-sdpa``: `DynamicCache`, the whole prompt in one forward; then decoding over the full context;
* ``full-blocks@B``: `DynamicCache`, the prompt in blocks of ``B`` tokens;
* ``full@b``: `DynamicCache` holding the prompt's last ``budget`` tokens (decoding only: the physical reference);
* ``<policy>@B``: `EvictionCache(budget)` fed in blocks of ``B``; then decoding.

Random weights make every prediction meaningless and every timing real: the shapes, dtype and kernels are those of
the real model. ``python benchmarks/gpu_check.py`` runs it (see docs/performance.md, "GPU").
"""

from __future__ import annotations

import contextlib
import json
import platform
import time
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from caote.benchmark.config import FULL_AT_BUDGET, FULL_BLOCKS, FULL_SDPA
from caote.benchmark.memory import cache_bytes
from caote.benchmark.sample import configuration_cache
from caote.cache import EvictionCache

# Llama-3.1-8B's config.json, as published (the weights are random here)
LLAMA_31_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=False,
)
# the same code path on a model small enough for a CPU test
TINY_SHAPES = dict(LLAMA_31_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def random_model(shapes: dict, device: str, dtype: torch.dtype, seed: int = 0):
    """A `LlamaForCausalLM` with ``shapes``, random weights drawn on ``device`` in ``dtype``, sdpa attention."""
    torch.manual_seed(seed)
    config = LlamaConfig(**shapes)
    with torch.device(device):  # drawn where it runs, in its dtype: 8B parameters never pass through float32
        model = LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _reset_peak(device: str) -> int:
    """Reset the accelerator's peak-memory counter (the allocator keeps its cached blocks: no fresh ``cudaMalloc``
    inside a timed region); the bytes allocated now (the baseline)."""
    if not device.startswith("cuda"):
        return 0
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak(device: str, baseline: int) -> int | None:
    return torch.cuda.max_memory_allocated() - baseline if device.startswith("cuda") else None


def measure(model, ids: torch.Tensor, configuration: str, budget: int, block: int | None, new_tokens: int) -> dict:
    """Prefill ``ids`` under one configuration, then decode ``new_tokens`` greedy tokens; times and memory."""
    device = str(ids.device)
    cache, ids, step = configuration_cache(model, configuration, ids, budget, block)
    baseline = _reset_peak(device)
    with torch.no_grad(), cache if isinstance(cache, EvictionCache) else contextlib.nullcontext():
        _synchronize(device)
        began = time.perf_counter()
        for start in range(0, ids.shape[1], step):
            output = model(input_ids=ids[:, start : start + step], cache=cache, use_cache=True, logits_to_keep=1)
        _synchronize(device)
        prefill_s = time.perf_counter() - began
        peak = _peak(device, baseline)
        kv_peak = cache.stats().peak_kv_bytes if isinstance(cache, EvictionCache) else cache_bytes(cache)
        token = output.logits[:, -1].argmax(-1, keepdim=True)
        began = time.perf_counter()
        for _ in range(new_tokens):
            output = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
            token = output.logits[:, -1].argmax(-1, keepdim=True)
        _synchronize(device)
        decode_s = time.perf_counter() - began
    return {
        "prefill_s": prefill_s,
        "peak_memory_over_weights_bytes": peak,
        "kv_peak_bytes": kv_peak,
        "decode_tokens_per_s": new_tokens / decode_s if new_tokens else None,
    }


def configurations(policies, blocks) -> list[tuple[str, int | None]]:
    """(name, block) of every configuration, in the order they run: the references, then per block size, largest
    (fastest) first, the chunked full cache and every policy, so that a run cut short has every policy at one block
    size."""
    runs = [(FULL_SDPA, None), (FULL_AT_BUDGET, None)]
    for block in sorted(blocks, reverse=True):
        runs += [(FULL_BLOCKS, block)] + [(policy, block) for policy in policies]
    return runs


def gpu_check(
    model, prompt_tokens: int, budget: int, blocks, policies, new_tokens: int, device: str, save=None
) -> dict:
    """Every configuration once, on one random prompt, after a warm-up of each kind of forward on a short one;
    results keyed ``name`` or ``name@block``. A configuration that raises is recorded as ``{"error": ...}`` and the
    run goes on; ``save(results)`` is called after each configuration (a run cut short keeps what it measured)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), generator=generator).to(device)
    short = ids[:, : min(prompt_tokens, budget + 2 * max(blocks))]
    for name, block in [(FULL_SDPA, None), (FULL_BLOCKS, max(blocks)), (policies[0], max(blocks))]:
        with contextlib.suppress(Exception):  # a configuration that fails here fails again below, and is recorded
            measure(model, short, name, budget, block, 2)  # kernels, masks, the hook, the allocator's first blocks
    results = {}
    for name, block in tqdm(configurations(policies, blocks), desc="gpu check", unit="config"):
        key = name if block is None else f"{name}@{block}"
        try:
            results[key] = measure(model, ids, name, budget, block, 0 if name == FULL_BLOCKS else new_tokens)
        except Exception as error:  # one failing configuration must not cost the others (OOM, a kernel missing)
            results[key] = {"error": f"{type(error).__name__}: {error}"}
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        if save is not None:
            save(results)
    return results


def summary_lines(results: dict, meta: dict) -> list[str]:
    """Markdown: one row per configuration, with decoding vs ``full@b`` and prefill vs ``full-sdpa``."""
    reference_decode = results.get(FULL_AT_BUDGET, {}).get("decode_tokens_per_s")  # absent: partial or failed
    reference_prefill = results.get(FULL_SDPA, {}).get("prefill_s")
    lines = [
        f"# Accelerator check: {meta['model']}, prompt {meta['prompt_tokens']} tokens, budget {meta['budget']}",
        "",
        f"- {meta['device_name']}; torch {meta['torch']}, transformers {meta['transformers']}; {meta['started']}",
        f"- {meta['new_tokens']} decoded tokens per configuration; memory and KV peaks are those of the prefill "
        f"(for full@b, of its {meta['budget']}-token prompt); memory is the allocator's peak over the weights",
        "",
        "| configuration | prefill s | vs full-sdpa | prefill memory peak over weights | prefill KV peak | "
        "decode tok/s | vs full@b |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, entry in results.items():
        if "error" in entry:
            lines.append(f"| {key} | failed: {entry['error'][:200]} | | | | | |")
            continue
        prefill = "-" if key == FULL_AT_BUDGET else f"{entry['prefill_s']:.2f}"
        relative = entry["prefill_s"] / reference_prefill if reference_prefill else None
        ratio = "-" if key == FULL_AT_BUDGET or relative is None else f"{relative:.2f}x"
        peak = entry["peak_memory_over_weights_bytes"]
        peak = "-" if peak is None else f"{peak / 2**30:.2f} GiB"
        decode = entry["decode_tokens_per_s"]
        speed = "-" if decode is None else f"{decode:.1f}"
        versus = "-" if decode is None or not reference_decode else f"{decode / reference_decode:.2f}x"
        kv = f"{entry['kv_peak_bytes'] / 2**20:.1f} MiB"
        lines.append(f"| {key} | {prefill} | {ratio} | {peak} | {kv} | {speed} | {versus} |")
    return lines


def write_check(results: dict, meta: dict, out: Path) -> Path:
    """gpu_check.json and gpu_check.md under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    path = out / "gpu_check.md"
    path.write_text("\n".join(summary_lines(results, meta)) + "\n")
    return path


def run_meta(model_name: str, device: str, prompt_tokens: int, budget: int, new_tokens: int) -> dict:
    name = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or platform.machine()
    return {
        "model": model_name,
        "device_name": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "prompt_tokens": prompt_tokens,
        "budget": budget,
        "new_tokens": new_tokens,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
