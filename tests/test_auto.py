"""The ``auto`` policy, the default everywhere: resolved per model and budget, recorded under both names, and its
table of training-free choices recomputed from the committed rows of the long grid."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from statistics import mean

import pytest
import torch
from conftest import RandomIds, greedy, load_as, random_ids, tiny_model

import caote
from caote import predictor as predictor_files
from caote.benchmark.stats import DECODE_VS_FULL_AT_BUDGET_TARGET as DECODE_LIMIT
from caote.cache import EvictionCache
from caote.cli import build_parser, main
from caote.defaults import AUTO_COMPRESS, AUTO_TRAINING_FREE, DEFAULT_BUDGET
from caote.evaluation import runner
from caote.evaluation.config import EvalConfig
from caote.evaluation.grids import LONG_GRID
from caote.evaluation.registry import TASKS
from caote.evaluation.rows import load_rows
from caote.evaluation.tasks import Text
from caote.learned import feature_names
from caote.policies import auto_training_free, parse_policy
from caote.predictor import Predictor, model_fingerprint
from caote.settings import CacheSettings

ROOT = Path(__file__).resolve().parents[1]
LONG_RUNS = ROOT / "docs" / "results" / "runs" / "long"
COMPLETE_PARTS = ("smollm2-essays-4k", "smollm2-code-4k", "gemma3-essays-8k", "gemma3-code-8k")  # the evidence
BENCH = ROOT / "benchmarks" / "results" / "results.json"


@pytest.fixture
def nothing_shipped(tiny_predictors, monkeypatch):
    """Tiny models as they are: no predictor ships for them (none calibrated on the fly, see conftest)."""
    monkeypatch.setattr(Predictor, "for_model", classmethod(tiny_predictors))


def predictor_file(model, folder: Path, verdict: str, learned: str = "learned+caote", texts=("code-dev-1",)) -> str:
    """A predictor of ``model`` (zero weights of its shape) whose validation gave ``verdict``, saved in ``folder``."""
    groups = ("scalars",)
    shape = (model.config.num_hidden_layers, model.config.num_key_value_heads)
    validation = {
        "verdict": verdict,
        "learned": learned,
        "summary": f"{learned} against the best training-free policy",
        "texts": list(texts),
        "budgets": [128, 512],
        "kl": {},
    }
    weights = torch.zeros(*shape, len(feature_names(groups, model.config.head_dim)))
    predictor = Predictor(weights, groups, "tiny", model_fingerprint(model), list(texts), {"validation": validation})
    return str(predictor.save(folder / f"{verdict.replace(' ', '-')}-{learned}.safetensors"))


# -- the resolution ------------------------------------------------------------------------------------------------


def test_without_a_predictor_auto_takes_the_training_free_policy_of_the_budget(llama, nothing_shipped):
    assert EvictionCache(llama, budget=256).policy.name == "tova+caote"
    assert EvictionCache(llama, budget=1024).policy.name == "h2o+caote"
    # no model needed for this step: a budget takes the choice of the long grid's budget nearest on a log scale
    chosen = [auto_training_free(budget) for budget in (1, 511, 512, 4096)]
    assert chosen == ["tova+caote", "tova+caote", "h2o+caote", "h2o+caote"]
    assert CacheSettings(budget=511).policy.name == "tova+caote" != CacheSettings(budget=512).policy.name


@pytest.mark.parametrize("learned", ["learned+caote", "learned", "learned-block"])
def test_a_predictor_that_helps_upgrades_auto_to_the_learned_policy_it_names(llama, tmp_path, learned):
    path = predictor_file(llama, tmp_path, "helps", learned)
    cache = EvictionCache(llama, budget=256, predictor=path)
    assert cache.policy.name == learned and cache.settings.auto and cache.settings.requested == "auto"
    assert cache.settings.replace(budget=1024).policy.name == learned  # a learned choice does not hang on the budget
    out = greedy(llama, random_ids(300, seed=5), cache, new_tokens=3)  # prompt blocks past the budget, decode steps
    assert out.shape[-1] == 303 and (cache.stats().policy, cache.stats().requested) == (learned, "auto")


def test_a_predictor_that_does_not_help_leaves_auto_training_free(llama, tmp_path):
    path = predictor_file(llama, tmp_path, "does not help")
    assert EvictionCache(llama, budget=256, predictor=path).policy.name == "tova+caote"
    assert EvictionCache(llama, budget=1024, predictor=path).policy.name == "h2o+caote"


def test_auto_reading_the_whole_prompt_takes_the_paged_retrieval_policy_even_where_a_predictor_helps(llama, tmp_path):
    path = predictor_file(llama, tmp_path, "helps")
    assert EvictionCache(llama, CacheSettings(budget=256, predictor=path)).policy.name == "learned+caote"
    settings = CacheSettings(budget=256, prefill="compress")
    assert settings.auto and settings.policy.name == AUTO_COMPRESS
    assert EvictionCache(llama, settings).policy.name == AUTO_COMPRESS
    with pytest.raises(ValueError, match="^policy 'tova\\+caote/page16' reads no predictor"):
        settings.replace(predictor=path)  # auto would ignore it
    assert CacheSettings(budget=20, prefill="compress").policy.name == "tova+caote/page15"  # pages fit the room


def test_a_given_predictor_that_cannot_serve_the_model_is_refused_not_skipped(llama, tmp_path):
    with pytest.raises(ValueError, match="^cannot read predictor .*missing.safetensors"):
        EvictionCache(llama, budget=256, predictor=str(tmp_path / "missing.safetensors"))
    other = tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match="was calibrated for 'tiny', not this model"):
        EvictionCache(other, budget=256, predictor=predictor_file(llama, tmp_path, "helps"))


def test_a_shipped_predictor_that_does_not_fit_the_model_is_refused_not_taken_for_a_missing_one(
    llama, tmp_path, monkeypatch
):
    groups = ("scalars",)
    features = len(feature_names(groups, llama.config.head_dim))
    weights = torch.zeros(llama.config.num_hidden_layers - 1, llama.config.num_key_value_heads, features)
    Predictor(weights, groups, "tiny", model_fingerprint(llama), ["code-dev-1"], {}).save(tmp_path / "tiny.safetensors")
    monkeypatch.setattr(predictor_files, "PREDICTOR_DIR", tmp_path)
    with pytest.raises(ValueError, match="^predictor shipped for 'tiny' holds weights of shape"):
        EvictionCache(llama, budget=256)
    # nothing shipped: auto stays training-free
    monkeypatch.setattr(predictor_files, "PREDICTOR_DIR", tmp_path / "none")
    assert EvictionCache(llama, budget=256).policy.name == auto_training_free(256)


def test_replace_chooses_again_for_a_new_budget_and_a_named_policy_ends_auto():
    settings = CacheSettings(budget=256)
    assert settings.policy.name == "tova+caote" and settings.auto
    assert settings.replace(budget=1024).policy.name == "h2o+caote"
    named = settings.replace(policy="h2o")
    assert (named.policy.name, named.auto, named.requested) == ("h2o", False, "h2o")
    assert named.replace(policy="auto", budget=1024).requested == "auto"
    assert CacheSettings.of(settings) is settings


def test_auto_accepts_a_predictor_which_every_other_non_learned_policy_refuses():
    assert CacheSettings(budget=256, predictor="p.safetensors").predictor == "p.safetensors"
    with pytest.raises(
        ValueError,
        match="^policy 'caote-block' reads no predictor, .* or 'auto' reading its prompt in blocks, or leave it out$",
    ):
        CacheSettings(budget=256, policy="caote-block", predictor="p.safetensors")


def test_too_small_a_budget_is_refused_in_one_line_naming_what_auto_resolved_to(llama, tmp_path):
    with pytest.raises(ValueError) as error:
        CacheSettings(budget=5)
    assert str(error.value) == (
        "budget 5 leaves no room to choose: it must exceed sink_tokens + recent_window = 4 + 1 "
        "(policy auto resolved to 'tova+caote')"
    )
    with pytest.raises(ValueError, match=r"= 4 \+ 16 \(policy auto resolved to 'learned\+caote'\)$") as error:
        EvictionCache(llama, budget=20, predictor=predictor_file(llama, tmp_path, "helps"))  # learned keeps 16 recent
    assert "\n" not in str(error.value)


# -- both names, wherever a policy is reported ---------------------------------------------------------------------


def test_stats_and_repr_record_the_policy_run_and_the_one_asked_for(llama, nothing_shipped):
    with EvictionCache(llama, budget=40) as cache, torch.no_grad():
        llama(input_ids=random_ids(80), cache=cache, use_cache=True)
    stats = cache.stats()
    assert (stats.policy, stats.requested, stats.tokens_kept) == ("tova+caote", "auto", 40)
    assert repr(cache).startswith("EvictionCache(policy='tova+caote' (auto), budget=40,")
    named = EvictionCache(llama, budget=40, policy="h2o")
    assert (named.stats().policy, named.stats().requested) == ("h2o", "h2o")
    assert repr(named).startswith("EvictionCache(policy='h2o', budget=40,")


@pytest.mark.parametrize("verdict, resolved", [("helps", "learned+caote"), ("does not help", "tova+caote")])
def test_an_eval_row_of_auto_records_what_it_resolved_to_and_the_verdict_is_printed_once(
    llama, tmp_path, capsys, verdict, resolved
):
    path = predictor_file(llama, tmp_path, verdict)
    config = EvalConfig(
        benchmark="perplexity",
        model="tiny",
        policies=["auto", "tova"],
        budgets=[24, 40],
        lengths=[0],
        out=tmp_path / "rows",
        block_size=16,
        progress=False,
        predictor=Path(path),
    )
    texts = [Text("text-a", 96, "x" * 5, "a"), Text("text-b", 96, "x" * 6, "b")]
    assert runner.run_texts(config, llama, RandomIds(96), texts) == 2 * 5
    rows = load_rows(config.out)
    assert {row["resolved"] for row in rows if row["policy"] == "auto"} == {resolved}
    assert not any("resolved" in row for row in rows if row["policy"] != "auto")  # other rows as before auto
    err = capsys.readouterr().err
    line = f"caote: predictor {path!r}: {verdict} (learned+caote against the best training-free policy; 1 dev excerpts"
    assert err.count(line) == 1, err


def test_auto_is_refused_on_texts_its_learned_choice_was_calibrated_on(llama, tmp_path):
    path = predictor_file(llama, tmp_path, "helps", texts=("text-a",))
    config = EvalConfig("perplexity", "tiny", ["auto"], [24], [0], out=tmp_path, block_size=16, predictor=Path(path))
    with pytest.raises(ValueError, match="calibrated on the documents of 1 of the texts"):
        runner.run_texts(config, llama, RandomIds(96), [Text("text-a", 96, "x", "a")])


@pytest.fixture
def vocab_model(tokenizer):
    """A tiny Llama the bundled tokenizer can drive."""
    return tiny_model("llama", vocab_size=49152, max_position_embeddings=256)


@pytest.mark.parametrize("verdict, resolved", [("helps", "learned+caote"), ("does not help", "h2o+caote")])
def test_caote_generate_prints_the_verdict_and_names_both_policies(
    vocab_model, tokenizer, tmp_path, capsys, monkeypatch, verdict, resolved
):
    load_as(monkeypatch, vocab_model, tokenizer)
    path = predictor_file(vocab_model, tmp_path, verdict)
    code = main(["generate", "hello there", "--no-chat", "--max-new-tokens", "2", "--stats", "--predictor", path])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"caote: predictor {path!r}: {verdict} (" in err and f"policy auto -> {resolved}\n" in err


def test_rows_of_auto_are_summarised_and_drawn_as_a_policy_of_their_own(tmp_path):
    from caote.reports.summary import summarise_rows

    def row(policy, budget, unit, kl):
        return {"benchmark": "perplexity", "example_id": f"essay-{unit}", "unit": unit, "policy": policy,
                "budget": budget, "kl": kl, "ppl_delta": kl, "ppl_full": 25.0, "fidelity": kl,
                "fidelity_layers": [kl, kl], "tokens": 1024, "seconds": 1.0}  # fmt: skip

    rows = [row("full", None, unit, 0.0) for unit in "ab"]
    rows += [row(policy, budget, unit, 0.1) for policy in ("auto", "h2o") for budget in (128, 256) for unit in "ab"]
    pieces = summarise_rows(rows, "perplexity", tmp_path)
    assert {(r["policy"], r["budget"]) for r in pieces["records"] if r["metric"] == "kl"} >= {("auto", 128)}
    assert (tmp_path / "perplexity_kl_vs_budget.png").is_file() and (tmp_path / "fidelity_layers_b128.png").is_file()


def test_auto_is_a_name_the_evaluation_takes_and_the_benchmark_refuses(capsys):
    from caote.evaluation.config import config_from_args
    from caote.policies import expand_policies, hindsight_policies

    assert expand_policies("auto,h2o,Auto") == ["auto", "h2o"] and hindsight_policies(["auto", "oracle"]) == ["oracle"]
    arguments = ["eval", "perplexity", "--policies", "auto,tova", "--budgets"]
    assert config_from_args(build_parser().parse_args([*arguments, "256"])).policies == ["auto", "tova"]
    with pytest.raises(ValueError, match=r"^--budgets: 5 is too small for auto \(.*resolved to 'tova\+caote'\)\)$"):
        config_from_args(build_parser().parse_args([*arguments, "5"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--policies", "auto"])
    assert "auto names no one policy to time: name those it resolves to (tova+caote" in capsys.readouterr().err


# -- the default everywhere ----------------------------------------------------------------------------------------


def test_auto_is_the_default_of_the_settings_generate_the_pipeline_and_the_cli(vocab_model, tokenizer, nothing_shipped):
    from transformers import pipeline

    from caote.pipeline import TASK

    assert CacheSettings().requested == "auto"
    assert CacheSettings().policy.name == auto_training_free(DEFAULT_BUDGET)
    assert build_parser().parse_args(["generate", "hi"]).policy == "auto"
    result = caote.generate(vocab_model, tokenizer, "hello there", budget=32, max_new_tokens=2, return_stats=True)
    assert (result.stats.requested, result.stats.policy) == ("auto", "tova+caote")
    pipe = pipeline(TASK, model=vocab_model, tokenizer=tokenizer)
    stats = pipe("hello there " * 30, question="Who?", budget=32, max_new_tokens=2, return_stats=True)["stats"]
    assert {(item.requested, item.policy) for item in stats} == {("auto", "tova+caote")}


def test_the_pipeline_prints_the_verdict_of_the_predictor_it_reads_once(vocab_model, tokenizer, tmp_path, capsys):
    from transformers import pipeline

    from caote.pipeline import TASK

    path = predictor_file(vocab_model, tmp_path, "does not help")
    pipe = pipeline(TASK, model=vocab_model, tokenizer=tokenizer)
    for _ in range(2):
        pipe("hello there " * 30, question="Who?", budget=32, max_new_tokens=2, predictor=path)
    assert capsys.readouterr().err.count(f"caote: predictor {path!r}: does not help (") == 1


# -- the table, from the committed rows of the long grid -----------------------------------------------------------


def long_grid_choices() -> tuple[dict[int, str], list[str]]:
    """Per budget of the long grid, the training-free policy of lowest geometric mean, over the perplexity parts
    whose every cell holds all its texts, of its mean KL, among those fast enough to decode (`decodes_fast`); and
    those parts."""
    logs: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    complete = []
    for part in LONG_GRID.parts:
        if TASKS[part.task].texts is None:  # NIAH: no KL
            continue
        policies = [name for name in part.policies or LONG_GRID.policies if training_free(name) and decodes_fast(name)]
        cells = [(policy, budget) for policy in policies for budget in LONG_GRID.budgets]
        kl: dict[tuple, dict[str, float]] = defaultdict(dict)
        for row in load_rows(LONG_RUNS / part.key):
            kl[(row["policy"], row["budget"])][row["example_id"]] = row["kl"]
        if any(len(kl[cell]) < part.samples for cell in cells):  # still being computed
            continue
        complete.append(part.key)
        for policy, budget in cells:
            logs[budget][policy] += math.log(mean(kl[(policy, budget)].values()))
    return {budget: min(logs[budget], key=logs[budget].get) for budget in LONG_GRID.budgets}, complete


def decodes_fast(name: str) -> bool:
    """Whether the committed `caote bench` run decoded ``name`` at `DECODE_LIMIT` or more of a full cache of the same
    size at every context of its decode rounds (a policy it did not decode is not known to)."""
    ratios = json.loads(BENCH.read_text(encoding="utf-8"))["summary"]["ratios"]
    measured = [by_policy[name].get("decode_vs_full_at_budget") for by_policy in ratios.values() if name in by_policy]
    measured = [ratio for ratio in measured if ratio is not None]
    return bool(measured) and min(measured) >= DECODE_LIMIT


def training_free(name: str) -> bool:
    policy = parse_policy(name)
    return policy.evicts and not policy.reads_predictor and not policy.base.hindsight


def test_autos_table_is_the_long_grids_lowest_kl_at_each_budget():
    choices, complete = long_grid_choices()
    assert set(COMPLETE_PARTS) <= set(complete), complete
    assert choices == AUTO_TRAINING_FREE


def test_a_learned_policy_without_a_predictor_names_the_models_that_ship_one(llama, tiny_predictors):
    shipped = r"only gemma3-270m, smollm2-135m ship one$"
    with pytest.raises(ValueError, match=rf"needs a predictor calibrated for .*{shipped}"):
        tiny_predictors(Predictor, llama)  # the unpatched lookup: none ships for a tiny model


def test_of_a_models_shipped_predictors_a_cache_takes_the_one_for_its_budget(llama, tmp_path, monkeypatch, capsys):
    """A model may ship a predictor for large budgets beside its own (`Predictor.min_budget`, ``caote calibrate
    --min-budget``): a cache takes the one of the largest minimum not above its budget, and says which."""
    every = Predictor.load(predictor_file(llama, tmp_path, "helps"))
    large = Predictor.load(predictor_file(llama, tmp_path, "does not help"))
    large.details["min_budget"] = 1024
    large.weights = large.weights + 1.0
    large.save(tmp_path / "does-not-help-learned+caote.safetensors")
    monkeypatch.setattr(predictor_files, "PREDICTOR_DIR", tmp_path)
    for budget, chosen in ((None, every), (256, every), (1023, every), (1024, large), (4096, large)):
        assert torch.equal(Predictor.shipped_for(llama, budget).weights, chosen.weights), budget
    assert Predictor.for_model(llama, budget=2048).min_budget == 1024
    # auto reads the verdict of the file its budget takes
    assert EvictionCache(llama, budget=256).policy.name == "learned+caote"
    assert EvictionCache(llama, budget=1024).policy.name == auto_training_free(1024)
    found = CacheSettings(budget=2048, policy="learned+caote").predictor_for(llama)
    assert found[1] == "shipped for 'tiny' at budgets from 1024"
    # a run reading both (an evaluation at 256 and 2048) prints both verdicts
    from caote import generation

    monkeypatch.setattr(generation, "_announced", set())
    generation.announce_predictor(llama, *(CacheSettings(budget=b, policy="learned+caote") for b in (256, 2048)))
    printed = capsys.readouterr().err
    assert "shipped for 'tiny': helps" in printed and "shipped for 'tiny' at budgets from 1024: does not" in printed
    # only large-budget predictors shipped: a smaller budget takes the one of the smallest minimum
    (tmp_path / "helps-learned+caote.safetensors").unlink()
    assert Predictor.shipped_for(llama, 128).min_budget == 1024
    # two files of one model with the same minimum: which one is meant cannot be told, so neither is taken
    large.weights = large.weights + 1.0
    large.save(tmp_path / "another-learned+caote.safetensors")
    tied = r"^another-learned\+caote\.safetensors, does-not-help-learned\+caote\.safetensors in .* budget \(1024\)"
    with pytest.raises(ValueError, match=tied):
        Predictor.shipped_for(llama, 2048)
