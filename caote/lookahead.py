"""Look-ahead: let the model draft a few tokens greedily before a prompt block's eviction, so that the eviction can
measure its error against the queries of those draft tokens too (the `caote-ahead` policy).

A real future query is the best judge of which tokens matter (the hindsight `oracle` keeps the tokens later queries
attend to); a greedy draft from the un-evicted cache is the cheapest causal guess of those queries. Its cost: the
layers of a prompt block wait with ``budget + block`` tokens until the forward ends (instead of one layer at a time),
then ``tokens`` one-token forwards run over ``budget + block + i`` tokens; their keys and values are dropped again
before the eviction, and generation goes on from the cache as if no draft had run.
"""

from __future__ import annotations

import torch
from torch import nn


def draft(model: nn.Module, cache, hidden: torch.Tensor, forward_kwargs: dict, tokens: int) -> None:
    """Run ``tokens`` greedy one-token forwards of ``model``'s decoder through ``cache`` after the forward whose
    last hidden states are ``hidden`` ``(B, T, D)`` and whose keyword arguments were ``forward_kwargs`` (its 2D
    ``attention_mask`` and ``position_ids`` are extended one token per step). The cache records what it needs of
    each draft forward (see `EvictionCache.after_forward`); nothing is returned."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    mask, positions = forward_kwargs.get("attention_mask"), forward_kwargs.get("position_ids")
    if mask is not None and mask.dim() != 2:
        raise ValueError("a look-ahead policy needs a 2D attention mask (or none); got a 4D mask")
    with torch.no_grad():
        token = head(hidden[:, -1:]).argmax(-1)
        for step in range(tokens):
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
            if positions is not None:
                positions = positions[:, -1:] + 1
            output = decoder(input_ids=token, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
            if step + 1 < tokens:
                token = head(output[0][:, -1:]).argmax(-1)
