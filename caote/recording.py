"""What a layer's policy records of each attention call, decided here once: how many of the call's newest query rows
its memory takes (`rows_to_record`), whether a decode step in place reads its row from the call itself
(`reads_row_now`, which `caote.cache.EvictionCache.attends` asks), and the folding of those rows into the layer's
history (`record`). kvpress's presses receive the attention in a hook the same way; here the strategy
(`caote.strategies`) calls `record` right after the layer's attention.
"""

from __future__ import annotations

import torch
from torch import nn

from caote.attention import AttentionCall, attention_probabilities
from caote.layer import EvictionLayer


def rows_to_record(layer: EvictionLayer) -> int:
    """How many of this forward's newest query rows the policy's memory takes: none without one, or when rows this
    old fall out of it before the next eviction (a layer with room to spare does no scoring work)."""
    memory = layer.settings.policy.base.memory
    return 0 if memory is None else memory.rows(layer.new_tokens, layer.retained, layer.settings.budget)


def reads_row_now(layer: EvictionLayer, module: nn.Module, queries: torch.Tensor) -> bool:
    """Whether caote computes this call's attention itself, output and row in one pass: a lone float32 query (in a
    lower precision the model's kernel keeps computing the output, so that a decode step in place gives the same
    output as one in arrival order; and not while training) of a layer decoding in place whose every slot holds a
    real token (the query needs no mask), which overflows (it evicts now) and whose memory takes the row."""
    if queries.shape[-2] != 1 or queries.dtype != torch.float32 or module.training or not layer.in_place:
        return False
    if layer.padded or layer.slots.free.shape[-1] or layer.retained <= layer.settings.budget:
        return False
    return rows_to_record(layer) > 0


def record(layer: EvictionLayer, call: AttentionCall, real: torch.Tensor | None) -> None:
    """Fold the attention rows the policy's memory takes (`rows_to_record`) into ``layer``'s history.
    Probabilities are the family's eager attention over the call's final queries, in float32 under every backend,
    so the backend does not change the kept set; ``call.rows`` are the call's own (`caote.attention.
    decode_attention`, `reads_row_now`), and ``call.output`` its output ``(B, 1, H_q, d)``, kept for the scores
    (`caote.bases.ScoreInputs.output`)."""
    if layer.in_place:
        output = call.output
        layer.slots.output = (
            None if output is None else output.reshape(output.shape[0], layer.keys.shape[1], -1, output.shape[-1])
        )
    rows = rows_to_record(layer)
    if rows == 0:
        layer.history = None
        return
    if call.rows is not None:
        probabilities = call.rows
    else:
        probabilities = attention_probabilities(
            call.module, call.queries[:, :, -rows:], layer.keys, layer.values, call.mask, call.kwargs
        )
    if real is not None:  # padding queries add nothing
        probabilities = probabilities * real[:, -rows:][:, None, :, None]
    memory = layer.settings.policy.base.memory
    layer.history = memory.fold(layer.history, probabilities, layer.in_place, layer.cumulative_length)
