"""`EvictionLayer`: one full-attention layer of an `EvictionCache`, which owns its eviction.

It holds the retained keys and values, their absolute positions and what its policy remembers of the attention rows
(`caote.history`), and runs its own step of the data path:

    attention probabilities -> base score -> value-aware transform -> GQA aggregation -> protect -> keep top-b -> gather

(`record`: the rows; `evict`: `Policy.scores`, `protect`, ``topk``, `keep`). When a layer is evicted is its
policy's strategy (`caote.strategies`); a decode step's layers in place may be scored together as one stack
(`evict_together`). The cache around it holds the hooks, the per-forward bookkeeping, the statistics and snapshots.

**Decoding in place.** Prompt blocks are appended and gathered as above, in arrival order. At the first one-token
forward that will evict, the layer packs its ``budget`` tokens into buffers of ``budget + 1`` slots, allocated once;
from then on each decoded token's key, value and position are written into a slot that an eviction freed, and an
eviction only marks its tokens' slots free (no gather of the cache). Slots are then out of arrival order: positions
travel with them, neighbour-reading scores (SnapKV's pooling) see the slots in position order, ties between equal
scores go to the older token, and a lone decoding query needs a mask only while slots are free (interval > 1) or
hold padding (`slot_mask`). A forward of more tokens (a new prompt turn) and `leave_slots` return to arrival order.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from caote.attention import SlotViews, attention_probabilities
from caote.policies import ScoreInputs
from caote.settings import CacheSettings

FREE = -2  # the position of a slot that holds no token while decoding in place (-1 is padding)
# the most bytes one stack of `evict_together` copies (the history, and the keys and values its scoring reads, counted
# as float32): a step's transient copies stay bounded whatever the model, budget and policy
STACK_BYTES = 64 * 2**20


def layer_bytes(layer) -> int:
    """Bytes of the keys and values a cache layer (of any kind) holds now."""
    if not layer.is_initialized or layer.keys.dim() < 3:
        return 0
    return layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()


# what a layer decoding in place writes in place (never replaces): a stack's copy of them may become the layers' own
# storage (`EvictionLayer.stacked`), so that the next step's stack is a view
HELD_BY_STACK = ("keys", "values", "positions", "history", "_sinks", "value_norms", "_normed")


def adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat(tensors)`` without a copy when the tensors (equal in shape) are already the consecutive pieces of
    one contiguous tensor along its first axis (a stack's, `EvictionLayer.stacked`): that tensor; else None."""
    first = tensors[0]
    whole = first._base
    if whole is None or whole.shape[0] != len(tensors) * first.shape[0] or whole.shape[1:] != first.shape[1:]:
        return None
    start, size = whole.storage_offset(), first.numel()
    for index, tensor in enumerate(tensors):
        if tensor._base is not whole or tensor.storage_offset() != start + index * size or not tensor.is_contiguous():
            return None
    return whole if whole.is_contiguous() else None


def history_index(slots: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """Slot indices ``(B, H_kv, k)`` as an index into a per-query-head ``history`` ``(B, H_q, [R,] N)``: each KV
    head's slots repeated over its query group (and over the rows)."""
    index = slots.repeat_interleave(history.shape[1] // slots.shape[1], dim=1)
    return index.unsqueeze(2).expand(-1, -1, history.shape[2], -1) if history.dim() == 4 else index


def clear_history(history: torch.Tensor, slots: torch.Tensor) -> None:
    """Zero, in place, what every query head's ``history`` ``(B, H_q, [R,] N)`` holds of the ``slots``
    ``(B, H_kv, k)`` (a KV head's query heads side by side, so the slots broadcast over the group as a view)."""
    batch, kv_heads, count = slots.shape
    grouped = history.view(batch, kv_heads, -1, *history.shape[2:])
    index = slots.view(batch, kv_heads, *(1,) * (history.dim() - 2), count).expand(*grouped.shape[:-1], count)
    grouped.scatter_(-1, index, 0.0)


class EvictionLayer(DynamicLayer):
    """One layer's retained keys/values plus what its scores need: absolute positions and attention history.

    ``get_seq_length`` counts every token seen (so RoPE positions stay absolute); `retained` the tokens held.
    ``decodes_in_place`` (set by the cache from its strategy) lets decode steps write into fixed buffers.
    """

    def __init__(self, settings: CacheSettings):
        super().__init__()
        self.settings = settings
        self.cumulative_length = 0
        self.new_tokens = 0
        self.positions: torch.Tensor | None = None  # (B, H_kv, N) int64, -1 = padding
        self.history: torch.Tensor | None = None  # the policy's `caote.history` of attention rows, token axis last
        self.padded = False  # a padding slot was recorded since the last reset (it may since have been evicted)
        self.decodes_in_place = False
        self.free: torch.Tensor | None = None  # in place: (B, H_kv, F) the empty slots, filled in this order
        self._written: torch.Tensor | None = None  # in place: (B, H_kv, 1) the slot of this step's token
        self._newest: torch.Tensor | None = None  # in place: (B, H_kv, 1) the position of this step's token
        self._sinks: torch.Tensor | None = None  # in place: (B, H_kv, S) bool, the slots of the sink tokens
        self._no_free: torch.Tensor | None = None  # in place: (B, H_kv, 0), ``free`` when every slot is taken
        self._views: SlotViews | None = None  # in place: the slot buffers' views, made once (`slot_views`)
        self._output: torch.Tensor | None = None  # in place: (B, H_kv, g, d) this step's attention output, when
        # caote computed it (`record`'s ``call_output``)
        self.value_norms: torch.Tensor | None = None  # in place, value-aware on the CPU: (B, H_kv, S) float32 ||v||
        self._normed: torch.Tensor | None = None  # the position each slot's norm was taken for (`held_value_norms`)

    @property
    def in_place(self) -> bool:
        return self.free is not None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if self.in_place and (new > 1 or self.free.shape[-1] == 0):  # a new prompt turn, or no slot free (a forward
            self.leave_slots()  # that raised before its eviction): back to the block path for this forward
        elif not self.in_place and new == 1 and self.decodes_in_place and self.retained == self.settings.budget:
            self.enter_slots()
        self.new_tokens = new
        self.cumulative_length += new
        if self.in_place:
            return self._write(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    @property
    def retained(self) -> int:
        if self.keys is None or self.keys.dim() < 3:
            return 0
        return self.keys.shape[-2] - (self.free.shape[-1] if self.free is not None else 0)

    # -- decoding in place ---------------------------------------------------------------------------------------

    def enter_slots(self) -> None:
        """Pack the ``budget`` retained tokens into buffers of ``budget + 1`` slots (a decode step's peak), the last
        one free; the layout equals arrival order until the first eviction. A layer holding more (a restored
        snapshot of a larger cache) decodes in arrival order until an eviction brings it to the budget."""
        batch, kv_heads, tokens, dim = self.keys.shape
        keys = self.keys.new_empty(batch, kv_heads, tokens + 1, dim)
        values = self.values.new_empty(batch, kv_heads, tokens + 1, self.values.shape[-1])
        keys[..., :tokens, :], values[..., :tokens, :] = self.keys, self.values
        positions = self.positions.new_full((batch, kv_heads, tokens + 1), FREE)
        positions[..., :tokens] = self.positions
        self.keys, self.values, self.positions = keys, values, positions
        if self.history is not None:
            self.history = torch.nn.functional.pad(self.history, (0, 1))
        self.free = torch.full((batch, kv_heads, 1), tokens, dtype=torch.long, device=keys.device)
        self._no_free = self.free[..., :0]
        self.find_sinks()
        if self.settings.policy.value_aware and keys.device.type == "cpu":  # the bounds of `lowest_errors` read them
            self.value_norms = positions.new_zeros(positions.shape, dtype=torch.float32)
            self._normed = torch.full_like(positions, FREE - 1)  # no slot's norm taken yet

    def find_sinks(self) -> None:
        """Record the slots of the sink tokens: never evicted, they stay theirs while the layer decodes in place
        (found again when the settings change, `adopt`)."""
        self._sinks = (self.positions >= 0) & (self.positions < self.settings.sink_tokens)

    def adopt(self, settings: CacheSettings, decodes_in_place: bool) -> None:
        """Evict as ``settings`` say from now on (a restored snapshot, perhaps of another cache); slots of another
        schedule or budget return to arrival order."""
        self.settings, self.decodes_in_place = settings, decodes_in_place
        if self.in_place and (not decodes_in_place or self.keys.shape[-2] != settings.budget + 1):
            self.leave_slots()
        elif self.in_place:
            self.find_sinks()

    def _write(self, key_states, value_states):
        """Write the step's token into the next free slot of every KV head, in place."""
        if self.free.shape[-1] == 1:  # the one free slot (interval 1): no slicing
            slot, self.free = self.free, self._no_free
        else:
            slot, self.free = self.free[..., :1], self.free[..., 1:]
        index = slot.unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[-1])
        self.keys.scatter_(2, index, key_states)
        if self.values.shape[-1] != self.keys.shape[-1]:
            index = slot.unsqueeze(-1).expand(-1, -1, -1, self.values.shape[-1])
        self.values.scatter_(2, index, value_states)
        # the slot is taken (`slot_mask` and a forward that raises before `add_positions` read it as such); the
        # true position follows in `add_positions`
        self.positions.scatter_(2, slot, self.cumulative_length - 1)
        self._written = slot
        return self.keys, self.values

    def slot_views(self) -> SlotViews:
        """The views of the slot buffers `caote.attention.decode_attention` reads, made once per buffer."""
        if self._views is None or not self._views.views(self.keys, self.values):
            self._views = SlotViews.of(self.keys, self.values)
        return self._views

    def held_value_norms(self) -> torch.Tensor | None:
        """``(B, H_kv, S)`` float32: the norm of every slot's value, taken once per token. A slot whose position is
        not the one its norm was taken for (a token decoded into it since) gets its norm now, so no write path has
        to remember it: positions name tokens, as the learned policy's remembered key terms assume too (a decoded
        token's position is one no held token has). None unless the layer keeps them (in place, value-aware, CPU)."""
        if self.value_norms is None:
            return None
        stale = (self._normed != self.positions).view(-1).nonzero().squeeze(-1)  # on the CPU the read-back is free
        if stale.numel():
            written = self.values.reshape(-1, self.values.shape[-1]).index_select(0, stale)
            self.value_norms.view(-1).index_copy_(0, stale, torch.linalg.vector_norm(written.float(), dim=-1))
            self._normed.view(-1).index_copy_(0, stale, self.positions.view(-1).index_select(0, stale))
        return self.value_norms

    def reads_row_now(self) -> bool:
        """A decode step in place at which the policy reads this step's attention row: every slot holds a real token
        (the lone query needs no mask), the layer overflows (it evicts now) and its history takes the row."""
        if not self.in_place or self.padded or self.free.shape[-1] or self.retained <= self.settings.budget:
            return False
        history = self.settings.policy.base.history
        return history is not None and history.rows(1, self.retained, self.settings.budget) > 0

    def slot_mask(self, attention_mask, queries: torch.Tensor, additive: bool):
        """The mask of a lone decoding query over the slots: the model's own while every slot holds a real token;
        else ``(B, H_q, 1, S)`` over the slots that do (bool, or additive in the queries' dtype)."""
        if not self.padded and self.free.shape[-1] == 0:
            return attention_mask
        real = (self.positions >= 0).repeat_interleave(queries.shape[1] // self.positions.shape[1], dim=1)
        real = real.unsqueeze(2)
        if not additive:
            return real
        return torch.zeros(real.shape, dtype=queries.dtype, device=real.device).masked_fill_(
            ~real, torch.finfo(queries.dtype).min
        )

    def _free_slots(self, evicted: torch.Tensor) -> None:
        """Mark the slots ``evicted`` ``(B, H_kv, k)`` free, forgetting what the history remembered of them."""
        self.positions.scatter_(2, evicted, FREE)
        # a history whose rows are all replaced by the next step's (TOVA's one row) need not forget them
        if self.history is not None and self.settings.policy.base.history.carries_over(1):
            clear_history(self.history, evicted)
        self.free = evicted

    def leave_slots(self) -> None:
        """Back to arrival order: the occupied slots gathered by position (free ones sort first, then padding)."""
        if self.in_place:
            free = self.free.shape[-1]
            self.free = self._written = self._newest = self._sinks = self._no_free = self._views = None
            self.value_norms = self._normed = None
            self.keep(self.positions.argsort(dim=-1, stable=True)[..., free:])

    def kept_positions(self) -> torch.Tensor:
        """``(B, H_kv, retained)``: the positions of the tokens held, in arrival order (``-1`` for padding)."""
        if not self.in_place:
            return self.positions
        return self.positions.sort(dim=-1).values[..., self.free.shape[-1] :]

    def detached_copy(self) -> EvictionLayer:
        """A copy that later in-place writes of either do not reach (buffers are shared unless decoding in place)."""
        twin = copy.copy(self)
        twin._views = None  # views of this layer's buffers, which the twin must not keep alive
        if self.in_place:
            twin.keys, twin.values, twin.positions = self.keys.clone(), self.values.clone(), self.positions.clone()
            twin.history = None if self.history is None else self.history.clone()
            if self.value_norms is not None:
                twin.value_norms, twin._normed = self.value_norms.clone(), self._normed.clone()
        return twin

    @property
    def kv_bytes(self) -> int:
        """Bytes of the keys and values held now."""
        return layer_bytes(self)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Retained tokens sit just before the new ones in the mask; padding slots stay at the front (see `protect`).
        # In place, a decode step attends over every slot (`slot_mask` masks the ones that hold no real token); a
        # layer with no slot free goes back to arrival order in `update`, so it gets the arrival-order sizes.
        if self.in_place and query_length == 1 and self.free.shape[-1] > 0:
            return self.keys.shape[-2], self.cumulative_length + 1 - self.keys.shape[-2]
        return self.retained + query_length, self.cumulative_length - self.retained

    # -- what the scores read ------------------------------------------------------------------------------------

    def add_positions(self, positions: torch.Tensor, padded: bool) -> None:
        """Append the absolute positions ``(B, H_kv, new)`` of the newest tokens (``-1`` for padding); in place, write
        the step's token's into its slot."""
        self.padded = self.padded or padded
        if self.in_place:
            self.positions.scatter_(2, self._written, positions)
            self._newest = positions
        else:
            self.positions = positions if self.positions is None else torch.cat([self.positions, positions], dim=-1)

    def record(
        self,
        module: nn.Module,
        queries,
        mask,
        kwargs: dict,
        real: torch.Tensor | None,
        call_rows=None,
        call_output=None,
    ):
        """Fold the attention rows the policy's history reads into it, computing only rows it will still hold at the
        next eviction (a layer with room to spare does no scoring work). Probabilities are the family's eager
        attention over the call's final queries, in float32 under every backend, so the backend does not change
        the kept set; ``call_rows`` are the call's own (`caote.attention.decode_attention`, `reads_row_now`), and
        ``call_output`` its output ``(B, 1, H_q, d)``, kept for the scores (`ScoreInputs.output`)."""
        kv_heads = self.keys.shape[1]
        self._output = (
            None
            if call_output is None
            else call_output.reshape(call_output.shape[0], kv_heads, -1, call_output.shape[-1])
        )
        history = self.settings.policy.base.history
        rows = 0 if history is None else history.rows(self.new_tokens, self.retained, self.settings.budget)
        if rows == 0:  # no history, or rows too old to reach the next eviction
            self.history = None
            return
        if call_rows is not None:
            probabilities = call_rows
        else:
            probabilities = attention_probabilities(module, queries[:, :, -rows:], self.keys, self.values, mask, kwargs)
        if real is not None:  # padding queries add nothing
            probabilities = probabilities * real[:, -rows:][:, None, :, None]
        self.history = history.fold(self.history, probabilities, in_place=self.in_place)

    # -- the eviction ----------------------------------------------------------------------------------------------

    def evict(self, kept: int, random: Callable[[], torch.Generator], **inputs) -> None:
        """Keep the ``kept`` tokens of highest protected score (base score -> transform -> GQA, `Policy.scores`);
        ``inputs`` are the strategy's extra `ScoreInputs` (``future``, ``ahead_rows``). In place, free the others."""
        if self.in_place:
            self._free_slots(self.slots_to_free(self.retained - kept, random, inputs))
            return
        settings, base = self.settings, self.settings.policy.base
        if self.unscored:
            self.keep(base.keep_unscored(self.positions, kept, settings.sink_tokens))
            return
        protected = self.protected(self.padded)
        inputs = self._score_inputs(None, protected, self.padded, random, inputs)
        scores = self.protect(settings.policy.scores(inputs, settings.aggregation), protected, self.padded)
        self.keep(scores.topk(kept, dim=-1, sorted=False).indices.sort(dim=-1).values)

    def slots_to_free(self, count: int, random: Callable[[], torch.Generator], inputs: dict) -> torch.Tensor:
        """In place: the ``count`` slots ``(B, H_kv, count)`` of lowest protected score, ties going to the older
        token; a base that scores by recency alone picks them without scoring."""
        settings, base = self.settings, self.settings.policy.base
        padded = self.padded  # else every slot is real: the scores and the protection skip their masking
        if self.unscored:
            return base.drop_unscored(self.positions, count, settings.sink_tokens)
        order = self.positions.argsort(dim=-1) if base.ordered else None
        protected = self.protected(padded)
        inputs = self._score_inputs(order, protected, padded, random, inputs)
        scores = settings.policy.scores(inputs, settings.aggregation, fused=settings.compile_decode, lowest=count)
        if order is not None:  # back from position order to the slots
            scores = torch.empty_like(scores).scatter_(-1, order, scores)
        return self._lowest(self.protect(scores, protected, padded), count)

    @property
    def unscored(self) -> bool:
        """Whether an eviction picks its tokens without scoring: a base that scores by recency alone
        (`BaseScore.keep_unscored` / ``drop_unscored``) while no slot holds padding."""
        return self.settings.policy.base.keep_unscored is not None and not self.padded

    @property
    def stack_key(self) -> tuple:
        """What layers must share to be scored together as one stack (`evict_together`)."""
        history = None if self.history is None else (self.history.shape, self.history.dtype)
        held = (self.keys.shape, self.values.shape, self.values.dtype)
        return (self.values.device, held, history, self.retained, self.padded)

    def stacked_names(self) -> tuple[str, ...]:
        """What `stacked` concatenates for this layer's policy: what its scoring reads."""
        policy = self.settings.policy
        reads = ("keys",) * ("keys" in policy.base.reads) + ("values",) * policy.reads_values
        reads += ("_output",) * policy.reads_output
        reads += ("value_norms", "_normed") * (self.value_norms is not None)
        return ("positions", "history", "free", "_sinks", "_written", "_newest") + reads

    def stacked_bytes(self) -> int:
        """The bytes `stacked` copies of this layer (keys and values counted as float32, as the scores read them)."""
        tensors = {name: getattr(self, name) for name in self.stacked_names()}
        return sum(
            tensor.numel() * (4 if name in ("keys", "values") else tensor.element_size())
            for name, tensor in tensors.items()
            if tensor is not None
        )

    @classmethod
    def stacked(cls, layers: list[EvictionLayer]) -> EvictionLayer:
        """One layer decoding in place whose batch rows are those of ``layers`` (equal `stack_key`), in order: what
        the scores read (`stacked_names`), concatenated along the batch axis; the keys and values it does not read
        are None. What the layers write in place (`HELD_BY_STACK`) is copied once: the copy becomes their storage
        (each layer's rows a view of it, the old buffers freed), so the next step's stack of the same layers is a
        view of it (`adjacent`), not a copy; either way, what the stack writes there is the layers' own."""
        first = layers[0]
        stack = cls(first.settings)
        for name in first.stacked_names():
            tensors = [getattr(layer, name) for layer in layers]
            missing = any(tensor is None for tensor in tensors)  # (a call output some layer's kernel kept)
            whole = None if missing else adjacent(tensors)
            if whole is None and not missing:
                whole = torch.cat(tensors)
                if name in HELD_BY_STACK:  # the copy becomes the layers' storage: the next step stacks a view
                    for layer, own in zip(layers, whole.split(tensors[0].shape[0])):
                        setattr(layer, name, own)
                        layer._views = None  # nor do its attention's views keep the old buffers alive
            setattr(stack, name, whole)
        stack.padded, stack.new_tokens, stack.decodes_in_place = first.padded, first.new_tokens, True
        return stack

    def _score_inputs(self, order, protected: torch.Tensor, padded: bool, random, inputs: dict) -> ScoreInputs:
        """What the scores read, the slots in position order when ``order`` ``(B, H_kv, S)`` is given."""
        keys, values, positions, history = self.keys, self.values, self.positions, self.history
        value_norms = self.held_value_norms()
        if order is not None:
            keys = None if keys is None else keys.gather(2, order.unsqueeze(-1).expand_as(keys))
            values = None if values is None else values.gather(2, order.unsqueeze(-1).expand_as(values))
            positions, protected = positions.gather(2, order), protected.gather(2, order)
            value_norms = None if value_norms is None else value_norms.gather(2, order)
            if history is not None:
                history = history.gather(-1, history_index(order, history))
        return ScoreInputs(
            keys=keys,
            values=values,
            positions=positions,
            real=positions >= 0 if padded else None,
            history=history,
            random=random,
            new_tokens=self.new_tokens,
            kept=protected,
            output=self._output,
            value_norms=value_norms,
            **inputs,
        )

    def _lowest(self, scores: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` slots ``(B, H_kv, count)`` of lowest score, ties going to the older token."""
        if count == 1:  # the lowest score; among equal ones the lowest position
            above = scores != scores.amin(dim=-1, keepdim=True)
            return self.positions.masked_fill(above, torch.iinfo(torch.long).max).argmin(dim=-1, keepdim=True)
        order = self.positions.argsort(dim=-1)
        ranked = scores.gather(-1, order).argsort(dim=-1, stable=True)[..., :count]
        return order.gather(-1, ranked)

    def protected(self, padded: bool = True) -> torch.Tensor:
        """``(B, H_kv, N)`` bool: the slots that stay whatever their score, the sinks and the recent window (never
        padding nor a free slot)."""
        positions = self.positions
        if self.in_place and not padded:  # the sinks' slots are known; the newest token is this step's
            if self.settings.recent == 1:
                return self._sinks.scatter(-1, self._written, True)
            return self._sinks | (positions > self._newest - self.settings.recent)
        newest = positions.amax(dim=-1, keepdim=True)
        protected = (positions < self.settings.sink_tokens) | (positions > newest - self.settings.recent)
        return protected & (positions >= 0) if padded else protected

    def protect(self, scores: torch.Tensor, protected: torch.Tensor, padded: bool = True) -> torch.Tensor:
        """The ``protected`` slots always stay; padding always goes first (which keeps the slots that the 2D
        padding mask marks as padding exactly the retained padding slots)."""
        scores = scores.masked_fill(protected, float("inf"))
        return scores.masked_fill(self.positions < 0, float("-inf")) if padded else scores

    def keep(self, indices: torch.Tensor) -> None:
        """Gather the tokens ``indices`` ``(B, H_kv, b)`` (sorted) from every per-token tensor of the layer."""
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
            self.history = self.history.gather(-1, history_index(indices, self.history))

    def truncate(self, tokens: int) -> None:
        """Drop every slot after the first ``tokens`` (a look-ahead draft's), as if those tokens were never seen."""
        self.cumulative_length -= self.retained - tokens
        self.keys, self.values = self.keys[..., :tokens, :], self.values[..., :tokens, :]
        self.positions = self.positions[..., :tokens]

    def reset(self) -> None:
        super().reset()
        self.new_tokens = 0
        self.padded = False
        self.positions = self.history = self.free = self._written = self._newest = self._sinks = None
        self._no_free = self._views = self._output = self.value_norms = self._normed = None

    def _refuse(self, *args, **kwargs):
        raise ValueError(
            "EvictionCache cannot be cropped, reordered or re-batched: beam search, assisted/speculative decoding "
            "and contrastive search are not supported; use greedy or sampling with num_beams=1"
        )

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _refuse


def evict_together(
    layers: dict[int, EvictionLayer],
    kept: int,
    random: Callable[[], torch.Generator],
    inputs: Callable[[dict[int, EvictionLayer], EvictionLayer], dict] = lambda layers, stack: {},
) -> None:
    """Evict the ``layers`` (by layer index) of one decode step, each decoding in place and holding more than
    ``kept`` tokens, as one: every group of equal `EvictionLayer.stack_key` is scored as a single stack of its
    layers' batch rows (`EvictionLayer.stacked`; split into stacks of at most `STACK_BYTES` copied), so
    the ~35 operators of a scored step run once per stack instead of once per layer, and the slots are freed once
    in the stack, whose positions and history are the layers' storage (each layer keeps its rows of the freed
    slots as its free list). ``inputs`` gives a stack's extra `ScoreInputs` from its
    layers (by index) and the stack (the learned policy's predictor of those layers; what it writes to the stack's
    history or keys, the layers' storage, is theirs). The same arithmetic row by row as evicting them one at
    a time (and the same draws of the random base, taken in layer order)."""
    groups: dict[tuple, list[int]] = {}
    for index, layer in layers.items():
        groups.setdefault(layer.stack_key, []).append(index)
    for indices in groups.values():
        first = layers[indices[0]]
        count = first.retained - kept  # the same in every layer of the group (read before any is evicted)
        if first.unscored:  # nothing scored: no stack
            for index in indices:
                layers[index]._free_slots(layers[index].slots_to_free(count, random, {}))
            continue
        per_stack = max(1, STACK_BYTES // first.stacked_bytes())
        for start in range(0, len(indices), per_stack):
            stack = {index: layers[index] for index in indices[start : start + per_stack]}
            together = EvictionLayer.stacked(list(stack.values()))
            extra = inputs(stack, together)
            slots = together.slots_to_free(count, random, extra)
            together._free_slots(slots)  # once for all: the stack's positions and history are the layers' storage
            for layer, own in zip(stack.values(), slots.split(first.positions.shape[0])):
                layer.free = own
