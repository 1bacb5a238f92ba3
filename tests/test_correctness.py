"""Every supported configuration evicts exactly what it claims; every other one is refused."""

import pytest
import torch
from conftest import greedy, random_ids, tiny_model

import caote.bases
import caote.recording
from caote import EvictionCache, policy_names
from caote.history import RecentRows
from caote.policies import parse_policy
from caote.settings import CacheSettings

BLOCK = 32


# -- 1. Mistral's sliding window ---------------------------------------------------------------------------------


def test_a_sliding_window_model_evicts_exactly_while_the_sequence_fits_in_its_window():
    windowed = tiny_model("mistral", sliding_window=200)
    unwindowed = tiny_model("mistral", sliding_window=None)
    ids = random_ids(150, seed=11)
    outputs, positions = [], []
    for model in (windowed, unwindowed):
        cache = EvictionCache(model, budget=48, policy="tova+caote", block_size=BLOCK)
        outputs.append(greedy(model, ids, cache, new_tokens=6))
        positions.append(cache.layers[0].kept_positions())
    # the window never bites: the same tokens and kept positions as without a window, no slot read as padding
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(positions[0], positions[1])
    assert (positions[0] >= 0).all() and (positions[0][..., :4] == torch.arange(4)).all()


@pytest.mark.parametrize("window,length", [(24, 100), (64, 100)])
def test_a_sequence_longer_than_the_sliding_window_is_refused_in_one_line(window, length):
    model = tiny_model("mistral", sliding_window=window)
    cache = EvictionCache(model, budget=48 if window > 48 else 16, policy="tova+caote", block_size=BLOCK)
    with pytest.raises(ValueError) as error:
        greedy(model, random_ids(length), cache, new_tokens=6)
    message = str(error.value)
    assert "\n" not in message
    assert f"sliding window of {window} tokens" in message
    assert f"budget {cache.budget}, block size {BLOCK}" in message


def test_the_full_policy_is_never_refused_for_a_sliding_window():
    model = tiny_model("mistral", sliding_window=24)
    cache = EvictionCache(model, budget=16, policy="full", block_size=BLOCK)
    assert greedy(model, random_ids(100), cache, new_tokens=6).shape[-1] == 106


# -- 2. attention backends -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention"])
def test_backends_other_than_sdpa_and_eager_are_refused_up_front(implementation):
    model = tiny_model("llama")
    model.config._attn_implementation = implementation
    with pytest.raises(ValueError, match=rf"^attention implementation '{implementation}' is not supported.*'sdpa'"):
        EvictionCache(model, budget=40)


def test_a_backend_switched_after_the_cache_was_built_is_refused_at_the_next_forward():
    model = tiny_model("llama")
    cache = EvictionCache(model, budget=40, policy="tova")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="is not supported by caote"):
        model(random_ids(10), cache=cache, use_cache=True)


# -- 3. padding takes no part in any score -------------------------------------------------------------------------

# `random` draws its numbers per batch, so a padded batch draws different numbers than a row alone: left out.
DETERMINISTIC = [name for name in policy_names() if name != "full" and not name.startswith("random")] + [
    "tova+caote/page8",
    "h2o/page16",
    "knorm/page8",
]


@pytest.fixture(scope="module")
def padded_runs():
    # float64: the padded row's scores are reduced over more slots than the row alone (padding contributes exact
    # zeros), which changes float32 rounding enough to flip near-ties; in float64 only a real leak changes them.
    model = tiny_model("llama").double()
    long_row, short_row = random_ids(160, seed=4), random_ids(96, seed=5)
    padded = torch.cat([torch.zeros(1, 2 * BLOCK, dtype=torch.long), short_row], dim=1)
    ids = torch.cat([long_row, padded])
    attention_mask = torch.ones_like(ids)
    attention_mask[1, : 2 * BLOCK] = 0
    return model, ids, attention_mask, short_row


@pytest.mark.parametrize("policy", DETERMINISTIC)
def test_a_row_left_padded_by_whole_blocks_keeps_what_it_keeps_alone(padded_runs, policy):
    model, ids, attention_mask, short_row = padded_runs
    batch_cache = EvictionCache(model, budget=48, policy=policy, block_size=BLOCK)
    batch = greedy(model, ids, batch_cache, attention_mask=attention_mask, new_tokens=6)
    alone_cache = EvictionCache(model, budget=48, policy=policy, block_size=BLOCK)
    alone = greedy(model, short_row, alone_cache, new_tokens=6)
    assert torch.equal(batch[1, -6:], alone[0, -6:])
    for batch_layer, alone_layer in zip(batch_cache.layers, alone_cache.layers):
        assert torch.equal(batch_layer.positions[1], alone_layer.positions[0])


# -- 4. / 5. the pipeline without a question, generate's attention_mask --------------------------------------------


def test_the_pipeline_continues_the_context_when_there_is_no_question(tokenizer):
    from transformers import pipeline

    import caote  # noqa: F401  (registers the pipeline)

    model = tiny_model("llama", vocab_size=len(tokenizer))
    pipe = pipeline("caote-text-generation", model=model, tokenizer=tokenizer)
    result = pipe("The grass is green and the sky is blue. " * 20, chat=False, budget=64, max_new_tokens=4)
    assert isinstance(result["answer"], str)


def test_generate_refuses_an_attention_mask_in_one_line(tokenizer):
    import caote

    model = tiny_model("llama", vocab_size=len(tokenizer))
    with pytest.raises(ValueError, match="^caote.generate sets 'attention_mask' itself; do not pass it$"):
        caote.generate(model, tokenizer, "hello", budget=32, attention_mask=torch.ones(1, 1))


# -- 8. TOVA as published: one decision per layer -------------------------------------------------------------------


def test_tova_layer_averages_the_newest_query_over_all_heads_and_evicts_the_same_tokens_everywhere():
    model = tiny_model("llama", num_key_value_heads=2)
    cache = EvictionCache(model, budget=40, policy="tova-layer", block_size=BLOCK)
    greedy(model, random_ids(120, seed=12), cache, new_tokens=6)
    for layer in cache.layers:
        assert torch.equal(layer.positions[:, 0], layer.positions[:, 1])
    # the score itself: mean over all query heads of the newest row, the same for every KV head
    generator = torch.Generator().manual_seed(0)
    rows = torch.softmax(torch.randn(1, 4, 1, 10, generator=generator), -1)
    keys = torch.zeros(1, 2, 10, 8)
    inputs = caote.bases.ScoreInputs(
        keys=keys,
        values=keys,
        positions=torch.arange(10).expand(1, 2, 10),
        real=torch.ones(1, 2, 10, dtype=bool),
        history=rows,
    )
    scores = parse_policy("tova-layer").scores(inputs)
    expected = rows[:, :, -1].mean(1, keepdim=True).expand(1, 2, 10)
    torch.testing.assert_close(scores, expected)


# -- 9. bf16: the backend does not change the kept set ------------------------------------------------------------


@pytest.mark.parametrize("policy", ["tova", "snapkv+caote", "h2o+fastcaote"])
def test_bf16_eager_and_sdpa_keep_the_same_tokens_given_the_same_inputs(policy):
    """Layer 0 sees identical queries and keys under both backends (its input is the embedding), so its kept set
    must not depend on the backend. (Later layers differ without eviction already: bf16 kernels round
    differently.)"""
    ids = random_ids(160, seed=13)
    kept = {}
    for implementation in ("sdpa", "eager"):
        model = tiny_model("llama", attn_implementation=implementation).to(torch.bfloat16)
        cache = EvictionCache(model, budget=40, policy=policy, block_size=BLOCK)
        with torch.no_grad():
            for start in range(0, 160, BLOCK):
                model(ids[:, start : start + BLOCK], cache=cache, use_cache=True)
        kept[implementation] = cache.layers[0].positions
    assert torch.equal(kept["sdpa"], kept["eager"])


# -- 10. / 12. the cache holds what it reports, nothing more -------------------------------------------------------


def held_tensors(cache):
    for layer in cache.layers:
        for name in ("keys", "values", "positions", "history"):
            tensor = getattr(layer, name)
            if isinstance(tensor, torch.Tensor):
                yield name, tensor


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("policy", ["tova+caote", "snapkv", "h2o"])
@pytest.mark.parametrize("length,budget,new_tokens", [(100, 40, 6), (60, 64, 1)])
def test_no_tensor_the_cache_holds_keeps_a_larger_storage_alive(implementation, policy, length, budget, new_tokens):
    """Also right after prompt blocks that do not evict (60 tokens, budget 64): no slice of a block's attention
    matrix may stay behind in the cache, nor in a snapshot of it."""
    model = tiny_model("llama", attn_implementation=implementation)
    cache = EvictionCache(model, budget=budget, policy=policy, block_size=BLOCK)
    greedy(model, random_ids(length, seed=14), cache, new_tokens=new_tokens)
    snapshot = cache.snapshot()
    # a decode step's stack may hold several layers' tensors as one storage (`EvictionLayer.stacked`): every storage
    # is no larger than the tensors the cache holds in it
    held: dict[int, list] = {}
    for name, tensor in held_tensors(cache):
        held.setdefault(tensor.untyped_storage().data_ptr(), []).append((name, tensor))
    for tensors in held.values():
        storage = tensors[0][1].untyped_storage().nbytes()
        assert storage <= sum(t.numel() * t.element_size() for _, t in tensors), [name for name, _ in tensors]
    # shared while tokens are in arrival order; a layer decoding in place writes its buffers, so they are copied
    assert (snapshot.layers[0].keys is cache.layers[0].keys) != cache.layers[0].in_place


def test_the_last_mask_is_not_kept_alive_and_reset_forgets_it():
    model = tiny_model("llama")
    cache = EvictionCache(model, budget=40, policy="tova", block_size=BLOCK)
    ids = torch.cat([random_ids(70, seed=15), torch.cat([torch.zeros(1, 6, dtype=torch.long), random_ids(64)], 1)])
    greedy(model, ids, cache, attention_mask=(ids != 0).long(), new_tokens=6)
    assert cache._shared.mask_seen is None or cache._shared.mask_seen[0]() is None
    cache.reset()
    assert cache._shared.mask_seen is None


def test_the_peak_is_tracked_with_a_running_total_not_a_sum_over_layers_per_call(monkeypatch):
    model = tiny_model("llama")
    cache = EvictionCache(model, budget=40, policy="tova", block_size=BLOCK)
    calls = []
    original = EvictionCache.kv_bytes
    monkeypatch.setattr(EvictionCache, "kv_bytes", lambda self: calls.append(1) or original(self))
    greedy(model, random_ids(100, seed=16), cache, new_tokens=6)
    assert calls == []
    stats = cache.stats()
    assert stats.kv_bytes == sum(tensor.nbytes for name, tensor in held_tensors(cache) if name in ("keys", "values"))
    # the peak is inside a prefill block: the layer being scored holds budget + block, the others budget
    per_token = stats.kv_bytes // (cache.layers[0].keys.shape[-2] * len(cache.layers))  # 41 slots decoding in place
    assert stats.peak_kv_bytes == per_token * (40 * len(cache.layers) + BLOCK)


# -- 14.4: a cache with room to spare does no scoring work --------------------------------------------------------


@pytest.mark.parametrize("policy,window", [("tova+caote", 1), ("snapkv+caote", 32), ("h2o", None)])
def test_attention_rows_are_computed_only_when_the_policy_will_read_them(monkeypatch, policy, window):
    model = tiny_model("llama")
    computed = []
    original = caote.recording.attention_probabilities

    def counting(module, queries, keys, *args):
        computed.append((queries.shape[-2], keys.shape[-2]))
        return original(module, queries, keys, *args)

    monkeypatch.setattr(caote.recording, "attention_probabilities", counting)
    budget = 200
    cache = EvictionCache(model, budget=budget, policy=policy, block_size=BLOCK)
    greedy(model, random_ids(100, seed=17), cache, new_tokens=40)  # 139 tokens at most: never near the budget
    if window is None:  # H2O's running sum needs every row of every step
        assert len(computed) == len(cache.layers) * (4 + 39)
    else:
        assert computed == []


@pytest.mark.parametrize("policy", ["tova+caote", "snapkv+caote", "snapkv"])
@pytest.mark.parametrize("interval", [1, 8])
def test_rows_resume_in_time_for_the_next_eviction_so_the_kept_set_is_unchanged(monkeypatch, policy, interval):
    """Skipping rows while far below the budget must keep exactly what recording every row keeps."""
    model = tiny_model("llama")
    ids = random_ids(70, seed=18)  # under budget - window after the prompt; decoding then crosses the budget
    kept = []
    for always in (False, True):
        if always:
            monkeypatch.setattr(RecentRows, "rows", lambda self, new, retained, budget: min(self.window, new))
        cache = EvictionCache(model, budget=96, policy=policy, block_size=BLOCK, decode_eviction_interval=interval)
        kept.append((greedy(model, ids, cache, new_tokens=60), [layer.positions for layer in cache.layers]))
    assert torch.equal(kept[0][0], kept[1][0])
    for first, second in zip(kept[0][1], kept[1][1]):
        assert torch.equal(first, second)


def test_the_settings_read_the_window_from_the_policy():
    assert CacheSettings(budget=100, policy="snapkv").recent == 32
    assert CacheSettings(budget=100, policy="h2o").recent == 50
    assert CacheSettings(budget=100, policy="h2o").replace(budget=200).recent == 100  # the share follows the budget


@pytest.mark.parametrize(
    "policy", ["streamingllm", "h2o", "tova", "h2o+caote", "snapkv", "snapkv+caote", "caote-ahead"]
)
@pytest.mark.parametrize("budget", [40, 44])
def test_a_left_padded_batch_evicting_every_few_decode_steps_keeps_what_each_row_keeps_alone(policy, budget):
    # each row's own tokens decide when it evicts, not the count of slots the batch's rows share: with an interval of
    # 3 the rows fall out of phase, and a row holding fewer tokens than the others holds masked slots meanwhile
    model = tiny_model("llama").double()
    long_row, short_row = random_ids(279, seed=4), random_ids(23, seed=5)
    ids = torch.cat([long_row, torch.cat([torch.zeros(1, 256, dtype=torch.long), short_row], dim=1)])
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :256] = 0
    settings = {"budget": budget, "policy": policy, "decode_eviction_interval": 3}
    batch_cache = EvictionCache(model, **settings)
    batch = greedy(model, ids, batch_cache, attention_mask=attention_mask, new_tokens=28, block_size=128)
    for row, alone_ids in enumerate((long_row, short_row)):
        alone_cache = EvictionCache(model, **settings)
        alone = greedy(model, alone_ids, alone_cache, new_tokens=28, block_size=128)
        assert torch.equal(batch[row, -28:], alone[0, -28:])
        for batch_layer, alone_layer in zip(batch_cache.layers, alone_cache.layers):
            for head, alone_head in zip(batch_layer.kept_positions()[row], alone_layer.kept_positions()[0]):
                assert torch.equal(head[head >= 0], alone_head)
            assert batch_layer.retained <= budget
