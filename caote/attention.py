"""Reading attention out of any Hugging Face decoder through transformers' public `AttentionInterface`.

Every modern decoder family computes its final queries (QK-norm, RoPE, its own scaling) and then calls
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)``. While any
`EvictionCache` of a model is alive, the model's configs name caote's dispatcher for the backend they had:
``caote_sdpa`` over sdpa, ``caote_eager`` over eager (so ``model.config._attn_implementation`` reads that name;
the backend name returns when the last cache of the model is closed or garbage-collected). Each dispatcher is
registered here with its backend's own mask function, and its attention function always runs the backend's own
kernel (sdpa, or the family's eager function): a forward given no `EvictionCache` gets the masks and outputs it
gets without caote, bit for bit. In a forward given an `EvictionCache` the cache then receives the call's queries,
keys, values and mask and evicts. The probabilities the scores need are the family's own eager attention applied
to just the needed query rows, in float32, so soft-capping, scaling and query norms are the family's own: there is
no per-family code. One exception saves that second pass: a decode step of a layer decoding in place that reads
its newest row now (`AttentionObserver.attends`) has its attention computed once by `decode_attention`, which
returns the output and the probabilities together.

The channel from a forward to its cache is `ActiveForward`, held in a context variable for that forward only, so
each thread (each context) sees only its own forward's cache: several threads, each with its own cache, and plain
forwards beside them can share one model. The dispatcher is installed once per model config, counted over the live
caches of the model and removed with the last one, under a lock.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

from caote.families import SUPPORTED_MODEL_TYPES

# Backends the cache wraps; other implementations (flash, flex, paged) hand masks the cache cannot read exactly.
SUPPORTED_ATTENTION = ("sdpa", "eager")
# Each backend's mask function, which its dispatcher registers too: a dispatched forward gets the backend's masks.
BACKEND_MASKS = {"sdpa": sdpa_mask, "eager": eager_mask}
# The implementation name a model carries over each backend while a cache of it is alive, and back.
DISPATCHERS = {backend: f"caote_{backend}" for backend in SUPPORTED_ATTENTION}
DISPATCHED_BACKENDS = {dispatcher: backend for backend, dispatcher in DISPATCHERS.items()}


class AttentionCall(NamedTuple):
    """One attention call of a forward given an `EvictionCache`, as `caote_attention` reports it after the kernel."""

    module: nn.Module  # the attention module; its ``layer_idx`` names the layer
    queries: torch.Tensor  # the call's final queries (B, H_q, q, d)
    keys: torch.Tensor  # the call's keys (B, H_kv, N, d)
    values: torch.Tensor  # the call's values (B, H_kv, N, d_v)
    mask: torch.Tensor | None  # the 4D mask the kernel got (bool for sdpa, additive for eager), or None
    kwargs: dict  # the call's other arguments (scaling, dropout, soft-capping, ...)
    rows: torch.Tensor | None = None  # the probabilities (B, H_q, 1, N) when caote computed them (`decode_attention`)
    output: torch.Tensor | None = None  # the output where `decode_attention` gave it as the group's weighted sum


class AttentionObserver(Protocol):
    """What a forward's attention calls report to (an `EvictionCache`): the calls from this module upward
    (``attention_mask`` before the kernel, for a layer decoding in place; ``attends``: whether caote computes this
    call's attention itself, `decode_attention`; ``after_attention`` after it, with the call's `AttentionCall`).

    ``after_forward`` may run forwards of its own through the same model (`caote.strategies.LookAhead` drafts),
    whose attention calls report here again: the one run-time loop of the library (docs/architecture.md)."""

    def attention_mask(self, module: nn.Module, queries, attention_mask, additive: bool): ...

    def attends(self, module: nn.Module, queries) -> SlotViews | None: ...

    def after_attention(self, call: AttentionCall): ...

    def after_forward(self, model: nn.Module, output, forward_kwargs: dict) -> None: ...


@dataclass(frozen=True)
class ActiveForward:
    """The forward running now under an `EvictionCache`: where the attention calls of its layers report."""

    cache: AttentionObserver
    outer: ActiveForward | None  # the forward this one runs inside, if any: active again when this one ends


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


def caote_attention(backend: str, module: nn.Module, query, key, value, attention_mask, **kwargs):
    """The attention function of ``backend``'s dispatcher: the backend's own kernel, then, in a forward given an
    `EvictionCache` (in this thread), the cache scores and evicts this layer."""
    kernel = family_eager_attention(module) if backend == "eager" else ALL_ATTENTION_FUNCTIONS["sdpa"]
    active = _ACTIVE.get()
    if active is None:
        return kernel(module, query, key, value, attention_mask, **kwargs)
    attention_mask = active.cache.attention_mask(module, query, attention_mask, backend == "eager")
    views = active.cache.attends(module, query)
    if views is not None:  # one pass for the output and the row the policy reads
        output, rows, weighted = decode_attention(module, query, views, kwargs)
        active.cache.after_attention(AttentionCall(module, query, key, value, attention_mask, kwargs, rows, weighted))
        return output, rows  # the weights, as the eager kernel returns them (float32, as the query)
    output = kernel(module, query, key, value, attention_mask, **kwargs)
    active.cache.after_attention(AttentionCall(module, query, key, value, attention_mask, kwargs))
    return output


for _backend, _dispatcher in DISPATCHERS.items():
    AttentionInterface.register(_dispatcher, functools.partial(caote_attention, _backend))
    AttentionMaskInterface.register(_dispatcher, BACKEND_MASKS[_backend])


def name_implementation(config, name: str) -> None:
    """Set ``config``'s own implementation name, leaving its sub-configs' as they are (each is held on its own)."""
    config._attn_implementation = {"": name}


class DispatcherHolds:
    """How many live `ForwardSwitch`es hold each model config under caote's dispatcher: the first hold installs the
    dispatcher over the config's backend, the last restores the backend's name (unless another name was set over
    the dispatcher meanwhile). One lock guards every change; it is re-entrant because a garbage collection in this
    thread may finalize a cache, which releases its hold, while the lock is held."""

    def __init__(self):
        self._lock = threading.RLock()
        self._configs: dict[int, Any] = {}  # the held configs by id (configs compare by value, so are unhashable)
        self._holds: Counter[int] = Counter()

    def acquire(self, configs: list) -> None:
        with self._lock:
            for config in configs:
                self._configs[id(config)] = config
                self._holds[id(config)] += 1
            self.install(configs)

    def install(self, configs: list) -> None:
        """Name the dispatcher of each config's backend (a config naming an unsupported one is left to the check)."""
        with self._lock:
            for config in configs:
                if config._attn_implementation in DISPATCHERS:
                    name_implementation(config, DISPATCHERS[config._attn_implementation])

    def release(self, configs: list) -> None:
        with self._lock:
            for config in configs:
                self._holds[id(config)] -= 1
                if self._holds[id(config)] == 0:
                    del self._holds[id(config)], self._configs[id(config)]
                    if config._attn_implementation in DISPATCHED_BACKENDS:
                        name_implementation(config, DISPATCHED_BACKENDS[config._attn_implementation])


_HOLDS = DispatcherHolds()


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


class SlotViews(NamedTuple):
    """The fixed slot buffers of a layer decoding in place, ``keys`` / ``values`` ``(B, H_kv, S, d)``, and the views
    `decode_attention` multiplies by, made once per buffer: ``keys_t`` ``(B * H_kv, d, S)``, ``flat_values``
    ``(B * H_kv, S, d_v)``."""

    keys: torch.Tensor
    values: torch.Tensor
    keys_t: torch.Tensor
    flat_values: torch.Tensor

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor) -> SlotViews:
        slots = keys.shape[-2]
        return cls(
            keys, values, keys.view(-1, slots, keys.shape[-1]).transpose(1, 2), values.view(-1, slots, values.shape[-1])
        )

    def views(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether these are the views of ``keys`` and ``values`` (the same tensors, not equal ones)."""
        return self.keys is keys and self.values is values


def decode_attention(module: nn.Module, query: torch.Tensor, slots: SlotViews, kwargs: dict):
    """A lone decoding float32 query's attention over every slot (no mask), once for both the layer and its policy:
    returns the output ``(B, 1, H_q, d_v)``, as the model's kernel returns it, the probabilities
    ``(B, H_q, 1, N)``, as `attention_probabilities` computes them, and the output again where it is the group's
    ``bmm`` of those probabilities, bit for bit what `caote.value_aware.weighted_values` gives (else None).

    ``softmax(q k^T * scaling)``, then the probabilities times the values: the model's own computation up to the
    order of additions (the cache calls it for float32 queries only, `EvictionCache.attends`). A KV head's query
    group is one matrix product (no copy of the keys or values per query head). A family whose attention is more
    than a scaled dot product (soft-capping, attention sinks) runs its own eager function instead."""
    scaling = kwargs.get("scaling")
    if scaling is None or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        output, probabilities = family_eager_attention(module)(
            module, query, slots.keys, slots.values, None, **{**kwargs, "dropout": 0.0}
        )
        return output, probabilities, None
    batch, heads, _, dim = query.shape
    groups, tokens = slots.keys_t.shape[0], slots.keys_t.shape[-1]
    probabilities = (torch.bmm(query.reshape(groups, -1, dim), slots.keys_t) * scaling).softmax(-1)
    output = torch.bmm(probabilities, slots.flat_values).view(batch, 1, heads, -1)
    return output, probabilities.view(batch, heads, 1, tokens), output


class ForwardSwitch:
    """A cache's hold on its model's dispatcher (`DispatcherHolds`), and hooks on the model's decoder that, for each
    forward given ``cache``, open the `ActiveForward` channel of the calling thread; the channel closes when the
    forward ends, also when it raises. Forwards given any other cache, or none, pass untouched.

    The hooks hold the cache weakly; `remove`, or the cache's garbage collection, takes them off the model and
    releases the hold."""

    def __init__(self, model: nn.Module, cache):
        self._model = model
        self._cache = weakref.ref(cache)
        # the configs that name the implementation: the model's and its sub-models' (a decoder shares the model's)
        self._configs = list(
            {id(m.config): m.config for m in model.modules() if isinstance(m, PreTrainedModel)}.values()
        )
        decoder = model.get_decoder()
        handles = [
            decoder.register_forward_pre_hook(self._enter, with_kwargs=True),
            decoder.register_forward_hook(self._exit, with_kwargs=True, always_call=True),
        ]
        _HOLDS.acquire(self._configs)
        self._finalizer = weakref.finalize(cache, ForwardSwitch._release, handles, self._configs)

    @property
    def installed(self) -> bool:
        return self._finalizer.alive

    def remove(self) -> None:
        """Take the hooks off the model and release the hold (idempotent)."""
        self._finalizer()

    @staticmethod
    def _release(handles, configs: list) -> None:
        for handle in handles:
            handle.remove()
        _HOLDS.release(configs)

    # torch adds a hook before marking it as taking keyword arguments and removes it before the mark, so a forward
    # of another thread racing this cache's construction or `remove` may call a hook without them: never a forward
    # given this cache (not in use yet, or no longer), so the hooks ignore such a call.

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        if kwargs is None:  # called without the forward's keyword arguments: see above
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None or cache is not self._cache():
            return
        check_attention_implementation(self._model)
        if self._model.config._attn_implementation not in DISPATCHED_BACKENDS:  # a backend named over the dispatcher
            _HOLDS.install(self._configs)
        _ACTIVE.set(ActiveForward(cache, _ACTIVE.get()))

    def _exit(self, module: nn.Module, args: tuple, *kwargs_and_output) -> None:
        if len(kwargs_and_output) != 2:  # called without the forward's keyword arguments: see above
            return
        kwargs, output = kwargs_and_output
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        active = _ACTIVE.get()
        if active is None or active.cache is not cache or cache is not self._cache():
            return
        _ACTIVE.set(active.outer)
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
    attention a BlockMask), in one line naming the ones that work. Under caote's dispatcher, the backend it wraps
    is checked."""
    implementation = wrapped_implementation(model)
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attention implementation {implementation!r} is not supported by caote; load the model with "
            f"attn_implementation={' or '.join(repr(name) for name in SUPPORTED_ATTENTION)}"
        )


def wrapped_implementation(model: nn.Module) -> str | None:
    """The model's attention implementation, seen through caote's dispatcher (``caote_sdpa`` -> ``sdpa``)."""
    implementation = getattr(model.config, "_attn_implementation", None)
    return DISPATCHED_BACKENDS.get(implementation, implementation)
