"""`caote calibrate`'s recipe: rounds, the length rule, the held-out documents, the validation and its verdict."""

from __future__ import annotations

import pytest
import torch
from conftest import load_as
from test_cli import run_main

from caote.evaluation.calibration.texts import calibration_length, default_count
from caote.evaluation.splits import hold_out
from caote.evaluation.tasks import Text
from caote.evaluation.validation import (
    CANDIDATES,
    LEARNED,
    judge,
    logits_cost,
    validation_runs,
    validation_table,
)
from caote.predictor import PREDICTOR_DIR, VERDICT_DOES_NOT_HELP, VERDICT_HELPS, Predictor
from caote.testing import tiny_model

SHIPPED = PREDICTOR_DIR / "smollm2-135m.safetensors"


def texts_of(excerpts_per_document: dict[str, int]) -> list[Text]:
    """Excerpt ids as `calibration_texts` orders them: every document's first excerpt, then the second, ..."""
    texts, round_ = [], 1
    while any(count >= round_ for count in excerpts_per_document.values()):
        for name, count in excerpts_per_document.items():
            if count >= round_:
                suffix = f"-{round_}" if round_ > 1 else ""
                texts.append(Text(f"code-{name}-1024{suffix}", 1024, "text", name))
        round_ += 1
    return texts


def test_hold_out_takes_whole_documents_from_the_end_until_six_excerpts():
    texts = texts_of({"a": 5, "b": 5, "c": 5, "d": 2, "e": 5})
    fit, held = hold_out(texts)
    assert [text.id for text in held] == ["code-d-1024", "code-e-1024", "code-d-1024-2", "code-e-1024-2",
                                          "code-e-1024-3", "code-e-1024-4"]  # fmt: skip
    assert not {text.unit for text in fit} & {"d", "e"} and len(fit) == 15


def test_hold_out_keeps_half_of_the_documents_for_the_fit_or_holds_out_nothing():
    assert hold_out(texts_of({"a": 9, "b": 9}))[1][0].unit == "b"  # one of two documents, 6 of its 9 excerpts
    texts = texts_of({"a": 3, "b": 3, "c": 2})
    assert hold_out(texts) == (texts, [])  # one document of three gives 2 or 3 excerpts: no verdict
    assert hold_out(texts_of({"only": 40}))[1] == []


def kl_table(learned: list[float], best: list[float], budgets=(128, 512)) -> dict:
    table = {policy: {str(b): [1.0] * len(best) for b in budgets} for policy in LEARNED + CANDIDATES}
    for budget in budgets:
        table["learned+caote"][str(budget)] = list(learned)
        table["learned-block"][str(budget)] = [value + 0.5 for value in learned]
        table["snapkv+caote"][str(budget)] = list(best)
    return table


def test_the_verdict_needs_a_lower_mean_and_two_thirds_of_the_excerpts_at_every_budget():
    best = [0.5] * 6
    helps = judge(kl_table([0.4, 0.4, 0.4, 0.4, 0.6, 0.6], best), [128, 512])
    assert helps["verdict"] == VERDICT_HELPS and helps["learned"] == "learned+caote"
    assert helps["best"] == {"128": "snapkv+caote", "512": "snapkv+caote"}
    assert "lower on 4 of 6" in helps["summary"] and "-7%" in helps["summary"]
    # a lower mean from one excerpt is not enough
    lucky = judge(kl_table([0.1, 0.6, 0.6, 0.6, 0.4, 0.4], best), [128, 512])
    assert lucky["verdict"] == VERDICT_DOES_NOT_HELP and "lower on 3 of 6" in lucky["summary"]
    # most excerpts lower but a higher mean
    heavy_tail = judge(kl_table([0.45] * 5 + [2.0], best), [128, 512])
    assert heavy_tail["verdict"] == VERDICT_DOES_NOT_HELP


def test_of_two_learned_policies_that_pass_the_verdict_names_the_lower_at_the_smallest_budget():
    best = [0.5] * 6
    table = kl_table([0.4] * 6, best)
    table["learned-block"] = {"128": [0.3] * 6, "512": [0.45] * 6}  # lower at 128, higher at 512: still passes
    both = judge(table, [128, 512])
    assert both["verdict"] == VERDICT_HELPS and both["learned"] == "learned-block"
    table["learned-block"]["512"] = [0.6] * 6  # above the best training-free policy at 512: learned+caote's verdict
    assert judge(table, [128, 512])["learned"] == "learned+caote"
    del table["learned-block"]  # a validation from before learned-block: judged on the policies it has
    assert judge(table, [128, 512])["learned"] == "learned+caote"


def test_a_window_of_recent_tokens_is_judged_at_the_smallest_budget_only():
    assert validation_runs(("learned+caote", "streamingllm"), [128, 512]) == [
        ("learned+caote", 128),
        ("learned+caote", 512),
        ("streamingllm", 128),
    ]
    table = kl_table([0.4] * 6, [0.5] * 6)
    table["streamingllm"] = {"128": [0.1] * 6}  # the best candidate at 128, absent at 512
    verdict = judge(table, [128, 512])
    assert verdict["best"] == {"128": "streamingllm", "512": "snapkv+caote"}
    assert verdict["verdict"] == VERDICT_DOES_NOT_HELP
    lines = validation_table({"texts": ["t"] * 6, "budgets": [128, 512], "kl": table, **verdict}).splitlines()
    assert "| streamingllm | **0.1000** | – |" in lines


def test_the_table_marks_the_lowest_kl_and_states_the_verdict():
    validation = {"texts": ["t"] * 6, "budgets": [128, 512], "kl": kl_table([0.4] * 6, [0.5] * 6)}
    validation.update(judge(validation["kl"], [128, 512]))
    table = validation_table(validation)
    assert "| learned+caote | **0.4000** | **0.4000** |" in table and "| snapkv+caote | 0.5000 | 0.5000 |" in table
    assert table.splitlines()[-1].startswith("verdict: the predictor helps (b=128: learned+caote 0.4000 vs")


def test_the_calibration_length_follows_the_model():
    assert calibration_length(tiny_model("llama")) == 1024
    hybrid = tiny_model("gemma3_text")  # sliding layers (window 40) and full ones: 4 windows, never below 1024
    assert calibration_length(hybrid) == 1024
    hybrid.config.get_text_config().sliding_window = 512
    assert calibration_length(hybrid) == 2048
    assert default_count(1024) == 24 and default_count(2048) == 12 and default_count(10**6) == 4


def folder_of_texts(tmp_path, documents: int = 4, lines: int = 120):
    folder = tmp_path / "texts"
    folder.mkdir()
    for index in range(documents):
        (folder / f"doc{index}.txt").write_text(f"document {index} says line {index} of its own text\n" * lines)
    return folder


@pytest.fixture
def tiny_calibration(monkeypatch, tokenizer):
    """`caote calibrate` on a tiny random Llama (256 positions) with the bundled tokenizer."""
    model = tiny_model("llama", vocab_size=49152, max_position_embeddings=256)
    load_as(monkeypatch, model, tokenizer)
    return model


@pytest.fixture
def roomy_calibration(monkeypatch, tokenizer):
    """`caote calibrate` on a tiny random Llama with 1,024 positions: room for excerpts 4x as long as 256 tokens."""
    model = tiny_model("llama", vocab_size=49152, max_position_embeddings=1024)
    load_as(monkeypatch, model, tokenizer)
    return model


def test_long_excerpts_are_four_times_as_long_and_oversized_budgets_are_skipped(capsys, roomy_calibration, tmp_path):
    out = tmp_path / "mine.safetensors"
    code, stdout, err = run_main(
        capsys, "calibrate", "--texts", str(folder_of_texts(tmp_path)), "--length", "256", "--count", "8",
        "--long-count", "2", "--budgets", "40,300", "--rounds", "1", "--no-validation", "--min-budget", "512",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    assert Predictor.load(out).min_budget == 512  # --min-budget: for budgets from 512 where a model ships several
    lengths = [int(text_id.split("-")[2]) for text_id in Predictor.load(out).texts]
    assert lengths == [256] * 8 + [1024] * 2
    assert "8 texts of 256 tokens and 2 of 1024 x 2 budgets x 1 rounds" in stdout
    # blocks read, budget 300 skipped on the 256-token excerpts, every evicting pass stopping before the last block
    # (whose eviction has no later query): 8 x (2 full + 1) + 2 x (8 full + 2 budgets x 7)
    assert "68/68" in err


def test_no_balance_lengths_lets_each_length_weigh_by_its_rows(capsys, roomy_calibration, tmp_path):
    predictors, texts = {}, str(folder_of_texts(tmp_path))
    for flags in ([], ["--no-balance-lengths"]):
        out = tmp_path / f"mine{len(flags)}.safetensors"
        code, _, err = run_main(
            capsys, "calibrate", "--texts", texts, "--length", "256", "--count", "8", "--long-count", "2",
            "--budgets", "40", "--rounds", "1", "--no-validation", "--out", str(out), *flags,
        )  # fmt: skip
        assert code == 0, err
        predictors[bool(flags)] = Predictor.load(out)
    balanced, plain = predictors[False], predictors[True]
    assert balanced.details["balance_lengths"] and "balance_lengths" not in plain.details
    assert balanced.details["rows"] == plain.details["rows"]
    assert not torch.allclose(balanced.weights, plain.weights)


def test_the_long_excerpts_leave_out_the_documents_held_out_to_validate(capsys, roomy_calibration, tmp_path):
    out = tmp_path / "mine.safetensors"
    code, _, err = run_main(
        capsys, "calibrate", "--texts", str(folder_of_texts(tmp_path)), "--length", "256", "--count", "4",
        "--long-length", "512", "--long-count", "4", "--budgets", "40", "--rounds", "1", "--validation-budgets", "40",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    predictor = Predictor.load(out)
    held = {text_id.split("-")[1] for text_id in predictor.validation["texts"]}
    long = [text_id for text_id in predictor.texts if text_id.split("-")[2] == "512"]
    assert len(long) == 4 and held and held.isdisjoint(text_id.split("-")[1] for text_id in long)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--long-length", "2048", "--long-count", "2"], "--long-length 2048 exceeds the 1024 positions"),
        (["--long-count", "40"], "--long-count: 4 excerpts of 1024 tokens come from the documents not held out"),
        (["--long-length", "256", "--long-count", "2"], "--long-length (256) must exceed --length (256)"),
    ],
)
def test_long_excerpts_that_cannot_be_had_are_refused_in_one_line(capsys, roomy_calibration, tmp_path, args, message):
    base = ["--texts", str(folder_of_texts(tmp_path)), "--length", "256", "--budgets", "40", "--no-validation"]
    base += ["--out", "p.safetensors"]
    code, out, err = run_main(capsys, "calibrate", *base, *args)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_calibrate_runs_two_rounds_validates_on_held_out_documents_and_stores_the_verdict(
    capsys, tiny_calibration, tmp_path
):
    out = tmp_path / "mine.safetensors"
    folder = folder_of_texts(tmp_path)
    code, stdout, err = run_main(
        capsys, "calibrate", "--texts", str(folder), "--length", "256", "--budgets", "40", "--out", str(out),
        "--validation-budgets", "40,100",
    )  # fmt: skip
    assert code == 0, err
    predictor = Predictor.load(out)
    assert predictor.details["rounds"] == 2 and len(predictor.details["rolled_out_by"]) == 1
    validation = predictor.validation
    held = {text_id.split("-")[1] for text_id in validation["texts"]}
    assert len(validation["texts"]) == 6 and held.isdisjoint({text_id.split("-")[1] for text_id in predictor.texts})
    assert validation["budgets"] == [40, 100] and set(validation["kl"]) == set(LEARNED + CANDIDATES)
    assert validation["verdict"] in (VERDICT_HELPS, VERDICT_DOES_NOT_HELP)
    # a window of recent tokens is judged at the smallest budget only, every other policy at both
    assert list(validation["kl"]["streamingllm"]) == ["40"]
    assert all(list(rows) == ["40", "100"] for policy, rows in validation["kl"].items() if policy != "streamingllm")
    evicted = [value for rows in validation["kl"].values() for value in rows.get("100", [])]
    assert len(evicted) == 6 * (len(LEARNED + CANDIDATES) - 1) and min(evicted) > 0  # every excerpt evicted
    assert "x 2 rounds" in stdout and f"verdict: the predictor {validation['verdict']} (" in stdout
    assert predictor.helps == (validation["verdict"] == VERDICT_HELPS)
    assert predictor.verdict_line("mine").startswith(f"caote: predictor mine: {validation['verdict']} (b=40: ")
    # caote validate fits nothing and, by default, reads the excerpts and budgets of the stored validation
    again = tmp_path / "again.safetensors"
    code, stdout, err = run_main(
        capsys, "validate", str(out), "--texts", str(folder), "--length", "256", "--out", str(again)
    )  # fmt: skip
    assert code == 0, err
    assert f"validated {out} on the 6 excerpts of its stored validation" in stdout
    assert Predictor.load(again).validation["texts"] == validation["texts"]
    assert len(validation["digests"]) == 6 and Predictor.load(again).validation["digests"] == validation["digests"]
    assert Predictor.load(again).validation["kl"] == validation["kl"]  # budgets 40 and 100, as stored
    assert (Predictor.load(again).weights == predictor.weights).all()
    # texts without its excerpts (the dev code): excerpts of documents it was not fitted on, the stored budgets
    code, stdout, err = run_main(
        capsys, "validate", str(out), "--domain", "code", "--length", "256", "--out", str(again)
    )  # fmt: skip
    assert code == 0, err
    assert f"validated {out} on 6 excerpts of documents it was not fitted on" in stdout
    assert Predictor.load(again).validation["budgets"] == [40, 100]
    assert all(text_id.startswith("code-") for text_id in Predictor.load(again).validation["texts"])


def test_recompute_keeps_the_stored_rows_of_the_policies_it_does_not_name(capsys, tiny_calibration, tmp_path):
    out, again = tmp_path / "mine.safetensors", tmp_path / "again.safetensors"
    folder = folder_of_texts(tmp_path)
    code, _, err = run_main(
        capsys, "calibrate", "--texts", str(folder), "--length", "256", "--budgets", "40", "--rounds", "1",
        "--validation-budgets", "40", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    original = Predictor.load(out)
    stored = original.validation
    # rows no run could give: h2o+caote's (not named: kept, so the verdict must read it), learned+caote's (named: run
    # again)
    marked = dict(stored, kl={**stored["kl"], "h2o+caote": {"40": [0.0] * 6}, "learned+caote": {"40": [9.0] * 6}})
    del marked["kl"]["learned-block"]  # as in a validation from before learned-block: computed, though not named
    original.details["validation"] = marked
    original.save(out)
    base = ["validate", str(out), "--texts", str(folder), "--length", "256"]
    code, stdout, err = run_main(capsys, *base, "--recompute", "learned+caote", "--out", str(again))
    assert code == 0, err
    assert "rows of learned+caote, learned-block recomputed, the others as stored" in stdout
    # 6 excerpts x 2 blocks x (1 full + 2 policies x 1 budget), each block weighing what its logits cost
    units = 6 * 3 * round(2 * logits_cost(tiny_calibration))
    assert f"{units}/{units}" in err
    validation = Predictor.load(again).validation
    assert validation["recomputed"] == ["learned+caote", "learned-block"]
    assert list(validation["kl"]) == list(stored["kl"])
    assert validation["kl"]["h2o+caote"] == {"40": [0.0] * 6}  # kept, not run
    assert validation["best"] == {"40": "h2o+caote"} and validation["verdict"] == VERDICT_DOES_NOT_HELP
    for policy in ("learned+caote", "learned-block", "streamingllm"):
        assert validation["kl"][policy]["40"] == pytest.approx(stored["kl"][policy]["40"]), policy  # run alike, kept
    for args, message in [
        (
            ["--domain", "code"],
            "--recompute keeps rows of the stored validation's excerpts, but the "
            "texts lack some of them (another --length, --domain or --texts?)",
        ),
        (["--validation-budgets", "40,100"], "--recompute: --validation-budgets must be the stored validation's, 40"),
        (["--recompute", "learned,nope"], "--recompute takes policies of the validation (learned+caote, learned-"),
    ]:
        source = [] if "--domain" in args else ["--texts", str(folder)]
        argv = ["validate", str(out), *source, "--recompute", "learned-block", "--out", "x"]
        code, stdout, err = run_main(capsys, *argv, *args)
        assert code == 2 and stdout == "" and err.count("\n") == 1 and message in err, err
    original.details["validation"] = {key: value for key, value in stored.items() if key != "digests"}
    original.save(out)
    code, _, err = run_main(capsys, *base, "--recompute", "learned-block", "--out", str(again))
    assert code == 2 and "predates excerpt digests: validate it whole" in err
    original.details["validation"] = None
    original.save(out)
    code, _, err = run_main(capsys, *base, "--recompute", "learned-block", "--out", str(again))
    assert code == 2 and "has no stored validation to keep rows of" in err


def test_validating_again_says_why_when_the_stored_excerpts_texts_changed(capsys, tiny_calibration, tmp_path):
    out = tmp_path / "mine.safetensors"
    folder = folder_of_texts(tmp_path)
    code, _, err = run_main(
        capsys, "calibrate", "--texts", str(folder), "--length", "256", "--budgets", "40", "--rounds", "1",
        "--validation-budgets", "40", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    base = ["validate", str(out), "--texts", str(folder), "--length", "256"]
    code, stdout, err = run_main(capsys, *base, "--out", str(out))
    assert code == 0 and "not the stored validation's excerpts" not in err, err
    assert "on the 6 excerpts of its stored validation" in stdout
    held = folder / f"{Predictor.load(out).validation['texts'][0].split('-')[1]}.txt"
    held.write_text(held.read_text().replace("says", "writes"))  # the same file name, another text
    code, stdout, err = run_main(capsys, *base, "--recompute", "learned-block", "--out", str(out))
    assert code == 2 and stdout == "" and err.count("\n") == 1, err
    assert "--recompute keeps rows of the stored validation's excerpts, but the texts hold their ids, not all" in err
    code, stdout, err = run_main(capsys, *base, "--out", str(out))
    assert code == 0, err
    assert "not the stored validation's excerpts: the texts hold their ids, not all of their text" in err
    assert "on 6 excerpts of documents it was not fitted on" in stdout


def test_a_stored_validation_is_read_again_only_where_ids_and_texts_match():
    from types import SimpleNamespace

    from caote.evaluation.validation import digest
    from caote.validate_command import stored_excerpts

    texts = [Text(f"code-doc{index}-256-0", 256, f"text of document {index}", f"doc{index}") for index in range(3)]
    stored = {"texts": [texts[2].id, texts[0].id], "budgets": [40]}
    older = SimpleNamespace(validation=stored)  # validated before digests were stored: ids decide
    assert stored_excerpts(older, texts) == ([texts[2], texts[0]], "")
    digests = [digest(texts[2].text), digest(texts[0].text)]
    current = SimpleNamespace(validation={**stored, "digests": digests})
    assert stored_excerpts(current, texts) == ([texts[2], texts[0]], "")
    edited = [texts[0], texts[1], texts[2]._replace(text="the same file name, another text")]
    assert stored_excerpts(current, edited) == ([], "the texts hold their ids, not all of their text (edited files, "
                                                "or a tokenizer that decodes otherwise)")  # fmt: skip
    assert stored_excerpts(older, edited)[0] != []
    assert stored_excerpts(current, texts[:2]) == ([], "the texts lack some of them (another --length, --domain or "
                                                   "--texts?)")  # fmt: skip
    assert stored_excerpts(SimpleNamespace(validation=None), texts) == ([], "the predictor has no stored validation")


@pytest.mark.parametrize("name", ["smollm2-135m", "smollm2-135m-long", "gemma3-270m"])
def test_the_shipped_predictors_find_the_excerpts_of_their_stored_validation(tokenizer, name):
    from caote.evaluation.calibration.texts import calibration_texts
    from caote.models import GEMMA3, resolve_model_path
    from caote.predictor import PREDICTOR_DIR
    from caote.validate_command import stored_excerpts

    if name == GEMMA3.name:  # its tokenizer comes with the gemma extra, which the test command does not install
        if not GEMMA3.available():
            pytest.skip("Gemma-3 270M is not installed (the gemma extra)")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name))
    predictor = Predictor.load(PREDICTOR_DIR / f"{name}.safetensors")
    parts = predictor.validation["texts"][0].split("-")  # <domain>-<document>-<length>[-k]
    length = next(part for part in parts[2:] if part.isdigit())
    texts = calibration_texts(tokenizer, "essays" if parts[0] == "essay" else parts[0], int(length))
    found, _ = stored_excerpts(predictor, texts)
    assert [text.id for text in found] == predictor.validation["texts"] and len(predictor.validation["digests"]) == 6


def test_too_few_documents_give_no_verdict_and_say_so(capsys, tiny_calibration, tmp_path):
    out = tmp_path / "mine.safetensors"
    folder = folder_of_texts(tmp_path, documents=2, lines=60)
    args = ["--texts", str(folder), "--length", "256", "--budgets", "40", "--rounds", "1", "--out", str(out)]
    code, stdout, err = run_main(capsys, "calibrate", *args)
    assert code == 0, err
    assert "leave fewer than 6 excerpts to validate on" in err and "carries no verdict" in stdout
    assert Predictor.load(out).validation is None
    assert "was not validated" in Predictor.load(out).verdict_line("mine")


@pytest.mark.parametrize("stage", ["fit", "validation"])
def test_a_calibration_killed_midway_leaves_no_predictor_file(capsys, tiny_calibration, tmp_path, monkeypatch, stage):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    target = (
        "caote.evaluation.calibration.recipe.calibrate" if stage == "fit" else "caote.evaluation.validation.validate"
    )
    monkeypatch.setattr(target, interrupted)
    out = tmp_path / "mine.safetensors"
    args = ["--texts", str(folder_of_texts(tmp_path)), "--length", "256", "--budgets", "40", "--out", str(out)]
    code, _, err = run_main(capsys, "calibrate", *args)
    assert code == 130 and err.endswith("caote calibrate: interrupted\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["texts"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rounds", "0"], "argument --rounds: must be a positive integer, got '0'"),
        (["--validation-budgets", "128,x"], "--validation-budgets must be comma-separated values"),
        (["--validation-budgets", "16"], "budget 16 leaves no room to choose"),
        (["--validation-budgets", "30"], "--validation-budgets: budget 30 leaves no room to choose: it must exceed"),
        (["--length", "1024", "--long-length", "512"], "--long-length (512) must exceed --length (1024)"),
        (["--long-count", "-1"], "argument --long-count: must be an integer >= 0"),
        (["--long-length", "4096"], "--long-length takes effect with --long-count N"),
        (["--no-balance-lengths"], "--no-balance-lengths takes effect with --long-count N"),
        (["--validate", "p.safetensors"], "unrecognized arguments: --validate p.safetensors"),  # caote validate
        (["--first-round-share", "0"], "--first-round-share must lie in (0, 1], got 0.0"),
        (["--length", "200", "--budgets", "128"], "--length 200: an evicting pass stops before the last block"),
        (["--budgets", "30"], "the validation budgets 30,120: budget 30 leaves no room to choose"),
        (["--device", "nonsense"], "--device 'nonsense' cannot be used here"),
    ],
)
def test_bad_recipe_options_exit_2_before_loading_the_model(capsys, monkeypatch, args, message):
    monkeypatch.setattr("caote.models.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code, out, err = run_main(capsys, "calibrate", "--out", "p.safetensors", *args)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["missing.safetensors"], "'missing.safetensors' is not a file (write one with caote calibrate)"),
        ([SHIPPED, "--device", "nonsense"], "--device 'nonsense' cannot be used here"),
        ([SHIPPED, "--recompute", "tova+caote"], "--recompute takes policies of the validation (learned+caote"),
        ([SHIPPED, "--validation-budgets", "16"], "budget 16 leaves no room to choose"),
        ([SHIPPED, "--length", "128"], "--length must exceed one prefill block (128 tokens: the eviction after"),
    ],
)
def test_bad_validate_options_exit_2_before_loading_the_model(capsys, monkeypatch, args, message):
    monkeypatch.setattr("caote.models.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code, out, err = run_main(capsys, "validate", *map(str, args), "--out", "p.safetensors")
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_each_text_is_read_once_with_the_full_cache_keeping_one_row_of_logits_per_block(
    capsys, tiny_calibration, tmp_path, monkeypatch
):
    """The fit reads the full cache's future attention, not its log-probs: a block's logits over the vocabulary (at
    8,192 tokens, 8.6 GB for Gemma-3) are computed for its last row only; that pass serves every round and budget;
    the evicting passes stop before the last block, whose eviction no later query reads."""
    from caote.evaluation.calibration import recipe as calibration

    references, passes = [], []

    def recorded(*args, **kwargs):
        references.append(calibration_reference(*args, **kwargs))
        return references[-1]

    def rolled_out(model, input_ids, *args):
        passes.append(input_ids.shape[1])
        return calibration_roll_out(model, input_ids, *args)

    calibration_reference, calibration_roll_out = calibration.reference_pass, calibration.roll_out
    monkeypatch.setattr(calibration, "reference_pass", recorded)
    monkeypatch.setattr(calibration, "roll_out", rolled_out)
    out = tmp_path / "mine.safetensors"
    code, _, err = run_main(
        capsys, "calibrate", "--texts", str(folder_of_texts(tmp_path)), "--length", "256", "--budgets", "40,100",
        "--count", "8", "--no-validation", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    assert len(references) == 8  # two rounds, two budgets: one full-cache pass per text
    # the first round reads a quarter of the texts (at least 4), the second all 8, at both budgets, 128 tokens each
    assert passes == [128] * (4 * 2 + 8 * 2) and Predictor.load(out).details["rolled_out_by"] == [
        Predictor.load(out).texts[:4]
    ]
    # blocks of 128: 8 full-cache passes of 2 blocks, then 24 evicting passes of 1
    assert "40/40" in err
    for reference in references:
        assert [rows.shape[0] for rows in reference.log_probs[:-1]] == [1] * (len(reference.log_probs) - 1)
