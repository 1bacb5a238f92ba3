"""The per-layer budget probe of benchmarks/allocation_probe.py: its greedy allocation and the cache it
builds, whose every layer holds at most its own budget."""

import pytest
import torch
from conftest import load_script, random_ids

from caote.cache import EvictionCache, EvictionLayer
from caote.evaluation.lockstep import reference_pass, track

BLOCK = 16


@pytest.fixture(scope="module")
def probe():
    return load_script("allocation_probe")


def test_the_greedy_keeps_the_total_and_the_bounds_and_feeds_the_steeper_curve(probe):
    k = torch.arange(0, 513, dtype=torch.float64)
    curves = torch.stack([1 - torch.exp(-k / 30), 1 - torch.exp(-k / 200), 1 - torch.exp(-k / 80)])
    budgets = probe.allocate(curves, 128, 32, 32, 512)
    assert sum(budgets) == 3 * 128 and all(b % 32 == 0 and 32 <= b <= 512 for b in budgets)
    assert budgets[1] > budgets[2] > budgets[0], "the layer whose mass is spread widest gets the most slots"
    bounded = probe.allocate(curves, 128, 32, 64, 256)
    assert sum(bounded) == 3 * 128 and all(64 <= b <= 256 for b in bounded)


def test_every_layer_holds_at_most_its_own_budget(probe, llama):
    ids = random_ids(160, seed=3)
    budgets = [32, 64]
    cache = probe.allocated(budgets)(llama, budget=48, policy="h2o+caote", block_size=BLOCK)
    assert probe.allocated(None) is EvictionCache
    layers = [layer for layer in cache.layers if isinstance(layer, EvictionLayer)]
    with torch.no_grad():
        for start in range(0, ids.shape[1], BLOCK):
            llama(input_ids=ids[:, start : start + BLOCK], cache=cache, use_cache=True)
            assert all(layer.retained <= budget for layer, budget in zip(layers, budgets, strict=True))
    assert [layer.retained for layer in layers] == budgets
    with pytest.raises(ValueError, match="leaves no room"):  # each budget is validated like a uniform one
        probe.allocated([2, 94])(llama, budget=48, policy="h2o+caote", block_size=BLOCK)


def test_budgets_above_the_text_change_nothing_and_uneven_ones_do(probe, llama):
    ids = random_ids(160, seed=4)
    reference = reference_pass(llama, ids, BLOCK)
    above = track(llama, ids, reference, "tova+caote", 48, skip_prefix=False, cache_class=probe.allocated([200, 200]))
    assert above["kl"] < 1e-9
    uniform = track(llama, ids, reference, "tova+caote", 48, skip_prefix=False)["kl"]
    uneven = track(llama, ids, reference, "tova+caote", 48, skip_prefix=False, cache_class=probe.allocated([32, 64]))[
        "kl"
    ]
    assert uniform > 0 and uneven > 0 and uneven != uniform
