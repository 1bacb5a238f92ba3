"""``caote calibrate``'s fit: the `Recipe` and `calibrate`, which runs it on a model's texts into a `Predictor`.

Each text is read once with the full cache (`caote.evaluation.lockstep.reference_pass`), which records what later
queries give every token (`caote.future`); that record serves every round and budget. Each round then reads every
text again under an evicting cache at each budget (`collection.roll_out`), collecting rows at every eviction but
the one after the last block (no query comes later, so the pass stops before that block), and fits the ridge
weights (`ridge.solve_heads`); the first round evicts by H2O's mass, each later one by the previous round's
predictor (on-policy rows: DAgger-like, each round fitted on its own rows only).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

from tqdm.auto import tqdm

from caote.defaults import (
    CALIBRATION_BUDGETS,
    CALIBRATION_FIRST_ROUND_SHARE,
    CALIBRATION_MASS_WEIGHT,
    CALIBRATION_ROUNDS,
    CALIBRATION_TARGET,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_FEATURE_GROUPS,
    FEATURE_GROUPS,
    FUTURE_TARGETS,
)
from caote.evaluation.calibration.collection import (
    Collector,
    evicting_budgets,
    last_block_start,
    roll_out,
    rollout_settings,
)
from caote.evaluation.calibration.ridge import HELD_OUT_EVERY, NormalEquations, check_mass_weight, solve_heads
from caote.evaluation.lockstep import block_count, reference_pass
from caote.evaluation.splits import check_calibration_texts
from caote.learned import LEARNED_RECENT, feature_names
from caote.predictor import Predictor, model_fingerprint
from caote.rotary import rotary_inverse


@dataclass(frozen=True)
class Recipe:
    """How a predictor is fitted (the predictor's details record the fields that shaped it).

    ``budgets``: of the evicting passes (a text no longer than a budget skips it); ``groups``: the feature groups
    (`caote.defaults.FEATURE_GROUPS`); ``rounds``: the first evicts by H2O's mass (or by a given rollout predictor),
    each later one by the previous round's predictor; ``recent_window``: the newest tokens protected (a float: a
    share of the budget, as H2O's); ``mass_weight``: each row weighs (its future mass / its eviction's mean) to this
    power (`ridge.mass_weights`; 0: alike); ``target``: what the predictor learns to rank by (`caote.future.received`:
    the attention later queries give a token, ``mass``, or the change of their outputs were it evicted, ``change``);
    ``balance_lengths``: texts of different lengths weigh alike in the fit, each length's rows together as much as
    another's (`length_shares`; otherwise the longest texts, with the most rows, decide it)."""

    budgets: tuple[int, ...] = CALIBRATION_BUDGETS
    groups: tuple[str, ...] = DEFAULT_FEATURE_GROUPS
    rounds: int = CALIBRATION_ROUNDS
    first_round_share: float = CALIBRATION_FIRST_ROUND_SHARE
    recent_window: int | float = LEARNED_RECENT
    block_size: int = DEFAULT_BLOCK_SIZE
    mass_weight: float = CALIBRATION_MASS_WEIGHT
    target: str = CALIBRATION_TARGET
    balance_lengths: bool = True

    def __post_init__(self):
        object.__setattr__(self, "budgets", tuple(self.budgets))
        object.__setattr__(self, "groups", tuple(self.groups))
        if self.rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {self.rounds}")
        if not self.groups or any(group not in FEATURE_GROUPS for group in self.groups):
            raise ValueError(f"feature groups are some of {', '.join(FEATURE_GROUPS)}, got {self.groups}")
        if not 0 < self.first_round_share <= 1:
            raise ValueError(f"first_round_share must lie in (0, 1], got {self.first_round_share}")
        if self.target not in FUTURE_TARGETS:
            raise ValueError(f"target is one of {', '.join(FUTURE_TARGETS)}, got {self.target!r}")
        check_mass_weight(self.mass_weight)
        for budget in self.budgets:  # a budget the policy cannot run at is refused here, before any model loads
            self.settings(budget)

    def settings(self, budget: int):
        """The `caote.settings.CacheSettings` of the evicting passes at ``budget``."""
        recent = self.recent_window if isinstance(self.recent_window, int) else int(self.recent_window * budget)
        return rollout_settings(budget, recent, self.block_size)

    def round_texts(self, texts: list, round_number: int) -> list:
        """The texts round ``round_number`` (from 0) reads: all of them, but for a first round followed by others
        the first `first_round_share` of the texts of each length (at least `HELD_OUT_EVERY` of each, so that they
        choose the ridge strengths), in their order."""
        if round_number or self.rounds == 1:
            return texts
        by_length: dict[int, list] = {}
        for text in texts:
            by_length.setdefault(text.length, []).append(text)
        chosen = {
            id(text)
            for group in by_length.values()
            for text in group[: max(HELD_OUT_EVERY, math.ceil(self.first_round_share * len(group)))]
        }
        return [text for text in texts if id(text) in chosen]

    def blocks(self, texts: list) -> int:
        """The blocks `calibrate` reads for ``texts``: a full-cache pass of each, then one evicting pass, up to its
        last block, per round that reads it and budget it exceeds (the progress bar's unit: every block costs
        about the same)."""
        total, seen = 0, set()
        for number in range(self.rounds):
            for text in self.round_texts(texts, number):
                size = block_count(text.length, self.block_size)
                passes = len(evicting_budgets(text.length, self.budgets, self.block_size))
                total += size * (id(text) not in seen) + (size - 1) * passes
                seen.add(id(text))
        return total


def calibrate(
    model,
    tokenizer,
    texts: list,
    recipe: Recipe = Recipe(),
    rollout: Predictor | None = None,
    model_name: str | None = None,
    progress: bool = True,
    bar=None,
) -> Predictor:
    """Fit a `Predictor` for ``model`` on ``texts`` (`caote.evaluation.tasks.Text` of the dev split,
    `check_calibration_texts`) by ``recipe``. ``rollout``: an earlier predictor (same model and features) that
    evicts in the first round instead of H2O's mass. Every `HELD_OUT_EVERY`-th text chooses the ridge strengths
    (in a later round, evicted by a predictor that saw it: a slightly optimistic choice). ``bar``: a progress bar
    advanced by `Recipe.blocks` (None: this call's own, shown when ``progress``)."""
    check_calibration_texts(texts)
    if rollout is not None and (
        rollout.fingerprint != model_fingerprint(model) or set(rollout.groups) != set(recipe.groups)
    ):
        raise ValueError(
            f"the rollout predictor was calibrated for {rollout.model!r} on features {','.join(rollout.groups)}: it "
            f"must be of this model and of the features {','.join(recipe.groups)}"
        )
    if "key" in recipe.groups:
        rotary_inverse(model)  # refuses a model without RoPE before any work
    began = time.perf_counter()
    own_bar = bar is None
    if own_bar:
        bar = tqdm(total=recipe.blocks(texts), desc="caote calibrate", unit="block", disable=not progress)
    futures: dict[int, object] = {}  # id(text) -> its full-cache future, read by every round and budget
    earlier = [] if rollout is None else rollout.details.get("rolled_out_by", []) + [rollout.texts]
    predictor = rollout
    for round_number in range(recipe.rounds):
        read = recipe.round_texts(texts, round_number)
        last = round_number == recipe.rounds - 1
        collectors = _round(model, tokenizer, read, recipe, predictor, futures, bar, release=last)
        if round_number:
            earlier = earlier + [predictor.texts]
        predictor = _fitted(model, collectors, read, recipe, began, model_name, earlier or None)
    if own_bar:
        bar.close()
    return predictor


def _round(
    model, tokenizer, texts: list, recipe: Recipe, rollout: Predictor | None, futures: dict, bar, release: bool
) -> list:
    """One round's ``(collector, text length)`` per evicting pass, ``rollout`` ranking (None: H2O's mass); with
    ``release`` (the last round) each text's future is dropped after its last pass, so that memory holds one."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = len(feature_names(recipe.groups, head_dim))
    collectors = []
    remaining = Counter(id(text) for text in texts)
    for number, text in enumerate(texts):
        ids = tokenizer(text.text, return_tensors="pt").input_ids.to(model.device)  # as the evaluation tokenises
        blocks = block_count(text.length, recipe.block_size)
        if id(text) not in futures:
            # the fit reads no log-probs: scoring only the last token keeps one row of logits per block instead of
            # all of them (at 8,192 tokens, Gemma-3's 262,144-word vocabulary made that 8.6 GB and much of the pass)
            reference = reference_pass(
                model, ids, recipe.block_size, future=True, states=set(), scored_tail=1, future_target=recipe.target
            )
            futures[id(text)] = reference.future
            bar.update(blocks)
        for budget in evicting_budgets(text.length, recipe.budgets, recipe.block_size):
            settings = recipe.settings(budget)
            collector = Collector(
                recipe.groups,
                width,
                settings.recent,
                settings.sink_tokens,
                rollout=rollout,
                mass_weight=recipe.mass_weight,
            )
            collector.part = "held_out" if number % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else "fit"
            # the eviction after the last block has no future to learn from: the pass stops before that block
            roll_out(
                model,
                ids[:, : last_block_start(ids.shape[1], recipe.block_size)],
                settings,
                futures[id(text)],
                collector,
            )
            collectors.append((collector, text.length))
            bar.update(blocks - 1)
        remaining[id(text)] -= 1
        if release and not remaining[id(text)]:
            del futures[id(text)]
    return collectors


def length_shares(collectors: list) -> dict:
    """Per text length, the factor that gives that length's fitted rows (over every layer and head) an equal share
    of the total: ``(total / number of lengths with fitted rows) / its rows``; the total weight is unchanged. A
    length whose texts all choose ridge strengths (no fitted row) keeps factor 1. ``collectors``: ``(collector,
    text length)`` pairs."""
    rows: Counter = Counter()
    for collector, length in collectors:
        rows[length] += sum(equations.rows for key, equations in collector.equations.items() if key[0] == "fit")
    share = sum(rows.values()) / max(sum(1 for count in rows.values() if count), 1)
    return {length: share / count if count else 1.0 for length, count in rows.items()}


def _fitted(model, collectors: list, texts: list, recipe: Recipe, began: float, model_name, rolled_out) -> Predictor:
    """The predictor of one round's ``collectors``: their rows summed per (part, layer, head), each length's share
    balanced when the recipe asks and the texts differ in length, then the ridge fit."""
    details = {
        "budgets": list(recipe.budgets),
        "recent_window": recipe.recent_window,
        "mass_weight": recipe.mass_weight,
        "target": recipe.target,
        **({"first_round_share": recipe.first_round_share} if recipe.rounds > 1 else {}),
    }
    shares = {}
    if recipe.balance_lengths and len({length for _, length in collectors}) > 1:
        details["balance_lengths"] = True
        shares = length_shares(collectors)
    totals: dict = {}
    for collector, length in collectors:
        for key, equations in collector.equations.items():
            if key not in totals:
                totals[key] = NormalEquations.empty(equations.xty.shape[0])
            totals[key] += equations.scaled(shares[length]) if shares else equations
    if not totals:
        raise ValueError(
            "calibration collected nothing: no evicting pass overflowed its budget (give longer texts or smaller "
            "budgets)"
        )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    width = next(iter(totals.values())).xty.shape[0]
    weights, strengths, held_out_mse, held_out_variance = solve_heads(totals, config.num_hidden_layers, width)
    details.update(
        ridge=strengths,
        rows=round(sum(equations.rows for key, equations in totals.items() if key[0] == "fit")),
        held_out_mse=held_out_mse,
        held_out_variance=held_out_variance,
        seconds=round(time.perf_counter() - began, 1),
        rounds=recipe.rounds,
    )
    if rolled_out:  # the calibration texts of each earlier round whose predictor ranked the passes
        details["rolled_out_by"] = rolled_out
    name = model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__
    return Predictor(weights, recipe.groups, name, model_fingerprint(model), [text.id for text in texts], details)
