"""The ``learned`` policy: features, the predictor file, calibration's fit and split guard, and the policy grammar."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch
from conftest import RandomIds, greedy, random_ids, tiny_model

from caote.cache import EvictionCache
from caote.evaluation.calibration.collection import CollectingLayer, Collector, evicting_budgets
from caote.evaluation.calibration.recipe import Recipe, calibrate, length_shares
from caote.evaluation.calibration.ridge import (
    MASS_WEIGHT_RANGE,
    NormalEquations,
    mass_weights,
    weighted_rows,
    weighted_sums,
)
from caote.evaluation.calibration.texts import calibration_texts
from caote.evaluation.splits import check_calibration_texts, check_disjoint
from caote.evaluation.tasks import Text
from caote.history import (
    KEY_TERM_POSITION,
    NEWEST,
    PREDICTION_POSITION,
    RECENT_START,
    AttentionSum,
    RecentRows,
    SumAndRecent,
)
from caote.learned import feature_names
from caote.policies import parse_policy, policy_names
from caote.predictor import PREDICTOR_DIR, Predictor, model_fingerprint
from caote.rotary import rotary_inverse
from caote.settings import CacheSettings


def test_ridge_on_demeaned_groups_ranks_a_synthetic_case_right():
    generator = torch.Generator().manual_seed(0)
    truth = torch.tensor([2.0, -1.0, 0.0, 0.5], dtype=torch.float64)
    fit, held = NormalEquations.empty(4), NormalEquations.empty(4)
    for group in range(40):
        x = torch.randn(50, 4, generator=generator, dtype=torch.float64)
        offset = torch.randn(1, generator=generator, dtype=torch.float64) * 10  # a group-wide shift: irrelevant
        y = x @ truth + offset + 0.1 * torch.randn(50, generator=generator, dtype=torch.float64)
        (held if group % 4 == 3 else fit).add(x - x.mean(0), y - y.mean())
    weights = fit.solve(1e-4)
    assert torch.allclose(weights, truth, atol=0.05)
    assert held.squared_error(weights) < 0.02 < held.squared_error(fit.solve(10.0))
    x = torch.randn(30, 4, generator=generator, dtype=torch.float64)
    assert torch.equal((x @ weights).topk(10).indices.sort().values, (x @ truth).topk(10).indices.sort().values)


def test_a_column_of_rounding_noise_gets_weight_zero_and_a_small_live_one_keeps_its_weight():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 4, generator=generator, dtype=torch.float64)
    noise = 0.1 * torch.randn(2000, generator=generator, dtype=torch.float64)
    x[:, 2] *= 1e-2  # small but real: a near-dead channel, its weight must survive
    x[:, 3] = 1e-7 * noise  # rounding noise that happens to track the target's noise
    y = x[:, 0] * 2.0 - x[:, 1] + x[:, 2] * 50.0 + noise
    equations = NormalEquations.empty(4)
    equations.add(x, y)
    weights = equations.solve(1e-4)
    assert weights[3] == 0
    assert torch.allclose(weights[:3], torch.tensor([2.0, -1.0, 50.0], dtype=torch.float64), rtol=0.05)
    # standardised, the noise column would take a weight of about 1e7
    assert (equations.xty[3] / equations.xtx[3, 3]).abs() > 1e6


def test_mass_weights_grow_with_the_future_mass_clipped_and_of_mean_one():
    target = torch.log(torch.tensor([1e-9, 1.0, 2.0, 4.0, 8.0, 1e3], dtype=torch.float64))
    assert torch.equal(mass_weights(target, 0.0), torch.ones(6, dtype=torch.float64))
    weights = mass_weights(target, 0.5)
    assert torch.isclose(weights.mean(), torch.tensor(1.0, dtype=torch.float64))
    assert torch.allclose(weights[2:5] / weights[1:4], torch.tensor(2.0, dtype=torch.float64).sqrt())  # (m/mean)^0.5
    assert 0 < weights[0] < weights[1]  # a token no query reads still weighs something (clipped from below)
    one_heavy = torch.log(torch.tensor([1e-3] * 99 + [1e3], dtype=torch.float64))  # 100x and 1e-4x the mean: clipped
    clipped = mass_weights(one_heavy, 1.0)
    assert torch.isclose(
        clipped.max() / clipped.min(), torch.tensor(MASS_WEIGHT_RANGE[1] / MASS_WEIGHT_RANGE[0]).double()
    )


def test_each_heads_rows_are_weighted_and_centred_over_its_candidates_alone():
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(3, 40, 5, generator=generator, dtype=torch.float64)
    target = torch.randn(3, 40, generator=generator, dtype=torch.float64) * 3
    rows = torch.rand(3, 40, generator=generator) > 0.4
    features[~rows] = float("nan")  # what a head does not hold must not reach its sums
    xtx, xty, yty = weighted_sums(features, target, rows, 1.0)
    for head in range(3):
        x, y, weights = weighted_rows(features[head][rows[head]], target[head][rows[head]], 1.0)
        root = weights.sqrt()
        x, y = x * root[:, None], y * root
        assert torch.allclose(xtx[head], x.T @ x) and torch.allclose(xty[head], x.T @ y)
        assert torch.allclose(yty[head], y @ y)


def test_the_first_round_reads_a_share_of_each_excerpt_length_and_passes_stop_before_the_last_block():
    short = [Text(f"s-{i}", 1024, "x", f"s{i}") for i in range(40)]
    texts = short + [Text(f"l-{i}", 4096, "x", f"l{i}") for i in range(10)]
    first = Recipe(budgets=(128, 1024)).round_texts(texts, 0)
    assert [text.length for text in first] == [1024] * 10 + [4096] * 4  # a quarter of each, at least 4
    assert Recipe(budgets=(128,)).round_texts(texts, 1) == texts and Recipe(rounds=1).round_texts(texts, 0) == texts
    assert evicting_budgets(1024, (128, 896, 900), 128) == [128]  # the pass reads 896 tokens: 896 never overflows
    assert evicting_budgets(1000, (128, 896), 128) == [128]


def test_weighing_rows_by_mass_fits_the_tokens_that_will_be_read():
    # many light tokens whose log mass falls with feature 0, a few heavy ones whose log mass rises with it: one
    # line cannot serve both; unweighted, the light ones decide the slope, weighted by mass, the heavy ones do
    generator = torch.Generator().manual_seed(0)
    light, heavy = 90, 10
    signal = torch.randn(light + heavy, generator=generator, dtype=torch.float64)
    is_heavy = torch.arange(light + heavy) >= light
    target = torch.where(is_heavy, 2.0 + 0.5 * signal, -6.0 - 0.5 * signal)
    features = torch.stack([signal, is_heavy.double()], -1)
    slopes = {}
    for power in (0.0, 1.0):
        collector = Collector((), 2, 0, 0, mass_weight=power)
        for _ in range(8):
            collector.record(0, features[None, None], target[None, None], torch.ones(1, 1, light + heavy, dtype=bool))
        fitted = collector.equations[("fit", 0, 0)].solve(1e-9)
        # the closed form: least squares with an intercept, each row scaled by the square root of its weight
        root = mass_weights(target, power).sqrt()
        design = torch.cat([features, torch.ones(light + heavy, 1, dtype=torch.float64)], -1) * root[:, None]
        expected = torch.linalg.lstsq(design, target * root).solution[:2]
        assert torch.allclose(fitted, expected, atol=1e-6), (power, fitted, expected)
        slopes[power] = float(fitted[0])
    assert slopes[0.0] < 0 < slopes[1.0]  # only the weighted fit orders the heavy tokens as their mass does


def test_sum_and_recent_keeps_h2os_sum_the_block_and_the_newest_rows():
    rows = [torch.rand(1, 2, 5, 5 * (step + 1)) for step in range(3)] + [torch.rand(1, 2, 1, 16)]
    history = total = recent = None
    seen = 0
    for block in rows:
        seen += block.shape[-2]
        history = SumAndRecent(4).fold(history, block, seen=seen)
        total = AttentionSum().fold(total, block)
        recent = RecentRows(4).fold(recent, block)
    assert torch.allclose(history[:, :, 0], total) and torch.equal(history[:, :, NEWEST], recent[:, :, -1])
    # the window as a ring: the row of the c-th query at c % 4 (16 queries seen: arrival order)
    assert torch.equal(history[:, :, RECENT_START:], recent) and seen % 4 == 0
    last_block = torch.nn.functional.pad(rows[2], (0, 1))  # the decode step keeps the prompt block's statistics
    assert torch.allclose(history[:, :, 1], last_block.sum(2)) and torch.equal(history[:, :, 2], last_block.amax(2))


@pytest.mark.parametrize("in_place", [True, False])
def test_the_recent_rows_are_a_ring_indexed_by_the_queries_seen(in_place):
    """Whatever mix of blocks and decode steps folds them, the c-th query's row sits at ``RECENT_START + c % 4``
    and the newest at ``NEWEST``; a decode step in place writes into the history it was given."""
    history, seen, every = None, 0, []
    for new in [6, 1, 1, 3, 1, 9, 1, 1, 1, 1, 1, 2, 1]:
        block = torch.rand(1, 2, new, 30)
        seen += new
        every += list(block.unbind(2))
        folded = SumAndRecent(4).fold(history, block, in_place=in_place and new == 1, seen=seen)
        if in_place and new == 1:
            assert folded.data_ptr() == history.data_ptr()
        history = folded
        for query in range(seen - 4, seen):
            assert torch.equal(history[:, :, RECENT_START + query % 4], every[query])
        assert torch.equal(history[:, :, NEWEST], every[-1])


def test_a_decode_steps_row_folds_in_place_as_the_copying_fold_does():
    history = SumAndRecent(4).fold(None, torch.rand(1, 2, 6, 9), seen=6)  # a prompt block: the window is full
    for step in range(3):
        row = torch.rand(1, 2, 1, 9)
        copied = SumAndRecent(4).fold(history.clone(), row, seen=7 + step)
        folded = SumAndRecent(4).fold(history, row, in_place=True, seen=7 + step)
        assert folded.data_ptr() == history.data_ptr() and torch.equal(folded, copied)  # the same bits, no copy


@pytest.mark.parametrize("newest", [5, 3000])  # within the first table of angles, and past it (it grows)
def test_rope_is_undone_by_position(llama, newest):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    keys = torch.randn(1, 2, 7, llama.config.head_dim)
    positions = torch.tensor([[3, 0, 9, 4, 100, 5, 6], [1, 2, 3, 4, 5, 6, newest]]).unsqueeze(0)
    cos, sin = llama.model.rotary_emb(keys, positions.view(2, 7))
    rotated = torch.stack(
        [apply_rotary_pos_emb(keys[:, h : h + 1], keys[:, h : h + 1], cos[h : h + 1], sin[h : h + 1])[1][0, 0]
         for h in range(2)]
    ).unsqueeze(0)  # fmt: skip
    unrotate = rotary_inverse(llama)
    assert torch.allclose(unrotate(rotated, positions), keys, atol=1e-5)
    calls = []
    rotary = llama.model.rotary_emb
    real_forward = rotary.forward
    rotary.forward = lambda *args, **kwargs: calls.append(1) or real_forward(*args, **kwargs)
    try:
        for _ in range(3):  # positions the table already holds: no new angles
            assert torch.allclose(unrotate(rotated, positions), keys, atol=1e-5)
    finally:
        del rotary.forward
    assert calls == []


# 128 tokens in blocks of 32: the evicting passes read three blocks (the last one's eviction has no future) and evict
# after the second and the third, so the second eviction's rows depend on how the first ranked
TINY_TEXTS = [Text(f"mine-{i}", 128, "x" * (i + 1), f"mine-{i}") for i in range(4)]


def tiny_recipe(**fields) -> Recipe:
    """One round at budget 40 in blocks of 32, for the tiny texts."""
    return Recipe(**{"budgets": (40,), "block_size": 32, "rounds": 1, **fields})


def calibrated(model, tmp_path, groups=("scalars", "key")) -> str:
    predictor = calibrate(model, RandomIds(128), TINY_TEXTS, tiny_recipe(groups=groups), progress=False)
    return str(predictor.save(tmp_path / "tiny.safetensors"))


def test_a_second_round_rolls_out_the_learned_policy_with_the_first_rounds_predictor(llama, tmp_path, monkeypatch):
    first = Predictor.load(calibrated(llama, tmp_path))
    rankings, real_predict = [], CollectingLayer.predict

    def spied(self, inputs):
        ranking = real_predict(self, inputs)
        mass = inputs.history[:, :, 0].view(*ranking.shape[:2], -1, ranking.shape[-1]).mean(2)
        rankings.append(torch.allclose(ranking, torch.log(mass + 1e-6)))  # the first round's ranking: H2O's mass
        return ranking

    monkeypatch.setattr(CollectingLayer, "predict", spied)
    second = calibrate(llama, RandomIds(128), TINY_TEXTS, tiny_recipe(), progress=False, rollout=first)
    assert rankings and not any(rankings)  # every pass ranked by the first predictor, not by H2O's mass
    assert second.details["rolled_out_by"] == [first.texts] and not torch.allclose(second.weights, first.weights)
    elsewhere = Predictor(second.weights, second.groups, "m", second.fingerprint, ["mine-9"], second.details)
    with pytest.raises(ValueError, match="documents of 1 of the texts"):  # the first round's texts count too
        check_disjoint(elsewhere, ["mine-0"])
    with pytest.raises(ValueError, match="must be of this model and of the features scalars$"):
        calibrate(llama, RandomIds(128), TINY_TEXTS, tiny_recipe(groups=("scalars",)), progress=False, rollout=first)


def test_calibration_writes_a_predictor_that_the_learned_policies_read(llama, tmp_path):
    path = calibrated(llama, tmp_path)
    predictor = Predictor.load(path)
    width = len(feature_names(("scalars", "key"), llama.config.head_dim))
    assert predictor.weights.shape == (llama.config.num_hidden_layers, llama.config.num_key_value_heads, width)
    assert torch.isfinite(predictor.weights).all() and predictor.weights.abs().sum() > 0
    assert predictor.texts == [f"mine-{i}" for i in range(4)] and predictor.fingerprint == model_fingerprint(llama)
    assert predictor.details["rows"] > 0 and predictor.details["held_out_mse"] > 0
    assert predictor.details["mass_weight"] == 1.0 and predictor.details["budgets"] == [40]
    unweighted = calibrate(llama, RandomIds(128), TINY_TEXTS, tiny_recipe(mass_weight=0), progress=False)
    assert unweighted.details["mass_weight"] == 0 and not torch.allclose(unweighted.weights, predictor.weights)
    assert predictor.details["target"] == "mass"
    change = calibrate(llama, RandomIds(128), TINY_TEXTS, tiny_recipe(target="change"), progress=False)
    assert change.details["target"] == "change" and not torch.allclose(change.weights, predictor.weights)
    with pytest.raises(ValueError, match=r"mass_weight must lie in \[0, 4\], got -0.5"):
        tiny_recipe(mass_weight=-0.5)
    ids = random_ids(80)
    for name in ("learned", "learned+caote", "learned+fastcaote", "learned+caote/mean"):
        cache = EvictionCache(llama, budget=40, policy=name, predictor=path)  # the setting as a keyword
        out = greedy(llama, ids, cache, new_tokens=8)
        assert out.shape == (1, 88) and cache.stats().tokens_kept == 40, name


def test_balanced_lengths_give_each_lengths_rows_an_equal_share_of_the_fit(llama):
    def tokenizer(text, return_tensors=None):  # a text of n characters is n random ids, seeded by its letter
        return types.SimpleNamespace(input_ids=random_ids(len(text), seed=ord(text[0])))

    # 96 tokens in blocks of 32: the evicting pass reads two blocks and evicts after the second (64 > 40)
    texts = [Text(f"{letter}-96", 96, letter * 96, letter) for letter in "abc"]
    texts += [Text(f"{letter}-256", 256, letter * 256, letter) for letter in "lm"]
    options = dict(budgets=(40, 160), block_size=32, rounds=1)
    plain = calibrate(llama, tokenizer, texts, Recipe(balance_lengths=False, **options), progress=False)
    balanced = calibrate(llama, tokenizer, texts, Recipe(**options), progress=False)  # the default
    assert balanced.details["balance_lengths"] and "balance_lengths" not in plain.details
    assert balanced.details["rows"] == plain.details["rows"]  # the total weight is kept
    assert not torch.allclose(balanced.weights, plain.weights)
    alike = calibrate(
        llama, tokenizer, texts[:3] * 2, Recipe(**options), progress=False
    )  # one length: nothing to balance
    assert "balance_lengths" not in alike.details
    assert torch.equal(
        alike.weights,
        calibrate(llama, tokenizer, texts[:3] * 2, Recipe(balance_lengths=False, **options), progress=False).weights,
    )
    rows = {64: 300.0, 256: 100.0, 257: 200.0, 512: 0.0}
    collectors = [types.SimpleNamespace(equations={("fit", 0, 0): NormalEquations.empty(2)}) for _ in rows]
    for collector, count in zip(collectors, rows.values()):
        collector.equations["fit", 0, 0].rows = count
        collector.equations["held_out", 0, 0] = NormalEquations(torch.zeros(2, 2), torch.zeros(2), 0.0, 1e6)
    shares = length_shares(list(zip(collectors, rows)))
    # 200 each; held-out rows are not counted, and a length with held-out rows only keeps its weight
    assert shares == pytest.approx({64: 2 / 3, 256: 2.0, 257: 1.0, 512: 1.0})


def test_learned_refuses_a_model_without_a_predictor_in_one_line(llama, tmp_path, tiny_predictors, monkeypatch):
    path = calibrated(llama, tmp_path)
    monkeypatch.setattr(Predictor, "for_model", classmethod(tiny_predictors))  # no predictor made on the fly
    with pytest.raises(ValueError, match="caote calibrate") as error:
        EvictionCache(llama, budget=40, policy="learned+caote")
    assert "\n" not in str(error.value)
    other = tiny_model("llama", seed=1)
    assert model_fingerprint(other) != model_fingerprint(llama)
    with pytest.raises(ValueError, match="calibrated for"):
        EvictionCache(other, CacheSettings(budget=40, policy="learned", predictor=path))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda w: w[:-1], r"shape \(1, 2, 60\), not this model's .* \(2, 2, 60\)"),  # a layer short
        (lambda w: w[:, :1], r"shape \(2, 1, 60\)"),  # a KV head short
        (lambda w: w[..., :-2], r"shape \(2, 2, 58\)"),  # features short
        (lambda w: w.flatten(), r"shape \(240,\)"),
        (lambda w: w[0, 0, 0], r"shape \(\)"),
        (lambda w: w.index_fill(2, torch.tensor([3]), float("nan")), "NaN or infinite"),
        (lambda w: w.index_fill(0, torch.tensor([1]), float("inf")), "NaN or infinite"),
    ],
)
def test_a_predictor_whose_weights_do_not_fit_the_model_is_refused_when_the_cache_is_built(
    llama, tmp_path, damage, message
):
    import dataclasses

    predictor = Predictor.load(calibrated(llama, tmp_path))
    broken = dataclasses.replace(predictor, weights=damage(predictor.weights.clone()))
    path = broken.save(tmp_path / "broken.safetensors")
    with pytest.raises(ValueError, match=message) as error:
        EvictionCache(llama, CacheSettings(budget=40, policy="learned+caote", predictor=str(path)))
    assert "\n" not in str(error.value) and "caote calibrate" in str(error.value)


def test_a_predictor_of_another_feature_set_is_refused(llama, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = calibrated(llama, tmp_path, groups=("scalars",))
    with safe_open(path, framework="pt") as file:
        metadata = dict(file.metadata())
    save_file(load_file(path), path, metadata={**metadata, "feature_set": "caote-learned-0"})
    with pytest.raises(ValueError, match="calibrate it again"):
        Predictor.load(path)


def test_calibration_texts_are_dev_split_only_and_never_evaluated(tokenizer):
    from caote.evaluation.perplexity import domain_texts

    dev = calibration_texts(tokenizer, "essays", 1024, count=3)
    check_calibration_texts(dev)
    test = domain_texts(tokenizer, "essays", [1024], 2, "test")
    with pytest.raises(ValueError, match="dev split"):
        check_calibration_texts(dev + test)
    predictor = Predictor(torch.zeros(1, 1, 1), ("scalars",), "m", "f", [text.id for text in dev], {})
    check_disjoint(predictor, [text.id for text in test])
    with pytest.raises(ValueError, match="documents of 1 of the texts"):
        check_disjoint(predictor, [dev[0].id, test[0].id])
    other_length = dev[0].id.replace("-1024", "-2048") + "-2"  # another excerpt of the same document
    with pytest.raises(ValueError, match="documents of 1 of the texts"):
        check_disjoint(predictor, [other_length])
    check_disjoint(predictor, ["essays-joined3-4096"], "test")  # a window of the joined test essays
    with pytest.raises(ValueError, match="documents of 1 of the texts"):  # one of the dev essays joined
        check_disjoint(predictor, ["essays-joined3-4096"], "dev")


def test_code_texts_are_pinned_by_sha256(tmp_path, monkeypatch):
    from caote.evaluation import data

    name = data.code_names("dev")[0]
    (tmp_path / name).write_text(data.code_text(name) + "# changed\n")
    data.code_text.cache_clear()
    monkeypatch.setattr(data, "code_dir", lambda: tmp_path)
    try:
        with pytest.raises(RuntimeError, match="differs from the Python 3.11.7 file"):
            data.code_text(name)
    finally:
        data.code_text.cache_clear()


def test_a_file_that_is_not_a_predictor_is_one_line(tmp_path):
    path = tmp_path / "not.safetensors"
    path.write_bytes(b"certainly not safetensors")
    with pytest.raises(ValueError, match="cannot read predictor") as error:
        Predictor.load(path)
    assert "\n" not in str(error.value)


def test_calibration_that_collects_nothing_is_refused(llama):
    texts = [Text("mine-0", 30, "x", "mine-0")]
    with pytest.raises(ValueError, match="collected nothing"):
        calibrate(llama, RandomIds(30), texts, tiny_recipe(), progress=False)


def test_the_committed_predictor_was_calibrated_on_no_text_a_grid_evaluates(tokenizer):
    from caote.evaluation.data import split_of

    committed = sorted(PREDICTOR_DIR.glob("*.safetensors"))
    assert committed, "the bundled model's predictor is committed"
    for path in committed:
        predictor = Predictor.load(path)
        assert predictor.texts
        earlier = [text_id for texts in predictor.details.get("rolled_out_by", []) for text_id in texts]
        for text_id in predictor.texts + earlier:
            kind, unit = re.fullmatch(r"(essay|code)-(.+?)-\d+(?:-\d+)?", text_id).groups()
            assert split_of(unit + (".txt" if kind == "essay" else ".py")) == "dev", text_id


def test_the_grammar_names_the_learned_policies_everywhere():
    names = policy_names()
    assert {"learned", "learned+caote", "learned+fastcaote"} <= set(names)
    policy = parse_policy("learned+caote")
    assert policy.base.schedule == "learned" and policy.transform == "caote" and not policy.base.hindsight
    with pytest.raises(ValueError, match="did you mean 'learned"):
        parse_policy("lerned+caote")


def every_step_fresh(monkeypatch) -> None:
    """Every decode step predicts afresh (`PREDICTION_REFRESH` 1): the tests below compare each fresh prediction
    with every feature column computed from the keys."""
    import caote.learned

    monkeypatch.setattr(caote.learned, "PREDICTION_REFRESH", 1)


def test_remembered_key_terms_give_the_prediction_of_every_feature_column(llama, monkeypatch):
    from caote.learned import LayerPredictor, token_features

    every_step_fresh(monkeypatch)

    checked, unrotated = [], []
    real_predict = LayerPredictor.fresh

    def compared(self, inputs):
        split = real_predict(self, inputs)
        every = token_features(inputs, self.groups, real_unrotate, self.sink_tokens)  # not counted below
        whole = torch.einsum("...hnf,...hf->...hn", every, self.weights)
        assert torch.allclose(split, whole, rtol=1e-5, atol=1e-5)
        checked.append(inputs.new_tokens)
        return split

    monkeypatch.setattr(LayerPredictor, "fresh", compared)
    cache = EvictionCache(llama, budget=48, policy="learned+caote", block_size=32)
    real_unrotate = cache.strategy.unrotate

    def counting(keys, positions):
        unrotated.append(tuple(keys.shape[:3]))
        return real_unrotate(keys, positions)

    cache.strategy.unrotate = counting
    greedy(llama, random_ids(100, seed=3), cache, new_tokens=6)
    assert 32 in checked and 1 in checked  # prompt blocks and decode steps (in place)
    layers = llama.config.num_hidden_layers
    kv_heads = llama.config.num_key_value_heads
    assert unrotated[-1] == (layers, kv_heads, 1)  # a decode step undoes RoPE once: the new token of every layer

    def turn(seed: int) -> None:  # a new prompt turn, then two decode steps, each a forward of its own
        seen = cache.get_seq_length()
        for ids in (random_ids(8, seed=seed), random_ids(1, seed=seed + 1), random_ids(1, seed=seed + 2)):
            mask = torch.ones(1, seen + ids.shape[1], dtype=torch.long)
            with torch.no_grad():
                llama(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
            seen += ids.shape[1]

    count = len(checked)
    snapshot = cache.snapshot()
    turn(10)
    cache.restore(snapshot)
    turn(20)  # other tokens at the same positions: their key terms are computed again (compared above)
    assert len(checked) == count + 2 * (layers + 2)  # per turn: its prompt layer by layer, two steps' stacks


def test_key_terms_in_a_left_padded_batch_and_after_a_snapshot_of_another_predictor(llama, monkeypatch):
    from caote.learned import LayerPredictor, token_features

    every_step_fresh(monkeypatch)

    real_predict, calls = LayerPredictor.fresh, []

    def compared(self, inputs):
        split = real_predict(self, inputs)
        every = token_features(inputs, self.groups, self.unrotate, self.sink_tokens)
        whole = torch.einsum("...hnf,...hf->...hn", every, self.weights)
        real = inputs.positions >= 0
        assert torch.allclose(split[real], whole[real], rtol=1e-5, atol=1e-5)
        calls.append(int((~real).sum()))
        return split

    monkeypatch.setattr(LayerPredictor, "fresh", compared)
    ids = torch.cat([random_ids(90, seed=6), random_ids(90, seed=7)])
    mask = torch.ones_like(ids)
    mask[1, :11] = 0  # row 1: 11 padding tokens, so its KV heads hold fewer real tokens to remember than row 0's
    greedy(llama, ids, EvictionCache(llama, budget=48, policy="learned+caote", block_size=32), 3, attention_mask=mask)
    assert any(calls)  # evictions with padding held

    first = EvictionCache(llama, budget=48, policy="learned+caote", block_size=32)
    greedy(llama, random_ids(100, seed=8), first, new_tokens=2)
    snapshot = first.snapshot()
    other = Predictor(first.strategy.predictor.weights * 2, *[getattr(first.strategy.predictor, f) for f in (
        "groups", "model", "fingerprint", "texts", "details")])  # fmt: skip
    second = EvictionCache(llama, budget=48, policy="learned+caote", block_size=32)
    second.strategy.predictor = other
    second.restore(snapshot)
    layer = next(layer for layer in second.layers if layer.history is not None)
    assert not bool(layer.history[:, :, KEY_TERM_POSITION].any())  # the first predictor's key terms are not reused
    assert not bool(layer.history[:, :, PREDICTION_POSITION].any())  # nor its predictions
    assert bool(snapshot.layers[0].history[:, :, KEY_TERM_POSITION].any())  # ... and the snapshot keeps its own
    assert bool(snapshot.layers[0].history[:, :, PREDICTION_POSITION].any())
    seen = second.get_seq_length()
    with torch.no_grad():  # a decode step: every key term of the second predictor, compared above
        llama(input_ids=random_ids(1, seed=9), attention_mask=torch.ones(1, seen + 1, dtype=torch.long), cache=second)


def test_a_predictor_of_the_key_alone_predicts(llama):
    cache = EvictionCache(llama, budget=48, policy="learned+caote", block_size=32)
    full = cache.strategy.predictor
    columns = slice(len(feature_names(("scalars",), llama.config.head_dim)), None)
    cache.strategy.predictor = Predictor(full.weights[..., columns], ("key",), *[getattr(full, f) for f in (
        "model", "fingerprint", "texts", "details")])  # fmt: skip
    out = greedy(llama, random_ids(100, seed=10), cache, new_tokens=3)
    assert out.shape[-1] == 103


# the policy's 16 newest tokens (a token leaves the window the step after it is due); 2 (it leaves first: a fresh step
# every 3); 32 (the wait alone makes tokens due)
@pytest.mark.parametrize(("recent_window", "first", "gap"), [(None, 15, 16), (2, 2, 3), (32, 15, 16)])
def test_decode_steps_reuse_predictions_until_a_token_is_due(llama, recent_window, first, gap, monkeypatch):
    """Between refreshes a decode step scores with each token's last prediction: every token it may evict has one,
    the tokens not yet predicted are protected, and a fresh prediction comes once a token has waited
    `PREDICTION_REFRESH` - 1 steps or is about to leave the protected window."""
    import caote.learned
    from caote.learned import PREDICTION_REFRESH, LayerPredictor

    real_predict, real_fresh, real_remember = LayerPredictor.predict, LayerPredictor.fresh, LayerPredictor.remember_keys
    steps, last = [], {}  # per decode step (one stack of every layer): whether it predicted afresh; the last fresh
    keyed = set()  # the decode steps that computed key terms

    def remember_keys(self, inputs):
        if inputs.new_tokens == 1:
            keyed.add(len(steps) - 1)
        return real_remember(self, inputs)

    def fresh(self, inputs):
        if inputs.new_tokens == 1:
            steps[-1] = True
        return real_fresh(self, inputs)

    def predict(self, inputs):
        if inputs.new_tokens == 1:
            steps.append(False)
        predicted = real_predict(self, inputs)
        if inputs.new_tokens == 1:
            evictable = ~inputs.protected & (inputs.positions >= 0)
            assert torch.isfinite(predicted[evictable]).all()  # no token that can go lacks a prediction
            if steps[-1]:
                last.update(positions=inputs.positions.clone(), predicted=predicted.clone())
            elif last:  # reused: the last fresh step's prediction of every token still in its slot
                same = inputs.positions == last["positions"]
                assert torch.equal(predicted[same], last["predicted"][same])
                assert not torch.isfinite(predicted[~same & (inputs.positions >= 0)]).any()  # new since: none
        return predicted

    monkeypatch.setattr(LayerPredictor, "predict", predict)
    monkeypatch.setattr(LayerPredictor, "fresh", fresh)
    monkeypatch.setattr(LayerPredictor, "remember_keys", remember_keys)
    settings = CacheSettings(budget=48, policy="learned+caote", block_size=32, recent_window=recent_window)
    greedy(llama, random_ids(100, seed=4), EvictionCache(llama, settings), new_tokens=50)
    assert PREDICTION_REFRESH == 16 and len(steps) == 49  # the prompt's tokens all predicted at its last block
    fresh_steps = [index for index, fresh_now in enumerate(steps) if fresh_now]
    assert sorted(keyed) == fresh_steps  # a step that reuses predictions computes no key term
    assert fresh_steps[0] == first and len(fresh_steps) >= 3
    assert all(b - a == gap for a, b in zip(fresh_steps, fresh_steps[1:]))
    monkeypatch.setattr(caote.learned, "PREDICTION_REFRESH", 1)
    steps.clear()
    greedy(llama, random_ids(100, seed=4), EvictionCache(llama, settings), new_tokens=10)
    assert all(steps)  # 1: every step predicts afresh


def test_a_predictor_save_that_is_killed_leaves_no_file_and_a_finished_one_replaces_the_old(tmp_path, monkeypatch):
    import shutil

    import safetensors.torch

    path = tmp_path / "old.safetensors"
    shutil.copyfile(sorted(PREDICTOR_DIR.glob("*.safetensors"))[0], path)
    before = path.read_bytes()
    predictor = Predictor.load(path)
    written = safetensors.torch.save_file

    def killed(tensors, filename, metadata=None):
        written(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(Path(filename).read_bytes()[:40])  # half written, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", killed)
    fresh = tmp_path / "fresh.safetensors"
    with pytest.raises(KeyboardInterrupt):
        predictor.save(fresh)
    with pytest.raises(KeyboardInterrupt):
        predictor.save(path)
    assert not fresh.exists() and path.read_bytes() == before  # neither a half file nor a damaged old one
    assert sorted(item.name for item in tmp_path.iterdir()) == [path.name]
    monkeypatch.setattr(safetensors.torch, "save_file", written)
    assert Predictor.load(predictor.save(fresh)).weights.equal(predictor.weights)


def test_a_predictor_given_to_a_policy_that_reads_none_is_refused_not_ignored(capsys, tmp_path):
    from caote.cli import main

    with pytest.raises(ValueError, match="^policy 'h2o\\+caote' reads no predictor, so predictor='p.safetensors'"):
        CacheSettings(budget=64, policy="h2o+caote", predictor="p.safetensors")
    assert CacheSettings(budget=64, policy="learned", predictor="p.safetensors").predictor == "p.safetensors"
    committed = str(sorted(PREDICTOR_DIR.glob("*.safetensors"))[0])
    with pytest.raises(SystemExit) as stop:
        main(["generate", "hi", "--policy", "tova", "--predictor", committed])
    assert stop.value.code == 2 and "policy 'tova' reads no predictor" in capsys.readouterr().err


def test_the_newest_recent_rows_are_the_newest_queries_whatever_the_ring_turned():
    from caote.history import newest_recent_rows

    memory, history, seen = SumAndRecent(8), None, 0
    for new in (5, 1, 1, 6, 1, 9, 1, 1, 1, 3):  # prompt blocks and decode steps, the ring turning unevenly
        seen += new
        rows = torch.arange(seen - new, seen, dtype=torch.float32)[:, None].expand(new, seen) + 1  # query c: c + 1
        grown = history if history is None else torch.cat([history, history.new_zeros(1, 1, history.shape[2], new)], -1)
        history = memory.fold(grown, rows[None, None].clone(), in_place=False, seen=seen)
        positions = torch.arange(seen)[None, None]
        for count in (1, 3, 8):
            newest = newest_recent_rows(history, positions, count)[0, 0, :, 0]
            expected = torch.arange(max(seen - count, 0), seen, dtype=torch.float32) + 1
            assert sorted(newest.tolist()) == expected.tolist(), (seen, count)


def test_learned_block_keeps_what_learned_caote_keeps_without_its_block_term(llama, monkeypatch):
    """With the block's exponent 0 learned-block is learned+caote read from a ring of 128 rows instead of 16: the
    features read the same newest 16 rows (past the ring's first turn: 230 prompt tokens), so the same tokens stay
    through prompt blocks and decode steps; with its exponent the block's output change moves some."""
    import caote.learned

    ids = random_ids(230, seed=12)

    def run(policy: str) -> tuple:
        cache = EvictionCache(llama, budget=48, policy=policy, block_size=32)
        out = greedy(llama, ids, cache, new_tokens=20)
        return out, [layer.positions.sort(-1).values for layer in cache.layers]

    reference, kept = run("learned+caote")
    blended, blended_kept = run("learned-block")
    assert any(not torch.equal(a, b) for a, b in zip(kept, blended_kept))
    monkeypatch.setattr(caote.learned, "BLOCK_EXPONENT", 0.0)
    plain, plain_kept = run("learned-block")
    assert torch.equal(plain, reference)
    assert all(torch.equal(a, b) for a, b in zip(kept, plain_kept))


def test_the_block_floor_lifts_each_head_to_its_quantile_over_real_tokens():
    from caote.learned import floored

    errors = torch.tensor([[[0.0, 1.0, 2.0, 3.0, 4.0], [5.0, 0.0, 0.0, 9.0, 100.0]]])
    real = torch.tensor([[[True] * 5, [True, True, True, True, False]]])
    lifted = floored(errors, real, 0.5)
    assert lifted[0, 0].tolist() == [2.0, 2.0, 2.0, 3.0, 4.0]
    assert lifted[0, 1].tolist() == [5.0, 2.5, 2.5, 9.0, 100.0]  # median of 5, 0, 0, 9: the padded 100 sets none
    assert floored(errors, None, 0.0)[0, 0, 0] == torch.finfo(torch.float32).tiny  # a zero stays positive
    assert (floored(errors, torch.zeros_like(real), 0.5) == errors.clamp_min(torch.finfo(torch.float32).tiny)).all()
    # a batch of two, each row with its own padding: each (row, head) has its own floor
    pair = torch.stack([errors[0], errors[0].flip(-1)])
    masks = torch.stack([real[0], real[0].flip(-1)])
    assert torch.equal(floored(pair, masks, 0.5)[1], floored(errors, real, 0.5)[0].flip(-1))
    # mostly infinite errors: the floor lies between the finite ones and the largest float, not lost to a NaN
    infinite = floored(torch.tensor([[[1.0, 2.0] + [float("inf")] * 6]]), None, 0.25)[0, 0]
    assert torch.isfinite(infinite[:2]).all() and (infinite[:2] > 1e38).all() and torch.isinf(infinite[2:]).all()
    half = floored(errors.to(torch.bfloat16), real, 0.5)  # half precision: the quantile is taken in float32
    assert half.dtype == torch.bfloat16 and half[0, 1].tolist() == [5.0, 2.5, 2.5, 9.0, 100.0]
