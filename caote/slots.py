"""`SlotBuffer`: the fixed slots of a layer decoding in place.

At the first one-token forward that will evict, an `caote.layer.EvictionLayer` packs its ``budget`` tokens into
buffers of ``budget + 1`` slots, allocated once (`SlotBuffer.pack`); from then on each decoded token's key, value and
position are written into a slot that an eviction freed (`write`), and an eviction only marks its tokens' slots free
(`release`, no gather). Slots are then out of arrival order: positions travel with them, a lone decoding query
needs a mask only while slots are free (interval > 1) or hold padding (`mask`). transformers' own fixed buffers
(``StaticLayer``) work the same way with ``index_copy_``; here the free slots differ per KV head.

The layer keeps its storage (keys, values, positions, history); the buffer keeps what only in-place decoding needs,
listed once in `SlotBuffer.__init__`. Dropping the buffer (`caote.layer.EvictionLayer.leave_slots`) returns the layer
to arrival order.
"""

from __future__ import annotations

import copy

import torch

from caote.attention import SlotViews
from caote.positions import FREE, UNSEEN, held
from caote.value_aware import clear_history, group_size


class SlotBuffer:
    """What a layer decoding in place keeps besides its storage, each ``(B, H_kv, ...)``."""

    def __init__(self, free: torch.Tensor, sinks: torch.Tensor, norms: bool):
        self.free = free  # (B, H_kv, F) the empty slots, filled in this order
        self.no_free = free[..., :0]  # (B, H_kv, 0): ``free`` once every slot is taken
        self.sinks = sinks  # (B, H_kv, S) bool: the slots of the sink tokens, never freed
        self.written: torch.Tensor | None = None  # (B, H_kv, 1) the slot of this step's token
        self.newest: torch.Tensor | None = None  # (B, H_kv, 1) the position of this step's token
        self.views: SlotViews | None = None  # the buffers' views `caote.attention.decode_attention` reads
        self.output: torch.Tensor | None = None  # (B, H_kv, g, d) this step's attention output, when caote computed it
        # value-aware scoring on the CPU: (B, H_kv, S) float32 ||v|| per slot (read by `caote.bounds`), and the
        # position each norm was taken for
        self.value_norms = torch.zeros(sinks.shape, dtype=torch.float32, device=sinks.device) if norms else None
        self.normed = torch.full(sinks.shape, UNSEEN, dtype=torch.long, device=sinks.device) if norms else None

    # every field above, once; the tensors a stack of layers concatenates (`caote.stacking`), and those of them
    # written in place, which the stack's copy may become the layers' own storage of
    FIELDS = ("free", "no_free", "sinks", "written", "newest", "views", "output", "value_norms", "normed")
    STACKED = ("free", "sinks", "written", "newest", "output", "value_norms", "normed")
    WRITTEN_IN_PLACE = ("sinks", "value_norms", "normed")

    @classmethod
    def of_stack(cls, tensors: dict[str, torch.Tensor | None]) -> SlotBuffer:
        """The buffer of a stack of layers (`caote.stacking.stack`): what its scoring reads of theirs, ``tensors``
        by field; it writes no token, so every other field is None."""
        buffer = cls.__new__(cls)
        for name in cls.FIELDS:
            setattr(buffer, name, tensors.get(name))
        return buffer

    @classmethod
    def pack(cls, keys, values, positions, history, sink_tokens: int, norms: bool) -> tuple:
        """``(keys, values, positions, history, buffer)``: the ``N`` tokens held in buffers of ``N + 1`` slots, the
        last one free; the layout equals arrival order until the first eviction."""
        batch, kv_heads, tokens, dim = keys.shape
        slot_keys = keys.new_empty(batch, kv_heads, tokens + 1, dim)
        slot_values = values.new_empty(batch, kv_heads, tokens + 1, values.shape[-1])
        slot_keys[..., :tokens, :], slot_values[..., :tokens, :] = keys, values
        slot_positions = positions.new_full((batch, kv_heads, tokens + 1), FREE)
        slot_positions[..., :tokens] = positions
        if history is not None:
            history = torch.nn.functional.pad(history, (0, 1))
        free = torch.full((batch, kv_heads, 1), tokens, dtype=torch.long, device=keys.device)
        buffer = cls(free, sinks_of(slot_positions, sink_tokens), norms and keys.device.type == "cpu")
        return slot_keys, slot_values, slot_positions, history, buffer

    def write(self, keys, values, positions, key_states, value_states, position: int) -> None:
        """Write the step's token into the next free slot of every KV head, in place; its ``position`` marks the
        slot taken at once (a forward that raises before `caote.layer.EvictionLayer.add_positions` reads it so)."""
        if self.free.shape[-1] == 1:  # the one free slot (interval 1): no slicing
            slot, self.free = self.free, self.no_free
        else:
            slot, self.free = self.free[..., :1], self.free[..., 1:]
        index = slot.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        keys.scatter_(2, index, key_states)
        if values.shape[-1] != keys.shape[-1]:
            index = slot.unsqueeze(-1).expand(-1, -1, -1, values.shape[-1])
        values.scatter_(2, index, value_states)
        positions.scatter_(2, slot, position)
        self.written = slot

    def place(self, positions: torch.Tensor, newest: torch.Tensor) -> None:
        """Record the step's token's true position ``(B, H_kv, 1)`` in its slot."""
        positions.scatter_(2, self.written, newest)
        self.newest = newest

    def release(self, positions, history, slots: torch.Tensor, clears_history: bool) -> None:
        """Mark ``slots`` ``(B, H_kv, k)`` free, forgetting what the history remembered of them (unless every row of
        it is replaced by the next step's: TOVA's one row)."""
        positions.scatter_(2, slots, FREE)
        if history is not None and clears_history:
            clear_history(history, slots)
        self.free = slots

    def mask(self, positions, attention_mask, queries: torch.Tensor, additive: bool, padded: bool):
        """The mask of a lone decoding query over the slots: the model's own while every slot holds a real token;
        else ``(B, H_q, 1, S)`` over the slots that do (bool, or additive in the queries' dtype)."""
        if not padded and self.free.shape[-1] == 0:
            return attention_mask
        return query_head_mask(held(positions), queries, additive)

    def protected(self, positions: torch.Tensor, recent: int) -> torch.Tensor:
        """``(B, H_kv, S)`` bool: the sinks' slots and the recent window, in a layer with no padding (the newest
        token is this step's)."""
        if recent == 1:
            return self.sinks.scatter(-1, self.written, True)
        return self.sinks | (positions > self.newest - recent)

    def slot_views(self, keys: torch.Tensor, values: torch.Tensor) -> SlotViews:
        """The views of the slot buffers `caote.attention.decode_attention` reads, made once per buffer."""
        if self.views is None or not self.views.views(keys, values):
            self.views = SlotViews.of(keys, values)
        return self.views

    def norms(self, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """``(B, H_kv, S)`` float32: the norm of every slot's value, taken once per token. A slot whose position is
        not the one its norm was taken for (a token decoded into it since) gets its norm now, so no write path has
        to remember it: positions name tokens (a decoded token's position is one no held token has). None unless
        the buffer keeps them (value-aware, on the CPU)."""
        if self.value_norms is None:
            return None
        stale = (self.normed != positions).view(-1).nonzero().squeeze(-1)  # on the CPU the read-back is free
        if stale.numel():
            written = values.reshape(-1, values.shape[-1]).index_select(0, stale)
            self.value_norms.view(-1).index_copy_(0, stale, torch.linalg.vector_norm(written.float(), dim=-1))
            self.normed.view(-1).index_copy_(0, stale, positions.view(-1).index_select(0, stale))
        return self.value_norms

    def copy(self) -> SlotBuffer:
        """A copy that later in-place writes of either do not reach."""
        twin = copy.copy(self)
        twin.views = None  # views of this buffer's storage, which the twin must not keep alive
        if self.value_norms is not None:
            twin.value_norms, twin.normed = self.value_norms.clone(), self.normed.clone()
        return twin


def sinks_of(positions: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """``(B, H_kv, S)`` bool: the slots holding the first ``sink_tokens`` positions."""
    return held(positions) & (positions < sink_tokens)


def query_head_mask(real: torch.Tensor, queries: torch.Tensor, additive: bool) -> torch.Tensor:
    """``real`` ``(B, H_kv, N)`` as a mask ``(B, H_q, 1, N)`` for the ``queries``' heads: bool, or additive in the
    queries' dtype."""
    mask = real.repeat_interleave(group_size(queries.shape[1], real.shape[1]), dim=1).unsqueeze(2)
    return additive_mask(mask, queries.dtype) if additive else mask


def masked_slots_mask(positions: torch.Tensor, attention_mask, queries: torch.Tensor, additive: bool):
    """The mask of a forward's ``queries`` ``(B, H_q, q, d)`` over a padded batch's layer in arrival order whose rows
    hold slots beyond their own tokens (`caote.layer.EvictionLayer.keep`): the model's (or the causal one when it
    passes none), each query head also hiding its KV head's slots that hold no real token; ``(B, H_q, q, N)``, bool
    or additive in the queries' dtype."""
    rows, tokens = queries.shape[-2], positions.shape[-1]
    real = torch.nn.functional.pad(held(positions), (0, rows), value=True)  # the new tokens are real
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return torch.where(
            query_head_mask(real, queries, False),
            attention_mask[..., : tokens + rows],
            torch.finfo(attention_mask.dtype).min,
        )
    visible = torch.ones(rows, tokens + rows, dtype=torch.bool, device=real.device)
    visible[:, tokens:] = torch.ones(rows, rows, dtype=torch.bool, device=real.device).tril_()
    allowed = query_head_mask(real, queries, False) & (
        visible if attention_mask is None else attention_mask[..., : tokens + rows]
    )
    if not additive:
        return allowed
    return additive_mask(allowed, queries.dtype)


def protected(positions: torch.Tensor, sink_tokens: int, recent: int, padded: bool) -> torch.Tensor:
    """``(B, H_kv, N)`` bool: the slots of the first ``sink_tokens`` positions and of the ``recent`` newest (never
    padding, when ``padded``)."""
    newest = positions.amax(dim=-1, keepdim=True)
    kept = (positions < sink_tokens) | (positions > newest - recent)
    return kept & held(positions) if padded else kept


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as an additive one in ``dtype``: 0 where allowed, the dtype's lowest value elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)
