"""One sample: prefill (and optionally decode) one configuration at one context, measuring time and memory; in
this process, or in a fresh Python process (``isolate``) that runs `worker`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from caote.benchmark.config import FULL_AT_BUDGET, FULL_BLOCKS, FULL_SDPA, policy_settings
from caote.benchmark.inputs import allow_positions, load_benchmark_model
from caote.benchmark.memory import cache_bytes, peak_rss_bytes, reset_peak_rss, rss_bytes, weight_bytes
from caote.cache import EvictionCache

_MODELS: dict[tuple[str, int], tuple] = {}


def model_for(name: str, seed: int):
    """The benchmark model, loaded once per process (a new name or seed replaces it)."""
    key = (name, seed)
    if key not in _MODELS:
        _MODELS.clear()
        _MODELS[key] = load_benchmark_model(name, seed)
    return _MODELS[key]


def configuration_cache(model, configuration: str, ids, budget: int, block: int, decode_eviction_interval: int = 1):
    """The cache a configuration prefills, the prompt it reads and the tokens per forward: ``full-sdpa`` the whole
    prompt in one forward, ``full-blocks`` blocks of ``block``, ``full@b`` only the last ``budget`` tokens in one
    forward (`DynamicCache` all three), a policy an `EvictionCache` of ``budget`` fed in blocks of ``block``."""
    if configuration == FULL_AT_BUDGET:
        ids = ids[:, -budget:]
        return DynamicCache(), ids, ids.shape[1]
    if configuration == FULL_SDPA:
        return DynamicCache(), ids, ids.shape[1]
    if configuration == FULL_BLOCKS:
        return DynamicCache(), ids, block
    settings = policy_settings(configuration, budget, block, decode_eviction_interval)
    return EvictionCache(model, settings), ids, block


def run_sample(configuration: str, ids, settings: dict) -> dict:
    """Prefill ``ids`` under ``configuration`` (and decode when asked); returns one sample's measurements."""
    torch.set_num_threads(settings["threads"])
    model, _ = model_for(settings["model"], settings["seed"])
    block, budget = settings["block_size"], settings["budget"]
    context = ids.shape[1]
    allow_positions(model, context + settings["new_tokens"])
    with torch.no_grad():
        model(input_ids=ids[:, :16], use_cache=True, logits_to_keep=1)  # warm-up: kernels, thread pool, lazy init
    peak_reset = reset_peak_rss()
    baseline_rss = rss_bytes()

    interval = settings.get("decode_eviction_interval", 1)
    cache, ids, step = configuration_cache(model, configuration, ids, budget, block, interval)
    context = ids.shape[1]
    with torch.no_grad():
        start = time.perf_counter()
        for begin in range(0, context, step):
            output = model(input_ids=ids[:, begin : begin + step], cache=cache, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - start
    peak_rss = peak_rss_bytes()
    kv_now = cache_bytes(cache)
    kv_peak = cache.stats().peak_kv_bytes if isinstance(cache, EvictionCache) else kv_now
    sample = {
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": context / prefill_s,
        "kv_bytes_after_prefill": kv_now,
        "kv_peak_bytes": kv_peak,
        "baseline_rss_bytes": baseline_rss,
        "peak_rss_bytes": peak_rss,
        "prefill_rss_bytes": max(peak_rss - baseline_rss, 0),
        "peak_rss_reset": peak_reset,
    }
    new_tokens = settings["new_tokens"] if settings["decode"] else 0
    if new_tokens:
        token = output.logits[:, -1].argmax(-1, keepdim=True)
        kv_read = 0
        with torch.no_grad():
            start = time.perf_counter()
            for _ in range(new_tokens):
                kv_read += cache_bytes(cache)  # what this step's attention reads (before its own token is added)
                output = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
                token = output.logits[:, -1].argmax(-1, keepdim=True)
            decode_s = time.perf_counter() - start
        sample.update(
            decode_s=decode_s, decode_tokens_per_s=new_tokens / decode_s, decode_kv_bytes_per_token=kv_read / new_tokens
        )
    sample["weight_bytes"] = weight_bytes(model)
    return sample


def worker(spec_path: str) -> int:
    """Entry point of an isolated sample (``python -m caote.benchmark --worker SPEC``): read the spec, run it, print
    one JSON line."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["settings"]["threads"])
    ids = torch.load(spec["ids_path"])[:, : spec["context"]]
    sample = run_sample(spec["configuration"], ids, spec["settings"])
    print("CAOTE-BENCH-SAMPLE " + json.dumps(sample), flush=True)
    return 0


def run_isolated(configuration: str, context: int, ids_path: str, settings: dict, workdir: str) -> dict:
    spec = {"configuration": configuration, "context": context, "ids_path": ids_path, "settings": settings}
    spec_path = Path(workdir) / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": str(settings["threads"]), "MKL_NUM_THREADS": str(settings["threads"])}
    result = subprocess.run(
        [sys.executable, "-m", "caote.benchmark", "--worker", str(spec_path)], capture_output=True, text=True, env=env
    )
    for line in reversed(result.stdout.splitlines()):
        if line.startswith("CAOTE-BENCH-SAMPLE "):
            return json.loads(line.split(" ", 1)[1])
    tail = "\n".join((result.stderr or result.stdout).splitlines()[-15:])
    raise RuntimeError(f"benchmark sample {configuration} @ {context} failed (exit {result.returncode}):\n{tail}")
