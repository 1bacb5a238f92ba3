"""One loaded model used by several threads at once: each thread's own `EvictionCache`, and plain forwards beside
them, give exactly what they give alone."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from conftest import greedy, random_ids
from transformers import DynamicCache

from caote import EvictionCache
from caote.attention import attention_modules
from caote.families import FAMILIES
from caote.generation import generate_ids
from caote.settings import CacheSettings
from caote.testing import tiny_model

ROUNDS = 20
BLOCK = 16
# one job per caching thread: its prompt and its cache's settings
CACHING = [
    (random_ids(70, seed=40), CacheSettings(budget=24, policy="tova+caote", block_size=BLOCK)),
    (random_ids(55, seed=41), CacheSettings(budget=20, policy="h2o+fastcaote", block_size=BLOCK)),
    (random_ids(64, seed=42), CacheSettings(budget=28, policy="caote-ahead", block_size=BLOCK)),
]
PLAIN_IDS = random_ids(60, seed=43)


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Each test thread computes on one core, so that the threads' forwards interleave."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cached_answer(model, job) -> list[int]:
    """The job's greedy answer under a fresh EvictionCache (what `caote.generate` runs), with the cache's stats."""
    ids, settings = job
    new_ids, stats = generate_ids(model, ids, settings, max_new_tokens=8, pad_token_id=0)
    return [new_ids, stats]


def plain_answer(model) -> list[torch.Tensor]:
    """A forward without a cache, and greedy decoding through a DynamicCache."""
    with torch.no_grad():
        logits = model(PLAIN_IDS).logits
    return [logits, greedy(model, PLAIN_IDS, DynamicCache(config=model.config), new_tokens=8)]


def assert_identical(got, expected) -> None:
    for value, reference in zip(got, expected, strict=True):
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(value, reference, rtol=0, atol=0)
        else:
            assert value == reference


def run_together(jobs) -> list[list]:
    """Run every job (a no-argument function) ``ROUNDS`` times in its own thread, all rounds started together; the
    results per job and round, or the first error any thread raised."""
    barrier = threading.Barrier(len(jobs))
    results = [[] for _ in jobs]
    errors = []

    def work(index, job):
        try:
            for _ in range(ROUNDS):
                barrier.wait()
                results[index].append(job())
        except BaseException as error:  # re-raised in the main thread below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=work, args=pair) for pair in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def model(backend):
    return tiny_model("llama", attn_implementation=backend)


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_each_with_its_own_cache_answer_as_they_do_alone(model, backend, threads):
    jobs = CACHING[:threads]
    solo = [cached_answer(model, job) for job in jobs]
    results = run_together([lambda job=job: cached_answer(model, job) for job in jobs])
    for expected, rounds in zip(solo, results, strict=True):
        for got in rounds:
            assert_identical(got, expected)
    assert model.config._attn_implementation == backend  # restored when the last cache closed


@pytest.mark.parametrize("threads", [2, 3])
def test_a_plain_forward_beside_caching_threads_is_bit_identical_to_its_solo_run(model, threads):
    jobs = CACHING[: threads - 1]
    solo = [cached_answer(model, job) for job in jobs] + [plain_answer(model)]
    results = run_together([lambda job=job: cached_answer(model, job) for job in jobs] + [lambda: plain_answer(model)])
    for expected, rounds in zip(solo, results, strict=True):
        for got in rounds:
            assert_identical(got, expected)


def test_the_dispatcher_lives_while_any_cache_of_the_model_does():
    model = tiny_model("llama", attn_implementation="eager")
    first = EvictionCache(model, budget=24)
    second = EvictionCache(model, budget=24)
    assert model.config._attn_implementation == "caote_eager"
    assert len(attention_modules(model)) == 2  # the dispatcher is accepted: it wraps eager
    first.close()
    assert model.config._attn_implementation == "caote_eager"
    del second
    gc.collect()
    assert model.config._attn_implementation == "eager"


def test_a_supported_backend_chosen_while_a_cache_lives_is_wrapped_at_the_next_forward():
    model = tiny_model("llama")
    with EvictionCache(model, budget=24, block_size=BLOCK) as first:
        reference = greedy(model, random_ids(70, seed=44), first)
    cache = EvictionCache(model, budget=24, block_size=BLOCK)
    model.config._attn_implementation = "sdpa"  # what the dispatcher wraps, set over it
    assert torch.equal(greedy(model, random_ids(70, seed=44), cache), reference)
    assert model.config._attn_implementation == "caote_sdpa"
    cache.close()
    assert model.config._attn_implementation == "sdpa"


FAMILY_BACKENDS = [(name, backend) for name, family in FAMILIES.items() for backend in family.backends]


@pytest.mark.parametrize("family,backend", FAMILY_BACKENDS)
def test_a_plain_forward_under_the_dispatcher_is_bit_identical_in_every_family(family, backend):
    model = tiny_model(family, attn_implementation=backend)
    solo = plain_answer(model)
    with EvictionCache(model, budget=24):
        assert model.config._attn_implementation == f"caote_{backend}"
        assert_identical(plain_answer(model), solo)
