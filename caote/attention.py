"""Reading attention probabilities out of a Hugging Face model without changing its attention kernel.

The model keeps its own attention implementation (sdpa or eager). Hooks on each attention module keep the output
of its query projection and, after the module ran, finish the queries the scores need (QK-norm where the model has
one, RoPE) and take their float32 softmax against the cached keys.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Backends whose 4D mask the cache reads for padding; the probabilities are recomputed in float32 for both.
SUPPORTED_ATTENTION = ("sdpa", "eager")


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
    check_attention_implementation(model)
    decoder = model.model if hasattr(model, "model") and hasattr(model.model, "layers") else model
    return [layer.self_attn for layer in decoder.layers]


def check_attention_implementation(model: nn.Module) -> None:
    """Refuse attention backends whose masks the cache cannot read exactly (flash attention gets a 2D mask, flex
    attention a BlockMask), in one line naming the ones that work."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attention implementation {implementation!r} is not supported by caote; load the model with "
            f"attn_implementation={' or '.join(repr(name) for name in SUPPORTED_ATTENTION)}"
        )


def sliding_window(model: nn.Module) -> int | None:
    """The window of a model whose every layer slides (Mistral with ``sliding_window`` set), else None."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    return window if window is not None and not getattr(config, "layer_types", None) else None


class AttentionTap:
    """The hooks through which one cache sees a model's attention: after each attention module ran on a forward
    given that cache, ``cache.after_attention(module, kwargs, projected_queries)`` is called with the output of the
    module's query projection (kept instead of projecting again). Forwards given any other cache pass untouched.

    The hooks hold the cache weakly and are removed by `remove`, or when the cache is garbage-collected."""

    def __init__(self, modules: list[nn.Module], cache):
        self._cache = weakref.ref(cache)
        self._modules = modules
        self._queries: dict[nn.Module, torch.Tensor] = {}
        self._armed: set[nn.Module] = set()
        self._handles = []
        for module in modules:
            self._handles += [
                module.register_forward_pre_hook(self._before, with_kwargs=True),
                module.q_proj.register_forward_hook(self._query_hook(module)),
                module.register_forward_hook(self._after, with_kwargs=True, always_call=True),
            ]
        self._finalizer = weakref.finalize(cache, AttentionTap._remove_handles, self._handles)

    @property
    def installed(self) -> bool:
        return self._finalizer.alive

    def running(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s attention module is inside a forward given this tap's cache right now (False
        when another model runs the cache: its modules carry no hook of this cache)."""
        return self._modules[layer_idx] in self._armed

    def remove(self) -> None:
        """Take every hook off the model (idempotent)."""
        self._finalizer()
        self._queries.clear()
        self._armed.clear()

    @staticmethod
    def _remove_handles(handles) -> None:
        for handle in handles:
            handle.remove()

    def _ours(self, kwargs: dict):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        return cache if cache is not None and cache is self._cache() else None

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._ours(kwargs) is not None:
            check_attention_implementation(module)
            self._armed.add(module)

    def _query_hook(self, module: nn.Module):
        def keep(projection: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if module in self._armed:
                self._queries[module] = output

        return keep

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        self._armed.discard(module)
        queries = self._queries.pop(module, None)
        cache = self._ours(kwargs)
        if cache is None or output is None:  # output is None when the forward raised
            return
        cache.after_attention(module, kwargs, queries)


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
