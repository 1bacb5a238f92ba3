"""`EvictionLayer`: one full-attention layer of an `EvictionCache`, which owns its eviction.

It holds the retained keys and values, their absolute positions and what its policy remembers of the attention rows
(`caote.history`), and runs its own step of the data path:

    attention probabilities -> base score -> value-aware transform -> GQA aggregation -> protect -> keep top-b -> gather

(`record`: the rows; `evict`: `Policy.scores`, `protect`, ``topk``, `keep`). When a layer is evicted is its
policy's strategy (`caote.strategies`); the cache around it holds the hooks, the per-forward bookkeeping, the
statistics and snapshots.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from caote.attention import attention_probabilities
from caote.policies import ScoreInputs
from caote.settings import CacheSettings


def layer_bytes(layer) -> int:
    """Bytes of the keys and values a cache layer (of any kind) holds now."""
    if not layer.is_initialized or layer.keys.dim() < 3:
        return 0
    return layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()


class EvictionLayer(DynamicLayer):
    """One layer's retained keys/values plus what its scores need: absolute positions and attention history.

    ``get_seq_length`` counts every token seen (so RoPE positions stay absolute); ``keys.shape[-2]`` is the number
    retained. Retained tokens stay in arrival order.
    """

    def __init__(self, settings: CacheSettings):
        super().__init__()
        self.settings = settings
        self.cumulative_length = 0
        self.new_tokens = 0
        self.positions: torch.Tensor | None = None  # (B, H_kv, N) int64, -1 = padding
        self.history: torch.Tensor | None = None  # the policy's `caote.history` of attention rows, token axis last
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
        # Retained tokens sit just before the new ones in the mask; padding slots stay at the front (see `protect`).
        return self.retained + query_length, self.cumulative_length - self.retained

    # -- what the scores read ------------------------------------------------------------------------------------

    def add_positions(self, positions: torch.Tensor, padded: bool) -> None:
        """Append the absolute positions ``(B, H_kv, new)`` of the newest tokens (``-1`` for padding)."""
        self.padded = self.padded or padded
        self.positions = positions if self.positions is None else torch.cat([self.positions, positions], dim=-1)

    def record(self, module: nn.Module, queries, mask, kwargs: dict, real: torch.Tensor | None) -> None:
        """Fold the attention rows the policy's history reads into it, computing only rows it will still hold at the
        next eviction (a layer with room to spare does no scoring work). Probabilities are the family's eager
        attention over the call's final queries, in float32 under every backend, so the backend does not change
        the kept set."""
        history = self.settings.policy.base.history
        rows = 0 if history is None else history.rows(self.new_tokens, self.retained, self.settings.budget)
        if rows == 0:  # no history, or rows too old to reach the next eviction
            self.history = None
            return
        probabilities = attention_probabilities(module, queries[:, :, -rows:], self.keys, self.values, mask, kwargs)
        if real is not None:  # padding queries add nothing
            probabilities = probabilities * real[:, -rows:][:, None, :, None]
        self.history = history.fold(self.history, probabilities)

    # -- the eviction ----------------------------------------------------------------------------------------------

    def evict(self, kept: int, random: Callable[[], torch.Generator], **inputs) -> None:
        """Keep the ``kept`` tokens of highest protected score (base score -> transform -> GQA, `Policy.scores`);
        ``inputs`` are the strategy's extra `ScoreInputs` (``future``, ``ahead_rows``)."""
        settings, base = self.settings, self.settings.policy.base
        padded = self.padded  # else every slot is real: the scores and the protection skip their masking
        if base.keep_unscored is not None and not padded:
            self.keep(base.keep_unscored(self.positions, kept, settings.sink_tokens))
            return
        scores = settings.policy.scores(
            ScoreInputs(
                keys=self.keys,
                values=self.values,
                positions=self.positions,
                real=self.positions >= 0 if padded else None,
                history=self.history,
                random=random,
                **inputs,
            ),
            settings.aggregation,
        )
        self.keep(self.protect(scores, padded).topk(kept, dim=-1, sorted=False).indices.sort(dim=-1).values)

    def protect(self, scores: torch.Tensor, padded: bool = True) -> torch.Tensor:
        """Sinks and the recent window always stay; padding always goes first (which keeps the slots that the 2D
        padding mask marks as padding exactly the retained padding slots)."""
        positions = self.positions
        newest = positions.amax(dim=-1, keepdim=True)
        protected = (positions < self.settings.sink_tokens) | (positions > newest - self.settings.recent)
        if not padded:
            return scores.masked_fill(protected, float("inf"))
        scores = scores.masked_fill(protected & (positions >= 0), float("inf"))
        return scores.masked_fill(positions < 0, float("-inf"))

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
        if self.history is not None:  # per query head: each KV head's choice repeated over its group
            history = self.history
            index = indices.repeat_interleave(history.shape[1] // kv_heads, dim=1)
            if history.dim() == 4:
                index = index.unsqueeze(2).expand(-1, -1, history.shape[2], -1)
            self.history = history.gather(-1, index)

    def truncate(self, tokens: int) -> None:
        """Drop every slot after the first ``tokens`` (a look-ahead draft's), as if those tokens were never seen."""
        self.cumulative_length -= self.retained - tokens
        self.keys, self.values = self.keys[..., :tokens, :], self.values[..., :tokens, :]
        self.positions = self.positions[..., :tokens]

    def reset(self) -> None:
        super().reset()
        self.new_tokens = 0
        self.padded = False
        self.positions = self.history = None

    def _refuse(self, *args, **kwargs):
        raise ValueError(
            "EvictionCache cannot be cropped, reordered or re-batched: beam search, assisted/speculative decoding "
            "and contrastive search are not supported; use greedy or sampling with num_beams=1"
        )

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _refuse
