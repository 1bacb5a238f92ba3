"""The caote-text-generation pipeline: one compressed prefill, several questions, snapshot / restore."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids, tiny_model
from transformers import AutoTokenizer, DynamicCache, pipeline
from transformers.pipelines import PIPELINE_REGISTRY

import caote
from caote import EvictionCache
from caote.models import resolve_model_path
from caote.pipeline import SEPARATOR, TASK, CaoteTextGenerationPipeline, split_chat_template

CONTEXT = " ".join(f"Note {i}: the locker {i} code is {1000 + i * 37}." for i in range(40))
QUESTIONS = ["What is the code of locker 5?", "Which locker has code 1037?", "How many lockers are there?"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=49152)


@pytest.fixture(scope="module")
def pipe(model, tokenizer):
    return pipeline(TASK, model=model, tokenizer=tokenizer)


def test_registered_on_import(pipe):
    assert TASK in PIPELINE_REGISTRY.get_supported_tasks()
    assert isinstance(pipe, CaoteTextGenerationPipeline)
    assert caote.CaoteTextGenerationPipeline is CaoteTextGenerationPipeline


def test_split_chat_template(tokenizer):
    head, tail = split_chat_template(tokenizer, CONTEXT)
    whole = tokenizer.apply_chat_template(
        [{"role": "user", "content": CONTEXT + SEPARATOR}], add_generation_prompt=True, tokenize=False
    )
    assert head + SEPARATOR + tail == whole
    assert head.endswith(CONTEXT) and "assistant" in tail and CONTEXT not in tail
    tokenizer_without = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    tokenizer_without.chat_template = None
    assert split_chat_template(tokenizer_without, CONTEXT) == (CONTEXT, "")


def test_full_policy_answer_equals_stock_greedy_generate(pipe, model, tokenizer):
    question = QUESTIONS[0]
    head, tail = split_chat_template(tokenizer, CONTEXT)
    ids = torch.cat(
        [
            tokenizer(head, return_tensors="pt", add_special_tokens=False).input_ids,
            tokenizer(question + tail, return_tensors="pt", add_special_tokens=False).input_ids,
        ],
        dim=-1,
    )
    with torch.no_grad():
        reference = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=DynamicCache(config=model.config),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=[1, tokenizer.eos_token_id],
        )
    expected = tokenizer.decode(reference[0, ids.shape[-1] :], skip_special_tokens=True).strip()
    assert pipe(CONTEXT, question=question, policy="full", budget=64, max_new_tokens=6) == {"answer": expected}


def test_questions_share_one_prefill(pipe, model):
    fed = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(kwargs["input_ids"].shape[-1]), with_kwargs=True
    )
    try:
        out = pipe(CONTEXT, questions=QUESTIONS, budget=64, policy="snapkv+caote", max_new_tokens=4, return_stats=True)
    finally:
        handle.remove()
    context_tokens = out["stats"][0].tokens_seen
    assert context_tokens > 300
    # the context went through the model once, in 128-token blocks, then only question + answer tokens
    assert fed[: context_tokens // 128 + 1] == [128] * (context_tokens // 128) + [context_tokens % 128]
    assert sum(fed) < 2 * context_tokens
    assert max(fed) == 128
    assert len(out["answers"]) == 3 and all(isinstance(a, str) for a in out["answers"])
    assert all(stats.tokens_kept == 64 for stats in out["stats"])


def test_each_answer_is_as_if_asked_alone(pipe):
    together = pipe(CONTEXT, questions=QUESTIONS, budget=64, policy="tova+caote", max_new_tokens=5, return_stats=True)
    for index, question in enumerate(QUESTIONS):
        alone = pipe(CONTEXT, question=question, budget=64, policy="tova+caote", max_new_tokens=5, return_stats=True)
        assert alone["answer"] == together["answers"][index]
        assert alone["stats"][1] == together["stats"][index + 1]


def test_snapshot_restore_round_trip():
    model = tiny_model("llama")
    cache = EvictionCache(model, budget=32, policy="h2o+caote")
    with torch.no_grad():
        model(input_ids=random_ids(60), cache=cache, use_cache=True)
        snapshot = cache.snapshot()
        before = [
            (layer.keys.clone(), layer.positions.clone(), layer.history.clone(), layer.cumulative_length)
            for layer in cache.layers
        ]
        model(input_ids=random_ids(10, seed=1), cache=cache, use_cache=True)
        assert cache.get_seq_length() == 70
        cache.restore(snapshot)
        assert cache.get_seq_length() == 60
        for layer, (keys, positions, accumulated, length) in zip(cache.layers, before):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.positions, positions)
            assert torch.equal(layer.history, accumulated) and layer.cumulative_length == length
        # the restored state is a copy: running on does not touch the snapshot, which can be restored again
        logits_a = model(input_ids=random_ids(5, seed=2), cache=cache, use_cache=True).logits
        cache.restore(snapshot)
        logits_b = model(input_ids=random_ids(5, seed=2), cache=cache, use_cache=True).logits
    assert torch.equal(logits_a, logits_b)


def test_answer_prefix_and_no_chat(pipe):
    out = pipe(CONTEXT, question="Locker 5?", chat=False, answer_prefix=" Answer:", budget=64, max_new_tokens=3)
    assert set(out) == {"answer"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(question="a", questions=["b"]), "give either question or questions, not both"),
        (dict(questions=[]), "questions must be a non-empty list of strings"),
        (dict(questions="abc"), "questions must be a non-empty list of strings"),
        (dict(policy="tova+caot"), "unknown policy 'tova+caot'; did you mean 'tova+caote'?"),
        (dict(budget=0), "budget must be an integer >= 1, got 0"),
        (dict(block_size=-1), "block_size must be an integer >= 1, got -1"),
        (dict(windows=3), "unknown argument(s) windows for the caote-text-generation pipeline"),
    ],
)
def test_bad_arguments(pipe, kwargs, message):
    with pytest.raises(ValueError) as error:
        pipe(CONTEXT, **kwargs)
    assert str(error.value).startswith(message)


def test_empty_context(pipe):
    with pytest.raises(ValueError, match="^the context must be a non-empty string$"):
        pipe("   ", question="anything?")
