"""The base scores: what a policy ranks tokens by before any value-aware transform (`caote.value_aware`), as pure
tensor functions. Higher = keep.

``attention`` ``(B, H_q, R, N)`` holds softmax probabilities of some query rows over the N cached tokens, ``keys``
``(B, H_kv, N, d)``; a score is ``(B, H, N)`` with ``H`` the query heads for attention-based scores and the KV heads
for key-based ones. `caote.history` keeps what the attention-based ones read across steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from caote.value_aware import compute_dtype, masked_mean


def accumulate_attention(previous: torch.Tensor | None, attention: torch.Tensor) -> torch.Tensor:
    """H2O running sum (Zhang et al., arXiv 2306.14048): ``previous`` ``(B, H, N_old)`` plus every row of
    ``attention`` ``(B, H, R, N)``; tokens newer than ``previous`` start at zero."""
    total = attention.sum(-2)
    if previous is not None:
        total[..., : previous.shape[-1]] += previous
    return total


def keep_recent_rows(previous: torch.Tensor | None, attention: torch.Tensor, rows: int) -> torch.Tensor:
    """The last ``rows`` attention rows seen, ``(B, H, <=rows, N)``: older rows get zero attention on newer tokens
    (they could not see them)."""
    new = attention.shape[-2]
    if new == rows:  # the new rows are the window
        return attention
    if new > rows:  # the newest of them (cloned: a slice of a larger tensor)
        return attention[..., -rows:, :].clone()
    if previous is None:
        return attention
    previous = F.pad(previous[..., -(rows - new) :, :], (0, attention.shape[-1] - previous.shape[-1]))
    return torch.cat([previous, attention], dim=-2)


def h2o_score(accumulated: torch.Tensor) -> torch.Tensor:
    """H2O heavy hitters (Zhang et al., arXiv 2306.14048): attention accumulated over every query seen so far,
    carried across prefill blocks and decode steps for the tokens still cached. ``(B, H_q, N)`` in, out."""
    return accumulated


def tova_score(recent_rows: torch.Tensor) -> torch.Tensor:
    """TOVA (Oren et al., arXiv 2401.06104): the attention of the newest query. ``(B, H_q, R, N) -> (B, H_q, N)``."""
    return recent_rows[..., -1, :]


def snapkv_score(window_rows: torch.Tensor, kernel_size: int = 5) -> torch.Tensor:
    """SnapKV (Li et al., arXiv 2404.14469): attention of the last ``w`` queries (default 32, the observation window)
    summed over the tokens *before* the window, then average-pooled over ``kernel_size`` (default 5) neighbouring
    tokens so that neighbours of a hit survive with it, as the original pools ``attn[..., -w:, :-w]``. The window's
    own tokens are kept anyway (they are the protected recent window); they get their summed votes, unpooled, so that
    a value-aware transform still sees their share of the mass. ``(B, H_q, w, N) -> (B, H_q, N)``."""
    votes = window_rows.sum(-2)
    window = window_rows.shape[-2]
    batch, heads, tokens = votes.shape
    if kernel_size <= 1 or tokens <= window:
        return votes
    before = votes[..., : tokens - window].reshape(batch * heads, 1, tokens - window)
    pooled = F.avg_pool1d(before, kernel_size, stride=1, padding=kernel_size // 2)[..., : tokens - window]
    return torch.cat([pooled.view(batch, heads, -1), votes[..., tokens - window :]], dim=-1)


def oldest_after_sinks_dropped(positions: torch.Tensor, kept: int, sink_tokens: int) -> torch.Tensor:
    """StreamingLLM without scoring: the ``kept`` slots ``(B, H, kept)`` left when the oldest tokens after the sinks
    go, for a cache whose slots hold tokens in arrival order (so those are the slots right after the sinks). Assumes
    no padding and positions rising with the slot (true unless a caller passes ``position_ids`` that go
    backwards)."""
    sinks = (positions < sink_tokens).sum(-1, keepdim=True)
    slots = torch.arange(kept, device=positions.device)
    return slots + (positions.shape[-1] - kept) * (slots >= sinks)


def oldest_after_sinks(positions: torch.Tensor, count: int, sink_tokens: int) -> torch.Tensor:
    """StreamingLLM without scoring, for slots in any order (decoding in place): the ``count`` slots ``(B, H, count)``
    holding the oldest tokens after the sinks. Assumes no padding (and no free slot)."""
    after_sinks = positions.masked_fill(positions < sink_tokens, torch.iinfo(positions.dtype).max)
    if count == 1:
        return after_sinks.argmin(dim=-1, keepdim=True)
    return after_sinks.topk(count, dim=-1, largest=False).indices


def streamingllm_score(positions: torch.Tensor) -> torch.Tensor:
    """StreamingLLM (Xiao et al., arXiv 2309.17453): the most recent tokens; the attention sinks are kept by the
    cache's sink protection (4 tokens by default). ``positions`` ``(B, H_kv, N)``."""
    return positions.float()


def keydiff_score(keys: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """KeyDiff (Park et al., arXiv 2504.15364): keys far from the mean key are distinctive, so
    ``score_j = -cos(k_j, mean_i k_i)`` per KV head, the mean over the tokens ``real`` ``(B, H_kv, N)`` marks (not
    padding; all when None). ``(B, H_kv, N, d) -> (B, H_kv, N)``."""
    keys = keys.to(compute_dtype(keys))
    anchor = masked_mean(keys, real).unsqueeze(-2)
    return -F.cosine_similarity(keys, anchor, dim=-1)


def knorm_score(keys: torch.Tensor) -> torch.Tensor:
    """K-norm (Devoto et al., arXiv 2406.11430): keys with a small L2 norm attract attention, so
    ``score_j = -||k_j||_2``. ``(B, H_kv, N, d) -> (B, H_kv, N)``."""
    return -torch.linalg.vector_norm(keys.to(compute_dtype(keys)), dim=-1)


def random_score(keys: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Uniform random scores in [0, 1): the floor any real policy must beat. ``(B, H_kv, N, d) -> (B, H_kv, N)``.
    Drawn on the generator's device (the CPU by default) and moved to the keys' device, so one generator serves
    layers on any number of devices."""
    device = generator.device if generator is not None else keys.device
    return torch.rand(keys.shape[:-1], generator=generator, device=device).to(keys.device)
