"""The per-layer budget probe of issue 43 (benchmarks/allocation_probe.py): its greedy allocation and the cache it
builds, whose every layer holds at most its own budget."""

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import random_ids

import caote.evaluation.lockstep as lockstep
from caote.cache import EvictionCache, EvictionLayer
from caote.evaluation.lockstep import reference_pass, track

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "allocation_probe.py"
BLOCK = 16


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("allocation_probe", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    with probe.allocated(budgets):
        cache = lockstep.EvictionCache(llama, budget=48, policy="h2o+caote", block_size=BLOCK)
    assert lockstep.EvictionCache is EvictionCache, "the probe's cache is built only inside the context"
    layers = [layer for layer in cache.layers if isinstance(layer, EvictionLayer)]
    with torch.no_grad():
        for start in range(0, ids.shape[1], BLOCK):
            llama(input_ids=ids[:, start : start + BLOCK], cache=cache, use_cache=True)
            assert all(layer.retained <= budget for layer, budget in zip(layers, budgets, strict=True))
    assert [layer.retained for layer in layers] == budgets
    with pytest.raises(ValueError, match="leaves no room"):  # each budget is validated like a uniform one
        with probe.allocated([2, 94]):
            lockstep.EvictionCache(llama, budget=48, policy="h2o+caote", block_size=BLOCK)


def test_budgets_above_the_text_change_nothing_and_uneven_ones_do(probe, llama):
    ids = random_ids(160, seed=4)
    reference = reference_pass(llama, ids, BLOCK)
    with probe.allocated([200, 200]):
        assert track(llama, ids, reference, "tova+caote", 48, skip_prefix=False)["kl"] < 1e-9
    uniform = track(llama, ids, reference, "tova+caote", 48, skip_prefix=False)["kl"]
    with probe.allocated([32, 64]):
        uneven = track(llama, ids, reference, "tova+caote", 48, skip_prefix=False)["kl"]
    assert uniform > 0 and uneven > 0 and uneven != uniform
