"""What reusing the learned policy's predictions between refreshes costs in quality at decode steps: KL from the full
cache, token by token, over a teacher-forced continuation decoded one token per forward (every step evicts one
token), for a few refresh intervals (`caote.learned.PREDICTION_REFRESH`) beside h2o+caote.

python benchmarks/decode_refresh.py --budgets 128,256 --refresh 1,8 --out benchmarks/results/decode_refresh.json

The grid's KL is measured over prompt blocks, where the learned policy always predicts afresh; this is the
decode-step counterpart. Texts: dev-split essays (the committed predictor was calibrated on dev code; no test text).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from tqdm import tqdm
from transformers import DynamicCache

import caote.learned
from caote.cache import EvictionCache
from caote.evaluation.data import essay_excerpts
from caote.models import load_model


def continuation_log_probs(model, ids: torch.Tensor, cache, prompt: int, block: int) -> torch.Tensor:
    """``(T, V)`` log-probabilities of the tokens after ``prompt``, the prompt read in blocks of ``block`` and the
    rest one token per forward."""
    rows = []
    with torch.no_grad():
        for start in range(0, prompt, block):
            model(input_ids=ids[:, start : min(start + block, prompt)], cache=cache, use_cache=True, logits_to_keep=1)
        for position in range(prompt, ids.shape[1]):
            logits = model(input_ids=ids[:, position : position + 1], cache=cache, use_cache=True).logits
            rows.append(torch.log_softmax(logits[0, -1].float(), -1))
    return torch.stack(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="128,256")
    parser.add_argument("--refresh", default="1,8", help="PREDICTION_REFRESH values of learned+caote")
    parser.add_argument("--texts", type=int, default=12)
    parser.add_argument("--prompt", type=int, default=768)
    parser.add_argument("--continuation", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2-135m")
    length = args.prompt + args.continuation
    texts = essay_excerpts(tokenizer, length, args.texts, "dev")
    configurations = [("h2o+caote", None)] + [("learned+caote", int(k)) for k in args.refresh.split(",")]
    results: dict[str, list[float]] = {}
    for name, text in tqdm(texts, desc="texts"):
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :length]
        full = continuation_log_probs(model, ids, DynamicCache(), args.prompt, 128)
        for budget in (int(b) for b in args.budgets.split(",")):
            for policy, refresh in configurations:
                if refresh is not None:
                    caote.learned.PREDICTION_REFRESH = refresh
                cache = EvictionCache(model, budget=budget, policy=policy, block_size=128)
                evicted = continuation_log_probs(model, ids, cache, args.prompt, 128)
                kl = (full.exp() * (full - evicted)).sum(-1).mean().item()
                key = f"{policy}{'' if refresh is None else f' refresh {refresh}'} @ {budget}"
                results.setdefault(key, []).append(kl)
    print("| configuration | mean KL per decoded token | vs refresh 1, paired mean (lower on) | texts |")
    print("|---|---|---|---|")
    for key, values in results.items():
        policy, _, budget = key.partition(" @ ")
        every = results.get(f"learned+caote refresh 1 @ {budget}")
        paired = "-"
        if policy.startswith("learned") and every is not None and values is not every:
            differences = [a - b for a, b in zip(values, every)]
            paired = f"{statistics.mean(differences):+.4f} ({sum(d < 0 for d in differences)} of {len(values)})"
        print(f"| {key} | {statistics.mean(values):.4f} | {paired} | {len(values)} |")
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"arguments": vars(args), "kl": results}, file, indent=1)


if __name__ == "__main__":
    main()
