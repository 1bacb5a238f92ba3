"""Eviction policies: a base score, optionally made value-aware by CAOTE or FastCAOTE.

A policy name is ``<base>`` or ``<base>+caote`` / ``<base>+fastcaote`` (e.g. ``"snapkv+fastcaote"``), plus ``"full"``
(no eviction). A value-aware name may end in ``/<gqa>`` (``"tova+caote/mean"``) to fix how the CAOTE errors of a
KV group's query heads combine (`caote.scoring.GQA_AGGREGATIONS`), e.g. for an ablation in one evaluation grid.

Adding a base means writing one score function in `caote.scoring` and one `BaseScore` entry here; the entry carries
the base's behaviour (what it remembers of the attention rows, when it evicts), so nothing else names it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable

import torch

from caote import scoring
from caote.defaults import PAPER_BASES
from caote.history import AttentionSum, RecentRows, SumAndRecent
from caote.learned import LEARNED_RECENT, RECENT_ROWS, learned_score


@dataclass(frozen=True, kw_only=True)
class ScoreInputs:
    """Everything a base score may read for one layer at one step (all tensors cover retained + new tokens)."""

    keys: torch.Tensor | None  # (B, H_kv, N, d); None where the base does not read them (`BaseScore.reads`)
    values: torch.Tensor | None  # (B, H_kv, N, d); None where the policy does not read them (`Policy.reads_values`)
    positions: torch.Tensor  # (B, H_kv, N) absolute positions, -1 for padding
    real: torch.Tensor | None  # (B, H_kv, N) bool, False for padding (takes no part in any score); None: no padding
    history: torch.Tensor | None = None  # what the base's `history` kept of the attention rows, token axis last
    random: Callable[[], torch.Generator] | None = None  # the cache's seeded CPU generator, made on first use
    future: torch.Tensor | None = None  # (B, H_kv, N) attention from later queries (hindsight, `caote.future`)
    ahead_rows: torch.Tensor | None = None  # (B, H_q, k, N) attention of k drafted queries (look-ahead bases)
    new_tokens: int = 0  # how many of the tokens arrived in this forward (a prompt block's, or 1 when decoding)
    predictor: object | None = None  # the layer's `caote.learned.LayerPredictor` (the ``learned`` base)
    kept: torch.Tensor | None = None  # (B, H_kv, N) bool, the tokens that stay whatever their score (`protected`)
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


@dataclass(frozen=True, kw_only=True)
class BaseScore:
    """A base eviction score: how it scores, what it remembers and when it evicts.

    ``score``: `ScoreInputs` -> ``(B, H, N)``, higher = keep.
    ``history``: what the layer remembers of the attention rows (`caote.history`: ``AttentionSum`` for H2O's
    running sum, ``RecentRows(w)`` for the newest ``w`` rows), read as ``ScoreInputs.history``; None for none.
    ``schedule``: when a layer is evicted and with which extra inputs (`caote.strategies.STRATEGIES`, chosen once
    when a cache is built): ``"immediate"`` right after its attention (the paper's), ``"hindsight"`` with the
    attention of later queries (the oracle: cannot generate) or ``"lookahead"`` after a greedy draft of
    ``draft_tokens`` tokens.
    ``keep_unscored``: for a score that is the token's recency, the slots to keep ``(positions, kept, sinks) ->
    indices`` when no slot holds padding, without scoring (slots are in arrival order); ``drop_unscored`` the
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
    history: AttentionSum | RecentRows | SumAndRecent | None = None
    schedule: str = "immediate"
    draft_tokens: int = 0
    keep_unscored: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None
    drop_unscored: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None
    per_query_head: bool = False
    signed: bool = False
    recent_window: int | float = 1
    layer_wide: bool = False
    rank_only: bool = False
    reads: tuple[str, ...] = ("keys", "values")
    ordered: bool = False
    distribution: bool = False

    def __post_init__(self):
        if (self.keep_unscored is None) != (self.drop_unscored is None):
            raise ValueError(
                f"base {self.name!r}: keep_unscored and drop_unscored come together (arrival order, slots)"
            )

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


BASE_SCORES: dict[str, BaseScore] = {
    base.name: base
    for base in (
        BaseScore(
            name="streamingllm",
            reads=(),
            score=lambda x: scoring.streamingllm_score(x.positions),
            about=About("attention sinks + the most recent tokens", "Xiao et al. 2023, arXiv 2309.17453"),
            keep_unscored=scoring.oldest_after_sinks_dropped,
            drop_unscored=scoring.oldest_after_sinks,
            rank_only=True,
        ),
        BaseScore(
            name="h2o",
            reads=(),
            score=lambda x: scoring.h2o_score(x.history),
            about=About(
                "attention accumulated over every query so far (heavy hitters; half the budget kept recent)",
                "Zhang et al. 2023, arXiv 2306.14048",
            ),
            history=AttentionSum(),
            per_query_head=True,
            recent_window=0.5,
        ),
        BaseScore(
            name="tova",
            reads=(),
            score=lambda x: scoring.tova_score(x.history),
            about=About(
                "attention of the newest query, averaged per KV group (each KV head evicts its own tokens)",
                "Oren et al. 2024, arXiv 2401.06104",
            ),
            history=RecentRows(1),
            per_query_head=True,
            distribution=True,
        ),
        BaseScore(
            name="tova-layer",
            reads=(),
            score=lambda x: scoring.tova_score(x.history),
            about=About(
                "TOVA as published: attention of the newest query averaged over all heads of the layer; every KV "
                "head keeps the same tokens",
                "Oren et al. 2024, arXiv 2401.06104",
            ),
            history=RecentRows(1),
            per_query_head=True,
            layer_wide=True,
            distribution=True,
        ),
        BaseScore(
            name="snapkv",
            reads=(),
            score=lambda x: scoring.snapkv_score(x.history, SNAPKV_KERNEL),
            about=About(
                f"attention of the last {SNAPKV_WINDOW} queries on the tokens before them, pooled over "
                f"{SNAPKV_KERNEL} neighbours",
                "Li et al. 2024, arXiv 2404.14469",
            ),
            history=RecentRows(SNAPKV_WINDOW),
            per_query_head=True,
            recent_window=SNAPKV_WINDOW,
            ordered=True,
        ),
        BaseScore(
            name="keydiff",
            score=lambda x: scoring.keydiff_score(x.keys, x.real),
            about=About("negative cosine similarity of each key to the mean key", "Park et al. 2025, arXiv 2504.15364"),
            signed=True,
            reads=("keys",),
        ),
        BaseScore(
            name="knorm",
            score=lambda x: scoring.knorm_score(x.keys),
            about=About("negative L2 norm of each key", "Devoto et al. 2024, arXiv 2406.11430"),
            signed=True,
            reads=("keys",),
        ),
        BaseScore(
            name="random",
            score=lambda x: scoring.random_score(x.keys, x.random() if x.random is not None else None),
            about=About("uniformly random scores (a floor to beat)", "-"),
            reads=("keys",),  # for their shape and device
            ordered=True,  # one draw per token in position order, whatever slot holds it
        ),
        BaseScore(
            name="caote-window",
            reads=("values",),
            score=lambda x: scoring.multi_row_caote_score(x.history, x.values),
            about=About(
                f"beyond the paper: the exact CAOTE output change over each of the newest {SNAPKV_WINDOW} real "
                "queries (SnapKV's window), root-mean-square over the queries that see the token and rss over the KV "
                "group; costs the attention of those rows",
                "this library; CAOTE of arXiv 2504.14051 over many queries",
                paper_base="snapkv",
            ),
            history=RecentRows(SNAPKV_WINDOW),
            rank_only=True,
        ),
        BaseScore(
            name="caote-block",
            reads=("values",),
            score=lambda x: scoring.multi_row_caote_score(x.history, x.values),
            about=About(
                f"beyond the paper: caote-window over the newest {BLOCK_ROWS} queries (a whole prefill block; the "
                "latest decoded queries when decoding); costs about one more attention pass per block",
                "this library; CAOTE of arXiv 2504.14051 over many queries",
                paper_base="h2o",
            ),
            history=RecentRows(BLOCK_ROWS),
            rank_only=True,
        ),
        BaseScore(
            name="caote-ahead",
            reads=("values",),
            score=lambda x: scoring.multi_row_caote_score(rows_and_draft(x), x.values),
            about=About(
                f"beyond the paper: caote-block whose rows also include the queries of {LOOKAHEAD_TOKENS} tokens the "
                "model drafts greedily before each prompt block's eviction (decode steps: caote-block); costs "
                f"{LOOKAHEAD_TOKENS} one-token forwards per prompt block, and every layer holds budget + block tokens "
                "until the block's forward ends",
                "this library; draft queries as in Lookahead Q-Cache, Wang et al. 2025, arXiv 2505.20334",
                paper_base="h2o",
            ),
            history=RecentRows(BLOCK_ROWS),
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
            history=SumAndRecent(RECENT_ROWS),
            schedule="learned",
            recent_window=LEARNED_RECENT,
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
}


@dataclass(frozen=True)
class Transform:
    """A value-aware transform: ``errors`` ``(weights, values, real, kept, fused)`` -> every token's error, and the
    ``output`` ``(weights, values, real)`` it measures the values from (read by `caote.scoring.lowest_errors`);
    ``weighted``: that output is the weights' weighted sum of the values, so an attention row's is the attention
    output."""

    errors: Callable[..., torch.Tensor]
    output: Callable[..., torch.Tensor]
    weighted: bool


TRANSFORMS: dict[str, Transform | None] = {
    "none": None,
    "caote": Transform(scoring.caote_errors, scoring.caote_output, weighted=True),
    "fastcaote": Transform(scoring.fast_caote_errors, scoring.fast_caote_output, weighted=False),
}
TRANSFORM_SUMMARIES = {
    "caote": "value-aware: ranks by the exact attention-output change w/(1-w)*||X - v|| (arXiv 2504.14051)",
    "fastcaote": "value-aware, cheaper: CAOTE with the mean value in place of the output (arXiv 2504.14051)",
}


@dataclass(frozen=True)
class Policy:
    """A parsed policy: ``base`` is None for ``"full"`` (keep everything)."""

    name: str
    base: BaseScore | None
    transform: str = "none"
    gqa: str | None = None  # the name's own GQA aggregation (``/mean``), overriding the cache's

    @property
    def evicts(self) -> bool:
        return self.base is not None

    @property
    def value_aware(self) -> bool:
        """Whether a CAOTE / FastCAOTE transform follows the base score."""
        return TRANSFORMS[self.transform] is not None

    @property
    def reads_values(self) -> bool:
        """Whether scoring reads the held values: the base's own reading (`BaseScore.reads`) or a CAOTE transform."""
        return "values" in self.base.reads or self.value_aware

    @property
    def reads_output(self) -> bool:
        """Whether scoring reads a decode step's attention output (`ScoreInputs.output`): a weighted-output transform
        over a base that is the attention row itself."""
        transform = TRANSFORMS[self.transform]
        return self.base.distribution and transform is not None and transform.weighted

    def scores(
        self, inputs: ScoreInputs, gqa: str = "rss", fused: bool = False, lowest: int | None = None
    ) -> torch.Tensor:
        """base score -> value-aware transform -> GQA aggregation, ``(B, H_kv, N)``, higher = keep.

        Padding gets ``-inf`` before anything else, so it has no weight, no part in a mean or minimum and no vote.
        ``fused``: the transform in one compiled kernel (`caote.scoring.compiled`). ``lowest``: the caller evicts
        that many of the lowest-scored tokens not ``inputs.kept`` (a decode step); a value-aware transform then
        scores directly only the tokens that can be among them, the others getting a lower bound of their score
        (`caote.scoring.lowest_errors`; the same tokens go)."""
        base = self.base.score(inputs)
        kv_heads = inputs.positions.shape[1]
        grouped = scoring.group_query_heads(base, kv_heads) if self.base.per_query_head else base.unsqueeze(2)
        real = None if inputs.real is None else inputs.real.unsqueeze(2)  # (B, H_kv, 1, N), broadcast over the group
        if real is not None:
            grouped = grouped.masked_fill(~real, float("-inf"))
        transform = TRANSFORMS[self.transform]
        how = "mean" if transform is None else gqa
        if transform is not None:
            if self.base.distribution and real is None:  # attention rows: already distributions
                weights = grouped.to(scoring.compute_dtype(grouped))
            else:
                weights = scoring.normalise_weights(
                    grouped, signed=self.base.signed, padded=real is not None, positive=self.base.per_query_head
                )
            kept = None if inputs.kept is None or self.base.layer_wide else inputs.kept.unsqueeze(2)
            values = inputs.values.unsqueeze(2)
            if lowest is not None and kept is not None and real is None and not fused:
                values = values.to(weights.dtype)
                if self.reads_output and inputs.output is not None:
                    output = inputs.output.to(weights.dtype)  # the step's own: the same bmm, done once
                else:
                    output = transform.output(weights, values, real)
                norms = None if inputs.value_norms is None else inputs.value_norms.unsqueeze(2)
                bounded = scoring.lowest_errors(output, weights, values, kept, lowest, how, transform.weighted, norms)
                if bounded is not None:
                    return bounded
            grouped = transform.errors(weights, values, real, kept, fused=fused)
        scores = scoring.aggregate_groups(grouped, how)
        if self.base.layer_wide:  # one decision for all KV heads: combine them as one more group
            scores = scoring.aggregate_groups(scores.unsqueeze(1), how).expand_as(scores)
        return scores


def policy_names(hindsight: bool = False) -> list[str]:
    """Every policy string that can generate, in a stable order; with ``hindsight`` also those that need the future
    (``oracle``), which only teacher-forced evaluation can run."""
    names = ["full"]
    for name, base in BASE_SCORES.items():
        if base.hindsight and not hindsight:
            continue
        names.append(name)
        if not base.rank_only:
            names += [f"{name}+{transform}" for transform in TRANSFORM_SUMMARIES]
    return names


# The attention-score bases the CAOTE paper evaluates (arXiv 2504.14051, Tables 1-4): listed here once.
POLICY_GROUPS: dict[str, list[str]] = {
    "paper": ["full", "streamingllm"] + [f"{b}{t}" for b in PAPER_BASES for t in ("", "+caote", "+fastcaote")],
    "all": policy_names(),
}


def parse_policy(name: str) -> Policy:
    """``"snapkv+fastcaote"`` -> `Policy`; unknown names raise a one-line error with the closest valid name."""
    valid = policy_names(hindsight=True)
    if isinstance(name, str) and "/" in name:
        stem, _, gqa = name.strip().lower().partition("/")
        policy = parse_policy(stem)
        if not policy.value_aware or gqa not in scoring.GQA_AGGREGATIONS:
            raise ValueError(
                f"policy {name!r}: '/<gqa>' follows a value-aware policy (e.g. 'tova+caote/mean') and names one of "
                f"{', '.join(scoring.GQA_AGGREGATIONS)}"
            )
        return Policy(f"{policy.name}/{gqa}", policy.base, policy.transform, gqa)
    if not isinstance(name, str) or name.strip().lower() not in valid:
        close = difflib.get_close_matches(str(name).strip().lower(), valid, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown policy {name!r}{hint} (valid: {', '.join(valid)})")
    name = name.strip().lower()
    if name == "full":
        return Policy("full", None)
    base, _, transform = name.partition("+")
    return Policy(name, BASE_SCORES[base], transform or "none")


def hindsight_policies(names: list[str]) -> list[str]:
    """The policies among ``names`` that need the future (``oracle``): teacher-forced texts only."""
    return [name for name in names if parse_policy(name).evicts and parse_policy(name).base.hindsight]


def expand_policies(spec: str) -> list[str]:
    """``"h2o,h2o+caote"`` or a group name (``"paper"``, ``"all"``) -> validated policy names."""
    if not isinstance(spec, str):
        raise ValueError(
            f"policies must be a comma-separated string of policy names or groups ({', '.join(POLICY_GROUPS)}), "
            f"got {spec!r}"
        )
    names: list[str] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        for name in POLICY_GROUPS.get(item.lower(), [item]):
            name = parse_policy(name).name
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError(f"no policy given in {spec!r}")
    return names


def describe(name: str) -> str:
    """One line: what the policy keeps and where it comes from."""
    policy = parse_policy(name)
    if policy.base is None:
        return "keep every token (no eviction; the reference)"
    text = f"{policy.base.about.summary} [{policy.base.about.reference}]"
    if policy.value_aware:
        text += f"; {TRANSFORM_SUMMARIES[policy.transform]}"
    if policy.gqa is not None:
        text += f"; a KV group's query heads combined by {policy.gqa}"
    return text
