"""The per-layer diagnosis of benchmarks/captured_mass.py: the share of the oracle's top-b future mass a
policy keeps, per evicting layer."""

import pytest
import torch
from conftest import load_script, random_ids, tiny_model

from caote.cache import evicting_layers
from caote.future import FutureAttention

BLOCK = 16


@pytest.fixture(scope="module")
def probe():
    return load_script("captured_mass")


def test_the_share_is_one_for_the_top_tokens_and_less_for_others(probe):
    future = FutureAttention()
    received = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0]])  # one KV head, 8 tokens seen
    future.add(0, 8, torch.zeros(1, 8))
    future.add(0, 16, torch.cat([received, torch.zeros(1, 8)], dim=-1))
    top = probe.captured_share(future, 0, 8, torch.tensor([[0, 1]]), budget=2)
    assert top.tolist() == [1.0]
    assert probe.captured_share(future, 0, 8, torch.tensor([[2, 3]]), budget=2).tolist() == [pytest.approx(3 / 7)]
    last = probe.captured_share(future, 0, 16, torch.tensor([[0, 1]]), budget=2)  # no later queries
    assert torch.isnan(last).all()


def test_shares_are_recorded_for_the_evicting_layers_only_and_only_once_they_evict(probe):
    model = tiny_model("gemma3_text")  # hybrid: sliding-window layers keep their own window
    ids = random_ids(96, seed=2, vocab=model.config.vocab_size)
    rows = probe.measure(model, [("random", ids)], [40, 200], policies=("oracle", "h2o+caote"), block=BLOCK)
    evicting = [str(layer) for layer in evicting_layers(model)]
    assert len(evicting) < model.config.num_hidden_layers
    for row in rows:
        if row["budget"] == 200:  # more than the text: nothing is ever evicted
            assert row["shares"] == {} and row["kl"] < 1e-9
            continue
        assert list(row["shares"]) == evicting
        assert all(0.0 <= share <= 1.0 + 1e-9 for share in row["shares"].values())
    table = probe.table(rows, [40, 200])
    assert "| oracle | 40 |" in table and "| h2o+caote | 40 |" in table and "| 200 |" not in table
