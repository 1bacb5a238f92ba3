"""One-call generation under a bounded KV budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from caote.cache import DEFAULT_BLOCK_SIZE, CacheStats, EvictionCache


@dataclass
class GenerationResult:
    """The decoded answer, its token ids and what the cache held."""

    text: str
    token_ids: list[int]
    stats: CacheStats


def encode_prompt(tokenizer, prompt_or_messages) -> torch.Tensor:
    """``(1, T)`` input ids: a string is tokenised as is; a list of chat messages goes through the chat template."""
    if isinstance(prompt_or_messages, str):
        if not prompt_or_messages.strip():
            raise ValueError("the prompt is empty")
        return tokenizer(prompt_or_messages, return_tensors="pt").input_ids
    if not prompt_or_messages:
        raise ValueError("the message list is empty")
    ids = tokenizer.apply_chat_template(prompt_or_messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    return ids


def generate(model, tokenizer, prompt_or_messages, budget: int = 512, policy: str = "tova+caote",
             max_new_tokens: int = 64, block_size: int = DEFAULT_BLOCK_SIZE, return_stats: bool = False,
             streamer=None, **cache_and_generate_kwargs):
    """Answer ``prompt_or_messages`` with ``model`` while every layer keeps at most ``budget`` KV tokens.

    The prompt is consumed in blocks of ``block_size`` tokens (evicting after each) and every decoded token evicts
    one. Extra keyword arguments go to `EvictionCache` (``sink_tokens``, ``recent_window``, ``gqa``, ``seed``) or
    else to ``model.generate`` (``do_sample``, ``temperature``, ...). Returns the text, or a `GenerationResult`
    with ``return_stats=True``.
    """
    cache_keys = ("sink_tokens", "recent_window", "gqa", "seed")
    cache_kwargs = {key: cache_and_generate_kwargs.pop(key) for key in cache_keys if key in cache_and_generate_kwargs}
    input_ids = encode_prompt(tokenizer, prompt_or_messages).to(model.device)
    cache = EvictionCache(model, budget=budget, policy=policy, block_size=block_size, **cache_kwargs)
    cache_and_generate_kwargs.setdefault("do_sample", False)
    if not cache_and_generate_kwargs["do_sample"]:
        cache_and_generate_kwargs.update(temperature=None, top_p=None, top_k=None)
    with torch.no_grad():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            past_key_values=cache,
            prefill_chunk_size=block_size,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            streamer=streamer,
            **cache_and_generate_kwargs,
        )
    new_ids = output[0, input_ids.shape[1]:].tolist()
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    return GenerationResult(text, new_ids, cache.stats()) if return_stats else text
