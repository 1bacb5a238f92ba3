"""When a layer is evicted, and with which extra score inputs: one small strategy per schedule, chosen once when a
cache is built from the name a `BaseScore` gives its schedule (`caote.policies`; `STRATEGIES`).

* `Immediate`: right after the layer's attention, whenever it holds more than the budget (the paper's schedule);
  a decode step in place evicts its layers together when the forward ends (the same arithmetic, fewer operators).
* `Hindsight`: the same, with the attention each token will receive from later queries (the ``oracle``).
* `LookAhead`: a prompt block's eviction waits for the end of the forward, when the model drafts a few tokens
  greedily through the same cache; their queries join the block's rows (``caote-ahead``).
* `Learned`: `Immediate`, with the model's importance predictor (`caote.learned`) as a score input (``learned``).

A strategy works on the layers a cache hands it (`caote.layer.EvictionLayer`) and on the cache's random generator;
what it may need of the cache's surroundings comes in one `CacheContext`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from caote.attention import AttentionCall, attention_probabilities
from caote.future import FutureAttention
from caote.history import KEY_TERM_POSITION, PREDICTION_POSITION
from caote.layer import EvictionLayer
from caote.lookahead import draft
from caote.predictor import Predictor
from caote.recording import record
from caote.rotary import rotary_inverse
from caote.stacking import evict_together


@dataclass(frozen=True)
class CacheContext:
    """What a strategy may need besides the settings: the model, the oracle's hindsight (``future``), whether the
    model has sliding-window layers, and an object standing in for the model's predictor (calibration's
    `caote.evaluation.calibration.collection.Collector`, which reads ``future`` as its targets)."""

    model: nn.Module
    future: FutureAttention | None = None
    sliding_layers: bool = False
    stand_in: Predictor | None = None


class Immediate:
    """Evict a layer as soon as its attention has run and it holds more than the budget; decode steps write in
    place (`caote.layer.EvictionLayer`), and the layers of a decode step in place are evicted together when the
    forward ends (`caote.stacking.evict_together`: nothing reads a layer's cache between its attention and the next
    step, so waiting changes nothing but the number of operators)."""

    decodes_in_place = True
    evicts_together = True

    def __init_subclass__(cls, **kwargs):
        """A strategy decoding in place whose layers get inputs of their own (`inputs`) gives a stack of them theirs
        too (`stack_inputs`), or evicts layer by layer (``evicts_together = False``)."""
        super().__init_subclass__(**kwargs)
        own_inputs = cls.inputs is not Immediate.inputs and cls.stack_inputs is Immediate.stack_inputs
        if own_inputs and cls.decodes_in_place and cls.evicts_together:
            raise TypeError(f"{cls.__name__} has per-layer inputs: define stack_inputs or set evicts_together = False")

    def __init__(self, settings, context: CacheContext):
        self.settings = settings
        self._waiting: dict[int, EvictionLayer] = {}  # a decode step's layers by index, evicted in `after_forward`

    def after_attention(self, cache, index: int, layer, call: AttentionCall, real):
        """Record the rows the base reads (``call.rows``: the call's own, when caote computed its attention), then
        evict if the layer overflows: to ``budget`` after a prompt block, ``budget - interval + 1`` after a decode
        step (a decode step in place: at the end of the forward, with the step's other layers)."""
        record(layer, call, real)
        if layer.retained > layer.settings.budget:
            if self.evicts_together and layer.in_place and layer.new_tokens == 1:
                self._waiting[index] = layer
                return
            kept = layer.settings.kept_after(layer.new_tokens)
            layer.evict(kept, cache.random_generator, **self.inputs(index, layer))

    def inputs(self, index: int, layer) -> dict:
        """Extra `caote.policies.ScoreInputs` fields of an eviction: none."""
        return {}

    def after_forward(self, cache, model: nn.Module, output, kwargs: dict) -> list[int]:
        """Evict the decode step's waiting layers together; ``output`` is None when the forward raised (nothing is
        evicted then: a layer left without a free slot returns to arrival order at its next forward). Returns the
        layers evicted."""
        waiting, self._waiting = self._waiting, {}
        if not waiting or output is None:
            return []
        evict_together(waiting, self.settings.kept_after(1), cache.random_generator, self.stack_inputs)
        return list(waiting)

    def stack_inputs(self, layers: dict[int, EvictionLayer], stack: EvictionLayer) -> dict:
        """The extra `ScoreInputs` of ``layers`` (by index) scored together as ``stack``: none."""
        return {}

    def restored(self, layers: list) -> None:
        """The cache returned to a snapshot (maybe of another cache): nothing of the strategy's own to redo."""


class Hindsight(Immediate):
    """Evict with the attention each token receives from all later queries (`caote.future.FutureAttention`),
    recorded by a full-cache pass over the same teacher-forced text: a ceiling no generation can reach. Its future
    attention is looked up in arrival order, so it keeps the arrival-order path while decoding."""

    decodes_in_place = False

    def __init__(self, settings, context: CacheContext):
        if context.future is None:
            raise ValueError(
                f"policy {settings.policy.name!r} is a hindsight ceiling: it needs the attention of later queries, "
                "known only on a teacher-forced text (caote eval perplexity), so it cannot generate; pick a causal "
                "policy"
            )
        super().__init__(settings, context)
        self.future = context.future

    def inputs(self, index: int, layer) -> dict:
        return {"future": self.future.at(index, layer.cumulative_length, layer.positions)}


class LookAhead(Immediate):
    """A prompt block that overflows the budget waits, in every layer, for the end of its forward; then ``tokens``
    greedy one-token forwards run through the same cache (`caote.lookahead.draft`), each draft query's row over the
    tokens held before the draft is kept, the draft's keys and values are dropped, and every waiting layer is
    evicted with those rows as ``ahead_rows``. Decode steps evict at once, in arrival order.

    This is the one place a forward runs inside another: attention -> cache -> `after_forward` -> `draft` -> model
    -> attention (docs/architecture.md). The draft's tokens are dropped by truncating the arrival-order slots, so
    it keeps that path while decoding."""

    decodes_in_place = False

    def __init__(self, settings, context: CacheContext):
        if context.sliding_layers:
            raise ValueError(
                f"policy {settings.policy.name!r} drafts tokens and drops them again, which sliding-window layers "
                "cannot undo; pick caote-block for a model with sliding-window layers"
            )
        super().__init__(settings, context)
        self.tokens = settings.policy.base.draft_tokens
        self._pending: dict[int, int] = {}  # layer -> tokens it held before the draft, awaiting eviction
        self._drafted: dict[int, list[torch.Tensor]] = {}  # layer -> attention rows of the draft's queries
        self._drafting = False

    def after_attention(self, cache, index: int, layer, call: AttentionCall, real):
        if self._drafting:
            self._record_draft(index, layer, call, real)
        elif layer.new_tokens > 1:
            record(layer, call, real)
            if layer.retained > layer.settings.budget:
                self._pending[index] = layer.retained  # evicted in `after_forward`, once the draft's rows are seen
        else:
            super().after_attention(cache, index, layer, call, real)

    def _record_draft(self, index: int, layer, call: AttentionCall, real) -> None:
        """Keep a draft query's attention over the tokens a waiting layer held before the draft."""
        tokens = self._pending.get(index)
        if tokens is None:
            return
        row = attention_probabilities(
            call.module, call.queries[:, :, -1:], layer.keys, layer.values, call.mask, call.kwargs
        )
        if real is not None:
            row = row * real[:, -1:][:, None, :, None]
        self._drafted.setdefault(index, []).append(row[..., :tokens])

    def after_forward(self, cache, model: nn.Module, output, kwargs: dict) -> list[int]:
        """Draft, drop the draft, evict every waiting layer; ``output`` is None when the forward raised (nothing is
        drafted then). Returns the layers evicted."""
        if not self._pending or self._drafting:
            return []
        if output is None:
            self._pending = {}
            return []
        self._drafting = True
        try:
            draft(model, cache, output[0], kwargs, self.tokens)
        finally:
            self._drafting = False
            pending, self._pending = self._pending, {}
            drafted, self._drafted = self._drafted, {}
        for index, tokens in pending.items():
            layer = cache.layers[index]
            layer.truncate(tokens)
            ahead = torch.cat(drafted[index], dim=-2) if index in drafted else None
            layer.evict(layer.settings.budget, cache.random_generator, ahead_rows=ahead)
        return list(pending)


class Learned(Immediate):
    """`Immediate`, with each layer's slice of the model's importance predictor as the ``predictor`` score input:
    the file ``settings.predictor`` names, or the committed one for the model (`caote.predictor.Predictor.for_model`),
    or the context's stand-in (calibration: it also gets the oracle's ``future``, its targets). A decode step's
    layers are scored together with their predictors stacked (`stack_inputs`); calibration's stand-in records each
    layer's features and targets on its own, so there each layer is evicted alone."""

    def __init__(self, settings, context: CacheContext):
        super().__init__(settings, context)
        stand_in = context.stand_in is not None
        predictor = (
            context.stand_in if stand_in else Predictor.for_model(context.model, settings.predictor, settings.budget)
        )
        self.unrotate = rotary_inverse(context.model) if "key" in predictor.groups else None
        self.predictor, self.future = predictor, context.future if stand_in else None
        self.evicts_together = not stand_in

    def restored(self, layers: list) -> None:
        """A snapshot may come from a cache with another predictor: its layers' remembered key terms and predictions
        are computed again at their next eviction (`caote.learned.LayerPredictor`; the snapshot keeps its own)."""
        for layer in layers:
            if getattr(layer, "history", None) is not None and layer.history.dim() == 4:
                layer.history = layer.history.clone()
                layer.history[:, :, [KEY_TERM_POSITION, PREDICTION_POSITION]] = 0.0

    def inputs(self, index: int, layer) -> dict:
        inputs = {"predictor": self.predictor.layer(index, self.unrotate, self.settings.sink_tokens)}
        if self.future is not None:  # calibration: the targets the stand-in records
            inputs["future"] = self.future.at(index, layer.cumulative_length, layer.positions)
        return inputs

    def stack_inputs(self, layers: dict, stack: EvictionLayer) -> dict:
        """One predictor whose rows are the layers' (`caote.predictor.Predictor.stacked`): one pass for every
        layer of a decode step (the stack's history and keys are the layers' own storage, `caote.stacking`, so the
        key terms and predictions it writes land in the layers)."""
        batch = next(iter(layers.values())).positions.shape[0]
        return {"predictor": self.predictor.stacked(list(layers), batch, self.unrotate, self.settings.sink_tokens)}


STRATEGIES = {"immediate": Immediate, "hindsight": Hindsight, "lookahead": LookAhead, "learned": Learned}


def strategy_for(settings, context: CacheContext) -> Immediate:
    """The strategy of ``settings.policy``'s schedule, built for one cache."""
    return STRATEGIES[settings.policy.base.schedule](settings, context)
