"""Page-granular eviction: tokens ranked by the score of the page they belong to, so whole pages go together.

A page is ``size`` consecutive absolute positions (token ``t`` is on page ``t // size``), as in the paged caches of
vLLM, TensorRT-LLM and OpenVINO GenAI, whose cache eviction frees whole blocks of tokens, and as kvpress's ChunkKV
keeps whole chunks. Token-level eviction can keep some digits of an answer and drop others; ranking by page keeps
a fact together. A page's score combines its held tokens' (`REDUCTIONS`); every token of the page then carries it, so
the ordinary selection (protect, top-b, or the lowest slots while decoding in place) takes pages as wholes: an
eviction that must free fewer tokens than a page holds frees them from the lowest page (decoding: its oldest
first), so at most one page per KV head is held in part and the layer holds exactly its budget.
"""

from __future__ import annotations

import torch

# how a page's score combines its held tokens' scores (higher = keep)
REDUCTIONS = {"sum": "sum", "max": "amax"}
DEFAULT_REDUCTION = "sum"


def page_ids(positions: torch.Tensor, size: int) -> torch.Tensor:
    """``(B, H_kv, N)`` int64: each slot's page as a dense index in ``[0, N)`` per row; a slot holding no token
    (padding, free: a negative position) is a page of its own."""
    slots = torch.arange(positions.shape[-1], device=positions.device)
    pages = torch.where(positions >= 0, positions.div(size, rounding_mode="floor"), -1 - slots)
    order = pages.argsort(dim=-1)
    ordered = pages.gather(-1, order)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    return torch.empty_like(order).scatter_(-1, order, starts.long().cumsum(dim=-1) - 1)


def page_scores(scores: torch.Tensor, positions: torch.Tensor, size: int, reduction: str = DEFAULT_REDUCTION):
    """``scores`` ``(B, H_kv, N)`` with each token's replaced by its page's (``reduction`` of `REDUCTIONS` over
    the page's held tokens, at ``positions``)."""
    pages = page_ids(positions, size)
    pooled = torch.zeros_like(scores).scatter_reduce(-1, pages, scores, REDUCTIONS[reduction], include_self=False)
    return pooled.gather(-1, pages)
