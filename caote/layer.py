"""`EvictionLayer`: one full-attention layer of an `EvictionCache`, which owns its eviction.

It holds the retained keys and values, their absolute positions and what its policy remembers of the attention rows
(`caote.history`), and runs its part of the data path:

    attention probabilities -> base score -> value-aware transform -> GQA aggregation -> protect -> keep top-b -> gather

(`caote.recording`: the rows; `evict`: the policy's selection, `caote.policies.Policy.tokens_to_keep` /
``slots_to_free``; `keep`: the gather). When a layer is evicted is its policy's strategy (`caote.strategies`); a
decode step's layers in place may be scored together as one stack (`caote.stacking`). The cache around it holds the
hooks, the per-forward bookkeeping, the statistics and snapshots.

Prompt blocks are appended and gathered in arrival order. Decode steps may write into fixed slots instead
(`caote.slots.SlotBuffer`, the layer's ``slots`` while it decodes in place): then an eviction only marks slots free.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from transformers.cache_utils import DynamicLayer

from caote.attention import SlotViews
from caote.bases import ScoreInputs
from caote.positions import PADDING, held
from caote.settings import CacheSettings
from caote.slots import SlotBuffer, masked_slots_mask, protected, sinks_of
from caote.value_aware import group_index, group_size


def layer_bytes(layer) -> int:
    """Bytes of the keys and values a cache layer (of any kind) holds now."""
    if not layer.is_initialized or layer.keys.dim() < 3:
        return 0
    return layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()


class EvictionLayer(DynamicLayer):
    """One layer's retained keys/values plus what its scores need: absolute positions and attention history.

    ``get_seq_length`` counts every token seen (so RoPE positions stay absolute); `retained` the tokens held.
    ``slots_allowed`` (set by the cache from its strategy) lets decode steps write into fixed slots (`in_place`
    while they do).
    """

    def __init__(self, settings: CacheSettings):
        super().__init__()
        self.settings = settings
        self.cumulative_length = 0
        self.new_tokens = 0
        self.positions: torch.Tensor | None = None  # (B, H_kv, N) int64, `caote.positions` sentinels where no token
        self.history: torch.Tensor | None = None  # the policy's `caote.history` of attention rows, token axis last
        self.padded = False  # a padding slot was recorded since the last reset (it may since have been evicted)
        self.masked_slots = False  # a row of a padded batch holds slots beyond its own tokens (`keep`)
        self.slots_allowed = False
        self.slots: SlotBuffer | None = None  # while decoding in place

    @property
    def in_place(self) -> bool:
        return self.slots is not None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if self.in_place and (new > 1 or self.slots.free.shape[-1] == 0):  # a new prompt turn, or no slot free (a
            self.leave_slots()  # forward that raised before its eviction): back to arrival order for this forward
        elif not self.in_place and new == 1 and self.slots_allowed and self.retained == self.settings.budget:
            if not (self.padded and self.settings.decode_eviction_interval > 1):  # its rows evict out of phase
                self.enter_slots()
        self.new_tokens = new
        self.cumulative_length += new
        if self.in_place:
            self.slots.write(
                self.keys, self.values, self.positions, key_states, value_states, self.cumulative_length - 1
            )
            return self.keys, self.values
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    @property
    def retained(self) -> int:
        """Slots holding a token (or a padded row's masked slot): all but the free ones."""
        if self.keys is None or self.keys.dim() < 3:
            return 0
        return self.keys.shape[-2] - (self.slots.free.shape[-1] if self.in_place else 0)

    # -- decoding in place ---------------------------------------------------------------------------------------

    def enter_slots(self) -> None:
        """Pack the retained tokens into fixed slots, one of them free (`caote.slots.SlotBuffer.pack`). A layer
        holding more than the budget (a restored snapshot of a larger cache) decodes in arrival order until an
        eviction brings it to the budget."""
        self.keys, self.values, self.positions, self.history, self.slots = SlotBuffer.pack(
            self.keys,
            self.values,
            self.positions,
            self.history,
            self.settings.sink_tokens,
            self.settings.policy.value_aware,  # the bounds of `caote.bounds.lowest_errors` read the value norms
        )

    def leave_slots(self) -> None:
        """Back to arrival order: the held slots gathered by position (free ones sort first, then padding)."""
        if self.in_place:
            free = self.slots.free.shape[-1]
            self.slots = None
            self.keep(self.positions.argsort(dim=-1, stable=True)[..., free:])

    def adopt(self, settings: CacheSettings, slots_allowed: bool) -> None:
        """Evict as ``settings`` say from now on (a restored snapshot, perhaps of another cache); slots of another
        schedule or budget return to arrival order."""
        self.settings, self.slots_allowed = settings, slots_allowed
        out_of_phase = self.padded and settings.decode_eviction_interval > 1  # its rows may evict at other steps
        if self.in_place and (not slots_allowed or out_of_phase or self.keys.shape[-2] != settings.budget + 1):
            self.leave_slots()
        elif self.in_place:  # the sinks may be more or fewer
            self.slots.sinks = sinks_of(self.positions, settings.sink_tokens)

    def slot_views(self) -> SlotViews:
        """The views of the slot buffers `caote.attention.decode_attention` reads."""
        return self.slots.slot_views(self.keys, self.values)

    def attention_mask(self, attention_mask, queries: torch.Tensor, additive: bool):
        """The mask of this forward's ``queries`` over the layer: the model's, but for a lone query in place the one
        over the slots (`caote.slots.SlotBuffer.mask`), and for a padded batch's rows out of phase (`keep`) one
        that also hides their masked slots (`caote.slots.masked_slots_mask`)."""
        if self.in_place and queries.shape[-2] == 1:
            return self.slots.mask(self.positions, attention_mask, queries, additive, self.padded)
        if self.masked_slots:
            return masked_slots_mask(self.positions, attention_mask, queries, additive)
        return attention_mask

    def kept_positions(self) -> torch.Tensor:
        """``(B, H_kv, retained)``: the positions of the tokens held, in arrival order (``-1`` for padding)."""
        if not self.in_place:
            return self.positions
        return self.positions.sort(dim=-1).values[..., self.slots.free.shape[-1] :]

    def detached_copy(self) -> EvictionLayer:
        """A copy that later in-place writes of either do not reach (buffers are shared unless decoding in place)."""
        twin = copy.copy(self)
        if self.in_place:
            twin.slots = self.slots.copy()
            twin.keys, twin.values, twin.positions = self.keys.clone(), self.values.clone(), self.positions.clone()
            twin.history = None if self.history is None else self.history.clone()
        return twin

    @property
    def kv_bytes(self) -> int:
        """Bytes of the keys and values held now."""
        return layer_bytes(self)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Retained tokens sit just before the new ones in the mask; left padding stays at the front (see
        # `caote.policies.protect`), and the slots a padded batch's row masks among its tokens get their own mask
        # (`attention_mask`). In place, a decode step attends over every slot (`attention_mask` masks the
        # ones that hold no real token); a layer with no slot free goes back to arrival order in `update`, so it
        # gets the arrival-order sizes.
        if self.in_place and query_length == 1 and self.slots.free.shape[-1] > 0:
            return self.keys.shape[-2], self.cumulative_length + 1 - self.keys.shape[-2]
        return self.retained + query_length, self.cumulative_length - self.retained

    # -- what the scores read ------------------------------------------------------------------------------------

    def add_positions(self, positions: torch.Tensor, padded: bool) -> None:
        """Append the absolute positions ``(B, H_kv, new)`` of the newest tokens (``-1`` for padding); in place, write
        the step's token's into its slot."""
        self.padded = self.padded or padded
        if self.in_place:
            self.slots.place(self.positions, positions)
        else:
            self.positions = positions if self.positions is None else torch.cat([self.positions, positions], dim=-1)

    # -- the eviction ----------------------------------------------------------------------------------------------

    def evict(self, kept: int, random: Callable[[], torch.Generator], **inputs) -> None:
        """Keep the ``kept`` tokens of highest protected score; ``inputs`` are the strategy's extra `ScoreInputs`
        (``future``, ``ahead_rows``, ``predictor``). In place, free the others' slots."""
        if self.in_place:
            self.release(self.slots_to_free(self.retained - kept, random, inputs))
            return
        settings, base = self.settings, self.settings.policy.base
        if self.unscored:
            self.keep(base.kept_by_recency(self.positions, kept, settings.sink_tokens))
            return
        scoring = self.score_inputs(random, inputs)
        self.keep(*settings.policy.tokens_to_keep(scoring, kept, settings.budget, settings.aggregation))

    def slots_to_free(self, count: int, random: Callable[[], torch.Generator], inputs: dict) -> torch.Tensor:
        """In place: the ``count`` slots ``(B, H_kv, count)`` to free; a base that scores by recency alone picks them
        without scoring."""
        settings = self.settings
        if self.unscored:
            return settings.policy.base.freed_by_recency(self.positions, count, settings.sink_tokens)
        scoring = self.score_inputs(random, inputs)
        return settings.policy.slots_to_free(scoring, count, settings.aggregation, fused=settings.compile_decode)

    def release(self, slots: torch.Tensor) -> None:
        """In place: mark ``slots`` ``(B, H_kv, k)`` free (`caote.slots.SlotBuffer.release`)."""
        clears = self.history is not None and self.settings.policy.base.memory.carries_over(1)
        self.slots.release(self.positions, self.history, slots, clears)

    @property
    def unscored(self) -> bool:
        """Whether an eviction picks its tokens without scoring: a base that scores by recency alone
        (`caote.bases.BaseScore.kept_by_recency` / ``freed_by_recency``) while no slot holds padding."""
        return self.settings.policy.base.kept_by_recency is not None and not self.padded

    def score_inputs(self, random, inputs: dict) -> ScoreInputs:
        """What the scores read, the slots as the layer holds them; ``inputs``: the strategy's extra fields."""
        slots = self.slots
        return ScoreInputs(
            keys=self.keys,
            values=self.values,
            positions=self.positions,
            real=held(self.positions) if self.padded else None,
            history=self.history,
            random=random,
            new_tokens=self.new_tokens,
            protected=self.protected_slots(),
            output=None if slots is None else slots.output,
            value_norms=None if slots is None else slots.norms(self.values, self.positions),
            **inputs,
        )

    def protected_slots(self) -> torch.Tensor:
        """``(B, H_kv, N)`` bool: the slots that stay whatever their score, the sinks and the recent window (never
        padding nor a free slot)."""
        if self.in_place and not self.padded:  # the sinks' slots are known; the newest token is this step's
            return self.slots.protected(self.positions, self.settings.recent)
        return protected(self.positions, self.settings.sink_tokens, self.settings.recent, self.padded)

    def keep(self, indices: torch.Tensor, masked: torch.Tensor | None = None) -> None:
        """Gather the tokens ``indices`` ``(B, H_kv, b)`` (sorted) from every per-token tensor of the layer; the
        ``masked`` ones (a padded batch's rows, `caote.policies.Policy.tokens_to_keep`) are marked padding and
        masked until the next eviction drops them first."""
        batch, kv_heads, tokens, dim = self.keys.shape
        # Copy whole head_dim rows of the flattened (B * H_kv * N, d) tensors: far cheaper than element-wise gather.
        rows = (indices + torch.arange(batch * kv_heads, device=indices.device).view(batch, kv_heads, 1) * tokens).view(
            -1
        )
        self.keys = self.keys.reshape(-1, dim).index_select(0, rows).view(batch, kv_heads, -1, dim)
        value_dim = self.values.shape[-1]
        self.values = self.values.reshape(-1, value_dim).index_select(0, rows).view(batch, kv_heads, -1, value_dim)
        self.positions = self.positions.gather(2, indices)
        if self.history is not None:
            self.history = self.history.gather(-1, group_index(indices, self.history))
        if masked is not None and bool((masked & held(self.positions)).any()):
            self.positions = self.positions.masked_fill(masked, PADDING)
            if self.history is not None:  # what it remembered of them reaches no score (SnapKV's pooling included)
                gone = masked.repeat_interleave(group_size(self.history.shape[1], masked.shape[1]), dim=1)
                self.history = self.history.masked_fill(gone.unsqueeze(2) if self.history.dim() == 4 else gone, 0.0)
            self.masked_slots = True
        elif self.masked_slots:  # until the last slot it masked is evicted
            self.masked_slots = bool((self.positions == PADDING).any())

    def truncate(self, tokens: int) -> None:
        """Drop every slot after the first ``tokens`` (a look-ahead draft's), as if those tokens were never seen."""
        self.cumulative_length -= self.retained - tokens
        self.keys, self.values = self.keys[..., :tokens, :], self.values[..., :tokens, :]
        self.positions = self.positions[..., :tokens]

    def reset(self) -> None:
        super().reset()
        self.new_tokens = 0
        self.padded = self.masked_slots = False
        self.positions = self.history = self.slots = None

    def _refuse(self, *args, **kwargs):
        raise ValueError(
            "EvictionCache cannot be cropped, reordered or re-batched: beam search, assisted/speculative decoding "
            "and contrastive search are not supported; use greedy or sampling with num_beams=1"
        )

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _refuse
