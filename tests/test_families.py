"""Every supported family, each a tiny random model built from its config class: the core guarantees hold.

The README's family table is generated from the same matrix (`caote.families.FAMILIES`).
"""

import re
from pathlib import Path

import pytest
import torch
from conftest import greedy, prompt_then_step, random_ids
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from caote import EvictionCache
from caote.cache import EvictionLayer
from caote.families import FAMILIES, SUPPORTED_MODEL_TYPES, family_table
from caote.testing import tiny_model

BLOCK = 32
POLICIES = ["tova+caote", "snapkv+caote", "h2o+fastcaote", "h2o+caote/page8"]
ROOT = Path(__file__).resolve().parent.parent

CASES = [(name, backend) for name, family in FAMILIES.items() for backend in family.backends]


@pytest.mark.parametrize("family,backend", CASES)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_budget_above_everything_reproduces_a_dynamic_cache(family, backend, policy):
    model = tiny_model(family, attn_implementation=backend)
    ids = random_ids(100, seed=20)
    expected = greedy(model, ids, DynamicCache(config=model.config), new_tokens=8)
    assert torch.equal(
        greedy(model, ids, EvictionCache(model, budget=400, policy=policy, block_size=BLOCK), new_tokens=8), expected
    )


@pytest.mark.parametrize("family,backend", CASES)
# learned: RoPE undone in every family; a paged policy: whole pages, the budget exact
@pytest.mark.parametrize("policy", ["snapkv+caote", "learned+caote", "tova+caote/page16"])
def test_every_full_attention_layer_holds_at_most_budget_after_every_forward(family, backend, policy):
    model = tiny_model(family, attn_implementation=backend)
    budget = 48
    cache = EvictionCache(model, budget=budget, policy=policy, block_size=BLOCK)
    seen = []

    def probe(module, args, output):
        for layer in cache.layers:
            held = layer.keys.shape[-2]
            if isinstance(layer, EvictionLayer):  # decoding in place allocates one slot more, once
                assert layer.retained <= budget and held <= budget + 1
            else:  # a sliding-window layer of a hybrid model keeps its own bound
                assert isinstance(layer, DynamicSlidingWindowLayer) and held <= layer.sliding_window
        seen.append(cache.layers[-1].get_seq_length())

    handle = model.register_forward_hook(probe)
    try:
        out = greedy(model, random_ids(150, seed=21), cache, new_tokens=8)
    finally:
        handle.remove()
    assert out.shape[-1] == 158 and len(seen) == 5 + 7
    stats = cache.stats()
    assert (stats.tokens_seen, stats.tokens_kept) == (157, budget)
    assert stats.kv_bytes == sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_row_left_padded_by_whole_blocks_equals_the_row_alone(family):
    backend = FAMILIES[family].backends[0]
    model = tiny_model(family, attn_implementation=backend).double()  # float64: see test_correctness
    long_row, short_row = random_ids(128, seed=22), random_ids(64, seed=23)
    ids = torch.cat([long_row, torch.cat([torch.zeros(1, 2 * BLOCK, dtype=torch.long), short_row], dim=1)])
    attention_mask = torch.ones_like(ids)
    attention_mask[1, : 2 * BLOCK] = 0
    reference_batch = greedy(model, ids, DynamicCache(config=model.config), 6, attention_mask)
    reference_alone = greedy(model, short_row, DynamicCache(config=model.config), 6)
    if not torch.equal(reference_batch[1, -6:], reference_alone[0, -6:]):
        pytest.skip(f"transformers' own DynamicCache gives the padded {family} row other tokens than the row alone")
    batch = greedy(
        model, ids, EvictionCache(model, budget=48, policy="snapkv+caote", block_size=BLOCK), 6, attention_mask
    )
    alone = greedy(model, short_row, EvictionCache(model, budget=48, policy="snapkv+caote", block_size=BLOCK), 6)
    assert torch.equal(batch[1, -6:], alone[0, -6:])


@pytest.mark.parametrize("family", [name for name, family in FAMILIES.items() if len(family.backends) == 2])
def test_sdpa_and_eager_keep_the_same_tokens(family):
    ids = random_ids(130, seed=24)
    runs = {}
    for backend in ("sdpa", "eager"):
        model = tiny_model(family, attn_implementation=backend)
        cache = EvictionCache(model, budget=48, policy="tova+caote", block_size=BLOCK)
        runs[backend] = (
            greedy(model, ids, cache, new_tokens=8),
            [layer.positions for layer in cache.layers if hasattr(layer, "positions")],
        )
    assert torch.equal(runs["sdpa"][0], runs["eager"][0])
    for sdpa_positions, eager_positions in zip(runs["sdpa"][1], runs["eager"][1]):
        assert torch.equal(sdpa_positions, eager_positions)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_half_precision_models_run_end_to_end_within_budget(family, dtype):
    model = tiny_model(family, attn_implementation=FAMILIES[family].backends[0]).to(dtype)
    cache = EvictionCache(model, budget=48, policy="snapkv+caote", block_size=BLOCK)
    out = greedy(model, random_ids(120, seed=25), cache, new_tokens=8)
    assert out.shape[-1] == 128
    layer = next(layer for layer in cache.layers if isinstance(layer, EvictionLayer))
    assert layer.keys.dtype == dtype and layer.retained == 48
    assert layer.history.dtype == torch.float32  # the scores' probabilities stay float32


def test_a_model_without_an_eviction_cache_runs_as_before_and_the_cache_leaves_it_as_it_found_it():
    model = tiny_model("gemma3_text")
    ids = random_ids(60, seed=26)
    with torch.no_grad():
        before = model(ids).logits
    with EvictionCache(model, budget=40, policy="tova+caote", block_size=BLOCK) as cache:
        greedy(model, ids, cache, new_tokens=8)
        assert model.config._attn_implementation == "caote_sdpa"  # caote's dispatcher over sdpa while the cache lives
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
    assert model.config._attn_implementation == "sdpa"
    assert not model._forward_hooks and not model.get_decoder()._forward_pre_hooks


def test_the_supported_list_is_the_tested_matrix():
    assert SUPPORTED_MODEL_TYPES == tuple(FAMILIES)


def test_readme_family_table_matches_the_test_matrix():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- families:start -->\n(.*?)\n<!-- families:end -->", readme, re.S)
    assert match, "README.md lacks the <!-- families:start --> ... <!-- families:end --> block"
    assert match.group(1).strip() == family_table(), (
        "README family table is stale: paste `python -c 'from caote.families import family_table; "
        "print(family_table())'` between the markers"
    )


@pytest.mark.parametrize("family,backend", CASES)
@pytest.mark.parametrize("policy", ["tova+caote", "h2o+caote"])
def test_a_scored_decode_step_attends_once_with_the_family_s_own_numbers(family, backend, policy, monkeypatch):
    """A decode step in place computes each evicting layer's attention once (`decode_attention`: no model kernel,
    no second pass for the row), and it equals the family's eager attention over the slots, output and row."""
    import caote.attention
    import caote.recording

    fused, second_passes = [], []
    own = caote.attention.decode_attention

    def checked(module, query, slots, kwargs):
        output, rows, weighted = own(module, query, slots, kwargs)
        assert weighted is None or weighted is output  # passed on only where it is the group's own bmm
        call = {**kwargs, "dropout": 0.0}
        eager = caote.attention.family_eager_attention(module)
        want_output, want_rows = eager(module, query, slots.keys, slots.values, None, **call)
        torch.testing.assert_close(output, want_output, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rows, want_rows, rtol=1e-5, atol=1e-7)
        fused.append(module.layer_idx)
        return output, rows, weighted

    def counted(*args, **kwargs):
        second_passes.append(args[0].layer_idx)
        return caote.attention.attention_probabilities(*args, **kwargs)

    model = tiny_model(family, attn_implementation=backend)
    cache = EvictionCache(model, budget=40, policy=policy, block_size=BLOCK)
    ids = random_ids(2 * BLOCK, seed=23)
    with cache, torch.no_grad():
        out = prompt_then_step(model, cache, ids, BLOCK)
        monkeypatch.setattr(caote.attention, "decode_attention", checked)
        monkeypatch.setattr(caote.recording, "attention_probabilities", counted)
        for _ in range(3):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    evicting = [index for index, layer in enumerate(cache.layers) if isinstance(layer, EvictionLayer)]
    assert sorted(fused) == sorted(evicting * 3) and second_passes == []
