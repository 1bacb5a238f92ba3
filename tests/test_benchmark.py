"""The benchmark runs end to end on a tiny random Llama with tiny contexts (no timing assertions)."""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch
from conftest import random_ids, tiny_model

from caote.benchmark import inputs, memory
from caote.benchmark.cli import config_from_args
from caote.benchmark.config import DEFAULT_POLICIES, LEARNED_POLICY, TINY_LLAMA, BenchConfig
from caote.benchmark.document import markdown_report, report_from_json
from caote.benchmark.interval import decode_kl, interval_study, write_study
from caote.benchmark.schedule import _served_by_predictors, run_benchmark
from caote.benchmark.stats import summarise

TINY_RUN = dict(
    model=TINY_LLAMA,
    contexts=(48, 96),
    repeats={48: 2, 96: 1},
    budget=40,
    block_size=16,
    policies=("streamingllm", "tova", "tova+caote", "snapkv+fastcaote"),
    decode_policies=("streamingllm", "tova+caote"),
    new_tokens=3,
    threads=1,
    text="random",
)

SAMPLE_KEYS = {
    "configuration",
    "context",
    "repeat",
    "load_average",
    "prefill_s",
    "kv_peak_bytes",
    "kv_bytes_after_prefill",
    "peak_rss_bytes",
    "baseline_rss_bytes",
    "prefill_rss_bytes",
    "weight_bytes",
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    document = run_benchmark(BenchConfig(**TINY_RUN), out, log=lambda line: None)
    return document, out


def test_every_sample_is_recorded_round_robin(tiny_run):
    document, _ = tiny_run
    configurations = document["meta"]["configurations"]
    assert configurations == ["full-sdpa", "full-blocks", "full@b", *TINY_RUN["policies"]]
    samples = document["samples"]
    assert len(samples) == len(configurations) * 3  # 2 repeats at 48 tokens, 1 at 96
    for sample in samples:
        assert SAMPLE_KEYS <= set(sample)
        assert sample["prefill_s"] > 0
    # one round = every configuration once, before the next round starts
    first_round = [s["configuration"] for s in samples[: len(configurations)]]
    assert sorted(first_round) == sorted(configurations)
    second_round = [s["configuration"] for s in samples if s["repeat"] == 1]
    assert second_round[0] != first_round[0]  # rotated order


def test_decoding_only_for_full_cache_and_decode_policies(tiny_run):
    document, _ = tiny_run
    for sample in document["samples"]:
        decoded = sample["configuration"] in ("full-sdpa", "full@b", *TINY_RUN["decode_policies"])
        assert ("decode_tokens_per_s" in sample) == decoded
        if decoded:
            assert sample["decode_tokens_per_s"] > 0 and sample["decode_kv_bytes_per_token"] > 0


def test_decode_rounds_interleave_every_decode_policy_beside_full_at_budget(tiny_run):
    document, out = tiny_run
    rounds = document["decode_rounds"]
    assert len(rounds) == 3  # the default
    cells = {f"{context}/40/{name}" for context in (48, 96) for name in ("full@b", *TINY_RUN["decode_policies"])}
    for measured in rounds:
        assert set(measured["ms"]) == cells and all(ms > 0 for ms in measured["ms"].values())
        assert len(measured["load_start"]) == 3 and len(measured["load_end"]) == 3
    ratio = document["summary"]["ratios"]["96"]["tova+caote"]
    each = [r["ms"]["96/40/full@b"] / r["ms"]["96/40/tova+caote"] for r in rounds]
    assert ratio["decode_vs_full_at_budget_rounds"] == each
    assert ratio["decode_vs_full_at_budget"] == pytest.approx(statistics.median(each))
    limits = {t["target"]: t["limit"] for t in document["summary"]["targets"]}
    assert limits["decode streamingllm / full@b @ 96"] == 0.95 and limits["decode tova+caote / full@b @ 96"] == 0.9
    assert "## Decoding beside full@b, steps interleaved" in (out / "results.md").read_text()
    sequential = summarise({**document, "decode_rounds": []})["ratios"]["96"]["tova+caote"]  # an older results.json
    assert sequential["decode_vs_full_at_budget"] > 0 and "decode_vs_full_at_budget_rounds" not in sequential


def test_interleaved_decode_refuses_more_timed_steps_than_it_decodes():
    from caote.benchmark.paired import interleaved_decode

    with pytest.raises(ValueError, match="timed steps"):
        interleaved_decode(None, None, [64], [32], ["full@b"], steps=4, timed=5)


def test_kv_bytes_are_bounded_by_budget_plus_block(tiny_run):
    document, _ = tiny_run
    meta = document["meta"]
    per_token = 2 * meta["layers"] * meta["kv_heads"] * meta["head_dim"] * 4  # fp32 keys + values, all layers
    for sample in document["samples"]:
        if sample["configuration"] == "full@b":  # the prompt's last budget tokens only
            assert sample["kv_peak_bytes"] == per_token * min(TINY_RUN["budget"], sample["context"])
        elif sample["configuration"].startswith("full"):
            assert sample["kv_peak_bytes"] == per_token * sample["context"]
        else:
            assert sample["kv_peak_bytes"] <= per_token * (TINY_RUN["budget"] + TINY_RUN["block_size"])
            assert sample["kv_bytes_after_prefill"] == per_token * min(TINY_RUN["budget"], sample["context"])


def test_summary_has_medians_ratios_and_targets(tiny_run):
    document, _ = tiny_run
    summary = document["summary"]
    assert set(summary["medians"]) == set(document["meta"]["configurations"])
    ratios = summary["ratios"]["96"]
    assert ratios["tova+caote"]["time_vs_base"] is not None
    assert ratios["tova"]["time_vs_streamingllm"] is not None
    assert ratios["snapkv+fastcaote"]["time_vs_streamingllm"] is not None
    assert "time_vs_base" not in ratios["snapkv+fastcaote"]  # its base was not measured
    assert ratios["tova+caote"]["decode_speedup_bound"] > 0
    assert ratios["streamingllm"]["kv_peak_bound"] == pytest.approx((40 + 16) / 96)
    names = [target["target"] for target in summary["targets"]]
    assert "tova+caote / tova time @ 96" in names
    assert "decode speed-up tova+caote @ 96" in names
    assert ratios["tova+caote"]["decode_vs_full_at_budget"] > 0  # decoding against a full cache of budget tokens
    assert "decode tova+caote / full@b @ 96" in names and "decode streamingllm / full@b @ 48" in names
    assert "prefill streamingllm vs full-sdpa @ 96" in names
    assert summary["targets_total"] == len(summary["targets"])
    assert all(isinstance(target["met"], bool) for target in summary["targets"])


def test_files_written(tiny_run):
    document, out = tiny_run
    stored = json.loads((out / "results.json").read_text())
    assert stored["samples"] == json.loads(json.dumps(document["samples"]))
    assert {"meta", "samples", "summary"} <= set(stored)
    assert stored["meta"]["load_average_start"] is not None
    markdown = (out / "results.md").read_text()
    assert "## Context 96 tokens" in markdown and "## Targets:" in markdown
    assert "| tova+caote |" in markdown
    pytest.importorskip("matplotlib")
    assert (out / "results.png").stat().st_size > 0


def test_markdown_report_of_partial_document(tiny_run):
    document, _ = tiny_run
    partial = {"meta": document["meta"], "samples": document["samples"][:3]}
    text = markdown_report(partial)
    assert "## Context 48 tokens" in text


def test_prompt_ids_from_essays_or_random():
    ids, source = inputs.prompt_ids(None, 50, "essays", vocab_size=96)
    assert ids.shape == (1, 50) and "random" in source and int(ids.max()) < 96
    with pytest.raises(ValueError):
        inputs.prompt_ids(None, 10, "poetry", vocab_size=96)


def test_peak_rss_reads():
    memory.reset_peak_rss()
    now, peak = memory.rss_bytes(), memory.peak_rss_bytes()
    # the kernel updates VmHWM lazily (per-thread RSS counters), so it may trail VmRSS by a few pages
    assert now > 0 and peak > 0.9 * now


def test_config_validation():
    with pytest.raises(ValueError):
        run_benchmark(BenchConfig(**{**TINY_RUN, "policies": ("full",)}), None, log=lambda line: None)
    with pytest.raises(ValueError):
        run_benchmark(BenchConfig(**{**TINY_RUN, "decode_policies": ("h2o",)}), None, log=lambda line: None)


def test_cli_parser_registers_bench(tmp_path):
    from caote.cli import build_parser

    args = build_parser().parse_args(
        [
            "bench",
            "--model",
            TINY_LLAMA,
            "--contexts",
            "32,64",
            "--repeats",
            "1",
            "--budget",
            "40",
            "--block-size",
            "16",
            "--policies",
            "streamingllm,tova+caote",
            "--decode-policies",
            "tova+caote",
            "--new-tokens",
            "2",
            "--text",
            "random",
            "--out",
            str(tmp_path),
        ]
    )
    config = config_from_args(args)
    assert config.contexts == (32, 64) and config.repeats == {32: 1, 64: 1}
    assert config.policies == ("streamingllm", "tova+caote") and config.decode_policies == ("tova+caote",)
    assert callable(args.func)
    assert args.func(args) == 0
    assert (tmp_path / "results.md").is_file()


def test_report_from_partial_json(tiny_run, tmp_path):
    document, _ = tiny_run
    meta = {key: value for key, value in document["meta"].items() if key not in ("finished", "load_average_end")}
    partial = {"meta": meta, "samples": document["samples"][:4]}
    (tmp_path / "results.json").write_text(json.dumps(partial))
    rebuilt = report_from_json(tmp_path / "results.json", log=lambda line: None)
    assert rebuilt["summary"]["medians"]["full-sdpa"]["48"]["samples"] == 1
    assert "(unfinished)" in (tmp_path / "results.md").read_text()


def test_decode_kl_is_zero_without_eviction_and_grows_with_it(llama, tmp_path):
    ids = random_ids(96, seed=4)
    assert decode_kl(llama, ids, "tova+caote", 200, 40, 1)["kl"] < 1e-5  # nothing evicted: the full cache's steps
    evicting = decode_kl(llama, ids, "tova+caote", 24, 40, 4)
    assert evicting["kl"] > 1e-4 and evicting["tokens_per_s"] > 0
    study = interval_study(llama, [ids], "tova+caote", 24, 40, (1, 4))
    assert study["summary"][4]["kl"] == pytest.approx(evicting["kl"]) and len(study["samples"]) == 2
    meta = dict(budget=24, tokens=96, prompt_tokens=40, texts=1, split="dev", machine="m",
                started="now", load=[0.0])  # fmt: skip
    text = write_study({"tova+caote": study, "h2o+caote": study}, meta, tmp_path).read_text()
    assert "## tova+caote" in text and "## h2o+caote" in text and text.count("| 4 |") == 2
    assert (tmp_path / "decode_interval.json").is_file()


def test_each_policy_is_timed_against_its_cost_reference():
    from caote.benchmark.stats import _cost_reference

    assert _cost_reference("tova+caote") == ("tova", 1.05)
    assert _cost_reference("caote-window") == ("snapkv+caote", 1.10)
    assert _cost_reference("caote-ahead") == ("h2o+caote", 1.10)
    assert _cost_reference("streamingllm")[0] is None
    assert _cost_reference("tova+caote/mean/page16") == ("tova+caote/mean", 1.05)


def test_growth_fit_tells_a_linear_cost_from_a_quadratic_one():
    from caote.benchmark.stats import growth_fit

    contexts = (2048, 4096, 8192, 16384)
    linear = {str(c): {"prefill_s": 1.0 + c / 1000, "peak_rss_bytes": 100} for c in contexts}
    quadratic = {str(c): {"prefill_s": (c / 1000) ** 2, "peak_rss_bytes": c} for c in contexts}
    fit = growth_fit(linear)
    assert fit["seconds_per_1k_tokens"] == pytest.approx(1.0) and fit["intercept_s"] == pytest.approx(1.0)
    assert fit["r2"] == pytest.approx(1.0) and fit["marginal_cost_ratio"] == pytest.approx(1.0)
    assert fit["peak_rss_ratio"] == 1.0
    curved = growth_fit(quadratic)
    assert curved["marginal_cost_ratio"] == pytest.approx((16384 + 8192) / (4096 + 2048))  # 4x for 8x the context
    assert curved["peak_rss_ratio"] == 8.0 and curved["r2"] < 1.0
    assert growth_fit({"2048": linear["2048"], "4096": linear["4096"]}) is None  # a line needs 3 contexts to test


def test_three_contexts_give_growth_targets_table_and_plot(tiny_run, tmp_path):
    document, _ = tiny_run
    doubled = [
        {**s, "context": 192, "prefill_s": 2 * s["prefill_s"]} for s in document["samples"] if s["context"] == 96
    ]
    grown = {"meta": document["meta"], "samples": document["samples"] + doubled}
    (tmp_path / "results.json").write_text(json.dumps(grown))
    summary = report_from_json(tmp_path / "results.json", log=lambda line: None)["summary"]
    assert set(summary["growth"]) == {"full-sdpa", "full-blocks", *TINY_RUN["policies"]}  # full@b reads b tokens
    names = {target["target"] for target in summary["targets"]}
    assert "prefill grows linearly: tova+caote" in names and "peak RSS stays flat: tova+caote" in names
    assert "## How cost grows with the context" in (tmp_path / "results.md").read_text()
    pytest.importorskip("matplotlib")
    assert (tmp_path / "growth.png").stat().st_size > 0


def test_position_limit_is_raised_for_timing_only_when_too_low():
    from caote.testing import tiny_model

    model = tiny_model("llama", max_position_embeddings=64)
    assert inputs.allow_positions(model, 32) is None and model.config.max_position_embeddings == 64
    assert inputs.allow_positions(model, 100) == 64 and model.config.max_position_embeddings == 100


def test_gpu_check_runs_every_configuration_with_bounded_kv_on_a_tiny_model(tmp_path):
    from caote.benchmark.gpu import TINY_SHAPES, gpu_check, random_model, run_meta, write_check

    model = random_model(TINY_SHAPES, "cpu", torch.float32)
    saved = []
    results = gpu_check(model, 96, 24, (8, 16), ["streamingllm", "tova+caote"], 3, "cpu", save=saved.append)
    assert list(results) == ["full-sdpa", "full@b"] + [
        f"{name}@{block}" for block in (16, 8) for name in ("full-blocks", "streamingllm", "tova+caote")
    ]
    assert len(saved) == len(results)
    head_dim = TINY_SHAPES["hidden_size"] // TINY_SHAPES["num_attention_heads"]
    per_token = 2 * TINY_SHAPES["num_hidden_layers"] * TINY_SHAPES["num_key_value_heads"] * head_dim * 4  # K+V fp32
    assert results["full-sdpa"]["kv_peak_bytes"] == 96 * per_token
    for block in (8, 16):
        evicting = results[f"tova+caote@{block}"]
        assert evicting["kv_peak_bytes"] <= (24 + block) * per_token and evicting["decode_tokens_per_s"] > 0
        assert results[f"full-blocks@{block}"]["decode_tokens_per_s"] is None
    text = write_check(results, run_meta("tiny", "cpu", 96, 24, 3), tmp_path).read_text()
    assert "| tova+caote@16 |" in text and json.loads((tmp_path / "gpu_check.json").read_text())["results"]


def test_gpu_check_records_a_failing_configuration_and_goes_on_in_bfloat16(tmp_path):
    from caote.benchmark.gpu import TINY_SHAPES, gpu_check, random_model, run_meta, summary_lines

    model = random_model(TINY_SHAPES, "cpu", torch.bfloat16)
    # budget 4 leaves no room beside 4 sinks: EvictionCache refuses it, while the full-cache configurations run
    results = gpu_check(model, 64, 4, (8,), ["streamingllm", "tova+caote"], 2, "cpu")
    assert results["full@b"]["decode_tokens_per_s"] > 0 and results["full-blocks@8"]["prefill_s"] > 0
    assert results["tova+caote@8"]["error"].startswith("ValueError: budget 4 leaves no room")
    lines = summary_lines(results, run_meta("tiny", "cpu", 64, 4, 2))
    assert any(line.startswith("| tova+caote@8 | failed: ValueError") for line in lines)


def test_operator_counts_are_in_the_run_its_document_and_its_targets(tiny_run):
    document, out = tiny_run
    counts = document["operators"]["counts"]
    assert set(counts) == {"full@b", "streamingllm", "tova+caote"}
    assert 0 < counts["streamingllm"]["extra_per_layer"] < counts["tova+caote"]["extra_per_layer"]
    assert "## Operators per decode step" in (out / "results.md").read_text()
    names = [target["target"] for target in document["summary"]["targets"]]
    assert "decode operators per evicting layer: tova+caote" in names


def test_a_scored_decode_step_adds_few_operators_per_evicting_layer():
    """The speed-by-design limits on the exact eager path: tova+caote <= 35 and h2o+caote <= 45 ATen operators
    (views included) per evicting layer and decode step beside a full cache of the same size (a layer of which
    runs 44). A count, not a timing: it does not depend on the machine's load."""
    from caote.benchmark.operators import operator_counts
    from caote.benchmark.stats import OPERATOR_LIMITS
    from caote.testing import tiny_model

    model = tiny_model("llama", num_hidden_layers=4)
    counts = operator_counts(model, random_ids(100, seed=3), list(OPERATOR_LIMITS) + ["streamingllm"], 64, 32)
    extra = {name: entry["extra_per_layer"] for name, entry in counts["counts"].items() if name != "full@b"}
    assert all(extra[name] <= limit for name, limit in OPERATOR_LIMITS.items()), extra
    assert extra["streamingllm"] <= 10, extra


def test_a_decode_round_counts_the_scored_steps_whatever_the_interval():
    from caote.benchmark.paired import per_step

    steps = [1.0, 1.0, 4.0] * 4  # every third step evicts
    assert per_step(steps, 1) == 1.0  # the median step: one step in three scored, not counted
    assert per_step(steps, 3) == 2.0  # windows of three: the scored step in each


def test_the_decode_rounds_render_without_a_load_average(tiny_run):
    document, _ = tiny_run
    rounds = [{**r, "load_start": [], "load_end": []} for r in document["decode_rounds"]]
    assert "n/a -> n/a" in markdown_report({**document, "decode_rounds": rounds})


def test_the_default_run_leaves_out_the_learned_policy_of_a_model_without_a_predictor(capsys, monkeypatch):
    model = tiny_model("llama")  # no predictor ships for it
    lines = []
    served = _served_by_predictors(BenchConfig(model="tiny-llama"), model, lines.append)
    assert LEARNED_POLICY not in served.policies + served.decode_policies and len(lines) == 1
    assert served.policies == tuple(name for name in DEFAULT_POLICIES if name != LEARNED_POLICY)
    with pytest.raises(ValueError, match="needs a predictor, and none ships for 'tiny-llama'"):
        _served_by_predictors(BenchConfig(model="tiny-llama", policies=(LEARNED_POLICY,)), model, lines.append)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 1.9, 1.9))  # the hint follows these checks
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr("caote.benchmark.schedule.model_for", lambda name, seed: (model, None))

    def started(*args):
        raise RuntimeError("started")

    monkeypatch.setattr("caote.benchmark.schedule.prompt_ids", started)
    with pytest.raises(RuntimeError, match="^started$"):
        run_benchmark(BenchConfig(model="tiny-llama", threads=2), None, log=lines.append)
    assert capsys.readouterr().err.count("try --threads 1") == 1 and "leaves out learned+caote" in lines[-1]
