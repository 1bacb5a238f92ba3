"""`EvictionCache`: a transformers `Cache` that holds at most ``budget`` tokens per layer.

Used as ``model.generate(ids, cache=EvictionCache(model, budget=512, policy="snapkv+caote"), prefill_chunk_size=128)``
(``past_key_values=`` works too; transformers 5.2x renamed it). Each forward step runs attention over the retained
tokens plus the new ones; right after a layer's attention (a decode step in place: its layers together, when the
forward ends) the layer scores its tokens and keeps its top ``budget`` (`caote.layer.EvictionLayer`, on the
schedule of the policy's `caote.strategies` strategy):

    attention probabilities -> base score -> value-aware transform -> GQA aggregation -> protect -> keep top-b -> gather

The cache itself holds the hooks that route a forward's attention calls to it, what every layer of one forward
shares (positions, padding), the statistics and the snapshots.
"""

from __future__ import annotations

import copy
import logging
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from caote.attention import AttentionCall, ForwardSwitch, SlotViews, active_forward, attention_modules, sliding_windows
from caote.future import FutureAttention
from caote.layer import EvictionLayer, layer_bytes
from caote.recording import reads_row_now
from caote.settings import CacheSettings
from caote.strategies import CacheContext, strategy_for

logger = logging.getLogger(__name__)


def _detached(layer):
    """A copy of a cache layer that later in-place writes (of the copy or the original) do not reach."""
    return layer.detached_copy() if isinstance(layer, EvictionLayer) else copy.copy(layer)


class PositionsSeen(NamedTuple):
    """The positions one forward recorded in its first layer, reused by the forward's other layers."""

    position_ids: torch.Tensor | None  # the forward's ``position_ids`` argument (None: counted from the cache)
    real: torch.Tensor | None  # `ForwardShared.real_slots` of the forward
    key: tuple  # what else must match to reuse them: (tokens seen, new tokens, batch, KV heads, device)
    positions: torch.Tensor  # (B, H_kv, new) int64, -1 = padding


class ForwardShared:
    """What every layer of one forward shares, worked out in its first layer and reused by the others: which slots
    hold padding, and the absolute positions of the new tokens."""

    def __init__(self):
        self.mask_seen: tuple[weakref.ref, torch.Tensor | None] | None = None
        self.positions_seen: PositionsSeen | None = None  # of the last forward

    def clear(self) -> None:
        self.mask_seen = self.positions_seen = None

    def real_slots(self, attention_mask: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor | None:
        """``(B, N)`` bool: which cache slots hold real tokens rather than left padding; None when none is padding.

        The newest query of a step sees every earlier slot unless it is padding, so its row of the 4D mask (bool for
        sdpa, additive float for eager) is the padding mask of the slots. Every layer of a forward gets the same mask
        object, so the answer is worked out once per forward (the mask is held weakly: it is not kept alive); a layer
        holding masked slots passes its own mask (`EvictionLayer.attention_mask`), whose columns of the new tokens,
        the only ones read, are the model's."""
        if attention_mask is None:
            return None
        if self.mask_seen is not None and self.mask_seen[0]() is attention_mask:
            return self.mask_seen[1]
        row = attention_mask[:, 0, -1, -keys.shape[-2] :]
        real = (row if row.dtype == torch.bool else row == 0).expand(keys.shape[0], -1)
        real = None if bool(real.all()) else real.clone()
        self.mask_seen = (weakref.ref(attention_mask), real)
        return real

    def positions(self, layer: EvictionLayer, kwargs: dict, real: torch.Tensor | None) -> torch.Tensor:
        """Absolute positions ``(B, H_kv, new)`` of the forward's new tokens (``-1`` for padding), worked out once
        per forward (and shape, device)."""
        batch, kv_heads, new = layer.keys.shape[0], layer.keys.shape[1], layer.new_tokens
        device = layer.keys.device
        position_ids = kwargs.get("position_ids")
        key = (layer.cumulative_length, new, batch, kv_heads, device)
        seen = self.positions_seen
        if seen is None or seen.position_ids is not position_ids or seen.real is not real or seen.key != key:
            if position_ids is None:
                position_ids = torch.arange(layer.cumulative_length - new, layer.cumulative_length, device=device)
            positions = position_ids.to(device).view(-1, new).expand(batch, new)
            if real is not None:
                positions = positions.masked_fill(~real[:, -new:], -1)
            positions = positions.unsqueeze(1).expand(batch, kv_heads, new).contiguous()
            self.positions_seen = PositionsSeen(kwargs.get("position_ids"), real, key, positions)
        return self.positions_seen.positions


class ByteLedger:
    """The KV bytes a cache holds, as a running total kept per layer (O(1) per update, unlike a sum over all layers),
    and the most held at once."""

    def __init__(self, layers: list):
        self.reset(layers)

    def reset(self, layers: list, peak: int = 0) -> None:
        self.held = [layer_bytes(layer) for layer in layers]
        self.total = sum(self.held)
        self.peak = peak

    def account(self, index: int, layer) -> None:
        """Bring the total up to date with layer ``index`` and raise the peak if it is the most so far."""
        held = layer_bytes(layer)
        self.total += held - self.held[index]
        self.held[index] = held
        self.peak = max(self.peak, self.total)


@dataclass(frozen=True)
class CacheSnapshot:
    """The state of an `EvictionCache` at one moment (see `EvictionCache.snapshot`)."""

    layers: list[EvictionLayer]
    generator_state: torch.Tensor | None
    peak_kv_bytes: int


@dataclass
class CacheStats:
    """What eviction saved so far (per layer counts; bytes over all layers), and the policy that evicted.

    ``policy`` is the policy the cache ran, ``requested`` the name asked for (``"auto"``, or the policy's own).
    ``peak_kv_bytes`` is the most held at once: inside a prefill block only the layer being evicted holds
    ``budget + block`` tokens, the others at most ``budget`` (with ``prefill="compress"`` the block is the whole
    prompt: one layer holds it all before its eviction); a layer decoding in place holds the bytes of its
    ``budget + 1`` slots throughout (one of them free after each step).
    """

    tokens_seen: int
    tokens_kept: int
    tokens_evicted: int
    kv_bytes: int
    peak_kv_bytes: int
    full_kv_bytes: int
    policy: str
    requested: str

    @property
    def kv_bytes_saved(self) -> int:
        return self.full_kv_bytes - self.kv_bytes


def evicting_layers(model: nn.Module) -> list[int]:
    """The decoder layers an `EvictionCache` of ``model`` evicts in: every layer, except that a hybrid model's
    sliding-window layers keep their own window (a model whose every layer slides evicts in all of them)."""
    return _evicting(sliding_windows(model))


def _evicting(windows: list[int | None]) -> list[int]:
    """`evicting_layers` from the layers' sliding windows (`caote.attention.sliding_windows`)."""
    if all(window is not None for window in windows):
        return list(range(len(windows)))
    return [index for index, window in enumerate(windows) if window is None]


def _cache_layers(settings: CacheSettings, windows: list[int | None]) -> list:
    """The layers of an `EvictionCache` over decoder layers with these sliding windows: an `EvictionLayer` where it
    evicts (`_evicting`), a sliding-window layer keeping its own window elsewhere."""
    evicting = _evicting(windows)
    return [
        EvictionLayer(settings) if index in evicting else DynamicSlidingWindowLayer(window)
        for index, window in enumerate(windows)
    ]


def _warn_unbounded_prefill(new: int, block_size: int) -> None:
    """Warn that one forward brought ``new`` tokens, more than a prefill block: attention over them escapes the
    budget."""
    logger.warning(
        "EvictionCache received %d tokens in one forward (block size %d): attention over them is not "
        "bounded by the budget; pass prefill_chunk_size=%d to generate",
        new,
        block_size,
        block_size,
    )


class EvictionCache(Cache):
    """A bounded KV cache: after every forward step each layer holds at most ``budget`` tokens.

    Parameters
    ----------
    model:
        The model the cache serves (a supported family, sdpa or eager attention; the README's family table). The
        cache hooks its decoder and keeps the model under caote's attention dispatcher (`caote.attention`) until
        `close` (or the end of a ``with`` block, or the cache's collection).
    settings:
        A `caote.settings.CacheSettings` (its docstring describes each field), or its fields as keyword arguments;
        validated once, when built. The budget and the policy may also come positionally:
        ``EvictionCache(model, 256, "h2o")``. The policy ``"auto"`` is resolved here, for ``model``
        (`CacheSettings.for_model`); ``settings`` holds what it resolved to.
    future:
        The `caote.future.FutureAttention` of the teacher-forced text this cache will read, required by the
        ``oracle`` policy (and only by it): a hindsight ceiling for evaluation, which no generation can provide.
    stand_in:
        For the ``learned`` policy only, an object standing in for the model's importance predictor
        (calibration uses it to record features; `caote.evaluation.calibration.collection.Collector`). Users name a
        predictor file with the ``predictor`` setting
        (``EvictionCache(model, policy="learned+caote", predictor="my.safetensors")``).
    """

    def __init__(
        self,
        model: nn.Module,
        settings: CacheSettings | int | None = None,
        policy: str | None = None,
        *,
        future: FutureAttention | None = None,
        stand_in=None,
        **values,
    ):
        if settings is not None and not isinstance(settings, CacheSettings):  # EvictionCache(model, 256, "h2o")
            settings, values = None, {**values, "budget": settings}
        if policy is not None:
            values["policy"] = policy
        settings = CacheSettings.of(settings, **values)
        attention_modules(model)  # refuses an unsupported family or backend in one line
        self.settings = settings.for_model(model)
        self.policy = self.settings.policy
        windows = sliding_windows(model)
        context = CacheContext(model, future, any(window is not None for window in windows), stand_in)
        self.strategy = strategy_for(self.settings, context) if self.policy.evicts else None
        super().__init__(layers=_cache_layers(self.settings, windows))
        self.model_name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        # A model whose every layer slides (Mistral with a window) evicts everywhere, within its window only.
        self.sliding_window = min(windows) if all(window is not None for window in windows) else None
        self._generator: torch.Generator | None = None
        self._bytes = ByteLedger(self.layers)
        self._shared = ForwardShared()
        self.frozen = False
        self._slots_allowed = self.strategy is not None and self.strategy.decodes_in_place
        self._set_in_place(self._slots_allowed)
        self._switch = ForwardSwitch(model, self)

    @property
    def budget(self) -> int:
        return self.settings.budget

    @property
    def block_size(self) -> int:
        return self.settings.block_size

    def __repr__(self):
        settings = self.settings
        auto = " (auto)" if settings.auto else ""
        return (
            f"EvictionCache(policy={self.policy.name!r}{auto}, budget={settings.budget}, "
            f"block_size={settings.block_size}, sink_tokens={settings.sink_tokens}, recent_window={settings.recent}, "
            f"gqa={settings.aggregation!r})"
        )

    def close(self) -> None:
        """Remove the cache's hooks from the model and release its dispatcher (also done when the cache is
        garbage-collected). A closed cache refuses further forwards."""
        self._switch.remove()

    def __enter__(self) -> EvictionCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- generate integration ------------------------------------------------------------------------------------

    # `generate` marks every user-supplied cache by setting this attribute before it starts; no public hook tells a
    # cache that a new call begins, so the setter is where a cache still holding an earlier call's tokens is refused.
    @property
    def _is_user_defined(self) -> bool:
        return True

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        if self.get_seq_length() > 0:
            raise ValueError(
                f"this EvictionCache already holds {self.get_seq_length()} tokens from an earlier call; "
                "call cache.reset() or build a new EvictionCache for every generate call"
            )

    def freeze(self) -> None:
        """Stop evicting: every later token is kept, so the cache grows past the budget. This is kvpress's question
        protocol (compress the context, then let the question and the answer grow the cache uncompressed); a cache
        that is never frozen holds at most ``budget`` tokens throughout. `reset` unfreezes."""
        self.frozen = True
        self._set_in_place(False)  # a growing cache appends: back to arrival order

    def _set_in_place(self, allowed: bool) -> None:
        """Let (or stop) every evicting layer decode in place; a layer stopped returns to arrival order."""
        for layer in self.layers:
            if isinstance(layer, EvictionLayer):
                layer.slots_allowed = allowed
                if not allowed:
                    layer.leave_slots()

    def reset(self) -> None:
        """Forget every token and all scoring state, ready for a new sequence."""
        super().reset()
        self.frozen = False
        self._set_in_place(self._slots_allowed)
        self._bytes.reset(self.layers)
        self._generator = None
        self._shared.clear()

    def snapshot(self) -> CacheSnapshot:
        """Record the current state so that `restore` can return to it (e.g. to answer several questions about one
        compressed context). Free while tokens are in arrival order (the tensors are replaced, never written, so they
        are shared); the buffers of a layer decoding in place are copied."""
        generator = self._generator.get_state() if self._generator is not None else None
        return CacheSnapshot([_detached(layer) for layer in self.layers], generator, self._bytes.peak)

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Return to the state `snapshot` recorded; the snapshot stays valid for further restores."""
        if len(snapshot.layers) != len(self.layers):
            raise ValueError(f"the snapshot has {len(snapshot.layers)} layers but the cache has {len(self.layers)}")
        self.layers = [_detached(layer) for layer in snapshot.layers]
        for layer in self.layers:  # a snapshot of another cache (the evaluation's full-cache prefix) evicts as this one
            if isinstance(layer, EvictionLayer):
                layer.adopt(self.settings, self._slots_allowed and not self.frozen)
        if self.strategy is not None:
            self.strategy.restored(self.layers)
        self._shared.clear()
        self._bytes.reset(self.layers, snapshot.peak_kv_bytes)
        if snapshot.generator_state is not None and self._generator is not None:
            self._generator.set_state(snapshot.generator_state)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        if self.policy.evicts:
            if not self._switch.installed:
                raise ValueError("this EvictionCache was closed; build a new one")
            active = active_forward()
            if active is None or active.cache is not self:
                raise ValueError(
                    f"this EvictionCache was built for {self.model_name!r}; build a new one for each model"
                )
            self.check_sequence_length(layer.cumulative_length + key_states.shape[-2])
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def check_sequence_length(self, tokens: int) -> None:
        """Refuse a sequence of ``tokens`` that eviction cannot serve exactly: in a model whose every layer slides
        (Mistral with a window), transformers masks the window by cache slot, which after eviction no longer equals
        the token's position, so eviction is exact only while the whole sequence fits in the window."""
        if self.policy.evicts and self.sliding_window is not None and tokens > self.sliding_window:
            raise ValueError(
                f"{self.model_name!r} attends through a sliding window of {self.sliding_window} tokens in every "
                f"layer; eviction (budget {self.budget}, block size {self.block_size}) is exact only while the "
                f"whole sequence fits in that window, and this one reaches {tokens} tokens"
            )

    # -- eviction ------------------------------------------------------------------------------------------------

    def attention_mask(self, module: nn.Module, queries, attention_mask, additive: bool):
        """The mask ``module``'s attention should use (`EvictionLayer.attention_mask`; ``additive`` for eager
        attention): the model's, but where a layer holds slots that it does not (decoding in place, a padded batch's
        rows out of phase)."""
        layer = self.layers[module.layer_idx]
        if not isinstance(layer, EvictionLayer):
            return attention_mask
        return layer.attention_mask(attention_mask, queries, additive)

    def attends(self, module: nn.Module, queries) -> SlotViews | None:
        """The layer's slot views when caote computes ``module``'s attention in this call
        (`caote.attention.decode_attention`, decided by `caote.recording.reads_row_now`), so the row comes from the
        call itself instead of a second pass."""
        layer = self.layers[module.layer_idx]
        evicting = isinstance(layer, EvictionLayer) and self.strategy is not None and not self.frozen
        return layer.slot_views() if evicting and reads_row_now(layer, module, queries) else None

    def after_attention(self, call: AttentionCall):
        """Called by caote's attention function right after a layer attended, with the call (its probabilities
        ``rows`` when caote computed the attention, `attends`): records the layer's positions and hands it to the
        policy's strategy, which records its rows and evicts."""
        index = call.module.layer_idx
        layer = self.layers[index]
        self._bytes.account(index, layer)
        if not isinstance(layer, EvictionLayer):  # a sliding-window layer of a hybrid model keeps its own rule
            return
        new = layer.new_tokens
        prefilling_in_blocks = self.settings.prefill == "blocks" and self.policy.evicts
        if new > self.block_size and prefilling_in_blocks and index == self._first_evicting:  # once per forward
            _warn_unbounded_prefill(new, self.block_size)
        # a token decoded in place is never padding, and its mask already hides the slots that hold none
        real = None if layer.in_place else self._shared.real_slots(call.mask, layer.keys)
        layer.add_positions(self._shared.positions(layer, call.kwargs, real), real is not None)
        if self.strategy is None or self.frozen:
            return
        self.strategy.after_attention(self, index, layer, call, real)
        self._bytes.account(index, layer)

    def after_forward(self, model: nn.Module, output, forward_kwargs: dict) -> None:
        """Called when a forward given this cache ends (``output`` None when it raised): a strategy that waits for
        the end of the forward (`caote.strategies.LookAhead`'s prompt blocks, a decode step's layers in place) evicts
        now."""
        if self.strategy is not None:
            for index in self.strategy.after_forward(self, model, output, forward_kwargs):
                self._bytes.account(index, self.layers[index])

    def random_generator(self) -> torch.Generator:
        """One CPU generator for every layer: the numbers are drawn on the CPU and moved to each layer's device, so
        layers spread over several devices draw from one reproducible stream."""
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.settings.seed)
        return self._generator

    # -- statistics ----------------------------------------------------------------------------------------------

    def kv_bytes(self) -> int:
        """Bytes of keys and values held right now, over all layers."""
        return sum(layer_bytes(layer) for layer in self.layers)

    def stats(self) -> CacheStats:
        """Tokens seen / kept / evicted per evicting layer and KV bytes over every layer, sliding-window layers
        included (now, at peak, and what a full cache would hold)."""
        first = self.layers[self._first_evicting]
        seen, kept = first.get_seq_length(), first.retained
        now = self.kv_bytes()
        full = sum(layer_bytes(layer) * seen // layer.keys.shape[-2] for layer in self.layers if layer_bytes(layer))
        peak = max(self._bytes.peak, now)
        return CacheStats(seen, kept, seen - kept, now, peak, full, self.policy.name, self.settings.requested)

    @property
    def _first_evicting(self) -> int:
        return next(index for index, layer in enumerate(self.layers) if isinstance(layer, EvictionLayer))
