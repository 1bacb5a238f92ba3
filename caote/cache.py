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
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from caote.attention import attention_modules, attention_rows, finish_queries
from caote.policies import SNAPKV_WINDOW, Policy, ScoreInputs, parse_policy
from caote.scoring import GQA_AGGREGATIONS, accumulate_attention, keep_recent_rows

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 128
DEFAULT_SINK_TOKENS = 4


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
        self.positions = self.accumulated = self.recent_rows = None

    def _refuse(self, *args, **kwargs):
        raise ValueError(
            "EvictionCache cannot be cropped, reordered or re-batched: beam search, assisted/speculative decoding "
            "and contrastive search are not supported; use greedy or sampling with num_beams=1"
        )

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _refuse


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
        The Llama / Mistral / Qwen2 / Qwen3 model the cache serves; hooks are added to its attention modules once.
    budget:
        Tokens kept per layer (and per KV head) after each step.
    policy:
        ``"full"``, ``"streamingllm"``, ``"h2o"``, ``"tova"``, ``"snapkv"``, ``"keydiff"``, ``"knorm"``, ``"random"``
        or ``"<base>+caote"`` / ``"<base>+fastcaote"`` (see `caote.policies`).
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
        Plain base scores are always averaged over the group.
    seed:
        Seed of the ``random`` policy.
    decode_eviction_interval:
        Decoding evicts one token per step by default (1). With ``k > 1`` a decode step that overflows the budget
        evicts ``k`` tokens at once, so scoring runs every ``k`` steps; the cache then holds between
        ``budget - k + 1`` and ``budget`` tokens. Prefill blocks always evict down to ``budget``.
    """

    def __init__(
        self,
        model: nn.Module,
        budget: int,
        policy: str = "tova+caote",
        block_size: int = DEFAULT_BLOCK_SIZE,
        sink_tokens: int = DEFAULT_SINK_TOKENS,
        recent_window: int | None = None,
        gqa: str = "rss",
        seed: int = 0,
        decode_eviction_interval: int = 1,
    ):
        self.policy: Policy = parse_policy(policy)
        modules = attention_modules(model)
        self.recent_window = validate_settings(
            self.policy, budget, block_size, sink_tokens, recent_window, gqa, decode_eviction_interval
        )
        self.decode_eviction_interval = decode_eviction_interval
        super().__init__(layers=[EvictionLayer() for _ in modules])
        self.budget, self.block_size, self.sink_tokens, self.gqa, self.seed = budget, block_size, sink_tokens, gqa, seed
        self.model_name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        self._modules = modules
        self._generator: torch.Generator | None = None
        self._peak_kv_bytes = 0
        self._mask_seen: tuple[torch.Tensor, torch.Tensor | None] | None = None
        install_hooks(modules)

    def __repr__(self):
        return (
            f"EvictionCache(policy={self.policy.name!r}, budget={self.budget}, block_size={self.block_size}, "
            f"sink_tokens={self.sink_tokens}, recent_window={self.recent_window}, gqa={self.gqa!r})"
        )

    # -- generate integration ------------------------------------------------------------------------------------

    @property
    def _is_user_defined(self) -> bool:
        return True

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        # `generate` sets this on every user-supplied cache before it starts: the hook that refuses stale state.
        if self.get_seq_length() > 0:
            raise ValueError(
                f"this EvictionCache already holds {self.get_seq_length()} tokens from an earlier call; "
                "call cache.reset() or build a new EvictionCache for every generate call"
            )

    def reset(self) -> None:
        """Forget every token and all scoring state, ready for a new sequence."""
        super().reset()
        self._peak_kv_bytes = 0
        self._generator = None

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
        self._peak_kv_bytes = snapshot.peak_kv_bytes
        if snapshot.generator_state is not None and self._generator is not None:
            self._generator.set_state(snapshot.generator_state)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        if self.policy.evicts and layer.retained > self.budget:
            raise ValueError(
                f"layer {layer_idx} holds {layer.retained} tokens, over the budget of {self.budget}, so its last step "
                f"was never scored: this EvictionCache was built for {self.model_name!r} and the model running it "
                "has no caote hooks; build an EvictionCache with that model"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # -- eviction ------------------------------------------------------------------------------------------------

    def after_attention(self, module: nn.Module, kwargs: dict, attention_weights: torch.Tensor | None) -> None:
        """Score the tokens of ``module``'s layer and keep the top ``budget`` (called by the attention hook)."""
        if self._modules[module.layer_idx] is not module:
            raise ValueError(f"this EvictionCache was built for {self.model_name!r}; build a new one for each model")
        layer: EvictionLayer = self.layers[module.layer_idx]
        new = layer.new_tokens
        if new > self.block_size and self.policy.evicts and module.layer_idx == 0:  # once per forward
            logger.warning(
                "EvictionCache received %d tokens in one forward (block size %d): attention over them is not "
                "bounded by the budget; pass prefill_chunk_size=%d to generate",
                new,
                self.block_size,
                self.block_size,
            )
        projected_queries = module.__dict__.pop("_caote_projected_queries", None)
        real = self._real_slots(kwargs.get("attention_mask"), layer.keys)
        self._record_positions(layer, kwargs, real)
        self._peak_kv_bytes = max(self._peak_kv_bytes, self.kv_bytes())
        if not self.policy.evicts:
            return
        self._record_attention(layer, module, kwargs, attention_weights, projected_queries, real)
        if layer.retained <= self.budget:
            return
        kept = self.budget if new > 1 else self.budget - self.decode_eviction_interval + 1
        inputs = ScoreInputs(
            layer.keys,
            layer.values,
            layer.positions,
            layer.accumulated,
            layer.recent_rows,
            self._random_generator(layer.keys.device),
        )
        scores = self._protect(self.policy.scores(inputs, self.gqa), layer.positions)
        layer.keep(scores.topk(kept, dim=-1, sorted=False).indices.sort(dim=-1).values)

    def _real_slots(self, attention_mask: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor | None:
        """``(B, N)`` bool: which cache slots hold real tokens rather than left padding; None when none is padding.

        The newest query of a step sees every earlier slot unless it is padding, so its row of the 4D mask (bool for
        sdpa, additive float for eager) is the padding mask of the slots. Every layer of a forward gets the same mask
        object, so the answer is worked out once per forward."""
        if attention_mask is None or attention_mask.dim() != 4:
            return None
        if self._mask_seen is not None and self._mask_seen[0] is attention_mask:
            return self._mask_seen[1]
        row = attention_mask[:, 0, -1, -keys.shape[-2] :]
        real = (row if row.dtype == torch.bool else row == 0).expand(keys.shape[0], -1)
        real = None if bool(real.all()) else real
        self._mask_seen = (attention_mask, real)
        return real

    def _record_positions(self, layer: EvictionLayer, kwargs: dict, real: torch.Tensor | None) -> None:
        batch, kv_heads, new = layer.keys.shape[0], layer.keys.shape[1], layer.new_tokens
        device = layer.keys.device
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(layer.cumulative_length - new, layer.cumulative_length, device=device)
        positions = position_ids.to(device).view(-1, new).expand(batch, new)
        if real is not None:
            positions = positions.masked_fill(~real[:, -new:], -1)
        positions = positions.unsqueeze(1).expand(batch, kv_heads, new)
        layer.positions = positions if layer.positions is None else torch.cat([layer.positions, positions], dim=-1)

    def _record_attention(self, layer, module, kwargs, attention_weights, projected_queries, real) -> None:
        """Compute the attention rows the base score reads and fold them into the layer's history."""
        kind = self.policy.base.query_rows
        if kind == "none":
            return
        new = layer.new_tokens
        rows = {"last": 1, "window": min(SNAPKV_WINDOW, new), "all": new}[kind]
        if attention_weights is not None:  # eager attention already produced them
            probabilities = attention_weights[:, :, -rows:, :].float()
        else:
            if projected_queries is None:
                projected_queries = module.q_proj(kwargs["hidden_states"][:, -rows:])
            cos, sin = kwargs["position_embeddings"]
            queries = finish_queries(module, projected_queries[:, -rows:], (cos[:, -rows:], sin[:, -rows:]))
            probabilities = attention_rows(queries, layer.keys, module.scaling, real)
        if real is not None:  # padding queries add nothing
            probabilities = probabilities * real[:, -rows:][:, None, :, None]
        if kind == "all":
            layer.accumulated = accumulate_attention(layer.accumulated, probabilities)
        else:
            layer.recent_rows = keep_recent_rows(
                layer.recent_rows, probabilities, SNAPKV_WINDOW if kind == "window" else 1
            )

    def _protect(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Sinks and the recent window always stay; padding always goes first (which keeps the slots that the 2D
        padding mask marks as padding exactly the retained padding slots)."""
        newest = positions.amax(dim=-1, keepdim=True)
        protected = (positions >= 0) & ((positions < self.sink_tokens) | (positions > newest - self.recent_window))
        scores = scores.masked_fill(protected, float("inf"))
        return scores.masked_fill(positions < 0, float("-inf"))

    def _random_generator(self, device: torch.device) -> torch.Generator | None:
        if self.policy.base.name != "random":
            return None
        if self._generator is None:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return self._generator

    # -- statistics ----------------------------------------------------------------------------------------------

    def kv_bytes(self) -> int:
        """Bytes of keys and values held right now, over all layers."""
        return sum(
            layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
            for layer in self.layers
            if layer.is_initialized
        )

    def stats(self) -> CacheStats:
        """Tokens seen / kept / evicted per layer and KV bytes (now, at peak, and what a full cache would hold)."""
        first = self.layers[0]
        seen, kept = first.get_seq_length(), first.retained
        now = self.kv_bytes()
        full = now * seen // kept if kept else 0
        return CacheStats(seen, kept, seen - kept, now, max(self._peak_kv_bytes, now), full)


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


def _before_attention_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    module._caote_keep_queries = isinstance(cache, EvictionCache) and cache.policy.evicts


def _keep_projected_queries(attention: nn.Module):
    def hook(q_proj: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if getattr(attention, "_caote_keep_queries", False):
            attention._caote_projected_queries = output

    return hook


def _after_attention_hook(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, EvictionCache):
        if "hidden_states" not in kwargs and args:
            kwargs = {**kwargs, "hidden_states": args[0]}
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        cache.after_attention(module, kwargs, weights)


def install_hooks(modules: list[nn.Module]) -> None:
    """Add the eviction hooks to each attention module once; they act only on forwards given an EvictionCache.

    The query projection's output is kept for the scores (instead of projecting again); the hook after attention
    scores and evicts."""
    for module in modules:
        if getattr(module, "_caote_hooks", None) is None:
            module._caote_hooks = (
                module.register_forward_pre_hook(_before_attention_hook, with_kwargs=True),
                module.q_proj.register_forward_hook(_keep_projected_queries(module)),
                module.register_forward_hook(_after_attention_hook, with_kwargs=True),
            )
