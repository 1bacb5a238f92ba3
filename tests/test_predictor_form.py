"""The predictor-form probe (benchmarks/predictor_form.py): rows recorded under learned+caote, maps compared by the
future mass they would evict."""

import pytest
import torch
from conftest import load_script, random_ids, tiny_model

from caote.evaluation.tasks import Text
from caote.predictor import Predictor

BLOCK = 16


@pytest.fixture(scope="module")
def probe():
    return load_script("predictor_form")


def test_the_evicted_mass_is_that_of_the_lowest_scored_candidates(probe):
    target = torch.tensor([3.0, 1.0, 2.0, 0.5]).log()
    assert probe.evicted_mass(torch.tensor([0.0, 3.0, 2.0, 1.0]), target, 2) == pytest.approx(3.5)
    assert probe.evicted_mass(target, target, 2) == pytest.approx(1.5)  # the oracle evicts the least


def test_training_documents_never_give_a_test_text(probe):
    def text(text_id):
        return Text(text_id, 4096, "", text_id)

    pool = [text(i) for i in ("code-dis-4096", "code-gzip-4096", "code-csv-4096", "code-dis-4096-2", "code-trace-4096")]
    train, test = probe.choose(pool, 2, pool, 3)
    assert [t.id for t in train] == ["code-dis-4096", "code-gzip-4096"]
    assert [t.id for t in test] == ["code-csv-4096", "code-trace-4096"]  # dis's second excerpt is not a test text


def test_rows_come_from_the_asked_layers_and_the_oracle_evicts_least(probe):
    model = tiny_model("llama")
    predictor = Predictor.for_model(model)
    texts = [(number, random_ids(192, seed=number, vocab=model.config.vocab_size), [96]) for number in range(4)]
    rows = probe.record_rows(model, predictor, [(*text, {0, 1}, 1) for text in texts], block=BLOCK)
    assert {layer for layer, _ in rows} == {0, 1}
    for head_rows in rows.values():
        assert {text for text, _, _ in head_rows} == {0, 1, 2, 3}
        assert all(x.shape == (y.shape[0], predictor.weights.shape[-1]) for _, x, y in head_rows)
    torch.manual_seed(0)
    maps = probe.fit_maps(rows, predictor, {0, 1, 2}, epochs=2)
    results = probe.compare(rows, maps, {0, 1, 2}, block=BLOCK)
    assert set(results) == {f"{layer}.{head}" for layer, head in rows}
    for head in results.values():
        assert all(head["oracle"] <= head[name] + 1e-6 for name in probe.MAPS)
        assert head["oracle"] < head["mass"]
    relative = probe.summary(results)
    assert relative["shipped"] == pytest.approx(1.0) and set(relative) == set(probe.MAPS) - {"oracle"}


def test_the_shipped_map_as_a_stand_in_evicts_as_the_learned_policy_does(probe):
    model = tiny_model("llama")
    predictor = Predictor.for_model(model)
    ids = random_ids(192, seed=5, vocab=model.config.vocab_size)
    rows = probe.record_rows(model, predictor, [(0, ids, [96], {0, 1}, 2), (1, ids, [96], {0, 1}, 1)], block=BLOCK)
    for head_rows in rows.values():  # text 0 adds every second eviction's rows, text 1 every one (the same text)
        evictions = [sum(1 for text, _, _ in head_rows if text == number) for number in (0, 1)]
        assert evictions[0] == evictions[1] // 2 > 0
    maps = probe.fit_maps(rows, predictor, {0}, epochs=1)
    kl = probe.kl_rows(model, maps, predictor.groups, [("random", ids)], 64, ("learned+caote", "oracle"), block=BLOCK)
    by_run = {row["run"]: row["kl"] for row in kl}
    assert set(by_run) == {"map:shipped", "map:ridge", "map:mlp", "learned+caote", "oracle"}
    assert by_run["map:shipped"] == pytest.approx(by_run["learned+caote"], rel=1e-4)
    table = probe.kl_table(kl)
    assert "| map:mlp |" in table and "share of the gap" in table


def test_the_mlp_reads_a_column_constant_in_training_as_zero(probe):
    torch.manual_seed(0)
    x = torch.randn(200, 4)
    x[:, 3] = 0.0  # a sink flag: never set among the candidates
    y = x[:, 0] - x[:, 1]
    mlp = probe.fit_mlp([(0, x[i : i + 50], y[i : i + 50]) for i in range(0, 200, 50)], hidden=8, epochs=2)
    flagged = x.clone()
    flagged[:, 3] = 1.0
    assert torch.equal(mlp(flagged), mlp(x))


def test_the_gap_share_runs_from_the_best_training_free_policy_to_the_oracle(probe):
    kl = {"h2o+caote": 0.05, "tova+caote": 0.07, "oracle": 0.01, "map:mlp": 0.03}
    rows = [{"text": text, "run": run, "kl": value} for text in ("a", "b") for run, value in kl.items()]
    table = probe.kl_table(rows)
    assert "| map:mlp | 0.0300 | 50% |" in table and "| tova+caote | 0.0700 | -50% |" in table
    assert "| oracle | 0.0100 | 100% |" in table and "from h2o+caote" in table
