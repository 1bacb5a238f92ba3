"""ATen operators of one decode step, counted with a `TorchDispatchMode` (views included): what a bounded cache adds
per evicting layer, beside a full cache holding the same number of tokens.

On a CPU, and on an accelerator where each operator is a kernel launch, a decode step of a small model costs about
its operator count; the count does not depend on the machine's load, so it is measured once per run, not per round.
Counted on the CPU, one token evicted per step (``decode_eviction_interval=1``, the scored step). An operator is
counted inside a layer while that decoder layer's attention module runs (projections, rotary
embedding, the cache update, attention and, for a layer evicted alone, its eviction); the rest of the forward
(embeddings, masks, the positions worked out once per forward, the MLPs, the end-of-forward eviction of a decode
step's layers together) is counted apart, per forward; the count per evicting layer spreads it over them.
"""

from __future__ import annotations

import statistics
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from caote.benchmark.config import FULL_AT_BUDGET
from caote.benchmark.sample import configuration_cache
from caote.cache import EvictionCache, evicting_layers

COUNTED_STEPS = 4  # decode steps counted after the warm-up ones; the count is their mean


class OperatorCount(TorchDispatchMode):
    """Counts every ATen operator dispatched while active, by the decoder layer whose attention runs (None: outside
    every attention module) and by name."""

    def __init__(self):
        super().__init__()
        self.layer: int | None = None
        self.by_layer: Counter = Counter()
        self.names: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_layer[self.layer] += 1
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _count_in_attention(model, counter: OperatorCount) -> list:
    """Hooks that tell ``counter`` which layer's attention module is running."""
    handles = []
    for index, layer in enumerate(model.get_decoder().layers):

        def enter(module, args, index=index):
            counter.layer = index

        def leave(module, args, output):
            counter.layer = None

        handles += [layer.self_attn.register_forward_pre_hook(enter), layer.self_attn.register_forward_hook(leave)]
    return handles


def decode_step_operators(model, ids: torch.Tensor, configuration: str, budget: int, block: int, warm_up: int = 3):
    """Operators of the decode steps after a prefill of ``ids``: ``{"per_layer": [...], "per_forward": n, "names":
    Counter}``, the means over `COUNTED_STEPS` steps after ``warm_up`` uncounted ones. ``configuration`` is a policy
    (an `EvictionCache` fed in blocks of ``block``) or ``full@b`` (a `DynamicCache` of the last ``budget`` tokens)."""
    cache, ids, chunk = configuration_cache(model, configuration, ids, budget, block)
    counts, forwards, names = [], [], Counter()
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            logits = model(input_ids=ids[:, start : start + chunk], cache=cache, use_cache=True).logits
        for step in range(warm_up + COUNTED_STEPS):
            token = logits[:, -1:].argmax(-1)
            if step < warm_up:
                logits = model(input_ids=token, cache=cache, use_cache=True).logits
                continue
            counter = OperatorCount()
            handles = _count_in_attention(model, counter)
            try:
                with counter:
                    logits = model(input_ids=token, cache=cache, use_cache=True).logits
            finally:
                for handle in handles:
                    handle.remove()
            counts.append([counter.by_layer[index] for index in range(len(model.get_decoder().layers))])
            forwards.append(counter.by_layer[None])
            names.update(counter.names)
    if isinstance(cache, EvictionCache):
        cache.close()
    per_layer = [statistics.fmean(step[index] for step in counts) for index in range(len(counts[0]))]
    return {
        "per_layer": per_layer,
        "per_forward": statistics.fmean(forwards),
        "names": {name: count / COUNTED_STEPS for name, count in names.items()},
    }


def operator_counts(model, ids: torch.Tensor, policies, budget: int, block: int) -> dict:
    """Per policy: the operators a decode step adds over ``full@b``'s, per evicting layer (``extra_per_layer``:
    everything the step adds, the work the layers share included, divided by the evicting layers), split into what
    one layer's attention adds (``extra_in_layer``, the median over the evicting layers) and what the forward adds
    once (``extra_per_forward``: the positions every layer shares, the end-of-forward eviction of the step's layers
    together), counted after a prefill of ``ids`` (at least ``budget + 1`` tokens, so that every step evicts)."""
    layers = evicting_layers(model)
    full = decode_step_operators(model, ids, FULL_AT_BUDGET, budget, block)
    full_layer = statistics.median(full["per_layer"][index] for index in layers)
    counts = {FULL_AT_BUDGET: {"per_layer": full_layer, "per_forward": full["per_forward"]}}
    full_total = sum(full["per_layer"]) + full["per_forward"]
    for policy in policies:
        measured = decode_step_operators(model, ids, policy, budget, block)
        in_layer = statistics.median(measured["per_layer"][index] for index in layers) - full_layer
        step = sum(measured["per_layer"]) + measured["per_forward"] - full_total
        names = Counter(measured["names"])
        names.subtract(full["names"])
        counts[policy] = {
            "extra_per_layer": step / len(layers),
            "extra_in_layer": in_layer,
            "extra_per_forward": step - in_layer * len(layers),
            # the step's extra operators by name, over the whole forward, per evicting layer
            "extra_by_name": {name: n / len(layers) for name, n in sorted(names.items()) if n},
        }
    return {"budget": budget, "prompt_tokens": ids.shape[1], "evicting_layers": len(layers), "counts": counts}
