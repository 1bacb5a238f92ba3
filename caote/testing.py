"""Tiny random models built in-process (no hub access): the test suite's models and the benchmark's smoke model."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
}


def tiny_model(
    family: str = "llama", attn_implementation: str = "sdpa", seed: int = 0, sharpen: float = 4.0, **overrides
):
    """A random 2-layer model of ``family`` with GQA (4 query heads over 2 KV heads), in eval mode.

    ``sharpen`` scales every query projection: random initialisation gives near-uniform attention, under which
    eviction choices hardly matter (1 keeps the random weights as they are). ``overrides`` replace `TINY` fields."""
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_class(**{**TINY, **extra, **overrides})
    config._attn_implementation = attn_implementation
    model = model_class(config).eval()
    if sharpen != 1:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(sharpen)
    return model
