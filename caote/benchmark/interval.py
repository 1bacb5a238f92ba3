"""What ``decode_eviction_interval`` costs and buys: KL from the full cache of the predictions made while decoding
(text fed one token at a time after a block-wise prompt, so that decode-time eviction is what is measured; the
lockstep evaluation feeds blocks and never decodes) and decoding speed, against a full cache holding ``budget``
tokens (``full@b``), side by side in one run.

``python benchmarks/decode_interval.py`` writes ``benchmarks/results/decode_interval.{json,md}`` (one table per policy).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from caote.cache import EvictionCache
from caote.defaults import DEFAULT_BLOCK_SIZE
from caote.settings import CacheSettings


def decode_kl(model, input_ids: torch.Tensor, policy: str, budget: int, prompt_tokens: int, interval: int) -> dict:
    """Feed ``input_ids[:, :prompt_tokens]`` in blocks, then every later token alone; return the mean KL (nats per
    token) of those one-token steps' next-token distributions from the full cache's, and the steps per second."""
    with torch.no_grad():
        full = model(input_ids=input_ids).logits[0].float().log_softmax(-1)
        cache = EvictionCache(model, CacheSettings(budget=budget, policy=policy, decode_eviction_interval=interval))
        with cache:
            for start in range(0, prompt_tokens, DEFAULT_BLOCK_SIZE):
                stop = min(start + DEFAULT_BLOCK_SIZE, prompt_tokens)
                model(input_ids=input_ids[:, start:stop], cache=cache, use_cache=True, logits_to_keep=1)
            predictions = []
            began = time.perf_counter()
            for position in range(prompt_tokens, input_ids.shape[1]):
                logits = model(
                    input_ids=input_ids[:, position : position + 1], cache=cache, use_cache=True, logits_to_keep=1
                ).logits
                predictions.append(logits[0, -1])
            seconds = time.perf_counter() - began
    steps = input_ids.shape[1] - prompt_tokens
    log_probs = torch.stack(predictions).float().log_softmax(-1)
    reference = full[prompt_tokens:]
    kl = (reference.exp() * (reference - log_probs)).sum(-1).mean().item()
    return {"kl": kl, "tokens_per_s": steps / seconds}


def full_at_budget_speed(model, input_ids: torch.Tensor, budget: int, steps: int) -> float:
    """Decoding tokens per second of a `DynamicCache` that holds the prompt's last ``budget`` tokens."""
    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=input_ids[:, -budget:], cache=cache, use_cache=True, logits_to_keep=1)
        token = input_ids[:, -1:]
        began = time.perf_counter()
        for _ in range(steps):
            model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
        return steps / (time.perf_counter() - began)


def interval_study(
    model, texts: list[torch.Tensor], policy: str, budget: int, prompt_tokens: int, intervals, progress: bool = False
) -> dict:
    """Every interval on every text (one full@b speed per text and interval, measured right before it): per
    interval the mean KL, its increase over interval 1, and the median speed ratio to full@b."""
    samples = []
    with tqdm(total=len(texts) * len(intervals), desc=policy, unit="run", disable=not progress) as bar:
        for index, ids in enumerate(texts):
            steps = ids.shape[1] - prompt_tokens
            for interval in intervals:
                reference = full_at_budget_speed(model, ids[:, :prompt_tokens], budget, steps)
                result = decode_kl(model, ids, policy, budget, prompt_tokens, interval)
                sample = {"text": index, "interval": interval, **result, "full_at_budget_tokens_per_s": reference}
                samples.append(sample)
                bar.update()
    summary = {}
    for interval in intervals:
        mine = [s for s in samples if s["interval"] == interval]
        summary[interval] = {
            "kl": statistics.mean(s["kl"] for s in mine),
            "tokens_per_s": statistics.median(s["tokens_per_s"] for s in mine),
            "vs_full_at_budget": statistics.median(s["tokens_per_s"] / s["full_at_budget_tokens_per_s"] for s in mine),
        }
    return {"samples": samples, "summary": summary}


def write_study(studies: dict[str, dict], meta: dict, out: Path) -> Path:
    """decode_interval.json and decode_interval.md under ``out``: one `interval_study` per policy name."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_interval.json").write_text(json.dumps({"meta": meta, "policies": studies}, indent=1))
    lines = [
        f"# decode_eviction_interval: KL cost and decoding speed (budget {meta['budget']})",
        "",
        f"- {meta['texts']} texts of {meta['tokens']} tokens ({meta['split']} split essays): the first "
        f"{meta['prompt_tokens']} fed in blocks of {DEFAULT_BLOCK_SIZE}, the rest one token at a time (decode steps)",
        "- KL: nats per token of the decode steps' next-token distribution from one full-cache forward's",
        f"- speed: decode steps per second vs a full cache holding {meta['budget']} tokens (full@b), measured right "
        f"before each run; {meta['machine']}; run {meta['started']}, load average at start {meta['load']}",
    ]
    for policy, study in studies.items():
        first = study["summary"][min(study["summary"])]["kl"]
        lines += [
            "",
            f"## {policy}",
            "",
            "| interval | KL (mean) | KL vs interval 1 | decode tok/s (median) | vs full@b (median ratio) |",
            "|---|---|---|---|---|",
        ]
        for interval, entry in study["summary"].items():
            lines.append(
                f"| {interval} | {entry['kl']:.4f} | {entry['kl'] / first:.3f}x | {entry['tokens_per_s']:.2f} "
                f"| {entry['vs_full_at_budget']:.2f} |"
            )
    path = out / "decode_interval.md"
    path.write_text("\n".join(lines) + "\n")
    return path
