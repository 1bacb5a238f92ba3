"""``caote calibrate``: fit the ``learned`` policy's importance predictor (`caote.learned`) to the hindsight oracle.

For every calibration text, a full-cache pass records the attention each token receives from later queries
(`caote.future`); then the text is read again under an evicting cache at each calibration budget, whose every
eviction hands the candidates' features (what the learned policy will see) and targets ``log(1e-6 + future mass)``
to a `Collector`. The rollout evicts by CAOTE over the KV group's mean H2O mass (the predictor does not exist yet),
so the features come from the kind of cache the policy will run in; a second round can roll out
``learned+caote`` with the first round's predictor instead (``rollout``), so that they come from the policy's own
kept sets. Per (layer, KV head) the collector keeps only the normal equations of the rows centred within their
(layer, head, eviction) group (on the weighted means) — ``X^T X``, ``X^T y``, ``y^T y`` — so memory does not grow
with the amount of text.
The rows are weighted (`mass_weights`): evicting a token costs about the attention it would have received, so a
least-squares fit of the log mass that weighs every candidate alike spends itself on ordering tokens that no later
query reads; weighing each row by its future mass relative to its group's mean, to the power ``mass_weight``,
moves the fit to the tokens whose eviction would be felt.
The ridge strength of each head is the one with the smallest squared error on held-out texts (computed from their
normal equations), and the final fit uses every text.

Calibration texts are never evaluation texts: they come from the dev split (`check_calibration_texts`), and the
evaluation asks `check_disjoint` before it runs a learned policy (no shared text, nor any excerpt of a shared
document). Known simplifications: the held-out texts are every fourth excerpt, so one document can give excerpts to
both sides (the choice of strength is then a little optimistic); evictions after the last block, whose future is
empty, still add rows (their targets are all equal, so they only shrink the weights a little).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from caote.cache import EvictionCache
from caote.defaults import (
    CALIBRATION_BUDGETS,
    CALIBRATION_LENGTH,
    CALIBRATION_MASS_WEIGHT,
    CALIBRATION_TARGET,
    CALIBRATION_TOKENS,
    CALIBRATION_WINDOWS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_FEATURE_GROUPS,
)
from caote.evaluation.data import document_excerpts, essay_names, split_of
from caote.evaluation.lockstep import reference_pass
from caote.evaluation.perplexity import domain_texts
from caote.evaluation.tasks import Text
from caote.learned import EPSILON, LEARNED_RECENT, LayerPredictor, feature_names, linear_map
from caote.predictor import Predictor, model_fingerprint
from caote.rotary import rotary_inverse
from caote.settings import CacheSettings

RIDGE_STRENGTHS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
DEFAULT_STRENGTH = 1e-2  # a head without held-out rows to choose by
# relative weights are clipped to this range before they are scaled to mean 1: it bounds how far apart two rows of a
# group can weigh (400x), which limits how much of a fit the few heaviest tokens can decide
MASS_WEIGHT_RANGE = (0.05, 20.0)
MASS_WEIGHT_MOST = 4  # the largest power `calibrate` accepts (at 2 the heaviest few tokens already decide each fit)
HELD_OUT_EVERY = 4  # every 4th calibration text chooses the ridge strengths
DEAD_COLUMN = 1e-4  # a feature column this much smaller than the median one (root mean square) holds rounding only
# with the collector standing in for the predictor: CAOTE over the group's H2O mass, or over a rollout predictor's
ROLLOUT = "learned+caote"


@dataclass
class NormalEquations:
    """``X^T X``, ``X^T y``, ``y^T y`` and the row count of one (layer, KV head), in float64; the collector adds rows
    already scaled by the square roots of their weights, so these are the weighted sums."""

    xtx: torch.Tensor
    xty: torch.Tensor
    yty: float = 0.0
    rows: float = 0  # the rows' total weight: their number unless `scaled`

    @classmethod
    def empty(cls, width: int) -> NormalEquations:
        return cls(torch.zeros(width, width, dtype=torch.float64), torch.zeros(width, dtype=torch.float64))

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.xtx += x.T @ x
        self.xty += x.T @ y
        self.yty += float(y @ y)
        self.rows += x.shape[0]

    def scaled(self, factor: float) -> NormalEquations:
        """These rows, each weighing ``factor`` times as much (``rows`` counts the weight)."""
        return NormalEquations(self.xtx * factor, self.xty * factor, self.yty * factor, self.rows * factor)

    def __iadd__(self, other: NormalEquations) -> NormalEquations:
        self.xtx += other.xtx
        self.xty += other.xty
        self.yty += other.yty
        self.rows += other.rows
        return self

    def solve(self, strength: float) -> torch.Tensor:
        """Ridge weights on standardised columns (each scaled by its root mean square), returned unscaled. A column
        whose root mean square is below `DEAD_COLUMN` times the median column's gets weight 0: it holds rounding
        noise (a key channel the model's norm zeroes, undone from RoPE), which standardising would blow up into a
        weight of 1e5-1e6 that a half-precision cache's rounding then turns into noise in every prediction."""
        scale = (self.xtx.diagonal() / max(self.rows, 1)).sqrt()
        live = scale > DEAD_COLUMN * scale.median()
        weights = torch.zeros_like(self.xty)
        if not live.any():
            return weights
        kept = scale[live]
        gram = self.xtx[live][:, live] / (kept[:, None] * kept[None, :]) / max(self.rows, 1)
        gram += strength * torch.eye(gram.shape[0], dtype=gram.dtype)
        weights[live] = torch.linalg.solve(gram, self.xty[live] / kept / max(self.rows, 1)) / kept
        return weights

    def squared_error(self, weights: torch.Tensor) -> float:
        """Mean squared error of ``weights`` on these rows: ``(y^T y - 2 w^T X^T y + w^T X^T X w) / n`` (weighted as
        the rows are: `mass_weights` average 1 per group, so it is the weighted mean; not comparable with the error
        of a predictor fitted with another ``mass_weight``)."""
        error = self.yty - 2 * float(weights @ self.xty) + float(weights @ self.xtx @ weights)
        return error / max(self.rows, 1)


def check_mass_weight(power: float, name: str = "mass_weight") -> None:
    """Refuse a ``mass_weight`` outside ``[0, MASS_WEIGHT_MOST]`` (``name``: how the caller spells it)."""
    if not 0 <= power <= MASS_WEIGHT_MOST:
        raise ValueError(f"{name} must lie in [0, {MASS_WEIGHT_MOST}], got {power}")


def mass_weights(target: torch.Tensor, power: float) -> torch.Tensor:
    """Row weights of one group from its targets ``log(EPSILON + future mass)``: ``(m / mean m) ** power`` clipped
    to `MASS_WEIGHT_RANGE`, then scaled to mean 1 (so the ridge strengths keep their meaning)."""
    mass = target.exp()
    weights = (mass / mass.mean()).pow(power).clamp(*MASS_WEIGHT_RANGE)
    return weights / weights.mean()


def weighted_rows(x: torch.Tensor, y: torch.Tensor, power: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One group's features ``(N, F)`` and targets ``(N,)`` demeaned on their `mass_weights` to ``power`` (weighted
    means), and those weights (in the targets' dtype)."""
    weights = mass_weights(y.double(), power).to(y.dtype)
    x_mean = (weights[:, None] * x).sum(0) / weights.sum()
    y_mean = (weights * y).sum() / weights.sum()
    return x - x_mean, y - y_mean, weights


def ridge_strength(fit: NormalEquations, held: NormalEquations | None) -> tuple[float, float | None]:
    """The strength of `RIDGE_STRENGTHS` whose fit on ``fit`` has the least squared error on ``held``, and that
    error; `DEFAULT_STRENGTH` and None when there are no held-out rows."""
    if held is None or not held.rows:
        return DEFAULT_STRENGTH, None
    errors = {strength: held.squared_error(fit.solve(strength)) for strength in RIDGE_STRENGTHS}
    strength = min(errors, key=errors.get)
    return strength, errors[strength]


@dataclass
class Collector:
    """Stands in for a predictor during calibration: at each eviction it records every candidate's features and
    target (`NormalEquations` per part, layer and KV head) and ranks by the KV group's mean H2O mass, or by the
    ``rollout`` predictor's prediction."""

    groups: tuple[str, ...]
    width: int
    recent: int
    sink_tokens: int
    part: str = "fit"
    equations: dict = field(default_factory=dict)  # (part, layer, head) -> NormalEquations
    rollout: Predictor | None = None  # ranks the pass instead of H2O's mass (a second, on-policy round)
    mass_weight: float = CALIBRATION_MASS_WEIGHT  # rows weighted by relative future mass to this power (`mass_weights`)

    def layer(self, index: int, unrotate, sink_tokens: int) -> CollectingLayer:
        return CollectingLayer(self, index, unrotate, sink_tokens)

    def record(self, index: int, features: torch.Tensor, target: torch.Tensor, candidates: torch.Tensor) -> None:
        """Demean ``features`` ``(B, H, N, F)`` and ``target`` ``(B, H, N)`` over each head's ``candidates`` (means
        and rows weighted by `mass_weights`) and add them to that head's normal equations."""
        features, target = features.double().cpu(), target.double().cpu()
        candidates = candidates.cpu()
        for batch in range(features.shape[0]):
            for head in range(features.shape[1]):
                chosen = candidates[batch, head]
                if int(chosen.sum()) < 2:
                    continue
                x, y = features[batch, head][chosen], target[batch, head][chosen]
                x, y, weights = weighted_rows(x, y, self.mass_weight)
                root = weights.sqrt()
                key = (self.part, index, head)
                if key not in self.equations:
                    self.equations[key] = NormalEquations.empty(self.width)
                self.equations[key].add(x * root[:, None], y * root)


class CollectingLayer(LayerPredictor):
    """One layer's side of a `Collector`: records the candidates (neither sinks nor the recent window) at each
    eviction and returns the rollout's ranking."""

    def __init__(self, collector: Collector, index: int, unrotate, sink_tokens: int):
        super().__init__(None, collector.groups, unrotate, sink_tokens)
        self.collector, self.index = collector, index

    def predict(self, inputs) -> torch.Tensor:
        features = self.features(inputs)
        positions = inputs.positions
        newest = positions.amax(-1, keepdim=True)
        candidates = (positions >= self.sink_tokens) & (positions <= newest - self.collector.recent)
        target = torch.log(inputs.future.float() + EPSILON)
        self.collector.record(self.index, features, target, candidates)
        if self.collector.rollout is not None:  # the learned policy itself, with the earlier round's predictor
            return linear_map(features, self.collector.rollout.weights[self.index])
        history = inputs.history[:, :, 0]  # the rollout: the group's mean H2O mass
        kv_heads = inputs.values.shape[1]
        mass = history.view(history.shape[0], kv_heads, -1, history.shape[-1]).mean(2)
        return torch.log(mass.float() + EPSILON)


def calibration_texts(tokenizer, domain: str, length: int, count: int | None = None, seed: int = 0) -> list:
    """Texts of the dev split of ``domain`` (``essays`` or ``code``): the non-overlapping excerpts of ``length``
    tokens (`caote.evaluation.tasks.Text`; the first excerpt of every document, then the second, ...), the first
    ``count`` of them (None: all)."""
    return domain_texts(tokenizer, domain, [length], None, "dev", seed, every=True)[:count]


def folder_texts(tokenizer, folder, length: int, count: int | None = None) -> list:
    """Every non-overlapping excerpt of ``length`` tokens of the ``.txt`` files of ``folder`` (ids
    ``file-<name>-<length>[-k]``): the user's own calibration texts."""
    documents = [
        (path.stem, path.read_text(encoding="utf-8", errors="replace")) for path in sorted(folder.glob("*.txt"))
    ]
    if not documents:
        raise ValueError(f"no .txt files in {str(folder)!r}")
    excerpts = document_excerpts(tokenizer, documents, length, count, 0, str(folder), sentence_boundary=False)
    seen: dict[str, int] = {}
    texts = []
    for unit, text in excerpts:
        seen[unit] = seen.get(unit, 0) + 1
        texts.append(Text(f"file-{unit}-{length}" + (f"-{seen[unit]}" if seen[unit] > 1 else ""), length, text, unit))
    return texts


def check_calibration_texts(texts) -> None:
    """Refuse any text of an evaluation split: calibration reads dev-split essays or code only (a text from a
    folder, whose id is neither ``essay-`` nor ``code-``, is the user's own)."""
    test = [
        text.id
        for text in texts
        if text.id.startswith(("essay-", "code-"))
        and split_of(text.unit + ".txt" if text.id.startswith("essay-") else text.unit) != "dev"
    ]
    if test:
        raise ValueError(
            f"calibration texts must come from the dev split; {len(test)} are evaluation texts ({', '.join(test[:3])})"
        )


TEXT_ID = re.compile(r"(essay|code|file)-(.+?)-(\d+)(?:-\d+)?")  # <kind>-<document>-<length>[-<excerpt>]


def document_of(text_id: str) -> str:
    """The document a text id is an excerpt of (``essay-gap-1024-3`` -> ``essay:gap``); other ids are their own."""
    match = TEXT_ID.fullmatch(text_id)
    return f"{match.group(1)}:{match.group(2)}" if match else text_id


JOINED_ID = re.compile(r"essays-joined\d+-\d+")  # a window of a split's essays joined (`data.joined_essay_excerpts`)


def documents_of(text_id: str, split: str) -> set[str]:
    """The documents a text of ``split`` draws on: its own (`document_of`), or every essay of the split for a window
    of the joined essays (which spans several)."""
    if JOINED_ID.fullmatch(text_id):
        return {f"essay:{Path(name).stem}" for name in essay_names(split)}
    return {document_of(text_id)}


def check_disjoint(predictor: Predictor, text_ids, split: str = "test") -> None:
    """Refuse to evaluate a learned policy on a text (of ``split``) drawing on a document (any excerpt, any length)
    its predictor was calibrated on."""
    earlier = [text_id for texts in predictor.details.get("rolled_out_by", []) for text_id in texts]
    calibrated = {document_of(text_id) for text_id in [*predictor.texts, *earlier]}
    shared = sorted(text_id for text_id in text_ids if documents_of(text_id, split) & calibrated)
    if shared:
        raise ValueError(
            f"the predictor was calibrated on the documents of {len(shared)} of the texts to evaluate "
            f"({', '.join(shared[:3])}): calibrate on the dev split and evaluate on test"
        )


def rollout_settings(
    budget: int, recent_window: int | float = LEARNED_RECENT, block_size: int = DEFAULT_BLOCK_SIZE
) -> CacheSettings:
    """The settings of one evicting pass: `ROLLOUT` at ``budget``, protecting ``recent_window`` newest tokens (a
    float: a share of the budget, as H2O's)."""
    recent = recent_window if isinstance(recent_window, int) else int(recent_window * budget)
    return CacheSettings(budget=budget, policy=ROLLOUT, block_size=block_size, recent_window=recent)


def calibrate(
    model,
    tokenizer,
    texts: list,
    budgets=CALIBRATION_BUDGETS,
    groups: tuple[str, ...] = DEFAULT_FEATURE_GROUPS,
    recent_window: int | float = LEARNED_RECENT,
    block_size: int = DEFAULT_BLOCK_SIZE,
    progress: bool = True,
    model_name: str | None = None,
    rollout: Predictor | None = None,
    mass_weight: float = CALIBRATION_MASS_WEIGHT,
    target: str = CALIBRATION_TARGET,
    balance_lengths: bool = True,
    bar=None,
) -> Predictor:
    """Fit a `Predictor` for ``model`` on ``texts`` (`caote.evaluation.tasks.Text`, never a test-split text: see
    the module docstring), under rollouts at every budget of ``budgets``, protecting ``recent_window`` newest
    tokens (a float: a share of the budget, as H2O). With ``rollout`` (an earlier round's predictor of the same
    model and feature groups) the evicting passes run ``learned+caote`` with it, so the rows come from the kept
    sets the policy itself leaves (a second round of on-policy distillation, DAgger-like but fitted on this round's
    rows only). The held-out texts choosing the ridge strengths were then evicted by a predictor that saw them in
    its own fit: a slightly optimistic choice. ``mass_weight``: each row weighs (its future mass / its group's
    mean) to this power (`mass_weights`; 0 weighs every row alike). ``target``: what the predictor learns to
    rank by (`caote.future.received`): the attention later queries give a token (``mass``) or the change of their
    outputs were it evicted (``change``). ``balance_lengths``: texts of different lengths weigh alike in the fit,
    each length's rows together as much as another's (`length_shares`; otherwise a long excerpt adds rows in
    proportion to its length times its evicting passes, and the longest texts decide the fit; docs/learned.md).
    ``bar``: a progress bar to advance once per evicting pass instead of this call's own."""
    check_mass_weight(mass_weight)
    check_calibration_texts(texts)
    if rollout is not None and (rollout.fingerprint != model_fingerprint(model) or set(rollout.groups) != set(groups)):
        raise ValueError(
            f"the rollout predictor was calibrated for {rollout.model!r} on features {','.join(rollout.groups)}: it "
            f"must be of this model and of the features {','.join(groups)}"
        )
    if "key" in groups:
        rotary_inverse(model)  # refuses a model without RoPE before any work
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = len(feature_names(groups, head_dim))
    began = time.perf_counter()
    collectors, lengths = [], []
    own_bar = bar is None
    if own_bar:
        passes = sum(len(evicting_budgets(text, budgets)) for text in texts)
        bar = tqdm(total=passes, desc="caote calibrate", unit="pass", disable=not progress)
    for number, text in enumerate(texts):
        ids = tokenizer(text.text, return_tensors="pt").input_ids.to(model.device)  # as the evaluation tokenises
        # the fit reads no log-probs: scoring only the last token keeps one row of logits per block instead of
        # all of them (at 8,192 tokens, Gemma-3's 262,144-word vocabulary made that 8.6 GB and much of the pass)
        reference = reference_pass(
            model, ids, block_size, future=True, states=set(), scored_tail=1, future_target=target
        )
        for budget in evicting_budgets(text, budgets):
            settings = rollout_settings(budget, recent_window, block_size)
            collector = Collector(
                groups, width, settings.recent, settings.sink_tokens, rollout=rollout, mass_weight=mass_weight
            )
            collector.part = "held_out" if number % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else "fit"
            with ExitStack() as stack, torch.no_grad():
                cache = stack.enter_context(EvictionCache(model, settings, future=reference.future, stand_in=collector))
                for start in range(0, ids.shape[1], block_size):
                    model.get_decoder()(input_ids=ids[:, start : start + block_size], cache=cache, use_cache=True)
            collectors.append(collector)
            lengths.append(text.length)
            bar.update()
    if own_bar:
        bar.close()
    rolled_out = None if rollout is None else rollout.details.get("rolled_out_by", []) + [rollout.texts]
    recipe = {"budgets": list(budgets), "recent_window": recent_window, "mass_weight": mass_weight, "target": target}
    if balance_lengths and len(set(lengths)) > 1:
        recipe["balance_lengths"] = True
        shares = length_shares(collectors, lengths)
        for collector, length in zip(collectors, lengths):
            collector.equations = {key: rows.scaled(shares[length]) for key, rows in collector.equations.items()}
    return _fit(model, collectors, groups, width, texts, recipe, began, model_name, rolled_out)


def length_shares(collectors: list, lengths: list) -> dict:
    """Per text length, the factor that gives that length's fitted rows (over every layer and head) an equal share
    of the total: ``(total / number of lengths with fitted rows) / its rows``; the total weight is unchanged. A
    length whose texts all choose ridge strengths (no fitted row) keeps factor 1."""
    rows: Counter = Counter()
    for collector, length in zip(collectors, lengths):
        rows[length] += sum(equations.rows for key, equations in collector.equations.items() if key[0] == "fit")
    share = sum(rows.values()) / max(sum(1 for count in rows.values() if count), 1)
    return {length: share / count if count else 1.0 for length, count in rows.items()}


def evicting_budgets(text, budgets) -> list[int]:
    """The budgets of ``budgets`` below ``text``'s length: a pass at a budget the text never exceeds evicts nothing
    and collects no row, so it is not run (nor counted by a progress bar)."""
    return [budget for budget in budgets if budget < text.length]


def calibrate_rounds(model, tokenizer, texts: list, rounds: int, rollout: Predictor | None = None, **options):
    """``rounds`` rounds of `calibrate` on ``texts``, each evicting by the previous round's predictor (the first by
    ``rollout``, or by H2O's mass without one): the recipe of ``caote calibrate`` (two rounds by default,
    `caote.defaults.CALIBRATION_ROUNDS`). ``options`` go to every round; the result's ``seconds`` and ``rounds`` are
    the whole run's."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    predictor, seconds = rollout, 0.0
    for _ in range(rounds):
        predictor = calibrate(model, tokenizer, texts, rollout=predictor, **options)
        seconds += predictor.details["seconds"]
    predictor.details.update(seconds=round(seconds, 1), rounds=rounds)
    return predictor


def calibration_length(model) -> int:
    """The calibration excerpts' length for ``model``: `CALIBRATION_WINDOWS` sliding windows for a model whose
    layers mix sliding-window and full attention (the full layers, which evict, then see context the sliding ones
    no longer cover), else `CALIBRATION_LENGTH` (the standard grid's texts)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if window and "full_attention" in layer_types and "sliding_attention" in layer_types:
        return max(CALIBRATION_LENGTH, CALIBRATION_WINDOWS * window)
    return CALIBRATION_LENGTH


def default_count(length: int) -> int:
    """How many excerpts of ``length`` tokens make `CALIBRATION_TOKENS` (the 40 excerpts of 1,024 tokens the
    bundled model's predictor was fitted on), at least `HELD_OUT_EVERY` so a ridge strength can be chosen."""
    return max(HELD_OUT_EVERY, round(CALIBRATION_TOKENS / length))


def _fit(model, collectors, groups, width, texts, recipe, began, model_name, rolled_out) -> Predictor:
    totals: dict = {}
    for collector in collectors:
        for key, equations in collector.equations.items():
            if key not in totals:
                totals[key] = NormalEquations.empty(width)
            totals[key] += equations
    layers = sorted({layer for _, layer, _ in totals})
    heads = sorted({head for _, _, head in totals})
    if not totals:
        raise ValueError(
            "calibration collected nothing: no evicting pass overflowed its budget (give longer texts or smaller "
            "budgets)"
        )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    weights = torch.zeros(config.num_hidden_layers, len(heads), width)
    chosen, held_out_error, baseline_error = {}, [], []
    for layer in layers:
        for head in heads:
            fit = totals.get(("fit", layer, head))
            held = totals.get(("held_out", layer, head))
            if fit is None:
                continue
            strength, error = ridge_strength(fit, held)
            if error is not None:
                held_out_error.append(error)
                baseline_error.append(held.yty / held.rows)
            every = NormalEquations.empty(width)
            every += fit
            if held is not None:
                every += held
            weights[layer, head] = every.solve(strength).float()
            chosen[f"{layer}.{head}"] = strength
    rows = sum(equations.rows for key, equations in totals.items() if key[0] == "fit")
    details = {
        **recipe,
        "ridge": chosen,
        "rows": round(rows),
        "held_out_mse": sum(held_out_error) / max(len(held_out_error), 1),
        "held_out_variance": sum(baseline_error) / max(len(baseline_error), 1),
        "seconds": round(time.perf_counter() - began, 1),
    }
    if rolled_out is not None:  # the calibration texts of each earlier round whose predictor ranked the passes
        details["rolled_out_by"] = rolled_out
    name = model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__
    return Predictor(weights, tuple(groups), name, model_fingerprint(model), [text.id for text in texts], details)
