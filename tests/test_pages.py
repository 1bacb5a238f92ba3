"""Page-granular eviction (``/page<size>``) and prefill, then compress (``prefill="compress"``).

Pages: every token carries its page's score, so a page goes as a whole; the layer still holds exactly its budget
(at most one page per KV head in part), exact against a full cache when nothing is evicted, in place as in arrival
order, padded rows as alone (tests/test_in_place.py and tests/test_correctness.py run the paged policies listed
there). Compress: the whole prompt in one forward, evicted once, then decoding bounded.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from conftest import greedy, load_script, random_ids
from transformers import DynamicCache

from caote.cache import EvictionCache
from caote.layer import EvictionLayer
from caote.pages import page_ids, page_scores
from caote.policies import parse_policy
from caote.settings import CacheSettings
from caote.testing import tiny_model

PAGED = ["tova+caote/page8", "h2o/page16", "snapkv+caote/page8", "learned+caote/page8", "keydiff/page8"]


def test_a_page_is_its_positions_divided_by_the_size_whatever_the_slot_order():
    positions = torch.tensor([[[9, 0, 1, 8, -1, 17, 16, -2]]])
    pages = page_ids(positions, 8)[0, 0].tolist()
    assert pages[1] == pages[2] and pages[0] == pages[3] and pages[5] == pages[6]  # {0, 1}, {8, 9}, {16, 17}
    assert len({pages[1], pages[0], pages[5], pages[4], pages[7]}) == 5  # padding and a free slot: pages of their own
    assert max(pages) < positions.shape[-1]  # dense


def test_a_page_carries_the_sum_of_its_evictable_tokens_scores_shifted_to_the_row_s_lowest():
    positions = torch.tensor([[[0, 1, 2, 3, 4, 5, 6, 7, -1]]])
    scores = torch.tensor([[[9.0, 2.0, 5.0, 0.5, 0.25, 1.25, -1.0, 3.0, float("-inf")]]])
    protected = torch.tensor([[[True, False, False, False, False, False, False, True, False]]])
    got = page_scores(scores, positions, 2, protected)[0, 0].tolist()
    # shifted by the lowest evictable score, -1: pages {1}, {2, 3}, {4, 5}, {6}; the sink, the window and padding alone
    assert got == [9.0, 3.0, 7.5, 7.5, 3.5, 3.5, 0.0, 3.0, float("-inf")]


def test_a_fuller_page_of_a_signed_base_ranks_no_lower_than_its_part():
    positions = torch.arange(4).view(1, 1, 4)
    scores = torch.tensor([[[-2.0, -2.0, -3.0, -5.0]]])  # keydiff-like: all negative
    got = page_scores(scores, positions, 2)[0, 0].tolist()
    assert got[0] > got[2]  # the page of the two better tokens ranks higher, not lower, for summing two


@pytest.mark.parametrize("policy", PAGED)
def test_a_paged_policy_whose_budget_holds_everything_decodes_as_a_full_cache(policy):
    model = tiny_model("llama")
    ids = random_ids(40, seed=3)
    expected = greedy(model, ids, DynamicCache(config=model.config), new_tokens=8)
    with EvictionCache(model, budget=64, policy=policy, block_size=16) as cache:
        assert torch.equal(greedy(model, ids, cache, new_tokens=8, block_size=16), expected)


def held_pages(layer: EvictionLayer, size: int, protected_from: int) -> list[dict[int, int]]:
    """Per KV head, how many tokens of each page it holds among positions from ``protected_from`` down to the sinks."""
    positions = layer.kept_positions()[0]
    return [
        {page: int(((row // size) == page).sum()) for page in set((row // size).tolist())}
        for row in (head[(head >= 4) & (head < protected_from)] for head in positions)
    ]


@pytest.mark.parametrize("new_tokens", [1, 30])
@pytest.mark.parametrize("prefill", ["blocks", "compress"])
@pytest.mark.parametrize("policy", ["tova+caote/page8", "h2o+caote/page16", "keydiff/page8"])
def test_whole_pages_go_and_each_layer_holds_exactly_its_budget(policy, prefill, new_tokens):
    model = tiny_model("llama", num_key_value_heads=2)
    size = parse_policy(policy).page
    ids = random_ids(150, seed=7)
    settings = CacheSettings(budget=60, policy=policy, block_size=16, prefill=prefill)
    with EvictionCache(model, settings) as cache:
        greedy(model, ids, cache, new_tokens=new_tokens, block_size=settings.prefill_chunk_size)
        for layer in cache.layers:
            assert layer.retained == 60
            newest = int(layer.kept_positions().max()) - settings.recent + 1
            for counts in held_pages(layer, size, newest - newest % size):  # pages wholly outside the window
                partial = [page for page, count in counts.items() if count < size and page * size >= 4]
                assert len(partial) <= 1, counts


def test_compress_reads_the_whole_prompt_once_and_keeps_what_one_block_of_the_whole_prompt_keeps(caplog):
    model = tiny_model("llama")
    ids = random_ids(100, seed=5)
    compress = CacheSettings(budget=48, policy="snapkv+caote/page8", block_size=32, prefill="compress")
    assert compress.prefill_chunk_size is None
    with caplog.at_level(logging.WARNING), EvictionCache(model, compress) as cache:
        got = greedy(model, ids, cache, new_tokens=6, block_size=compress.prefill_chunk_size)
        stats = cache.stats()
    assert not [record for record in caplog.records if "not bounded by the budget" in record.getMessage()]
    one_block = CacheSettings(budget=48, policy="snapkv+caote/page8", block_size=100)
    with EvictionCache(model, one_block) as cache:
        assert torch.equal(greedy(model, ids, cache, new_tokens=6, block_size=100), got)
    layers = model.config.num_hidden_layers
    per_token = stats.full_kv_bytes // stats.tokens_seen // layers  # bytes of one token in one layer
    assert stats.tokens_kept == 48
    assert stats.peak_kv_bytes == per_token * (100 + 48 * (layers - 1))  # one layer whole, the others at the budget


def test_generate_and_the_pipeline_take_the_prefill_mode(tokenizer):
    from transformers import pipeline

    import caote

    model = tiny_model("llama", vocab_size=len(tokenizer))
    text = "The grass is green and the sky is blue. " * 30
    peaks = {}
    pipe = pipeline("caote-text-generation", model=model, tokenizer=tokenizer)
    for prefill in ("blocks", "compress"):
        result = caote.generate(model, tokenizer, text, budget=40, prefill=prefill, max_new_tokens=4, return_stats=True)
        output = pipe(text, chat=False, budget=40, prefill=prefill, max_new_tokens=4, return_stats=True)
        assert result.stats.tokens_kept == output["stats"][0].tokens_kept == 40
        peaks[prefill] = (result.stats.peak_kv_bytes, output["stats"][0].peak_kv_bytes)
    assert all(whole > blocks for whole, blocks in zip(peaks["compress"], peaks["blocks"]))  # the prompt, read whole


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"policy": "tova/page0"}, "page size must be an integer >= 1, got 0"),
        ({"policy": "tova+caote/page600"}, "page size 600 of policy 'tova\\+caote/page600' is larger than the 507"),
        ({"policy": "streamingllm/page8"}, "keeps the newest tokens"),
        ({"policy": "full/page8"}, "keeps every token"),
        ({"policy": "tova/page8-max"}, "'/page<size>' takes a whole number of positions"),
        ({"policy": "tova+caote/page8/mean"}, "'/page<size>' comes last"),
        ({"prefill": "whole"}, "prefill must be one of blocks, compress, got 'whole'"),
    ],
)
def test_bad_pages_and_prefill_modes_are_refused_in_one_line(values, message):
    with pytest.raises(ValueError, match=message):
        CacheSettings(budget=512, **values)


@pytest.mark.parametrize(
    "arguments",
    [
        ["generate", "hello", "--policy", "tova/page0"],
        ["generate", "hello", "--policy", "h2o/page300", "--budget", "256"],
        ["generate", "hello", "--prefill", "all"],
        ["eval", "passkey", "--policies", "auto", "--budgets", "5", "--prefill", "compress"],
        ["eval", "perplexity", "--prefill", "compress"],
    ],
)
def test_the_command_line_refuses_them_with_exit_code_2(arguments, capsys):
    """Before any model loads (the bundled model is not needed for a refusal)."""
    from caote.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_the_retrieval_page_s_table_is_generated_from_the_committed_runs():
    page = (Path(__file__).resolve().parents[1] / "docs" / "results" / "retrieval.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- retrieval:start -->\n(.*?)\n<!-- retrieval:end -->", page, re.S)
    assert match, "docs/results/retrieval.md lacks the <!-- retrieval:start --> ... <!-- retrieval:end --> block"
    assert match.group(1) == load_script("retrieval_table").table(), (
        "stale: paste `python benchmarks/retrieval_table.py`"
    )
