"""Decoding speed of a few policies beside a full cache of the same size (full@b), in paired rounds, optionally
against another checkout of caote: each round runs one fresh process per checkout, side by side (one thread each),
so both see the same load; the ratios are medians over the rounds of per-round ratios.

python benchmarks/decode_paired.py                                   # this checkout: 2k/4k/8k x budgets 256/512
python benchmarks/decode_paired.py --against /tmp/before --rounds 3  # and an older checkout beside it
python benchmarks/decode_paired.py --report-from a.json b.json        # the table of rounds saved with --out

The prompt is the start of the test essays (the bundled model, blocks of 128); each configuration prefills it, then
the configurations decode ``--steps`` greedy tokens with their steps interleaved
(`caote.benchmark.paired.interleaved_decode`, as `caote bench`'s decode rounds), and the median of the last
``--timed`` step times is a configuration's ms per step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from caote.benchmark.config import FULL_AT_BUDGET

HERE = Path(__file__).resolve().parents[1]


def measure(contexts, budgets, policies, steps: int, timed: int) -> dict:
    """``{"<context>/<budget>/<configuration>": ms per decode step}`` in this process (one thread): the rounds of
    `caote.benchmark.paired.interleaved_decode` on the bundled model and the test essays. The function comes from
    this checkout's file, the caches from the caote the worker imports (an older checkout has no such module)."""
    import torch

    from caote.evaluation.data import essays
    from caote.models import load_model

    spec = importlib.util.spec_from_file_location("caote_paired", HERE / "caote" / "benchmark" / "paired.py")
    paired = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paired)
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m")
    ids = tokenizer("\n\n".join(essays("test")), return_tensors="pt").input_ids[:, : max(contexts)]
    return paired.interleaved_decode(model, ids, contexts, budgets, [FULL_AT_BUDGET, *policies], steps, timed)


def worker(tree: Path, arguments: list[str]) -> subprocess.Popen:
    """A fresh process measuring with the caote of ``tree``."""
    environment = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", *arguments]
    return subprocess.Popen(command, cwd=tree, env=environment, stdout=subprocess.PIPE, text=True)


def load() -> float:
    return os.getloadavg()[0]


def table(rounds: list[dict], contexts, budgets, policies) -> str:
    """The Markdown table of ``rounds``: per configuration the median ms per step and decode speed against full@b,
    and, when the rounds hold an ``against`` checkout, its ratio and the paired ms ratio this / against."""
    against = "against" in rounds[0]
    header = "| prompt | budget | policy | ms per step | decode vs full@b |"
    if against:
        header += " vs full@b, --against -> this | ms, this / --against |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for context in contexts:
        for budget in budgets:
            full = f"{context}/{budget}/{FULL_AT_BUDGET}"
            for policy in policies:
                key = f"{context}/{budget}/{policy}"
                ms = statistics.median(r["this"][key] for r in rounds)
                ratio = statistics.median(r["this"][full] / r["this"][key] for r in rounds)
                line = f"| {context} | {budget} | {policy} | {ms:.1f} | {ratio:.2f} |"
                if against:
                    before = statistics.median(r["against"][full] / r["against"][key] for r in rounds)
                    paired = statistics.median(r["this"][key] / r["against"][key] for r in rounds)
                    line += f" {before:.2f} -> {ratio:.2f} | {paired:.2f} |"
                lines.append(line)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="2048,4096,8192")
    parser.add_argument("--budgets", default="256,512")
    parser.add_argument("--policies", default="streamingllm,h2o+caote,tova+caote")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--timed", type=int, default=56)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another caote checkout, measured side by side")
    parser.add_argument("--out", type=Path, help="write every round's numbers here (JSON)")
    parser.add_argument("--report-from", type=Path, nargs="+", help="measure nothing: the table of saved rounds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    contexts = [int(value) for value in args.contexts.split(",")]
    budgets = [int(value) for value in args.budgets.split(",")]
    policies = args.policies.split(",")
    if args.worker:
        print(json.dumps(measure(contexts, budgets, policies, args.steps, args.timed)))
        return 0
    if args.report_from:
        print(
            table([r for path in args.report_from for r in json.loads(path.read_text())], contexts, budgets, policies)
        )
        return 0
    trees = {"this": HERE, **({"against": args.against.resolve()} if args.against else {})}
    passed = [f"--{name}={getattr(args, name)}" for name in ("contexts", "budgets", "policies", "steps", "timed")]
    rounds = []
    for number in range(args.rounds):
        started = load()
        running = {name: worker(tree, passed) for name, tree in trees.items()}
        measured = {name: json.loads(process.communicate()[0]) for name, process in running.items()}
        rounds.append({"load_start": started, "load_end": load(), **measured})
        print(f"round {number + 1}: load {started:.2f} -> {load():.2f}", file=sys.stderr, flush=True)
        if args.out:  # after every round, so that an interrupted run keeps its rounds
            args.out.write_text(json.dumps(rounds, indent=1))
    print(table(rounds, contexts, budgets, policies))
    return 0


if __name__ == "__main__":
    sys.exit(main())
