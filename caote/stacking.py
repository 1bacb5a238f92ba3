"""A decode step's layers scored together: layers decoding in place whose tensors agree in shape are concatenated
along the batch axis into one stack (an `EvictionLayer` of their rows), scored once and freed once, so the ~35
operators of a scored step run once per stack instead of once per layer. The same arithmetic row by row as evicting
them one at a time (and the same draws of the random base, taken in layer order).

What the layers write in place is copied into the stack once: the copy becomes their storage (each layer's rows a
view of it), so the next step's stack of the same layers is a view (`adjacent`), not a copy.
"""

from __future__ import annotations

from typing import Callable

import torch

from caote.layer import EvictionLayer
from caote.slots import SlotBuffer

# the most bytes one stack copies (the history, and the keys and values its scoring reads, counted as float32): a
# step's transient copies stay bounded whatever the model, budget and policy
STACK_BYTES = 64 * 2**20
# what a layer decoding in place writes in place (never replaces), of the layer's own tensors
LAYER_WRITTEN_IN_PLACE = ("keys", "values", "positions", "history")


def stack_key(layer: EvictionLayer) -> tuple:
    """What layers must share to be scored together as one stack."""
    history = None if layer.history is None else (layer.history.shape, layer.history.dtype)
    held = (layer.keys.shape, layer.values.shape, layer.values.dtype)
    return (layer.values.device, held, history, layer.retained, layer.padded)


def stacked_names(layer: EvictionLayer) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What a stack concatenates for ``layer``'s policy, of the layer's tensors and of its `SlotBuffer`'s: what its
    scoring reads."""
    policy = layer.settings.policy
    own = ("positions", "history") + ("keys",) * ("keys" in policy.base.reads) + ("values",) * policy.reads_values
    slots = ("free", "sinks", "written", "newest") + ("output",) * policy.reads_output
    slots += ("value_norms", "normed") * (layer.slots.value_norms is not None)
    return own, slots


def stacked_bytes(layer: EvictionLayer) -> int:
    """The bytes a stack copies of ``layer`` (keys and values counted as float32, as the scores read them)."""
    own, slots = stacked_names(layer)
    tensors = [(name, getattr(layer, name)) for name in own] + [(name, getattr(layer.slots, name)) for name in slots]
    return sum(
        tensor.numel() * (4 if name in ("keys", "values") else tensor.element_size())
        for name, tensor in tensors
        if tensor is not None
    )


def adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat(tensors)`` without a copy when the tensors (equal in shape) are already the consecutive pieces of
    one contiguous tensor along its first axis (a stack's): that tensor; else None."""
    first = tensors[0]
    whole = first._base
    if whole is None or whole.shape[0] != len(tensors) * first.shape[0] or whole.shape[1:] != first.shape[1:]:
        return None
    start, size = whole.storage_offset(), first.numel()
    for index, tensor in enumerate(tensors):
        if tensor._base is not whole or tensor.storage_offset() != start + index * size or not tensor.is_contiguous():
            return None
    return whole if whole.is_contiguous() else None


def concatenated(holders: list, name: str, written_in_place: bool) -> torch.Tensor | None:
    """``name`` of every holder (layer or slot buffer) concatenated along the batch axis (None when some holder has
    none: a call output some layer's kernel kept); a copy of what is written in place becomes the holders' own
    storage."""
    tensors = [getattr(holder, name) for holder in holders]
    if any(tensor is None for tensor in tensors):
        return None
    whole = adjacent(tensors)
    if whole is None:
        whole = torch.cat(tensors)
        if written_in_place:  # the copy becomes the holders' storage: the next step stacks a view
            for holder, own in zip(holders, whole.split(tensors[0].shape[0])):
                setattr(holder, name, own)
    return whole


def stack(layers: list[EvictionLayer]) -> EvictionLayer:
    """One layer decoding in place whose batch rows are those of ``layers`` (equal `stack_key`), in order: what the
    scores read (`stacked_names`) concatenated; the keys and values it does not read are None. What the stack writes
    there (its positions, history, freed slots) is the layers' own."""
    first = layers[0]
    together = EvictionLayer(first.settings)
    own, slot_names = stacked_names(first)
    for name in own:
        setattr(together, name, concatenated(layers, name, name in LAYER_WRITTEN_IN_PLACE))
    buffers = [layer.slots for layer in layers]
    read = {  # what the scores read of the buffers (a stack writes no token: it needs nothing else of them)
        name: concatenated(buffers, name, name in SlotBuffer.WRITTEN_IN_PLACE) if name in slot_names else None
        for name in SlotBuffer.STACKED
    }
    together.slots = SlotBuffer.of_stack(read)
    for layer in layers:  # nor do a layer's attention views keep buffers it no longer holds alive
        if layer.slots.views is not None and not layer.slots.views.views(layer.keys, layer.values):
            layer.slots.views = None
    together.padded, together.new_tokens, together.slots_allowed = first.padded, first.new_tokens, True
    return together


def evict_together(
    layers: dict[int, EvictionLayer],
    kept: int,
    random: Callable[[], torch.Generator],
    inputs: Callable[[dict[int, EvictionLayer], EvictionLayer], dict] = lambda layers, stack: {},
) -> None:
    """Evict the ``layers`` (by layer index) of one decode step, each decoding in place and holding more than
    ``kept`` tokens, as one: every group of equal `stack_key` is scored as a single stack of its layers' batch rows
    (split into stacks of at most `STACK_BYTES` copied), and its slots are freed once in the stack, whose positions
    and history are the layers' storage (each layer keeps its rows of the freed slots as its free list). ``inputs``
    gives a stack's extra `ScoreInputs` from its layers (by index) and the stack (the learned policy's predictor of
    those layers; what it writes to the stack's history or keys, the layers' storage, is theirs)."""
    groups: dict[tuple, list[int]] = {}
    for index, layer in layers.items():
        groups.setdefault(stack_key(layer), []).append(index)
    for indices in groups.values():
        first = layers[indices[0]]
        count = first.retained - kept  # the same in every layer of the group (read before any is evicted)
        if first.unscored:  # nothing scored: no stack
            for index in indices:
                layers[index].release(layers[index].slots_to_free(count, random, {}))
            continue
        per_stack = max(1, STACK_BYTES // stacked_bytes(first))
        for start in range(0, len(indices), per_stack):
            group = {index: layers[index] for index in indices[start : start + per_stack]}
            together = stack(list(group.values()))
            slots = together.slots_to_free(count, random, inputs(group, together))
            together.release(slots)  # once for all: the stack's positions and history are the layers' storage
            for layer, own in zip(group.values(), slots.split(first.positions.shape[0])):
                layer.slots.free = own
