"""Reading attention out of any Hugging Face decoder through transformers' public `AttentionInterface`.

Every modern decoder family computes its final queries (QK-norm, RoPE, its own scaling) and then calls
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)``. For the length of
each forward given an `EvictionCache`, the model runs under the implementation ``caote_sdpa`` or ``caote_eager``,
registered here (with the matching mask functions): the model's own kernel (sdpa, or the family's eager function)
computes the attention output unchanged, then the cache receives the call's queries, keys, values and mask and
evicts. The probabilities the scores need are the family's own eager attention applied to just the needed query
rows, in float32, so soft-capping, scaling and query norms are the family's own: there is no per-family code.

The channel from a forward to its cache is `ActiveForward`, held in a context variable for that forward only; the
implementation the model had is restored when the forward ends (also when it raises).
"""

from __future__ import annotations

import sys
import weakref
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

from caote.families import SUPPORTED_MODEL_TYPES

# Backends the cache wraps; other implementations (flash, flex, paged) hand masks the cache cannot read exactly.
SUPPORTED_ATTENTION = ("sdpa", "eager")
# The implementation names a cache's forwards run under, with the mask function each needs (the wrapped backend's).
CAOTE_MASKS = {"caote_sdpa": sdpa_mask, "caote_eager": eager_mask}


class AttentionObserver(Protocol):
    """What a forward's attention calls report to (an `EvictionCache`): the one call from this module upward.

    ``after_forward`` may run forwards of its own through the same model (`caote.strategies.LookAhead` drafts),
    whose attention calls report here again: the one run-time loop of the library (docs/architecture.md)."""

    def after_attention(self, module: nn.Module, queries, keys, values, attention_mask, kwargs: dict) -> None: ...

    def after_forward(self, model: nn.Module, output, forward_kwargs: dict) -> None: ...


@dataclass(frozen=True)
class ActiveForward:
    """The forward running now under an `EvictionCache`: where the attention calls of its layers report."""

    cache: AttentionObserver
    implementation: str  # "sdpa" or "eager": the kernel the model had


_ACTIVE: ContextVar[ActiveForward | None] = ContextVar("caote_active_forward", default=None)


def active_forward() -> ActiveForward | None:
    """The `ActiveForward` of the forward running now in this thread, if it was given an `EvictionCache`."""
    return _ACTIVE.get()


def family_eager_attention(module: nn.Module) -> Callable:
    """The ``eager_attention_forward`` of the module's own modeling file (soft-capping, sinks and all)."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"{type(module).__name__} has no eager_attention_forward in its modeling file")
    return eager


def caote_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """The registered attention function: the model's own kernel, then the cache scores and evicts this layer."""
    active = _ACTIVE.get()
    if active is None:
        raise RuntimeError("caote attention ran outside a forward given an EvictionCache")
    kernel = family_eager_attention(module) if active.implementation == "eager" else ALL_ATTENTION_FUNCTIONS["sdpa"]
    output = kernel(module, query, key, value, attention_mask, **kwargs)
    active.cache.after_attention(module, query, key, value, attention_mask, kwargs)
    return output


for _name, _mask in CAOTE_MASKS.items():
    AttentionInterface.register(_name, caote_attention)
    AttentionMaskInterface.register(_name, _mask)


def attention_probabilities(
    module: nn.Module, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, kwargs: dict
) -> torch.Tensor:
    """Softmax probabilities ``(B, H_q, R, N)`` in float32 of the ``R`` newest queries ``(B, H_q, R, d)`` over
    ``keys`` ``(B, H_kv, N, d)``, computed by the family's eager attention with the call's own arguments.

    ``mask`` is the call's 4D mask (bool for sdpa, additive for eager) or None (sdpa's causal fast path); the rows
    of padding queries come out uniform and are zeroed by the caller."""
    rows, tokens = queries.shape[-2], keys.shape[-2]
    floor = torch.finfo(torch.float32).min
    if mask is None and rows == 1:  # a lone newest query sees every slot
        additive = None
    elif mask is None:
        additive = torch.zeros(rows, tokens, device=queries.device)
        future = torch.ones(rows, rows, dtype=torch.bool, device=queries.device).triu_(1)
        additive[:, tokens - rows :].masked_fill_(future, floor)
        additive = additive[None, None]
    else:
        mask = mask[..., -rows:, :tokens]
        additive = (
            torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, floor)
            if mask.dtype == torch.bool
            else mask.float()
        )
    call = {**kwargs, "dropout": 0.0}
    # zero-width values: the family's function computes its probabilities as always and skips the weighted sum of
    # values (and the copy of every value per query head) that only the attention output needs
    _, probabilities = family_eager_attention(module)(
        module, queries.float(), keys.float(), values[..., :0].float(), additive, **call
    )
    return probabilities


class ForwardSwitch:
    """Hooks on a model's decoder that, for each forward given ``cache``, switch the model to the caote attention
    implementation and open the `ActiveForward` channel; the implementation the model had and the channel are
    restored when the forward ends, also when it raises. Forwards given any other cache pass untouched.

    The hooks hold the cache weakly and are removed by `remove`, or when the cache is garbage-collected."""

    def __init__(self, model: nn.Module, cache):
        self._model = model
        self._cache = weakref.ref(cache)
        self._restore: list[tuple[str, Any]] = []
        # the configs that name the implementation: the model's and its sub-models' (a decoder shares the model's)
        self._configs = list(
            {id(m.config): m.config for m in model.modules() if isinstance(m, PreTrainedModel)}.values()
        )
        decoder = model.get_decoder()
        handles = [
            decoder.register_forward_pre_hook(self._enter, with_kwargs=True),
            decoder.register_forward_hook(self._exit, with_kwargs=True, always_call=True),
        ]
        self._finalizer = weakref.finalize(cache, ForwardSwitch._remove_handles, handles)

    @property
    def installed(self) -> bool:
        return self._finalizer.alive

    def remove(self) -> None:
        """Take the hooks off the model (idempotent)."""
        self._finalizer()

    @staticmethod
    def _remove_handles(handles) -> None:
        for handle in handles:
            handle.remove()

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None or cache is not self._cache():
            return
        implementation = self._model.config._attn_implementation
        check_attention_implementation(self._model)
        token = _ACTIVE.set(ActiveForward(cache, implementation))
        self._restore.append((implementation, token))
        self._set_implementation(f"caote_{implementation}")

    def _set_implementation(self, name: str) -> None:
        """Switch every config of the model to ``name``: what ``model.set_attn_implementation`` ends in, without its
        checks and its walk over every module (about 1.5 ms per forward, twice per forward)."""
        for config in self._configs:
            config._attn_implementation = name

    def _exit(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not self._restore or cache is None or cache is not self._cache():
            return
        implementation, token = self._restore.pop()
        self._set_implementation(implementation)
        _ACTIVE.reset(token)
        cache.after_forward(self._model, output, kwargs)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer; one-line errors for an unsupported family or backend."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {model_type!r} ({type(model).__name__}) is not supported; caote supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    check_attention_implementation(model)
    return [layer.self_attn for layer in model.get_decoder().layers]


def sliding_windows(model: nn.Module) -> list[int | None]:
    """Per decoder layer: its sliding window, or None for full attention (from ``config.layer_types``; a model
    without them slides in every layer when ``config.sliding_window`` is set, as Mistral does)."""
    config = model.config
    count = len(model.get_decoder().layers)
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * count
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(
            f"{type(model).__name__} has {', '.join(unknown)} layers; caote evicts in full-attention layers and "
            "leaves sliding-window layers to their window, and supports no other kind"
        )
    return [window if kind == "sliding_attention" else None for kind in kinds]


def check_attention_implementation(model: nn.Module) -> None:
    """Refuse attention backends whose masks the cache cannot read exactly (flash attention gets a 2D mask, flex
    attention a BlockMask), in one line naming the ones that work."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attention implementation {implementation!r} is not supported by caote; load the model with "
            f"attn_implementation={' or '.join(repr(name) for name in SUPPORTED_ATTENTION)}"
        )
