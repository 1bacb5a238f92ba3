"""Page-granular eviction: tokens ranked by the score of the page they belong to, so whole pages go together.

A page is ``size`` consecutive absolute positions (token ``t`` is on page ``t // size``), as in the paged caches of
vLLM, TensorRT-LLM and OpenVINO GenAI, whose cache eviction frees whole blocks of tokens, and as kvpress's ChunkKV
keeps whole chunks. Token-level eviction can keep some digits of an answer and drop others; ranking by page keeps a
fact together. A page's score is the sum of its evictable tokens' scores, each first shifted so that the row's lowest
is 0 (a signed base's negative scores would otherwise make a fuller page rank lower); protected tokens (sinks, the
recent window) take no part, since they stay whatever their page scores. Every evictable token then carries its page's
score, so the ordinary selection (top-b in arrival order, the lowest slots in place) takes pages as wholes: an
eviction that frees fewer tokens than a page holds takes them from the lowest page, its older tokens first, and a page
held in part scores lower than it did whole, so decoding finishes it before it starts another. At most one page per
KV head is then held in part, and the layer holds exactly its budget.
"""

from __future__ import annotations

import torch


def page_ids(positions: torch.Tensor, size: int, alone: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, H_kv, N)`` int64: each slot's page as a dense index in ``[0, N)`` per row; a slot holding no token
    (padding, free: a negative position) or ``alone`` (bool, e.g. protected) is a page of its own."""
    slots = torch.arange(positions.shape[-1], device=positions.device)
    own = positions < 0 if alone is None else (positions < 0) | alone
    pages = torch.where(own, -1 - slots, positions.div(size, rounding_mode="floor"))
    order = pages.argsort(dim=-1)
    ordered = pages.gather(-1, order)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    return torch.empty_like(order).scatter_(-1, order, starts.long().cumsum(dim=-1) - 1)


def page_scores(
    scores: torch.Tensor, positions: torch.Tensor, size: int, protected: torch.Tensor | None = None
) -> torch.Tensor:
    """``scores`` ``(B, H_kv, N)`` (higher = keep) with each evictable token's replaced by its page's: the sum over
    the page's evictable tokens of their scores shifted by the row's lowest finite one. ``protected`` tokens and
    slots holding no token keep their own score and take no part in any page's."""
    alone = positions < 0 if protected is None else (positions < 0) | protected
    finite = torch.isfinite(scores) & ~alone
    lowest = scores.masked_fill(~finite, float("inf")).amin(dim=-1, keepdim=True)
    shifted = torch.where(finite, scores - lowest.masked_fill(torch.isinf(lowest), 0.0), scores)
    pages = page_ids(positions, size, alone)
    pooled = torch.zeros_like(shifted).scatter_add(-1, pages, shifted.masked_fill(alone, 0.0))
    return torch.where(alone, scores, pooled.gather(-1, pages))
