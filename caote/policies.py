"""Eviction policies: a base score, optionally made value-aware by CAOTE or FastCAOTE.

A policy name is ``<base>`` or ``<base>+caote`` / ``<base>+fastcaote`` (e.g. ``"snapkv+fastcaote"``), plus ``"full"``
(no eviction). Adding a policy means writing one score function in `caote.scoring` and one `BaseScore` entry here.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable

import torch

from caote import scoring


@dataclass(frozen=True)
class ScoreInputs:
    """Everything a base score may read for one layer at one step (all tensors cover retained + new tokens)."""

    keys: torch.Tensor  # (B, H_kv, N, d)
    values: torch.Tensor  # (B, H_kv, N, d)
    positions: torch.Tensor  # (B, H_kv, N) absolute positions, -1 for padding
    accumulated: torch.Tensor | None  # (B, H_q, N) attention summed over every query seen (bases reading "all")
    recent_rows: torch.Tensor | None  # (B, H_q, R, N) attention of the newest queries (bases reading "last"/"window")
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class BaseScore:
    """A base eviction score and what it needs from the attention.

    ``query_rows``: which attention rows the cache must compute: ``"none"``, ``"last"`` (newest query),
    ``"window"`` (the newest ``window`` queries) or ``"all"`` (every query, accumulated H2O-style).
    ``per_query_head``: the score comes per query head (attention) rather than per KV head (keys).
    ``signed``: scores may be negative, so CAOTE shifts them before normalising.
    ``recent_window``: newest tokens protected from eviction unless the user overrides it (by default just the
    newest token, which the next step reads first); a float is a share of the budget (H2O's heavy-hitter / recent
    split).
    """

    name: str
    score: Callable[[ScoreInputs], torch.Tensor]
    query_rows: str
    per_query_head: bool
    signed: bool
    summary: str
    reference: str
    recent_window: int | float = 1


SNAPKV_WINDOW = 32
SNAPKV_KERNEL = 5

BASE_SCORES: dict[str, BaseScore] = {
    base.name: base
    for base in (
        BaseScore(
            "streamingllm",
            lambda x: scoring.streamingllm_score(x.positions),
            "none",
            False,
            False,
            "attention sinks + the most recent tokens",
            "Xiao et al. 2023, arXiv 2309.17453",
        ),
        BaseScore(
            "h2o",
            lambda x: scoring.h2o_score(x.accumulated),
            "all",
            True,
            False,
            "attention accumulated over every query so far (heavy hitters; half the budget kept recent)",
            "Zhang et al. 2023, arXiv 2306.14048",
            recent_window=0.5,
        ),
        BaseScore(
            "tova",
            lambda x: scoring.tova_score(x.recent_rows),
            "last",
            True,
            False,
            "attention of the newest query",
            "Oren et al. 2024, arXiv 2401.06104",
        ),
        BaseScore(
            "snapkv",
            lambda x: scoring.snapkv_score(x.recent_rows, SNAPKV_KERNEL),
            "window",
            True,
            False,
            f"attention of the last {SNAPKV_WINDOW} queries, pooled over {SNAPKV_KERNEL} neighbours",
            "Li et al. 2024, arXiv 2404.14469",
            recent_window=SNAPKV_WINDOW,
        ),
        BaseScore(
            "keydiff",
            lambda x: scoring.keydiff_score(x.keys),
            "none",
            False,
            True,
            "negative cosine similarity of each key to the mean key",
            "Park et al. 2025, arXiv 2504.15364",
        ),
        BaseScore(
            "knorm",
            lambda x: scoring.knorm_score(x.keys),
            "none",
            False,
            True,
            "negative L2 norm of each key",
            "Devoto et al. 2024, arXiv 2406.11430",
        ),
        BaseScore(
            "random",
            lambda x: scoring.random_score(x.keys, x.generator),
            "none",
            False,
            False,
            "uniformly random scores (a floor to beat)",
            "-",
        ),
    )
}

TRANSFORMS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None] = {
    "none": None,
    "caote": scoring.caote_score,
    "fastcaote": scoring.fast_caote_score,
}
TRANSFORM_SUMMARIES = {
    "caote": "value-aware: ranks by the exact attention-output change w/(1-w)*||X - v|| (arXiv 2504.14051)",
    "fastcaote": "value-aware, cheaper: CAOTE with the mean value in place of the output (arXiv 2504.14051)",
}
# Bases whose score is a ranking only (no mass to normalise): CAOTE does not apply to them.
RANK_ONLY_BASES = ("streamingllm",)


@dataclass(frozen=True)
class Policy:
    """A parsed policy: ``base`` is None for ``"full"`` (keep everything)."""

    name: str
    base: BaseScore | None
    transform: str = "none"

    @property
    def evicts(self) -> bool:
        return self.base is not None

    def scores(self, inputs: ScoreInputs, gqa: str = "rss") -> torch.Tensor:
        """base score -> value-aware transform -> GQA aggregation, ``(B, H_kv, N)``, higher = keep."""
        base = self.base.score(inputs)
        kv_heads = inputs.values.shape[1]
        grouped = scoring.group_query_heads(base, kv_heads) if self.base.per_query_head else base.unsqueeze(2)
        transform = TRANSFORMS[self.transform]
        if transform is None:
            return scoring.aggregate_groups(grouped, "mean")
        weights = scoring.normalise_weights(grouped, signed=self.base.signed)
        return scoring.aggregate_groups(transform(weights, inputs.values.unsqueeze(2)), gqa)


def policy_names() -> list[str]:
    """Every valid policy string, in a stable order."""
    names = ["full"]
    for base in BASE_SCORES:
        names.append(base)
        if base not in RANK_ONLY_BASES:
            names += [f"{base}+{transform}" for transform in TRANSFORM_SUMMARIES]
    return names


# The attention-score bases the CAOTE paper evaluates (arXiv 2504.14051, Tables 1-4): listed here once.
PAPER_BASES = ("h2o", "tova", "snapkv")

POLICY_GROUPS: dict[str, list[str]] = {
    "paper": ["full", "streamingllm"] + [f"{b}{t}" for b in PAPER_BASES for t in ("", "+caote", "+fastcaote")],
    "all": policy_names(),
}


def parse_policy(name: str) -> Policy:
    """``"snapkv+fastcaote"`` -> `Policy`; unknown names raise a one-line error with the closest valid name."""
    if not isinstance(name, str) or name.strip().lower() not in policy_names():
        close = difflib.get_close_matches(str(name).strip().lower(), policy_names(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown policy {name!r}{hint} (valid: {', '.join(policy_names())})")
    name = name.strip().lower()
    if name == "full":
        return Policy("full", None)
    base, _, transform = name.partition("+")
    return Policy(name, BASE_SCORES[base], transform or "none")


def expand_policies(spec: str) -> list[str]:
    """``"h2o,h2o+caote"`` or a group name (``"paper"``, ``"all"``) -> validated policy names."""
    names: list[str] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        for name in POLICY_GROUPS.get(item.lower(), [item]):
            parse_policy(name)
            if name.lower() not in names:
                names.append(name.lower())
    if not names:
        raise ValueError(f"no policy given in {spec!r}")
    return names


def describe(name: str) -> str:
    """One line: what the policy keeps and where it comes from."""
    policy = parse_policy(name)
    if policy.base is None:
        return "keep every token (no eviction; the reference)"
    text = f"{policy.base.summary} [{policy.base.reference}]"
    if policy.transform != "none":
        text += f"; {TRANSFORM_SUMMARIES[policy.transform]}"
    return text
