"""The base scores a policy starts from: `BASE_SCORES`, one `BaseScore` entry per base, and `ScoreInputs`, what a
score may read.

Adding a base means writing one score function in `caote.base_scores` and one `BaseScore` entry here; the entry
carries the base's behaviour (what it reads and remembers of the attention rows, when it evicts), so nothing else
names it.
Its fields are checked when it is built: a nonsensical combination fails at import with a one-line `ValueError`.
`caote.policies` turns each base into policies (plain, ``+caote``, ``+fastcaote``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from caote import base_scores, value_aware
from caote.history import AttentionSum, RecentRows, SumAndRecent
from caote.learned import (
    BLOCK_EXPONENT,
    BLOCK_FLOOR_QUANTILE,
    LEARNED_RECENT,
    RECENT_ROWS,
    learned_block_score,
    learned_score,
)


@dataclass(frozen=True, kw_only=True)
class ScoreInputs:
    """Everything a base score may read for one layer at one step (all tensors cover retained + new tokens)."""

    keys: torch.Tensor | None  # (B, H_kv, N, d); None where the base does not read them (`BaseScore.reads`)
    values: torch.Tensor | None  # (B, H_kv, N, d); None where the policy does not read them (`Policy.reads_values`)
    positions: torch.Tensor  # (B, H_kv, N) absolute positions, -1 for padding
    real: torch.Tensor | None  # (B, H_kv, N) bool, False for padding (takes no part in any score); None: no padding
    history: torch.Tensor | None = None  # what the base's `memory` kept of the attention rows, token axis last
    random: Callable[[], torch.Generator] | None = None  # the cache's seeded CPU generator, made on first use
    future: torch.Tensor | None = None  # (B, H_kv, N) attention from later queries (hindsight, `caote.future`)
    ahead_rows: torch.Tensor | None = None  # (B, H_q, k, N) attention of k drafted queries (look-ahead bases)
    new_tokens: int = 0  # how many of the tokens arrived in this forward (a prompt block's, or 1 when decoding)
    predictor: object | None = None  # the layer's `caote.learned.LayerPredictor` (the ``learned`` base)
    protected: torch.Tensor | None = None  # (B, H_kv, N) bool, the tokens that stay whatever their score
    # (B, H_kv, g, d) the attention output of a decode step that attended once (`caote.attention.decode_attention`)
    output: torch.Tensor | None = None
    # (B, H_kv, N) float32 ``||v_j||`` of the values, kept per slot by a layer decoding in place (its bounds read them)
    value_norms: torch.Tensor | None = None


@dataclass(frozen=True)
class About:
    """What a report says of a base (no part of how it runs): a one-line ``summary``, its ``reference`` and, for a
    policy beyond the paper, the ``paper_base`` that reads the same kind of query rows (its best variant is the
    reference of docs/results.md's "beyond the paper" section)."""

    summary: str
    reference: str
    paper_base: str | None = None


# when a layer may be evicted: the names of `caote.strategies.STRATEGIES` (which imports this module's importers)
SCHEDULES = ("immediate", "hindsight", "lookahead", "learned")
READABLE = ("keys", "values")  # what a score may read of the held tokens (`BaseScore.reads`)


@dataclass(frozen=True, kw_only=True)
class BaseScore:
    """A base eviction score: how it scores, what it remembers and when it evicts.

    ``score``: `ScoreInputs` -> ``(B, H, N)``, higher = keep.
    ``memory``: how the layer remembers the attention rows (`caote.history`: ``AttentionSum`` for H2O's running
    sum, ``RecentRows(w)`` for the newest ``w`` rows), whose tensor is read as ``ScoreInputs.history``; None for
    none.
    ``schedule``: when a layer is evicted and with which extra inputs (`caote.strategies.STRATEGIES`, chosen once
    when a cache is built): ``"immediate"`` right after its attention (the paper's), ``"hindsight"`` with the
    attention of later queries (the oracle: cannot generate), ``"lookahead"`` after a greedy draft of
    ``draft_tokens`` tokens or ``"learned"`` with the model's predictor (`SCHEDULES`).
    ``kept_by_recency``: for a score that is the token's recency, the slots to keep ``(positions, kept, sinks) ->
    indices`` when no slot holds padding, without scoring (slots are in arrival order); ``freed_by_recency`` the
    same for a layer decoding in place: the ``(positions, count, sinks) -> indices`` of the slots to free.
    ``per_query_head``: the score comes per query head (attention) rather than per KV head (keys).
    ``signed``: scores may be negative, so CAOTE shifts them before normalising.
    ``recent_window``: newest tokens protected from eviction unless the user overrides it (by default just the
    newest token, which the next step reads first); a float is a share of the budget (H2O's heavy-hitter / recent
    split).
    ``layer_wide``: one decision for the whole layer (every KV head keeps the same tokens), as the original TOVA.
    ``rank_only``: the score is a ranking with no attention mass to normalise, so CAOTE does not apply.
    ``reads``: which of the held tokens' keys and values the score reads (a decode step's layers scored together
    stack only those, and the values whenever the policy's transform reads them: `Policy.reads_values`); a new base
    reads both unless it says otherwise.
    ``ordered``: the score depends on the tokens' order (SnapKV's pooling and window, the random draws), so a layer
    decoding in place hands it the slots sorted by position.
    ``distribution``: the score is already each query head's distribution over the tokens (the newest attention
    row, a softmax), so CAOTE takes it as it is, not divided by its sum again, and its weighted output is then the
    attention output itself (`ScoreInputs.output`, which a decode step that attended once passes on, bit for bit).
    """

    name: str
    score: Callable[[ScoreInputs], torch.Tensor]
    about: About
    memory: AttentionSum | RecentRows | SumAndRecent | None = None
    schedule: str = "immediate"
    draft_tokens: int = 0
    kept_by_recency: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None
    freed_by_recency: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None
    per_query_head: bool = False
    signed: bool = False
    recent_window: int | float = 1
    layer_wide: bool = False
    rank_only: bool = False
    reads: tuple[str, ...] = ("keys", "values")
    ordered: bool = False
    distribution: bool = False

    def __post_init__(self):
        problem = self._problem()
        if problem is not None:
            raise ValueError(f"base {self.name!r}: {problem}")

    def _problem(self) -> str | None:
        """The first field that makes no sense (alone or with the others), in words, or None."""
        window = self.recent_window
        if not isinstance(self.name, str) or self.name in ("", "full") or self.name != self.name.lower():
            return "name must be lowercase and not 'full' (`caote.policies.parse_policy` lowercases a name)"
        if any(mark in self.name for mark in "+/, "):
            return "name must not hold '+', '/', ',' or a space (the marks of the policy grammar and lists)"
        if not isinstance(self.reads, tuple) or not set(self.reads) <= set(READABLE):
            return f"reads {self.reads!r} must be a tuple of {' and '.join(map(repr, READABLE))}"
        if self.schedule not in SCHEDULES:
            return f"schedule {self.schedule!r} is none of {', '.join(SCHEDULES)}"
        if not isinstance(self.draft_tokens, int) or (self.draft_tokens > 0) != (self.schedule == "lookahead"):
            return f"draft_tokens {self.draft_tokens!r}: a positive count with schedule 'lookahead', else 0"
        if isinstance(window, bool) or not (
            (isinstance(window, int) and window >= 1) or (isinstance(window, float) and 0 < window < 1)
        ):
            return f"recent_window {window!r} must be a positive token count or a float share in (0, 1)"
        if self.memory is not None and not isinstance(self.memory, (AttentionSum, RecentRows, SumAndRecent)):
            return f"memory {self.memory!r} must be AttentionSum(), RecentRows(w), SumAndRecent(w) or None"
        if self.per_query_head and self.memory is None:
            return "per_query_head scores come from attention rows: it needs a memory"
        if self.distribution and not self.per_query_head:
            return "distribution (each query head's attention row) needs per_query_head"
        if self.rank_only and (self.signed or self.distribution):
            return "signed and distribution tell CAOTE how to read the score, which a rank_only base never gets"
        if (self.kept_by_recency is None) != (self.freed_by_recency is None):
            return "kept_by_recency and freed_by_recency come together (arrival order, slots)"
        return None

    @property
    def hindsight(self) -> bool:
        """The score reads the attention of later queries, known only on a teacher-forced text: it cannot generate."""
        return self.schedule == "hindsight"


SNAPKV_WINDOW = 32
SNAPKV_KERNEL = 5
BLOCK_ROWS = 128  # caote-block's rows: the default prefill block
LOOKAHEAD_TOKENS = 8  # caote-ahead's greedy draft before each prompt block's eviction


def rows_and_draft(inputs: ScoreInputs) -> torch.Tensor:
    """The recent attention rows followed by the drafted queries' rows, when a draft ran."""
    if inputs.ahead_rows is None:
        return inputs.history
    return torch.cat([inputs.history, inputs.ahead_rows], dim=-2)


def register(*bases: BaseScore) -> dict[str, BaseScore]:
    """The registry of ``bases`` by name, in their order; a name given twice fails (the later entry would hide the
    earlier one)."""
    registry: dict[str, BaseScore] = {}
    for base in bases:
        if base.name in registry:
            raise ValueError(f"base {base.name!r}: name registered twice in BASE_SCORES")
        registry[base.name] = base
    return registry


BASE_SCORES: dict[str, BaseScore] = register(
    BaseScore(
        name="streamingllm",
        reads=(),
        score=lambda x: base_scores.streamingllm_score(x.positions),
        about=About("attention sinks + the most recent tokens", "Xiao et al. 2023, arXiv 2309.17453"),
        kept_by_recency=base_scores.oldest_after_sinks_dropped,
        freed_by_recency=base_scores.oldest_after_sinks,
        rank_only=True,
    ),
    BaseScore(
        name="h2o",
        reads=(),
        score=lambda x: base_scores.h2o_score(x.history),
        about=About(
            "attention accumulated over every query so far (heavy hitters; half the budget kept recent)",
            "Zhang et al. 2023, arXiv 2306.14048",
        ),
        memory=AttentionSum(),
        per_query_head=True,
        recent_window=0.5,
    ),
    BaseScore(
        name="tova",
        reads=(),
        score=lambda x: base_scores.tova_score(x.history),
        about=About(
            "attention of the newest query, averaged per KV group (each KV head evicts its own tokens)",
            "Oren et al. 2024, arXiv 2401.06104",
        ),
        memory=RecentRows(1),
        per_query_head=True,
        distribution=True,
    ),
    BaseScore(
        name="tova-layer",
        reads=(),
        score=lambda x: base_scores.tova_score(x.history),
        about=About(
            "TOVA as published: attention of the newest query averaged over all heads of the layer; every KV "
            "head keeps the same tokens",
            "Oren et al. 2024, arXiv 2401.06104",
        ),
        memory=RecentRows(1),
        per_query_head=True,
        layer_wide=True,
        distribution=True,
    ),
    BaseScore(
        name="snapkv",
        reads=(),
        score=lambda x: base_scores.snapkv_score(x.history, SNAPKV_KERNEL),
        about=About(
            f"attention of the last {SNAPKV_WINDOW} queries on the tokens before them, pooled over "
            f"{SNAPKV_KERNEL} neighbours",
            "Li et al. 2024, arXiv 2404.14469",
        ),
        memory=RecentRows(SNAPKV_WINDOW),
        per_query_head=True,
        recent_window=SNAPKV_WINDOW,
        ordered=True,
    ),
    BaseScore(
        name="keydiff",
        score=lambda x: base_scores.keydiff_score(x.keys, x.real),
        about=About("negative cosine similarity of each key to the mean key", "Park et al. 2025, arXiv 2504.15364"),
        signed=True,
        reads=("keys",),
    ),
    BaseScore(
        name="knorm",
        score=lambda x: base_scores.knorm_score(x.keys),
        about=About("negative L2 norm of each key", "Devoto et al. 2024, arXiv 2406.11430"),
        signed=True,
        reads=("keys",),
    ),
    BaseScore(
        name="random",
        score=lambda x: base_scores.random_score(x.keys, x.random() if x.random is not None else None),
        about=About("uniformly random scores (a floor to beat)", "-"),
        reads=("keys",),  # for their shape and device
        ordered=True,  # one draw per token in position order, whatever slot holds it
    ),
    BaseScore(
        name="caote-window",
        reads=("values",),
        score=lambda x: value_aware.multi_row_caote_score(x.history, x.values),
        about=About(
            f"beyond the paper: the exact CAOTE output change over each of the newest {SNAPKV_WINDOW} real "
            "queries (SnapKV's window), root-mean-square over the queries that see the token and rss over the KV "
            "group; costs the attention of those rows",
            "this library; CAOTE of arXiv 2504.14051 over many queries",
            paper_base="snapkv",
        ),
        memory=RecentRows(SNAPKV_WINDOW),
        rank_only=True,
    ),
    BaseScore(
        name="caote-block",
        reads=("values",),
        score=lambda x: value_aware.multi_row_caote_score(x.history, x.values),
        about=About(
            f"beyond the paper: caote-window over the newest {BLOCK_ROWS} queries (a whole prefill block; the "
            "latest decoded queries when decoding); costs about one more attention pass per block",
            "this library; CAOTE of arXiv 2504.14051 over many queries",
            paper_base="h2o",
        ),
        memory=RecentRows(BLOCK_ROWS),
        rank_only=True,
    ),
    BaseScore(
        name="caote-ahead",
        reads=("values",),
        score=lambda x: value_aware.multi_row_caote_score(rows_and_draft(x), x.values),
        about=About(
            f"beyond the paper: caote-block whose rows also include the queries of {LOOKAHEAD_TOKENS} tokens the "
            "model drafts greedily before each prompt block's eviction (decode steps: caote-block); costs "
            f"{LOOKAHEAD_TOKENS} one-token forwards per prompt block, and every layer holds budget + block tokens "
            "until the block's forward ends",
            "this library; draft queries as in Lookahead Q-Cache, Wang et al. 2025, arXiv 2505.20334",
            paper_base="h2o",
        ),
        memory=RecentRows(BLOCK_ROWS),
        schedule="lookahead",
        draft_tokens=LOOKAHEAD_TOKENS,
        rank_only=True,
    ),
    BaseScore(
        name="learned",
        reads=("keys", "values"),  # the keys: the predictor's key terms of new tokens (`remember_keys`)
        score=learned_score,
        about=About(
            "beyond the paper: each token's future attention predicted by a per-(layer, KV head) linear map of "
            "causal features (attention so far, age, value, pre-RoPE key) fitted once per model to the "
            "hindsight oracle; needs a calibrated predictor (`caote calibrate`; the bundled models ship one)",
            "this library; distilled from the hindsight oracle, cf. KVzap (NVIDIA kvpress, 2025)",
            paper_base="h2o",
        ),
        memory=SumAndRecent(RECENT_ROWS),
        schedule="learned",
        recent_window=LEARNED_RECENT,
    ),
    BaseScore(
        name="learned-block",
        reads=("keys", "values"),
        score=learned_block_score,
        about=About(
            f"beyond the paper: learned+caote's score times caote-block's (the exact output change over the newest "
            f"{BLOCK_ROWS} queries, floored at its {BLOCK_FLOOR_QUANTILE:.0%} quantile) to the power {BLOCK_EXPONENT}, "
            "at prompt blocks; decode steps score as learned+caote; needs a calibrated predictor, like learned, and "
            "keeps the block's attention rows",
            "this library; learned (above) and CAOTE of arXiv 2504.14051 over many queries",
            paper_base="h2o",
        ),
        memory=SumAndRecent(BLOCK_ROWS),
        schedule="learned",
        recent_window=LEARNED_RECENT,
        rank_only=True,
    ),
    BaseScore(
        name="oracle",
        reads=(),
        score=lambda x: x.future,
        about=About(
            "hindsight ceiling: the attention each token receives from all later queries of the full-cache pass, "
            "summed over its KV group (teacher-forced text only; cannot generate)",
            "-",
        ),
        schedule="hindsight",
        rank_only=True,
    ),
)
