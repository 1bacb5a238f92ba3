"""Where the time of one prefill block and one decode step goes (torch.profiler), for a few policies and a full
cache of the same size; the summary is in docs/performance.md.

python benchmarks/profile_step.py                                   # streamingllm, tova+caote, h2o+caote, full@b
python benchmarks/profile_step.py --policies snapkv+caote --steps 16 --rows 15
"""

import argparse
import time

import torch
from transformers import DynamicCache

from caote.cache import EvictionCache
from caote.evaluation.data import essay_excerpts
from caote.models import load_model


def prefill(model, ids, policy: str, budget: int, block: int):
    """The prompt but its last block fed in blocks (full@b: the last ``budget`` tokens, in one forward); returns the
    cache and the start of the last block."""
    last = (ids.shape[1] - 1) // block * block
    if policy == "full@b":
        cache = DynamicCache()
        model(input_ids=ids[:, -budget:], cache=cache, use_cache=True, logits_to_keep=1)
        return cache, last
    cache = EvictionCache(model, budget=budget, policy=policy, block_size=block)
    for start in range(0, last, block):
        model(input_ids=ids[:, start : start + block], cache=cache, use_cache=True, logits_to_keep=1)
    return cache, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="streamingllm,tova+caote,h2o+caote,full@b")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32, help="decode steps profiled")
    parser.add_argument("--rows", type=int, default=12, help="operators listed per profile")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2-135m")
    text = essay_excerpts(tokenizer, args.context, 1, "dev")[0][1]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.context]
    for policy in args.policies.split(","):
        with torch.no_grad():
            cache, last = prefill(model, ids, policy, args.budget, args.block)
            if policy != "full@b":
                with torch.profiler.profile() as block_profile:
                    began = time.perf_counter()
                    model(input_ids=ids[:, last:], cache=cache, use_cache=True, logits_to_keep=1)
                    block_seconds = time.perf_counter() - began
                tokens, milliseconds = ids.shape[1] - last, block_seconds * 1e3
                print(f"\n## {policy}: the last prefill block ({tokens} tokens), {milliseconds:.0f} ms\n")
                print(block_profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
            token = ids[:, -1:]
            with torch.profiler.profile() as decode_profile:
                began = time.perf_counter()
                for _ in range(args.steps):
                    model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
                step_ms = (time.perf_counter() - began) / args.steps * 1e3
        operators = sum(e.count for e in decode_profile.key_averages() if e.key.startswith("aten::")) / args.steps
        print(f"\n## {policy}: decode, {step_ms:.1f} ms per step (profiled), {operators:.0f} aten ops per step\n")
        print(decode_profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
