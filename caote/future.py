"""Future attention: how much attention each token receives from all *later* queries, known only in hindsight.

On a teacher-forced text the whole sequence is known in advance, so a full-cache pass can record, for every layer,
KV head and block boundary ``t`` (the number of tokens seen when the cache evicts), the attention mass each earlier
token ``j < t`` receives from every later query ``i >= t``, summed over the query heads of the KV group:

    F_t[h, j] = sum_{i >= t} sum_{q in group(h)} A_q[i, j]

The ``oracle`` policy (`caote.bases`) keeps the tokens with the largest ``F_t``: a ceiling that says how much any
causal policy could still gain at a budget. Only these column sums are stored (layers x boundaries x KV heads x
tokens), never attention matrices.

A second target, ``change``, weighs each later query's attention by how far its output lies from the token's value:
the CAOTE error (arXiv 2504.14051, Thm. 3.2) of evicting ``j`` alone, summed over the later queries,

    C_t[h, j] = sum_{i >= t} sum_{q in group(h)} A_q[i, j] / (1 - A_q[i, j]) * || x_q[i] - v_j ||_2

with ``x_q[i]`` query ``i``'s attention output: the total output change the future would feel, which the learned
policy can be fitted to (`caote.evaluation.calibration`) where attention mass alone ranks poorly.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from caote.defaults import FUTURE_TARGETS as TARGETS
from caote.value_aware import distances, eviction_weight, group_query_heads


def received(probabilities: torch.Tensor, values: torch.Tensor, target: str = "mass") -> torch.Tensor:
    """``(B, H_kv, N)``: what the ``R`` queries of ``probabilities`` ``(B, H_q, R, N)`` give each of the ``N``
    tokens, summed over the rows and each KV group's query heads: their attention (``mass``), or the CAOTE error of
    evicting the token alone from each row (``change``; ``values`` ``(B, H_kv, N, d)``)."""
    kv_heads = values.shape[1]
    grouped = group_query_heads(probabilities, kv_heads)  # (B, H_kv, g, R, N)
    if target == "mass":
        return grouped.sum((2, 3))
    if target != "change":
        raise ValueError(f"unknown future target {target!r}; choose one of {', '.join(TARGETS)}")
    batch, _, group, rows, tokens = grouped.shape
    weights = grouped.reshape(batch, kv_heads, group * rows, tokens)
    values = values.to(weights.dtype)
    outputs = torch.matmul(weights, values)  # (B, H_kv, g * R, d)
    return (eviction_weight(weights) * distances(outputs, values.unsqueeze(2))).sum(2)


class FutureAttention:
    """Per-layer attention received from later queries, filled block by block by a full-cache pass.

    `add` takes each block's column sums as the full cache reads it; `finish` turns them into the future mass at
    every boundary; `at` gathers it for the tokens a cache holds. ``target``: what is summed (`received`)."""

    def __init__(self, target: str = "mass"):
        if target not in TARGETS:
            raise ValueError(f"unknown future target {target!r}; choose one of {', '.join(TARGETS)}")
        self.target = target
        self._received: dict[int, list[tuple[int, torch.Tensor]]] = defaultdict(list)
        self._future: dict[tuple[int, int], torch.Tensor] = {}

    def add(self, layer: int, seen: int, received: torch.Tensor) -> None:
        """Record that the queries of the block ending at ``seen`` tokens gave ``received`` ``(H_kv, seen)``
        attention to each token (summed over the block's queries and the query heads of each KV group)."""
        self._received[layer].append((seen, received.detach().double().cpu()))
        self._future.clear()

    def finish(self) -> FutureAttention:
        """Sum, for every boundary, what the blocks after it give each token (a reverse running sum)."""
        for layer, blocks in self._received.items():
            blocks = sorted(blocks, key=lambda item: item[0])
            running = torch.zeros_like(blocks[-1][1])
            for seen, received in reversed(blocks):
                self._future[(layer, seen)] = running[:, :seen].clone()
                running[:, :seen] += received
        self._received.clear()  # folded into the future masses
        return self

    def at(self, layer: int, seen: int, positions: torch.Tensor) -> torch.Tensor:
        """``(B, H_kv, N)`` future mass of the tokens at ``positions`` (``-1`` = padding, mass 0) when ``layer``
        has seen ``seen`` tokens."""
        if not self._future and self._received:
            self.finish()
        future = self._future.get((layer, seen))
        if future is None:
            raise ValueError(
                f"no future attention recorded for layer {layer} after {seen} tokens: the oracle can only evict at "
                "the block boundaries of the teacher-forced text it was recorded on"
            )
        index = positions.clamp_min(0).cpu()
        mass = future.unsqueeze(0).expand(index.shape[0], -1, -1).gather(2, index)
        return mass.masked_fill(positions.cpu() < 0, 0.0).to(positions.device, torch.float64)
