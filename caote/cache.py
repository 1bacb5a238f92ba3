"""`EvictionCache`: a transformers `Cache` that holds at most ``budget`` tokens per layer.

Used as ``model.generate(ids, cache=EvictionCache(model, budget=512, policy="snapkv+caote"), prefill_chunk_size=128)``
(``past_key_values=`` works too; transformers 5.2x renamed it). Each forward step runs attention over the retained
tokens plus the new ones; right after a layer's attention, a hook scores every token and the layer keeps its top
``budget``:

    attention probabilities -> base score -> value-aware transform -> GQA aggregation -> protect -> keep top-b -> gather
"""

from __future__ import annotations

import copy
import logging
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from caote.attention import (
    ForwardSwitch,
    active_forward,
    attention_modules,
    attention_probabilities,
    sliding_windows,
)
from caote.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_POLICY, DEFAULT_SINK_TOKENS
from caote.future import FutureAttention
from caote.lookahead import draft
from caote.policies import Policy, ScoreInputs, parse_policy
from caote.scoring import GQA_AGGREGATIONS, accumulate_attention, keep_recent_rows

logger = logging.getLogger(__name__)


class EvictionLayer(DynamicLayer):
    """One layer's retained keys/values plus what the scores need: absolute positions and attention history.

    ``get_seq_length`` counts every token seen (so RoPE positions stay absolute); ``keys.shape[-2]`` is the number
    retained. Retained tokens stay in arrival order.
    """

    def __init__(self):
        super().__init__()
        self.cumulative_length = 0
        self.new_tokens = 0
        self.positions: torch.Tensor | None = None  # (B, H_kv, N) int64, -1 = padding
        self.accumulated: torch.Tensor | None = None  # (B, H_q, N) float32, H2O running attention
        self.recent_rows: torch.Tensor | None = None  # (B, H_q, R, N) float32, newest attention rows
        self.padded = False  # a padding slot was recorded since the last reset (it may since have been evicted)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.new_tokens = key_states.shape[-2]
        self.cumulative_length += self.new_tokens
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    @property
    def retained(self) -> int:
        return 0 if self.keys is None or self.keys.dim() < 3 else self.keys.shape[-2]

    @property
    def kv_bytes(self) -> int:
        """Bytes of the keys and values held now."""
        return layer_bytes(self)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Retained tokens sit just before the new ones in the mask; padding slots stay at the front (see `_protect`).
        return self.retained + query_length, self.cumulative_length - self.retained

    def keep(self, indices: torch.Tensor) -> None:
        """Gather the tokens ``indices`` ``(B, H_kv, b)`` (sorted) from every per-token tensor of the layer."""
        batch, kv_heads, tokens, dim = self.keys.shape
        # Copy whole head_dim rows of the flattened (B * H_kv * N, d) tensors: far cheaper than element-wise gather.
        rows = (indices + torch.arange(batch * kv_heads, device=indices.device).view(batch, kv_heads, 1) * tokens).view(
            -1
        )
        self.keys = self.keys.reshape(-1, dim).index_select(0, rows).view(batch, kv_heads, -1, dim)
        self.values = self.values.reshape(-1, dim).index_select(0, rows).view(batch, kv_heads, -1, dim)
        self.positions = self.positions.gather(2, indices)
        if self.accumulated is not None or self.recent_rows is not None:
            group = (self.accumulated if self.accumulated is not None else self.recent_rows).shape[1] // indices.shape[
                1
            ]
            per_query_head = indices.repeat_interleave(group, dim=1)
            if self.accumulated is not None:
                self.accumulated = self.accumulated.gather(2, per_query_head)
            if self.recent_rows is not None:
                rows = self.recent_rows.shape[2]
                self.recent_rows = self.recent_rows.gather(3, per_query_head.unsqueeze(2).expand(-1, -1, rows, -1))

    def reset(self) -> None:
        super().reset()
        self.new_tokens = 0
        self.padded = False
        self.positions = self.accumulated = self.recent_rows = None

    def _refuse(self, *args, **kwargs):
        raise ValueError(
            "EvictionCache cannot be cropped, reordered or re-batched: beam search, assisted/speculative decoding "
            "and contrastive search are not supported; use greedy or sampling with num_beams=1"
        )

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _refuse


def oldest_after_sinks_dropped(positions: torch.Tensor, kept: int, sink_tokens: int) -> torch.Tensor:
    """The ``kept`` slots ``(B, H, kept)`` left when the oldest tokens after the sinks go (what a recency score keeps
    once sinks and recent window are protected): slots hold tokens in arrival order, so those are the slots right
    after the sinks. Assumes no padding and positions rising with the slot (true unless a caller passes
    ``position_ids`` that go backwards)."""
    sinks = (positions < sink_tokens).sum(-1, keepdim=True)
    slots = torch.arange(kept, device=positions.device)
    return slots + (positions.shape[-1] - kept) * (slots >= sinks)


def layer_bytes(layer) -> int:
    """Bytes of the keys and values a cache layer (of any kind) holds now."""
    if not layer.is_initialized or layer.keys.dim() < 3:
        return 0
    return layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()


class PositionsSeen(NamedTuple):
    """The positions one forward recorded in its first layer, reused by the forward's other layers."""

    position_ids: torch.Tensor | None  # the forward's ``position_ids`` argument (None: counted from the cache)
    real: torch.Tensor | None  # `EvictionCache._real_slots` of the forward
    key: tuple  # what else must match to reuse them: (tokens seen, new tokens, batch, KV heads, device)
    positions: torch.Tensor  # (B, H_kv, new) int64, -1 = padding


@dataclass(frozen=True)
class CacheSnapshot:
    """The state of an `EvictionCache` at one moment (see `EvictionCache.snapshot`)."""

    layers: list[EvictionLayer]
    generator_state: torch.Tensor | None
    peak_kv_bytes: int


@dataclass
class CacheStats:
    """What eviction saved so far (per layer counts; bytes over all layers).

    ``peak_kv_bytes`` is the most held at once: inside a forward step only the layer being evicted holds
    ``budget + new tokens``; the others hold at most ``budget``.
    """

    tokens_seen: int
    tokens_kept: int
    tokens_evicted: int
    kv_bytes: int
    peak_kv_bytes: int
    full_kv_bytes: int

    @property
    def kv_bytes_saved(self) -> int:
        return self.full_kv_bytes - self.kv_bytes


class EvictionCache(Cache):
    """A bounded KV cache: after every forward step each layer holds at most ``budget`` tokens.

    Parameters
    ----------
    model:
        The model the cache serves (a supported family, sdpa or eager attention; see the README's family table).
        The cache adds two hooks to its decoder, which switch it to caote's attention implementation for the
        forwards given this cache only; `close` (or leaving a ``with EvictionCache(...) as cache:`` block, or
        dropping the cache) removes them.
    budget:
        Tokens kept per full-attention layer (and per KV head) after each step. Sliding-window layers of hybrid
        models (Gemma-2/3, Cohere-2, ...) keep transformers' own sliding-window layer, bounded by its window.
    policy:
        ``"full"``, ``"streamingllm"``, ``"h2o"``, ``"tova"``, ``"tova-layer"``, ``"snapkv"``, ``"keydiff"``,
        ``"knorm"``, ``"random"`` or ``"<base>+caote"`` / ``"<base>+fastcaote"`` (see `caote.policies`).
    block_size:
        Prompt block size that ``generate(prefill_chunk_size=...)`` should use (the paper's 128); a forward with more
        new tokens than this is allowed but logs a warning, since its attention is not bounded by the budget.
    sink_tokens:
        The first positions, never evicted (StreamingLLM's attention sinks). Default 4.
    recent_window:
        The newest tokens, never evicted. Default: the policy's own (half the budget for H2O, SnapKV's 32-query
        window, else the newest token only).
    gqa:
        How CAOTE errors of the query heads sharing a KV head combine: ``"rss"`` (exact), ``"mean"`` or ``"max"``.
        Plain base scores are always averaged over the group. A policy name ending in ``/<gqa>`` sets it instead.
    seed:
        Seed of the ``random`` policy (its numbers are drawn on the CPU, whatever device each layer is on).
    future:
        The `caote.future.FutureAttention` of the teacher-forced text this cache will read, required by the
        ``oracle`` policy (and only by it): a hindsight ceiling for evaluation, which no generation can provide.
    decode_eviction_interval:
        Decoding evicts one token per step by default (1). With ``k > 1`` a step with one new token that overflows
        the budget evicts ``k`` tokens at once, so scoring runs every ``k`` steps; the cache then holds between
        ``budget - k + 1`` and ``budget`` tokens. Prompt blocks of two or more tokens evict down to ``budget``; a
        prompt whose last block has a single token counts it as a decode step (``generate`` does not tell the cache
        which forwards are prompt chunks).
    """

    def __init__(
        self,
        model: nn.Module,
        budget: int,
        policy: str = DEFAULT_POLICY,
        block_size: int = DEFAULT_BLOCK_SIZE,
        sink_tokens: int = DEFAULT_SINK_TOKENS,
        recent_window: int | None = None,
        gqa: str = "rss",
        seed: int = 0,
        decode_eviction_interval: int = 1,
        future: FutureAttention | None = None,
    ):
        self.policy: Policy = parse_policy(policy)
        if self.policy.evicts and self.policy.base.needs_future and future is None:
            raise ValueError(
                f"policy {self.policy.name!r} is a hindsight ceiling: it needs the attention of later queries, known "
                "only on a teacher-forced text (caote eval perplexity), so it cannot generate; pick a causal policy"
            )
        self.future = future
        attention_modules(model)  # refuses an unsupported family or backend in one line
        windows = sliding_windows(model)
        if self.policy.evicts and self.policy.base.lookahead and any(window is not None for window in windows):
            raise ValueError(
                f"policy {self.policy.name!r} drafts tokens and drops them again, which sliding-window layers "
                "cannot undo; pick caote-block for a model with sliding-window layers"
            )
        every_layer_slides = all(window is not None for window in windows)
        self.recent_window = validate_settings(
            self.policy, budget, block_size, sink_tokens, recent_window, gqa, decode_eviction_interval
        )
        self.decode_eviction_interval = decode_eviction_interval
        super().__init__(
            layers=[
                EvictionLayer() if window is None or every_layer_slides else DynamicSlidingWindowLayer(window)
                for window in windows
            ]
        )
        self.budget, self.block_size, self.sink_tokens, self.seed = budget, block_size, sink_tokens, seed
        self.gqa = self.policy.gqa or gqa
        self.model_name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        # A model whose every layer slides (Mistral with a window) evicts everywhere, within its window only.
        self.sliding_window = min(windows) if every_layer_slides else None
        self._generator: torch.Generator | None = None
        self._peak_kv_bytes = 0
        self._held_bytes = [0] * len(self.layers)  # per layer, as last accounted: a running total, not a sum per call
        self._total_bytes = 0
        self._mask_seen: tuple[weakref.ref, torch.Tensor | None] | None = None
        self._positions_seen: PositionsSeen | None = None  # of the last forward
        self.frozen = False
        self._pending: dict[int, int] = {}  # layer -> tokens it held before a look-ahead draft, awaiting eviction
        self._drafted: dict[int, list[torch.Tensor]] = {}  # layer -> attention rows of the draft's queries
        self._drafting = False
        self._switch = ForwardSwitch(model, self)

    def __repr__(self):
        return (
            f"EvictionCache(policy={self.policy.name!r}, budget={self.budget}, block_size={self.block_size}, "
            f"sink_tokens={self.sink_tokens}, recent_window={self.recent_window}, gqa={self.gqa!r})"
        )

    def close(self) -> None:
        """Remove the cache's hooks from the model (also done when the cache is garbage-collected). A closed cache
        refuses further forwards."""
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

    def reset(self) -> None:
        """Forget every token and all scoring state, ready for a new sequence."""
        super().reset()
        self.frozen = False
        self._peak_kv_bytes = self._total_bytes = 0
        self._held_bytes = [0] * len(self.layers)
        self._generator = None
        self._mask_seen = self._positions_seen = None

    def snapshot(self) -> CacheSnapshot:
        """Record the current state so that `restore` can return to it (e.g. to answer several questions about one
        compressed context). Free: the cache never writes into its tensors, it replaces them, so they are shared."""
        generator = self._generator.get_state() if self._generator is not None else None
        return CacheSnapshot([copy.copy(layer) for layer in self.layers], generator, self._peak_kv_bytes)

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Return to the state `snapshot` recorded; the snapshot stays valid for further restores."""
        if len(snapshot.layers) != len(self.layers):
            raise ValueError(f"the snapshot has {len(snapshot.layers)} layers but the cache has {len(self.layers)}")
        self.layers = [copy.copy(layer) for layer in snapshot.layers]
        self._mask_seen = self._positions_seen = None
        self._peak_kv_bytes = snapshot.peak_kv_bytes
        self._held_bytes = [layer_bytes(layer) for layer in self.layers]
        self._total_bytes = sum(self._held_bytes)
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

    def after_attention(self, module: nn.Module, queries, keys, values, attention_mask, kwargs: dict) -> None:
        """Score the tokens of ``module``'s layer and keep the top ``budget``: called by caote's attention function
        with the call's final queries ``(B, H_q, q, d)``, keys and values ``(B, H_kv, N, d)``, mask and arguments."""
        index = module.layer_idx
        layer = self.layers[index]
        self._account(index)
        self._peak_kv_bytes = max(self._peak_kv_bytes, self._total_bytes)
        if not isinstance(layer, EvictionLayer):  # a sliding-window layer of a hybrid model keeps its own rule
            return
        new = layer.new_tokens
        if new > self.block_size and self.policy.evicts and index == self._first_evicting:  # once per forward
            logger.warning(
                "EvictionCache received %d tokens in one forward (block size %d): attention over them is not "
                "bounded by the budget; pass prefill_chunk_size=%d to generate",
                new,
                self.block_size,
                self.block_size,
            )
        real = self._real_slots(attention_mask, layer.keys)
        self._record_positions(layer, kwargs, real)
        if not self.policy.evicts or self.frozen:
            return
        if self._drafting:
            self._record_draft(index, module, queries, attention_mask, kwargs, real)
            return
        self._record_attention(layer, module, queries, attention_mask, kwargs, real)
        if layer.retained <= self.budget:
            return
        if new > 1 and self.policy.base.lookahead:
            self._pending[index] = layer.retained  # evicted in `after_forward`, once the draft's queries are seen
            return
        kept = self.budget if new > 1 else self.budget - self.decode_eviction_interval + 1
        self._evict(index, kept)

    def _evict(self, index: int, kept: int, ahead_rows: torch.Tensor | None = None) -> None:
        """Score layer ``index``'s tokens and keep its top ``kept``."""
        layer = self.layers[index]
        padded = layer.padded  # else every slot is real: the scores and the protection skip their masking
        if self.policy.base.recency and not padded:
            layer.keep(oldest_after_sinks_dropped(layer.positions, kept, self.sink_tokens))
            self._account(index)
            return
        inputs = ScoreInputs(
            keys=layer.keys,
            values=layer.values,
            positions=layer.positions,
            real=layer.positions >= 0 if padded else None,
            accumulated=layer.accumulated,
            recent_rows=layer.recent_rows,
            generator=self._random_generator() if self.policy.base.needs_random else None,
            future=self.future.at(index, layer.cumulative_length, layer.positions)
            if self.policy.base.needs_future
            else None,
            ahead_rows=ahead_rows,
        )
        scores = self._protect(self.policy.scores(inputs, self.gqa), layer.positions, padded)
        layer.keep(scores.topk(kept, dim=-1, sorted=False).indices.sort(dim=-1).values)
        self._account(index)

    def after_forward(self, model: nn.Module, output, forward_kwargs: dict) -> None:
        """Called when a forward given this cache ends: a look-ahead policy (``caote-ahead``) whose prompt block
        overflowed the budget drafts its tokens now (`caote.lookahead.draft`), drops their keys and values, and
        evicts every waiting layer with the draft's queries among its rows. ``output`` is None when the forward
        raised."""
        if not self._pending or self._drafting:
            return
        if output is None:
            self._pending = {}
            return
        self._drafting = True
        try:
            draft(model, self, output[0], forward_kwargs, self.policy.base.lookahead)
        finally:
            self._drafting = False
            pending, self._pending = self._pending, {}
            drafted, self._drafted = self._drafted, {}
        for index, tokens in pending.items():
            layer = self.layers[index]
            layer.cumulative_length -= layer.retained - tokens
            layer.keys, layer.values = layer.keys[..., :tokens, :], layer.values[..., :tokens, :]
            layer.positions = layer.positions[..., :tokens]
            self._evict(index, self.budget, torch.cat(drafted[index], dim=-2) if index in drafted else None)

    def _record_draft(self, index, module, queries, attention_mask, kwargs, real) -> None:
        """Keep a draft query's attention over the tokens a waiting layer held before the draft."""
        tokens = self._pending.get(index)
        if tokens is None:
            return
        layer = self.layers[index]
        row = attention_probabilities(module, queries[:, :, -1:], layer.keys, layer.values, attention_mask, kwargs)
        if real is not None:
            row = row * real[:, -1:][:, None, :, None]
        self._drafted.setdefault(index, []).append(row[..., :tokens])

    def _account(self, index: int) -> None:
        """Bring the running total of KV bytes up to date with layer ``index`` (O(1), unlike summing all layers)."""
        held = layer_bytes(self.layers[index])
        self._total_bytes += held - self._held_bytes[index]
        self._held_bytes[index] = held

    def _real_slots(self, attention_mask: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor | None:
        """``(B, N)`` bool: which cache slots hold real tokens rather than left padding; None when none is padding.

        The newest query of a step sees every earlier slot unless it is padding, so its row of the 4D mask (bool for
        sdpa, additive float for eager) is the padding mask of the slots. Every layer of a forward gets the same mask
        object, so the answer is worked out once per forward (the mask is held weakly: it is not kept alive)."""
        if attention_mask is None:
            return None
        if self._mask_seen is not None and self._mask_seen[0]() is attention_mask:
            return self._mask_seen[1]
        row = attention_mask[:, 0, -1, -keys.shape[-2] :]
        real = (row if row.dtype == torch.bool else row == 0).expand(keys.shape[0], -1)
        real = None if bool(real.all()) else real.clone()
        self._mask_seen = (weakref.ref(attention_mask), real)
        return real

    def _record_positions(self, layer: EvictionLayer, kwargs: dict, real: torch.Tensor | None) -> None:
        batch, kv_heads, new = layer.keys.shape[0], layer.keys.shape[1], layer.new_tokens
        device = layer.keys.device
        position_ids = kwargs.get("position_ids")
        # every layer of a forward records the same positions: worked out once per forward (and shape, device)
        key = (layer.cumulative_length, new, batch, kv_heads, device)
        seen = self._positions_seen
        if seen is None or seen.position_ids is not position_ids or seen.real is not real or seen.key != key:
            if position_ids is None:
                position_ids = torch.arange(layer.cumulative_length - new, layer.cumulative_length, device=device)
            positions = position_ids.to(device).view(-1, new).expand(batch, new)
            if real is not None:
                positions = positions.masked_fill(~real[:, -new:], -1)
            positions = positions.unsqueeze(1).expand(batch, kv_heads, new).contiguous()
            self._positions_seen = PositionsSeen(kwargs.get("position_ids"), real, key, positions)
        positions = self._positions_seen.positions
        layer.padded = layer.padded or real is not None
        layer.positions = positions if layer.positions is None else torch.cat([layer.positions, positions], dim=-1)

    def _record_attention(self, layer, module, queries, attention_mask, kwargs, real) -> None:
        """Compute the attention rows the base score reads and fold them into the layer's history.

        Rows are computed only when the policy will read them: every row for a running sum (H2O), otherwise only
        while the layer is within the base's query window of its next eviction; a cache with room to spare does no
        scoring work. Probabilities are the family's eager attention over the call's final queries, in float32
        under every backend (eager's own are rounded to the model's dtype), so the backend does not change the kept
        set."""
        base = self.policy.base
        if base.query_rows == "none":
            return
        if not self._rows_needed(layer):
            layer.recent_rows = None  # rows this old fall out of the window before the next eviction
            return
        new = layer.new_tokens
        rows = new if base.query_rows == "all" else min(base.query_window, new)
        probabilities = attention_probabilities(
            module, queries[:, :, -rows:], layer.keys, layer.values, attention_mask, kwargs
        )
        if real is not None:  # padding queries add nothing
            probabilities = probabilities * real[:, -rows:][:, None, :, None]
        if base.query_rows == "all":
            layer.accumulated = accumulate_attention(layer.accumulated, probabilities)
        else:
            layer.recent_rows = keep_recent_rows(layer.recent_rows, probabilities, base.query_window)

    def _rows_needed(self, layer: EvictionLayer) -> bool:
        """Whether this step's attention rows can still be in the base's query window at the next eviction: that
        eviction comes once the layer holds more than ``budget`` tokens, so rows of a layer holding ``budget - w``
        or fewer are ``w`` or more queries old by then. A running sum (H2O) needs every row."""
        base = self.policy.base
        return base.query_rows == "all" or layer.retained > self.budget - base.query_window

    def _protect(self, scores: torch.Tensor, positions: torch.Tensor, padded: bool = True) -> torch.Tensor:
        """Sinks and the recent window always stay; padding always goes first (which keeps the slots that the 2D
        padding mask marks as padding exactly the retained padding slots)."""
        newest = positions.amax(dim=-1, keepdim=True)
        protected = (positions < self.sink_tokens) | (positions > newest - self.recent_window)
        if not padded:
            return scores.masked_fill(protected, float("inf"))
        scores = scores.masked_fill(protected & (positions >= 0), float("inf"))
        return scores.masked_fill(positions < 0, float("-inf"))

    def _random_generator(self) -> torch.Generator:
        """One CPU generator for every layer: the numbers are drawn on the CPU and moved to each layer's device, so
        layers spread over several devices draw from one reproducible stream."""
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed)
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
        return CacheStats(seen, kept, seen - kept, now, max(self._peak_kv_bytes, now), full)

    @property
    def _first_evicting(self) -> int:
        return next(index for index, layer in enumerate(self.layers) if isinstance(layer, EvictionLayer))


def validate_settings(
    policy: Policy, budget, block_size, sink_tokens, recent_window, gqa, decode_eviction_interval=1
) -> int:
    """Check the cache settings with one-line errors naming the value and what is allowed; returns the recent window
    in effect (``None`` means the policy's default, a share of the budget for H2O)."""
    for name, value, low in (
        ("budget", budget, 1),
        ("block_size", block_size, 1),
        ("sink_tokens", sink_tokens, 0),
        ("recent_window", 0 if recent_window is None else recent_window, 0),
        ("decode_eviction_interval", decode_eviction_interval, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if recent_window is None:
        default = policy.base.recent_window if policy.evicts else 0
        recent_window = int(default * budget) if isinstance(default, float) else default
    if budget <= sink_tokens + recent_window:
        raise ValueError(
            f"budget {budget} leaves no room to choose: it must exceed sink_tokens + recent_window "
            f"= {sink_tokens} + {recent_window}"
        )
    if budget - decode_eviction_interval + 1 <= sink_tokens + recent_window:
        raise ValueError(
            f"decode_eviction_interval {decode_eviction_interval} is too large for budget {budget}: "
            f"budget - interval + 1 must exceed sink_tokens + recent_window = {sink_tokens} + {recent_window}"
        )
    if gqa not in GQA_AGGREGATIONS:
        raise ValueError(f"gqa must be one of {', '.join(GQA_AGGREGATIONS)}, got {gqa!r}")
    return recent_window
