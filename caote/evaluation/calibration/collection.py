"""The rows of the fit: an evicting pass whose every eviction records each candidate's features and future.

A `Collector` stands in for the predictor while a text is read under an evicting cache (`roll_out`): at each
eviction it receives what the learned policy will see (`caote.learned.LayerPredictor.features`) and the target
``log(EPSILON + future)`` from the full cache's pass (`caote.future`), adds them to the normal equations of its
(layer, KV head) (`caote.evaluation.calibration.ridge`) and ranks the tokens for the cache to evict: by CAOTE over
the KV group's mean H2O mass (`ROLLOUT`; the predictor does not exist yet) or, in a later round, by the previous
round's predictor, so the rows come from the kept sets the policy itself leaves.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from caote.cache import EvictionCache
from caote.defaults import CALIBRATION_MASS_WEIGHT
from caote.evaluation.calibration.ridge import NormalEquations, weighted_sums
from caote.learned import EPSILON, LayerPredictor, linear_map
from caote.predictor import Predictor
from caote.settings import CacheSettings

# with the collector standing in for the predictor: CAOTE over the group's H2O mass, or over a rollout predictor's
ROLLOUT = "learned+caote"


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
        """Add each head's ``candidates`` (boolean ``(B, H, N)``) of ``features`` ``(B, H, N, F)`` and ``target``
        ``(B, H, N)`` to its normal equations, centred and weighted within the eviction (`weighted_sums`); a head
        with fewer than two candidates adds nothing."""
        heads = features.shape[1]
        candidates = candidates.cpu().flatten(0, 1)
        xtx, xty, yty = weighted_sums(
            features.cpu().flatten(0, 1), target.cpu().flatten(0, 1), candidates, self.mass_weight
        )
        for row, count in enumerate(candidates.sum(-1).tolist()):
            if count < 2:
                continue
            key = (self.part, index, row % heads)
            if key not in self.equations:
                self.equations[key] = NormalEquations.empty(self.width)
            self.equations[key].add_sums(xtx[row], xty[row], float(yty[row]), count)


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


def rollout_settings(budget: int, recent: int, block_size: int) -> CacheSettings:
    """The settings of one evicting pass: `ROLLOUT` at ``budget``, protecting the ``recent`` newest tokens."""
    return CacheSettings(budget=budget, policy=ROLLOUT, block_size=block_size, recent_window=recent)


def last_block_start(tokens: int, block_size: int) -> int:
    """Where the last block of a ``tokens``-long text begins: an evicting pass stops there, since the eviction after
    the last block has no later query to learn from."""
    return (tokens - 1) // block_size * block_size


def evicting_budgets(length: int, budgets, block_size: int) -> list[int]:
    """The budgets of ``budgets`` that a pass over a ``length``-token text, stopping before its last block
    (`last_block_start`), exceeds: a pass at another budget evicts nothing and collects no row, so it is not run
    (nor counted by a progress bar)."""
    return [budget for budget in budgets if budget < last_block_start(length, block_size)]


def roll_out(model, input_ids: torch.Tensor, settings: CacheSettings, future, collector: Collector) -> None:
    """Read ``input_ids`` ``(1, T)`` block by block under an `EvictionCache` of ``settings`` in which ``collector``
    stands in for the predictor, its targets taken from ``future`` (the full cache's `caote.future.FutureAttention`
    of the same ids)."""
    block = settings.block_size
    with ExitStack() as stack, torch.no_grad():
        cache = stack.enter_context(EvictionCache(model, settings, future=future, stand_in=collector))
        for start in range(0, input_ids.shape[1], block):
            model.get_decoder()(input_ids=input_ids[:, start : start + block], cache=cache, use_cache=True)
