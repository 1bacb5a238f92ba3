"""Eviction policies: a base score, optionally made value-aware by CAOTE or FastCAOTE.

A policy name is ``<base>`` or ``<base>+caote`` / ``<base>+fastcaote`` (e.g. ``"snapkv+fastcaote"``), plus ``"full"``
(no eviction). A value-aware name may end in ``/<gqa>`` (``"tova+caote/mean"``) to fix how the CAOTE errors of a
KV group's query heads combine (`caote.value_aware.GQA_AGGREGATIONS`), e.g. for an ablation in one evaluation grid.
Any evicting policy that scores may end in ``/page<size>`` (``"tova+caote/page32"``, after a ``/<gqa>``): tokens are
ranked by the summed score of their page of ``size`` positions, so whole pages go (`caote.pages`).
``"auto"`` names no policy of its own but one of these, chosen per model and budget (`is_auto`, `auto_thresholds`;
resolved by `caote.settings.CacheSettings`).

The grammar is parsed here only (`parse_policy`) and names are built here only (`policy_name`): elsewhere a name's
parts come from its parsed `Policy`. The bases themselves are the registry of `caote.bases` (`BASE_SCORES`).
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, replace
from typing import Callable

import torch

from caote import bounds, pages, value_aware
from caote.bases import BASE_SCORES, BaseScore, ScoreInputs
from caote.defaults import AUTO_COMPRESS, AUTO_POLICY, AUTO_TRAINING_FREE, PAPER_GROUP
from caote.positions import held


@dataclass(frozen=True)
class Transform:
    """A value-aware transform: ``errors`` ``(weights, values, real, protected, fused)`` -> every token's error, and the
    ``output`` ``(weights, values, real)`` it measures the values from (read by `caote.bounds.lowest_errors`);
    ``weighted``: that output is the weights' weighted sum of the values, so an attention row's is the attention
    output."""

    errors: Callable[..., torch.Tensor]
    output: Callable[..., torch.Tensor]
    weighted: bool


TRANSFORMS: dict[str, Transform | None] = {
    "none": None,
    "caote": Transform(value_aware.caote_errors, value_aware.caote_output, weighted=True),
    "fastcaote": Transform(value_aware.fast_caote_errors, value_aware.fast_caote_output, weighted=False),
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
    page: int | None = None  # ``/page<size>``: tokens ranked by their page's score (`caote.pages`); None: by their own

    @property
    def evicts(self) -> bool:
        return self.base is not None

    @property
    def base_name(self) -> str | None:
        """The base's name, which is also its plain policy's (``"h2o"`` of ``"h2o+caote/mean"``); None for full."""
        return None if self.base is None else self.base.name

    @property
    def reads_predictor(self) -> bool:
        """Whether the policy reads the model's importance predictor (the ``learned`` schedule, `caote.learned`)."""
        return self.base is not None and self.base.schedule == "learned"

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
        ``fused``: the transform in one compiled kernel (`caote.value_aware.compiled`). ``lowest``: the caller evicts
        that many of the lowest-scored tokens not ``inputs.protected`` (a decode step); a value-aware transform then
        scores directly only the tokens that can be among them, the others getting a lower bound of their score
        (`caote.bounds.lowest_errors`; the same tokens go). A paged policy's tokens then carry their page's score
        (`caote.pages.page_scores`), which reads every token's, so it never takes the bounds."""
        base = self.base.score(inputs)
        kv_heads = inputs.positions.shape[1]
        grouped = value_aware.group_query_heads(base, kv_heads) if self.base.per_query_head else base.unsqueeze(2)
        real = None if inputs.real is None else inputs.real.unsqueeze(2)  # (B, H_kv, 1, N), broadcast over the group
        if real is not None:
            grouped = grouped.masked_fill(~real, float("-inf"))
        transform = TRANSFORMS[self.transform]
        how = "mean" if transform is None else gqa
        if transform is not None:
            if self.base.distribution and real is None:  # attention rows: already distributions
                weights = grouped.to(value_aware.compute_dtype(grouped))
            else:
                weights = value_aware.normalise_weights(
                    grouped, signed=self.base.signed, padded=real is not None, positive=self.base.per_query_head
                )
            protected = None if inputs.protected is None or self.base.layer_wide else inputs.protected.unsqueeze(2)
            values = inputs.values.unsqueeze(2)
            if lowest is not None and protected is not None and real is None and not fused and self.page is None:
                values = values.to(weights.dtype)
                if self.reads_output and inputs.output is not None:
                    output = inputs.output.to(weights.dtype)  # the step's own: the same bmm, done once
                else:
                    output = transform.output(weights, values, real)
                norms = None if inputs.value_norms is None else inputs.value_norms.unsqueeze(2)
                bounded = bounds.lowest_errors(
                    output, weights, values, protected, lowest, how, transform.weighted, norms
                )
                if bounded is not None:
                    return bounded
            grouped = transform.errors(weights, values, real, protected, fused=fused)
        scores = value_aware.aggregate_groups(grouped, how)
        if self.base.layer_wide:  # one decision for all KV heads: combine them as one more group
            scores = value_aware.aggregate_groups(scores.unsqueeze(1), how).expand_as(scores)
        if self.page is not None:
            scores = pages.page_scores(scores, inputs.positions, self.page, inputs.protected)
        return scores

    # -- selection: inputs -> scores -> protect -> keep top-b (kvpress's ``compress``) -----------------------------

    def tokens_to_keep(self, inputs: ScoreInputs, kept: int, budget: int, gqa: str) -> tuple:
        """``(indices, masked)``: the ``kept`` tokens ``(B, H_kv, kept)`` of highest protected score of a layer in
        arrival order, sorted; ``masked`` is None, or for a padded batch ``(B, H_kv, width)`` bool: the kept slots
        a row does not hold. Each row of a padded batch is evicted as it would be alone: a row holding more than
        ``budget`` real tokens keeps its ``kept`` best, one holding fewer keeps them all (with a decode interval
        above 1 the rows fall out of phase); the rows share one width, at least ``kept``, a row's slots beyond its
        own count being its lowest-ranked."""
        scores = protect(self.ordered_scores(inputs, gqa, inputs.real is not None), inputs)
        if inputs.real is None:
            return self.best(scores, kept).sort(dim=-1).values, None
        own = inputs.real.sum(dim=-1, keepdim=True)
        target = torch.where(own > budget, kept, own)
        width = min(max(kept, int(target.max())), scores.shape[-1])
        indices, order = self.best(scores, width).sort(dim=-1)
        return indices, (torch.arange(width, device=own.device) >= target).gather(-1, order)

    def best(self, scores: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` tokens of highest score of tokens in arrival order, best first. A paged policy's tokens tie
        within a page: the newer ranks first, so the older goes first, as in place (`lowest`)."""
        if self.page is None:
            return scores.topk(count, dim=-1).indices
        newest_first = scores.flip(-1).argsort(dim=-1, descending=True, stable=True)[..., :count]
        return scores.shape[-1] - 1 - newest_first

    def slots_to_free(self, inputs: ScoreInputs, count: int, gqa: str, fused: bool = False) -> torch.Tensor:
        """The ``count`` slots ``(B, H_kv, count)`` of lowest protected score of a layer decoding in place (slots
        out of arrival order), ties going to the older token."""
        scores = self.ordered_scores(inputs, gqa, True, fused=fused, lowest=count)
        return lowest(protect(scores, inputs), inputs.positions, count)

    def ordered_scores(
        self, inputs: ScoreInputs, gqa: str, unordered: bool, fused: bool = False, lowest: int | None = None
    ) -> torch.Tensor:
        """`scores` of the slots as ``inputs`` hold them. A base that reads the tokens' order
        (`caote.bases.BaseScore.ordered`: SnapKV's pooling) is scored on them sorted by position when they may be
        ``unordered`` (a layer decoding in place; a padded batch's row with masked slots among its tokens, which
        sort first, as left padding does)."""
        if not (unordered and self.base.ordered):
            return self.scores(inputs, gqa, fused=fused, lowest=lowest)
        order = inputs.positions.argsort(dim=-1)
        scores = self.scores(in_position_order(inputs, order), gqa, fused=fused, lowest=lowest)
        return torch.empty_like(scores).scatter_(-1, order, scores)  # back from position order to the slots


def protect(scores: torch.Tensor, inputs: ScoreInputs) -> torch.Tensor:
    """The protected tokens (``inputs.protected``: sinks, recent window) always stay; padding always goes first (which
    keeps the slots that the 2D padding mask marks as padding exactly the retained padding slots)."""
    scores = scores.masked_fill(inputs.protected, float("inf"))
    return scores if inputs.real is None else scores.masked_fill(~inputs.real, float("-inf"))


def lowest(scores: torch.Tensor, positions: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` slots ``(B, H_kv, count)`` of lowest score, ties going to the older token."""
    if count == 1:  # the lowest score; among equal ones the lowest position
        above = scores != scores.amin(dim=-1, keepdim=True)
        return positions.masked_fill(above, torch.iinfo(torch.long).max).argmin(dim=-1, keepdim=True)
    order = positions.argsort(dim=-1)
    ranked = scores.gather(-1, order).argsort(dim=-1, stable=True)[..., :count]
    return order.gather(-1, ranked)


def in_position_order(inputs: ScoreInputs, order: torch.Tensor) -> ScoreInputs:
    """``inputs`` with the slots ``order`` ``(B, H_kv, S)`` puts in position order."""

    def by_order(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        return tensor.gather(2, order.unsqueeze(-1).expand_as(tensor) if tensor.dim() == 4 else order)

    positions = inputs.positions.gather(2, order)
    history = inputs.history
    return replace(
        inputs,
        keys=by_order(inputs.keys),
        values=by_order(inputs.values),
        positions=positions,
        real=None if inputs.real is None else held(positions),
        history=None if history is None else history.gather(-1, value_aware.group_index(order, history)),
        protected=by_order(inputs.protected),
        value_norms=by_order(inputs.value_norms),
    )


def policy_name(base: str, transform: str = "none", gqa: str | None = None, page: int | None = None) -> str:
    """The name `parse_policy` reads as ``base`` under ``transform`` (``"none"``: the plain base) with its own GQA
    aggregation ``gqa`` and pages of ``page`` positions: ``policy_name("tova", "caote", "mean") == "tova+caote/mean"``,
    ``policy_name("h2o", page=32) == "h2o/page32"`` (not validated, so a report may look up a policy its rows
    lack)."""
    name = base if transform == "none" else f"{base}+{transform}"
    name = name if gqa is None else f"{name}/{gqa}"
    return name if page is None else f"{name}/page{page}"


def policy_names(hindsight: bool = False) -> list[str]:
    """Every policy string that can generate, in a stable order; with ``hindsight`` also those that need the future
    (``oracle``), which only teacher-forced evaluation can run."""
    names = ["full"]
    for name, base in BASE_SCORES.items():
        if base.hindsight and not hindsight:
            continue
        names.append(name)
        if not base.rank_only:
            names += [policy_name(name, transform) for transform in TRANSFORM_SUMMARIES]
    return names


# names that stand for several policies (`expand_policies`): the CAOTE paper's (`caote.defaults.PAPER_GROUP`), all
POLICY_GROUPS: dict[str, list[str]] = {
    "paper": list(PAPER_GROUP),
    "all": policy_names(),
}


PAGE_SUFFIX = re.compile(r"page(\d+)")


def parse_policy(name: str) -> Policy:
    """``"snapkv+fastcaote"`` -> `Policy`; unknown names raise a one-line error with the closest valid name."""
    if isinstance(name, str) and "/" in name:
        stem, _, suffix = name.strip().lower().rpartition("/")
        page = PAGE_SUFFIX.fullmatch(suffix)
        if page is not None:
            return paged(parse_policy(stem), name, int(page.group(1)))
        if suffix.startswith("page"):
            raise ValueError(f"policy {name!r}: '/page<size>' takes a whole number of positions, e.g. '/page16'")
        policy = parse_policy(stem)
        if "/" in stem or not policy.value_aware or suffix not in value_aware.GQA_AGGREGATIONS:
            raise ValueError(
                f"policy {name!r}: '/<gqa>' follows a value-aware policy (e.g. 'tova+caote/mean') and names one of "
                f"{', '.join(value_aware.GQA_AGGREGATIONS)}; '/page<size>' comes last (e.g. 'tova+caote/mean/page32')"
            )
        return replace(policy, name=policy_name(policy.base_name, policy.transform, suffix), gqa=suffix)
    valid = policy_names(hindsight=True)
    if not isinstance(name, str) or name.strip().lower() not in valid:
        close = difflib.get_close_matches(str(name).strip().lower(), valid, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown policy {name!r}{hint} (valid: {', '.join(valid)})")
    name = name.strip().lower()
    if name == "full":
        return Policy("full", None)
    base, _, transform = name.partition("+")
    return Policy(name, BASE_SCORES[base], transform or "none")


def paged(policy: Policy, name: str, size: int) -> Policy:
    """``policy`` ranking its tokens by pages of ``size`` positions (``name``'s ``/page<size>``)."""
    if policy.page is not None:
        raise ValueError(f"policy {name!r} names a page size twice")
    if not policy.evicts or policy.base.kept_by_recency is not None:
        what = "keeps every token" if not policy.evicts else "keeps the newest tokens, whole runs already"
        raise ValueError(f"policy {name!r}: {policy.name} {what}, so pages change nothing; leave '/page' out")
    if size < 1:
        raise ValueError(f"policy {name!r}: the page size must be an integer >= 1, got {size}")
    return replace(policy, name=policy_name(policy.base_name, policy.transform, policy.gqa, size), page=size)


def is_auto(name) -> bool:
    """Whether ``name`` is ``"auto"``, resolved by `caote.settings.CacheSettings` rather than parsed."""
    return isinstance(name, str) and name.strip().lower() == AUTO_POLICY


def auto_thresholds() -> list[tuple[int, str]]:
    """``(from budget, policy)`` of auto's training-free choices, ascending: each long-grid budget's policy
    (`caote.defaults.AUTO_TRAINING_FREE`) serves the budgets nearer to it than to its neighbours on a log scale, so
    from the geometric midpoint with the grid budget below it, rounded up (a budget on it takes the larger's)."""
    grid = sorted(AUTO_TRAINING_FREE)
    starts = [1] + [math.isqrt(lower * upper - 1) + 1 for lower, upper in zip(grid, grid[1:])]
    return [(start, AUTO_TRAINING_FREE[budget]) for start, budget in zip(starts, grid)]


def auto_training_free(budget: int) -> str:
    """Auto's policy at ``budget`` for a model whose predictor does not help (`auto_thresholds`)."""
    return [policy for start, policy in auto_thresholds() if budget >= start][-1]


def hindsight_policies(names: list[str]) -> list[str]:
    """The policies among ``names`` that need the future (``oracle``): teacher-forced texts only."""
    parsed = [(name, parse_policy(name)) for name in names if not is_auto(name)]
    return [name for name, policy in parsed if policy.evicts and policy.base.hindsight]


def expand_policies(spec: str) -> list[str]:
    """``"h2o,h2o+caote"`` or a group name (``"paper"``, ``"all"``) -> validated policy names (``"auto"`` kept as
    it is)."""
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
            name = AUTO_POLICY if is_auto(name) else parse_policy(name).name
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError(f"no policy given in {spec!r}")
    return names


def describe(name: str) -> str:
    """One line: what the policy keeps and where it comes from."""
    if is_auto(name):
        thresholds = auto_thresholds()
        choices = ", ".join(
            f"{policy} below {following[0]}" if following else f"{policy} from {start}"
            for (start, policy), following in zip(thresholds, [*thresholds[1:], None])
        )
        return (
            "the default: the model's learned policy when its predictor's validation says it helps, else the "
            f"training-free one of lowest KL on the long grid at the budget among those decoding at 0.9x or more of a "
            f"full cache of the same size ({choices}); with the prompt read whole, then compressed (prefill "
            f"compress), {AUTO_COMPRESS} for retrieval [this library]"
        )
    policy = parse_policy(name)
    if policy.base is None:
        return "keep every token (no eviction; the reference)"
    text = f"{policy.base.about.summary} [{policy.base.about.reference}]"
    if policy.value_aware:
        text += f"; {TRANSFORM_SUMMARIES[policy.transform]}"
    if policy.gqa is not None:
        text += f"; a KV group's query heads combined by {policy.gqa}"
    if policy.page is not None:
        text += f"; tokens ranked by their page of {policy.page} positions, whole pages evicted (caote.pages)"
    return text
