"""Reading attention probabilities out of a Hugging Face model without changing its attention kernel.

The model keeps its own attention implementation (sdpa by default). Hooks on each attention module keep the output
of its query projection and, after the module ran, finish the queries the scores need (QK-norm where the model has
one, RoPE) and take their softmax against the cached keys. Under eager attention the probabilities the kernel
already produced are reused instead.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer; a clear error for unsupported architectures."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {model_type!r} ({type(model).__name__}) is not supported; "
            f"caote supports {', '.join(SUPPORTED_MODEL_TYPES)} (Llama, Mistral, Qwen2, Qwen3 classes)"
        )
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ValueError(
            f"{type(model).__name__} has non-full attention layers ({sorted(set(layer_types))}); "
            "caote evicts only in models whose every layer is full attention"
        )
    decoder = model.model if hasattr(model, "model") and hasattr(model.model, "layers") else model
    return [layer.self_attn for layer in decoder.layers]


def finish_queries(module: nn.Module, projected: torch.Tensor, position_embeddings) -> torch.Tensor:
    """Post-RoPE queries ``(B, H_q, R, d)`` from the query projection's output ``(B, R, H_q * d)``, exactly as the
    module builds them."""
    batch, rows, _ = projected.shape
    queries = projected.view(batch, rows, -1, module.head_dim)
    if hasattr(module, "q_norm"):  # Qwen3 QK-norm, applied per head before RoPE
        queries = module.q_norm(queries)
    queries = queries.transpose(1, 2)
    cos, sin = (table.unsqueeze(1) for table in position_embeddings)
    return queries * cos + rotate_half(queries) * sin


def attention_rows(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, real_slots: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax probabilities ``(B, H_q, R, N)`` (float32) of the ``R`` newest tokens' ``queries`` ``(B, H_q, R, d)``
    over ``keys`` ``(B, H_kv, N, d)``, whose last ``R`` slots are those same tokens (causal among them).
    ``real_slots`` ``(B, N)`` marks the slots that are not padding (None: no padding); rows that see nothing
    (padding queries) come out as zeros."""
    batch, heads, rows, dim = queries.shape
    kv_heads, tokens = keys.shape[1], keys.shape[2]
    grouped = queries.float().reshape(batch, kv_heads, heads // kv_heads * rows, dim)
    logits = torch.matmul(grouped, keys.float().transpose(-1, -2)).view(batch, heads, rows, tokens)
    logits.mul_(scaling)
    future = torch.ones(rows, rows, dtype=torch.bool, device=logits.device).triu_(1)
    logits[..., tokens - rows :].masked_fill_(future, float("-inf"))
    if real_slots is None:
        return torch.softmax(logits, dim=-1)
    logits.masked_fill_(~real_slots[:, None, None, :], float("-inf"))
    return torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
