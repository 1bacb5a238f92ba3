"""Measure what ``decode_eviction_interval`` costs in KL and buys in decoding speed (see `caote.benchmark.interval`).

python benchmarks/decode_interval.py                      # the committed run -> benchmarks/results/decode_interval.md
python benchmarks/decode_interval.py --policies tova+caote --intervals 1,8 --texts 1
"""

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from caote.arguments import int_tuple
from caote.benchmark.interval import interval_study, write_study
from caote.benchmark.memory import load_average
from caote.evaluation.data import essay_excerpts
from caote.models import load_model
from caote.policies import expand_policies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="h2o+caote,tova+caote", help="comma-separated policies")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=640, help="text length in tokens (default 640)")
    parser.add_argument("--prompt-tokens", type=int, default=384, help="fed in blocks; the rest is decoded")
    parser.add_argument("--intervals", type=int_tuple, default=(1, 4, 8, 16, 32))
    parser.add_argument("--texts", type=int, default=3, help="dev-split essays (default 3)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2-135m")
    texts = [
        tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]
        for _, text in essay_excerpts(tokenizer, args.tokens, args.texts, "dev")
    ]
    meta = {
        "budget": args.budget,
        "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "texts": len(texts),
        "split": "dev",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {args.threads}",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load": load_average(),
    }
    studies = {
        policy: interval_study(model, texts, policy, args.budget, args.prompt_tokens, args.intervals, progress=True)
        for policy in expand_policies(args.policies)
    }
    print(write_study(studies, meta, Path(args.out)).read_text())


if __name__ == "__main__":
    main()
