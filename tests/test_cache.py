"""EvictionCache inside stock `model.generate` on tiny random models."""

import gc

import pytest
import torch
from conftest import greedy, random_ids, tiny_model
from transformers import DynamicCache

from caote import EvictionCache, policy_names
from caote.cache import EvictionLayer

EVICTING = [name for name in policy_names() if name != "full"]
BLOCK = 32


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("policy", policy_names())
def test_a_budget_above_everything_reproduces_a_dynamic_cache(family, policy, request):
    model = request.getfixturevalue(family)
    ids = random_ids(150)
    expected = greedy(model, ids, DynamicCache(config=model.config))
    with torch.no_grad(), pytest.warns(FutureWarning):  # the 4.x spelling `past_key_values=` works too
        got = model.generate(
            ids,
            past_key_values=EvictionCache(model, budget=400, policy=policy, block_size=BLOCK),
            prefill_chunk_size=BLOCK,
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
        )
    assert torch.equal(got, expected)


class BudgetProbe:
    """A model forward hook that checks every layer after every forward step (prefill blocks included)."""

    def __init__(self, model, cache, budget):
        self.cache, self.budget, self.steps = cache, budget, 0
        self.handle = model.register_forward_hook(self)

    def __call__(self, module, args, output):
        lengths = {layer.retained for layer in self.cache.layers}
        assert len(lengths) == 1, f"layers disagree on the retained count: {lengths}"
        assert lengths.pop() <= self.budget
        # decoding in place allocates one slot more than the budget (the decode step's peak), once
        assert all(layer.keys.shape[-2] <= self.budget + 1 for layer in self.cache.layers)
        assert {layer.get_seq_length() for layer in self.cache.layers} == {self.cache.layers[0].cumulative_length}
        self.steps += 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("policy", EVICTING)
def test_every_layer_holds_at_most_budget_after_every_step(family, policy, request):
    model = request.getfixturevalue(family)
    ids = random_ids(200, seed=1)
    budget = 48
    cache = EvictionCache(model, budget=budget, policy=policy, block_size=BLOCK)
    probe = BudgetProbe(model, cache, budget)
    try:
        out = greedy(model, ids, cache, new_tokens=10)
    finally:
        probe.handle.remove()
    assert probe.steps == 7 + 9  # 200 tokens in 32-token blocks, then 9 decode forwards for 10 new tokens
    assert out.shape[1] == 210
    stats = cache.stats()
    assert (stats.tokens_seen, stats.tokens_kept) == (209, budget)
    positions = cache.layers[0].kept_positions()  # in arrival order (decode slots are sorted by position)
    assert positions.shape == (1, model.config.num_key_value_heads, budget)
    assert (positions.diff(dim=-1) > 0).all(), "every retained position is held once"
    assert (positions[..., -1] == 208).all(), "the newest token is always scored in"


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_other_supported_families_run(family):
    model = tiny_model(family)
    cache = EvictionCache(model, budget=40, policy="snapkv+caote", block_size=BLOCK)
    out = greedy(model, random_ids(100), cache, new_tokens=5)
    assert out.shape[1] == 105 and cache.layers[0].retained == 40


def test_positions_survive_eviction(llama):
    """A recency policy's block-wise prefill equals one full forward whose mask hides exactly the evicted tokens."""
    model = tiny_model("llama", attn_implementation="eager")
    length, budget, sinks = 160, 40, 4
    ids = random_ids(length, seed=2)
    cache = EvictionCache(model, budget=budget, policy="streamingllm", block_size=BLOCK, sink_tokens=sinks)

    def retained_at(block_start):
        if block_start <= budget:
            return list(range(block_start))
        return list(range(sinks)) + list(range(block_start - (budget - sinks), block_start))

    blocks = []
    with torch.no_grad():
        for start in range(0, length, BLOCK):
            retained_before = cache.layers[0].positions
            blocks.append(model(ids[:, start : start + BLOCK], cache=cache, use_cache=True).logits)
            if retained_before is not None:
                assert retained_before[0, 0].tolist() == retained_at(start)
        visible = torch.zeros(length, length, dtype=torch.bool)
        for query in range(length):
            block_start = query - query % BLOCK
            for key in retained_at(block_start) + list(range(block_start, query + 1)):
                visible[query, key] = True
        mask = torch.zeros(1, 1, length, length).masked_fill(~visible, torch.finfo(torch.float32).min)
        full = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(torch.cat(blocks, dim=1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", ["h2o", "tova+caote", "snapkv+fastcaote", "h2o+caote", "keydiff+caote"])
def test_sdpa_and_eager_keep_the_same_tokens(policy):
    ids = random_ids(180, seed=3)
    runs = {}
    for implementation in ("sdpa", "eager"):
        model = tiny_model("llama", attn_implementation=implementation)
        cache = EvictionCache(model, budget=50, policy=policy, block_size=BLOCK)
        runs[implementation] = (greedy(model, ids, cache, new_tokens=8), [layer.positions for layer in cache.layers])
    assert torch.equal(runs["sdpa"][0], runs["eager"][0])
    for sdpa_positions, eager_positions in zip(runs["sdpa"][1], runs["eager"][1]):
        assert torch.equal(sdpa_positions, eager_positions)


def test_left_padded_batch_matches_each_row_alone(llama):
    """Row 2 is left-padded by exactly one block, so its block boundaries match a run on it alone."""
    long_row, short_row = random_ids(160, seed=4), random_ids(128, seed=5)
    padded = torch.cat([torch.zeros(1, BLOCK, dtype=torch.long), short_row], dim=1)
    ids = torch.cat([long_row, padded])
    attention_mask = (ids != 0).long()
    attention_mask[0] = 1
    for policy in ("h2o+caote", "snapkv+fastcaote", "streamingllm"):
        batch = greedy(
            llama,
            ids,
            EvictionCache(llama, budget=48, policy=policy, block_size=BLOCK),
            attention_mask=attention_mask,
            new_tokens=6,
        )
        for row, alone_ids in enumerate((long_row, short_row)):
            alone = greedy(
                llama, alone_ids, EvictionCache(llama, budget=48, policy=policy, block_size=BLOCK), new_tokens=6
            )
            assert torch.equal(batch[row, -6:], alone[0, -6:]), (policy, row)


def test_left_padding_with_a_large_budget_matches_dynamic_cache(llama):
    ids = torch.cat(
        [random_ids(90, seed=6), torch.cat([torch.zeros(1, 37, dtype=torch.long), random_ids(53, seed=7)], 1)]
    )
    attention_mask = (ids != 0).long()
    expected = greedy(llama, ids, DynamicCache(config=llama.config), attention_mask=attention_mask)
    got = greedy(
        llama,
        ids,
        EvictionCache(llama, budget=500, policy="tova+caote", block_size=BLOCK),
        attention_mask=attention_mask,
    )
    assert torch.equal(got, expected)


def test_padding_is_evicted_before_any_real_token(llama):
    ids = torch.cat(
        [random_ids(100, seed=8), torch.cat([torch.zeros(1, 40, dtype=torch.long), random_ids(60, seed=9)], 1)]
    )
    cache = EvictionCache(llama, budget=50, policy="tova", block_size=BLOCK)
    greedy(llama, ids, cache, attention_mask=(ids != 0).long(), new_tokens=3)
    assert (cache.layers[0].kept_positions() >= 0).all()


@pytest.mark.parametrize("policy", ["streamingllm", "tova+caote"])
def test_padding_recorded_earlier_still_goes_first_when_a_later_forward_has_no_mask(llama, policy):
    """A manual loop: a left-padded prompt with its mask, then decode steps without one. The layer remembers that it
    holds padding, so padding still goes before any real token (and never counts as a sink)."""
    ids = torch.cat([torch.zeros(1, 8, dtype=torch.long), random_ids(40, seed=11)], 1)
    cache = EvictionCache(llama, budget=44, policy=policy, block_size=64)
    with torch.no_grad():
        llama(input_ids=ids, attention_mask=(ids != 0).long(), cache=cache, use_cache=True)
        assert int((cache.layers[0].positions < 0).sum(-1).max()) == 4  # 48 slots cut to 44: 4 padding went
        for _ in range(6):  # each step evicts one: the 4 padding slots left, then 2 real tokens
            llama(input_ids=ids[:, -1:], cache=cache, use_cache=True)
    assert (cache.layers[0].kept_positions() >= 0).all()


def test_a_cache_is_not_silently_reused_across_generate_calls(llama):
    cache = EvictionCache(llama, budget=40, policy="h2o+caote", block_size=BLOCK)
    first = greedy(llama, random_ids(90), cache)
    with pytest.raises(ValueError, match="already holds 101 tokens .* call cache.reset"):
        greedy(llama, random_ids(90), cache)
    cache.reset()
    assert cache.get_seq_length() == 0
    assert torch.equal(greedy(llama, random_ids(90), cache), first)


def test_two_caches_on_one_model_evict_independently(llama):
    """A full-cache reference run in lockstep with an evicting one: each forward touches only its own cache."""
    ids = random_ids(130, seed=10)
    reference = DynamicCache(config=llama.config)
    full = EvictionCache(llama, budget=10_000, policy="full", block_size=BLOCK)
    evicting = EvictionCache(llama, budget=40, policy="snapkv+caote", block_size=BLOCK)
    with torch.no_grad():
        for start in range(0, 130, BLOCK):
            block = ids[:, start : start + BLOCK]
            expected = llama(block, cache=reference, use_cache=True).logits
            torch.testing.assert_close(llama(block, cache=full, use_cache=True).logits, expected)
            llama(block, cache=evicting, use_cache=True)
    assert full.layers[0].keys.shape[-2] == 130 and evicting.layers[0].keys.shape[-2] == 40


def test_beam_search_is_refused_with_a_clear_message(llama):
    cache = EvictionCache(llama, budget=40, policy="tova", block_size=BLOCK)
    with pytest.raises(ValueError, match="beam search"):
        greedy(llama, random_ids(60), cache, num_beams=2)


def test_layers_are_eviction_layers_and_report_cumulative_mask_sizes(llama):
    cache = EvictionCache(llama, budget=40, policy="tova", block_size=BLOCK)
    greedy(llama, random_ids(100), cache, new_tokens=1)
    layer = cache.layers[1]
    assert isinstance(layer, EvictionLayer)
    assert layer.get_seq_length() == 100
    assert layer.get_mask_sizes(1) == (41, 60)


def test_a_model_without_this_caches_hooks_is_caught_at_its_first_forward(llama):
    other = tiny_model("llama", seed=1)
    EvictionCache(other, budget=40, policy="tova", block_size=BLOCK)  # hooks of another cache do not count
    cache = EvictionCache(llama, budget=40, policy="tova", block_size=BLOCK)
    with pytest.raises(ValueError, match="build a new one for each model"):
        other(random_ids(20), cache=cache, use_cache=True)


def hook_count(model) -> int:
    return sum(len(module._forward_hooks) + len(module._forward_pre_hooks) for module in model.modules())


def test_close_and_garbage_collection_take_the_hooks_off_the_model():
    model = tiny_model("llama")
    before = hook_count(model)
    with EvictionCache(model, budget=40, policy="tova", block_size=BLOCK) as cache:
        assert hook_count(model) == before + 2  # a pre- and a post-forward hook on the decoder
        greedy(model, random_ids(60), cache, new_tokens=2)
    assert hook_count(model) == before
    with pytest.raises(ValueError, match="was closed"):
        model(random_ids(4), cache=cache, use_cache=True)
    EvictionCache(model, budget=40, policy="tova", block_size=BLOCK)  # dropped at once
    gc.collect()
    assert hook_count(model) == before
    assert not any(name.startswith("_caote") for module in model.modules() for name in vars(module))


def test_a_decode_eviction_interval_evicts_k_tokens_every_k_steps_within_budget(llama):
    budget, interval = 48, 4
    cache = EvictionCache(
        llama, budget=budget, policy="tova+caote", block_size=BLOCK, decode_eviction_interval=interval
    )
    sizes = []
    handle = llama.register_forward_hook(lambda *_: sizes.append(cache.layers[0].retained))
    try:
        greedy(llama, random_ids(128), cache, new_tokens=13)
    finally:
        handle.remove()
    # 4 prefill blocks (the last evicts to the budget), then decode steps: 48 -> 45 on overflow, grow back to 48, ...
    assert sizes == [32, 48, 48, 48] + [45, 46, 47, 48] * 3
    with pytest.raises(ValueError, match="decode_eviction_interval 45 is too large for budget 48"):
        EvictionCache(llama, budget=48, policy="tova", decode_eviction_interval=45)


def test_a_forward_larger_than_the_block_warns_once(llama, caplog):
    cache = EvictionCache(llama, budget=40, policy="tova", block_size=BLOCK)
    with caplog.at_level("WARNING", logger="caote.cache"), torch.no_grad():
        llama(random_ids(100), cache=cache, use_cache=True)
    warnings = [record for record in caplog.records if "not bounded by the budget" in record.getMessage()]
    assert len(warnings) == 1 and "prefill_chunk_size=32" in warnings[0].getMessage()
    assert cache.layers[0].keys.shape[-2] == 40
