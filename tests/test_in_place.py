"""Decoding in place: after the prompt, each evicting layer writes decoded tokens into fixed buffers of budget + 1
slots, and an eviction only frees slots. Checked against the arrival-order path (the same cache with in-place
decoding turned off): the same tokens kept and the same logits, for every policy, both backends, padding and
decode intervals; and the edges (no new allocation, snapshots, a new prompt turn, freezing, the memory bound)."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_compiler, prompt_then_step, random_ids, tiny_model

from caote.cache import EvictionCache
from caote.layer import EvictionLayer
from caote.policies import Policy, policy_names
from caote.positions import FREE
from caote.slots import SlotBuffer
from caote.stacking import evict_together, stack
from caote.strategies import Immediate

BUDGET, BLOCK = 40, 16
# every policy, and paged ones (`caote.pages`): whole pages ranked alike in place and in arrival order
CAUSAL = [name for name in policy_names() if name != "full"] + [
    "tova+caote/page8",
    "snapkv+caote/page4",
    "keydiff/page8",
    "h2o/page16",
]


def decode(model, cache, ids, steps, attention_mask=None):
    """Feed ``ids`` in blocks, then ``steps`` greedy one-token forwards; the logits of every decode step."""
    logits, mask = [], attention_mask
    with torch.no_grad():
        for start in range(0, ids.shape[1], BLOCK):
            part = None if mask is None else mask[:, : start + BLOCK]
            out = model(input_ids=ids[:, start : start + BLOCK], attention_mask=part, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            out = model(input_ids=token, attention_mask=mask, cache=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            token = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1) if logits else out.logits


def arrival_order(cache: EvictionCache) -> EvictionCache:
    """``cache`` with in-place decoding turned off: today's cat-and-gather path, the reference."""
    cache._slots_allowed = False
    cache._set_in_place(False)
    return cache


def kept(cache: EvictionCache) -> list[torch.Tensor]:
    return [layer.kept_positions().sort(-1).values for layer in cache.layers if isinstance(layer, EvictionLayer)]


@pytest.mark.parametrize("policy", CAUSAL)
def test_every_policy_keeps_what_the_arrival_order_path_keeps(policy):
    if policy.startswith("knorm"):
        pytest.skip("ties exactly on repeated tokens, which now go to the older one: see test_kept_positions")
    model = tiny_model("llama")
    ids = random_ids(3 * BLOCK + 5, seed=4)
    with EvictionCache(model, budget=BUDGET, policy=policy, block_size=BLOCK) as slots:
        got = decode(model, slots, ids, 12)
        # look-ahead (caote-ahead) truncates its draft from the arrival-order slots: it keeps that path
        assert all(layer.in_place == (policy != "caote-ahead") for layer in slots.layers)
    with arrival_order(EvictionCache(model, budget=BUDGET, policy=policy, block_size=BLOCK)) as reference:
        want = decode(model, reference, ids, 12)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(kept(slots), kept(reference)))


@pytest.mark.parametrize("interval", [1, 3])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("policy", ["tova+caote", "h2o+caote", "snapkv+fastcaote", "streamingllm", "caote-window"])
def test_padding_backends_and_intervals_match_the_arrival_order_path(policy, attention, interval):
    model = tiny_model("qwen3", attn_implementation=attention)
    ids = random_ids(3 * BLOCK, batch=2, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :12] = 0  # the second row is left-padded: 4 padding slots outlive the prefill
    settings = dict(budget=BUDGET, policy=policy, block_size=BLOCK, decode_eviction_interval=interval)
    with EvictionCache(model, **settings) as slots:
        got = decode(model, slots, ids, 9, attention_mask=mask)
    with arrival_order(EvictionCache(model, **settings)) as reference:
        want = decode(model, reference, ids, 9, attention_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(kept(slots), kept(reference)))


def test_fifty_decode_steps_allocate_no_new_keys_values_or_positions():
    model = tiny_model("llama")
    cache = EvictionCache(model, budget=BUDGET, policy="tova+caote", block_size=BLOCK)
    ids = random_ids(3 * BLOCK, seed=6)
    with cache, torch.no_grad():
        out = prompt_then_step(model, cache, ids, BLOCK)

        def held(layer):
            return layer.keys, layer.values, layer.positions, layer.slots.value_norms, layer.slots.normed

        pointers = [[tensor.data_ptr() for tensor in held(layer)] for layer in cache.layers]
        shapes = [[tensor.shape for tensor in held(layer)] for layer in cache.layers]
        for _ in range(50):
            token = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=token, cache=cache, use_cache=True)
            assert [[t.data_ptr() for t in held(layer)] for layer in cache.layers] == pointers
            assert [[t.shape for t in held(layer)] for layer in cache.layers] == shapes
        assert all(layer.retained == BUDGET and layer.keys.shape[-2] == BUDGET + 1 for layer in cache.layers)
        assert cache.stats().tokens_seen == ids.shape[1] + 51


def test_a_snapshot_taken_while_decoding_in_place_is_not_overwritten():
    model = tiny_model("llama")
    cache = EvictionCache(model, budget=BUDGET, policy="h2o+caote", block_size=BLOCK)
    ids = random_ids(3 * BLOCK, seed=7)
    with cache:
        decode(model, cache, ids, 4)
        snapshot = cache.snapshot()
        first = decode_steps(model, cache, 6)
        cache.restore(snapshot)
        assert decode_steps(model, cache, 6) == first
        cache.restore(snapshot)
        assert decode_steps(model, cache, 6) == first


@pytest.mark.parametrize("policy", ["h2o+caote", "snapkv+fastcaote", "streamingllm"])
def test_each_slot_s_value_norm_is_taken_once_for_its_token_and_is_its_value_s_norm(policy, monkeypatch):
    """The bounds of `bounds.lowest_errors` read each slot's value norm from the layer: at a decode step only the
    newly written slots' norms are taken (one per layer, batch row and KV head), every real slot's equals the norm
    of the value it holds, a snapshot keeps its own, and a policy without a value-aware transform keeps none."""
    model = tiny_model("llama")
    ids = random_ids(3 * BLOCK, batch=2, seed=9)
    taken = []
    norms = SlotBuffer.norms

    def counted(slots, values, positions):
        if slots.value_norms is not None:
            taken.append(int((slots.normed != positions).sum()))
        return norms(slots, values, positions)

    monkeypatch.setattr(SlotBuffer, "norms", counted)
    with EvictionCache(model, budget=BUDGET, policy=policy, block_size=BLOCK) as cache:
        decode(model, cache, ids, 3)
        layers = [layer for layer in cache.layers if isinstance(layer, EvictionLayer)]
        if not cache.settings.policy.value_aware:
            assert not taken and all(layer.slots.value_norms is None for layer in layers)
            return
        snapshot = cache.snapshot()
        for _ in range(4):
            taken.clear()
            with torch.no_grad():
                model(input_ids=torch.full((2, 1), 5), cache=cache, use_cache=True)
            assert sum(taken) == len(layers) * 2 * layers[0].keys.shape[1]
            for layer in layers:
                real = layer.positions >= 0
                assert torch.equal(layer.slots.normed[real], layer.positions[real])
                want = torch.linalg.vector_norm(layer.values.float(), dim=-1)
                torch.testing.assert_close(layer.slots.value_norms[real], want[real], rtol=1e-6, atol=0)
        for mine, live in zip(snapshot.layers, layers):
            assert mine.slots.value_norms.data_ptr() != live.slots.value_norms.data_ptr()


def decode_steps(model, cache, steps, token=5) -> list[int]:
    tokens = []
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
    return tokens


def test_a_new_prompt_turn_after_decoding_returns_to_the_block_path():
    model = tiny_model("llama")
    ids = random_ids(3 * BLOCK, seed=8)
    turn = random_ids(BLOCK, seed=9)
    results = []
    for in_place in (True, False):
        cache = EvictionCache(model, budget=BUDGET, policy="tova+caote", block_size=BLOCK)
        if not in_place:
            arrival_order(cache)
        with cache, torch.no_grad():
            decode(model, cache, ids, 5)
            assert all(layer.in_place == in_place for layer in cache.layers)
            logits = model(input_ids=turn, cache=cache, use_cache=True).logits
            assert not any(layer.in_place for layer in cache.layers)
            assert all(layer.retained == BUDGET for layer in cache.layers)
            results.append((logits, kept(cache), decode_steps(model, cache, 5)))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    assert results[0][2] == results[1][2]


def test_freezing_while_decoding_in_place_grows_the_cache_in_arrival_order():
    model = tiny_model("llama")
    cache = EvictionCache(model, budget=BUDGET, policy="tova", block_size=BLOCK)
    with cache:
        decode(model, cache, random_ids(3 * BLOCK, seed=10), 3)
        cache.freeze()
        decode_steps(model, cache, 4)
        assert all(not layer.in_place and layer.retained == BUDGET + 4 for layer in cache.layers)
        positions = cache.layers[0].positions
        assert torch.equal(positions, positions.sort(-1).values)  # arrival order again


def test_free_slots_are_masked_and_the_peak_stays_within_the_prefill_bound():
    model = tiny_model("llama")
    interval = 4
    cache = EvictionCache(
        model, budget=BUDGET, policy="tova+caote", block_size=BLOCK, decode_eviction_interval=interval
    )
    with cache:
        decode(model, cache, random_ids(3 * BLOCK, seed=11), 2)
        layer = cache.layers[0]
        assert layer.in_place and (layer.positions == FREE).sum() == layer.slots.free.numel() > 0
        queries = torch.zeros(1, model.config.num_attention_heads, 1, 16)
        mask = layer.attention_mask(None, queries, additive=False)  # (B, H_q, 1, S): False exactly on the free slots
        group = model.config.num_attention_heads // model.config.num_key_value_heads
        assert torch.equal(~mask[:, :, 0], (layer.positions == FREE).repeat_interleave(group, dim=1))
        additive = layer.attention_mask(None, queries, additive=True)
        assert (additive[~mask] == torch.finfo(queries.dtype).min).all() and (additive[mask] == 0).all()
        stats = cache.stats()
        per_token = 2 * layer.keys.shape[1] * layer.keys.shape[-1] * layer.keys.element_size()  # keys and values
        assert stats.kv_bytes == (BUDGET + 1) * len(cache.layers) * per_token
        assert stats.peak_kv_bytes <= (BUDGET * len(cache.layers) + BLOCK) * per_token
        assert stats.tokens_kept == layer.retained <= BUDGET


@pytest.mark.parametrize("interval", [1, 3])
def test_streamingllm_frees_the_oldest_slots_after_the_sinks_without_scoring(monkeypatch, interval):
    model = tiny_model("llama")
    ids = random_ids(3 * BLOCK, seed=12)
    settings = dict(budget=BUDGET, policy="streamingllm", block_size=BLOCK, decode_eviction_interval=interval)
    with arrival_order(EvictionCache(model, **settings)) as reference:
        want = decode(model, reference, ids, 9)
    monkeypatch.setattr(EvictionLayer, "score_inputs", lambda *args: pytest.fail("streamingllm scored"))
    with EvictionCache(model, **settings) as slots:
        got = decode(model, slots, ids, 9)
        assert all(layer.in_place for layer in slots.layers)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(kept(slots), kept(reference)))


def test_a_restored_larger_snapshot_decodes_in_arrival_order_until_it_reaches_the_budget():
    model = tiny_model("llama")
    ids = random_ids(60, seed=13)
    with EvictionCache(model, budget=80, policy="full", block_size=BLOCK) as large:
        decode(model, large, ids, 0)
        snapshot = large.snapshot()
    results = []
    for in_place in (True, False):
        cache = EvictionCache(model, budget=BUDGET, policy="tova", block_size=BLOCK)
        if not in_place:
            arrival_order(cache)
        with cache:
            cache.restore(snapshot)
            results.append(decode_steps(model, cache, 6))
            assert all(layer.retained == BUDGET and layer.in_place == in_place for layer in cache.layers)
            assert all(int((layer.kept_positions() >= 0).sum()) == 2 * BUDGET for layer in cache.layers)
    assert results[0] == results[1]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_restoring_into_a_frozen_cache_or_after_a_failed_forward_returns_to_arrival_order(attention):
    model = tiny_model("llama", attn_implementation=attention)
    cache = EvictionCache(model, budget=BUDGET, policy="tova+caote", block_size=BLOCK)
    with cache:
        decode(model, cache, random_ids(3 * BLOCK, seed=14), 3)
        snapshot = cache.snapshot()
        cache.freeze()
        cache.restore(snapshot)
        assert not any(layer.in_place for layer in cache.layers)
        decode_steps(model, cache, 3)
        assert all(layer.retained == BUDGET + 3 for layer in cache.layers)  # frozen: every token kept
    cache = EvictionCache(model, budget=BUDGET, policy="tova+caote", block_size=BLOCK)
    with cache:
        decode(model, cache, random_ids(3 * BLOCK, seed=14), 3)

        def fail(*args, **kwargs):  # a forward that raises after the first layer wrote its token, before eviction
            raise RuntimeError("interrupted")

        cache.after_attention = fail
        with pytest.raises(RuntimeError, match="interrupted"):
            decode_steps(model, cache, 1)
        del cache.after_attention
        assert cache.layers[0].slots.free.shape[-1] == 0  # its one free slot took the token
        decode_steps(model, cache, 2)
        assert all(layer.retained == BUDGET for layer in cache.layers)
        assert all(int((layer.kept_positions() >= 0).sum()) == 2 * BUDGET for layer in cache.layers)


def test_a_snapshot_restored_into_a_cache_with_more_sinks_decodes_in_place_keeping_them():
    model = tiny_model("llama")
    source = EvictionCache(model, budget=BUDGET, policy="tova+caote", block_size=BLOCK, sink_tokens=2)
    target = EvictionCache(model, budget=BUDGET, policy="tova+caote", block_size=BLOCK, sink_tokens=12)
    with source, target:
        decode(model, source, random_ids(3 * BLOCK, seed=15), 3)
        target.restore(source.snapshot())
        assert all(layer.in_place for layer in target.layers)  # same schedule and budget: it stays in its slots
        early = [layer.kept_positions()[layer.kept_positions() < 12] for layer in target.layers]
        assert all(len(held) > 2 * 2 for held in early)  # more than the source's own sinks, in both KV heads
        decode_steps(model, target, 20)
        for layer, held in zip(target.layers, early):  # the target's sinks are never evicted
            assert torch.equal(layer.kept_positions()[layer.kept_positions() < 12], held)


@pytest.mark.parametrize("policy", ["tova+caote", "h2o+caote"])
def test_in_bfloat16_the_model_s_kernel_keeps_the_output_so_the_slots_match_arrival_order(policy):
    model = tiny_model("llama").to(torch.bfloat16)
    ids = random_ids(3 * BLOCK + 5, seed=16)
    with EvictionCache(model, budget=BUDGET, policy=policy, block_size=BLOCK) as slots:
        got = decode(model, slots, ids, 12)
    with arrival_order(EvictionCache(model, budget=BUDGET, policy=policy, block_size=BLOCK)) as reference:
        want = decode(model, reference, ids, 12)
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)  # the slots' order changes bfloat16's sums only
    assert all(torch.equal(a, b) for a, b in zip(kept(slots), kept(reference)))


def one_at_a_time(cache: EvictionCache) -> EvictionCache:
    """``cache`` evicting each layer of a decode step right after its attention: the reference for scoring them
    together at the end of the forward."""
    cache.strategy.evicts_together = False
    return cache


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("interval", [1, 3])
@pytest.mark.parametrize(
    "policy",
    [
        "streamingllm",
        "h2o+caote",
        "tova+caote",
        "snapkv+caote",
        "knorm+caote",
        "random",
        "tova-layer+fastcaote",
        "caote-block",
        "learned+caote",
    ],
)
def test_a_decode_step_scores_its_layers_together_as_they_would_be_one_at_a_time(policy, interval, padded, monkeypatch):
    model = tiny_model("qwen3")
    ids = random_ids(3 * BLOCK, batch=2, seed=21)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :12] = 0  # padding slots outlive the prefill, so every base scores (streamingllm included)
    settings = dict(budget=BUDGET, policy=policy, block_size=BLOCK, decode_eviction_interval=interval)
    EvictionCache(model, **settings).close()  # the learned policy's tiny predictor is calibrated here, uncounted
    calls = {"scores": 0}
    scores = Policy.scores

    def counted(self, *args, **kwargs):
        calls["scores"] += 1
        return scores(self, *args, **kwargs)

    monkeypatch.setattr(Policy, "scores", counted)
    with EvictionCache(model, **settings) as together:
        got = decode(model, together, ids, 9, attention_mask=mask)
    scored_together, calls["scores"] = calls["scores"], 0
    with one_at_a_time(EvictionCache(model, **settings)) as alone:
        want = decode(model, alone, ids, 9, attention_mask=mask)
    assert torch.equal(got, want)  # the same tokens kept, so the same arithmetic to the bit
    assert all(torch.equal(a, b) for a, b in zip(kept(together), kept(alone)))
    if padded and interval > 1:  # rows out of phase: the layers decode in arrival order, each evicted alone
        assert not any(layer.in_place for layer in together.layers) and calls["scores"] == scored_together
        return
    evicting_steps = 9 if interval == 1 else 3
    scored = padded or policy != "streamingllm"  # without padding, streamingllm frees its oldest slots unscored
    assert calls["scores"] - scored_together == evicting_steps * (len(together.layers) - 1) * scored


def waiting_layers(model, ids, monkeypatch) -> list[EvictionLayer]:
    """The layers of a decode step after their attention, each holding one token over the budget: the step's
    end-of-forward eviction is held back."""
    held = []

    def hold(self, cache, model, output, kwargs):
        held.extend(self._waiting.values())
        self._waiting = {}
        return []

    cache = EvictionCache(model, budget=BUDGET, policy="h2o+caote", block_size=BLOCK)
    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(Immediate, "after_forward", hold)
        prompt_then_step(model, cache, ids, BLOCK)
    cache.close()
    assert len(held) == len(cache.layers) and all(layer.retained == BUDGET + 1 for layer in held)
    return held


def test_layers_of_unequal_shapes_are_scored_in_separate_stacks(monkeypatch):
    model = tiny_model("llama")
    one = waiting_layers(model, random_ids(3 * BLOCK, seed=22), monkeypatch)
    two = waiting_layers(model, random_ids(3 * BLOCK, batch=2, seed=23), monkeypatch)
    reference = [layer.detached_copy() for layer in one + two]
    evict_together(dict(enumerate(one + two)), BUDGET, lambda: None)  # batch 1 and batch 2: two stacks
    evict_together(dict(enumerate(reference[: len(one)])), BUDGET, lambda: None)
    evict_together(dict(enumerate(reference[len(one) :])), BUDGET, lambda: None)
    for layer, alone in zip(one + two, reference):
        assert layer.retained == BUDGET and torch.equal(layer.positions, alone.positions)
        assert torch.equal(layer.slots.free, alone.slots.free) and torch.equal(layer.history, alone.history)


def test_a_stack_holds_at_most_stack_bytes_of_values(monkeypatch):
    import caote.stacking

    model = tiny_model("llama")
    layers = waiting_layers(model, random_ids(3 * BLOCK, seed=24), monkeypatch)
    reference = [layer.detached_copy() for layer in layers]
    stacks = []
    monkeypatch.setattr(caote.stacking, "STACK_BYTES", 4 * layers[0].values.numel())  # one layer's float32 values
    evict_together(dict(enumerate(layers)), BUDGET, lambda: None, lambda each, stack: stacks.append(list(each)) or {})
    assert stacks == [[index] for index in range(len(layers))]
    evict_together(dict(enumerate(reference)), BUDGET, lambda: None)  # every layer in one stack
    for layer, together in zip(layers, reference):
        assert layer.retained == together.retained == BUDGET
        assert torch.equal(layer.positions, together.positions) and torch.equal(layer.slots.free, together.slots.free)


def test_a_forward_that_raises_after_every_attention_evicts_nothing_and_decoding_recovers():
    model = tiny_model("llama")
    cache = EvictionCache(model, budget=BUDGET, policy="h2o+caote", block_size=BLOCK)
    norm = model.get_decoder().norm
    with cache:
        decode(model, cache, random_ids(3 * BLOCK, seed=24), 2)
        handle = norm.register_forward_hook(lambda *args: (_ for _ in ()).throw(RuntimeError("interrupted")))
        with pytest.raises(RuntimeError, match="interrupted"):
            decode_steps(model, cache, 1)
        handle.remove()
        assert all(layer.retained == BUDGET + 1 and layer.slots.free.shape[-1] == 0 for layer in cache.layers)
        decode_steps(model, cache, 2)
        assert all(layer.retained == BUDGET for layer in cache.layers)


def test_after_the_first_step_a_stack_is_a_view_of_its_layers_storage_not_a_copy():
    """The first stacked eviction copies what the layers write in place; that copy becomes their storage, so later
    steps stack the same layers without copying (and still keep what one layer at a time keeps)."""
    model = tiny_model("llama")
    ids = random_ids(3 * BLOCK, seed=8)
    with EvictionCache(model, budget=BUDGET, policy="h2o+caote", block_size=BLOCK) as cache, torch.no_grad():
        out = prompt_then_step(model, cache, ids, BLOCK)
        out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
        layers = list(cache.layers)
        together = stack(layers)
        for name in ("values", "positions", "history", "slots.sinks", "slots.value_norms", "slots.normed"):
            in_stack, in_first = attribute(together, name), attribute(layers[0], name)
            assert in_stack.data_ptr() == in_first.data_ptr(), name
            for index, layer in enumerate(layers):
                assert torch.equal(in_stack[index : index + 1], attribute(layer, name)), name
        assert together.keys is None  # h2o+caote does not read the keys: never stacked, each layer keeps its own


@needs_compiler
def test_compiled_decode_scoring_keeps_what_the_eager_default_keeps():
    model = tiny_model("llama")
    ids = random_ids(3 * BLOCK, batch=2, seed=9)
    settings = dict(budget=BUDGET, policy="tova+caote", block_size=BLOCK)
    with EvictionCache(model, **settings, compile_decode=True) as compiled:
        got = decode(model, compiled, ids, 6)
    with EvictionCache(model, **settings) as eager:
        want = decode(model, eager, ids, 6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(kept(compiled), kept(eager)))


@pytest.mark.parametrize("interval", [1, 3])
@pytest.mark.parametrize(
    "policy", ["h2o+caote", "tova+caote", "tova+fastcaote", "snapkv+caote", "knorm+caote", "tova+caote/max"]
)
def test_decode_steps_scoring_only_their_candidates_keep_what_scoring_every_token_keeps(policy, interval, monkeypatch):
    """`bounds.lowest_errors` inside real decode steps (its size threshold lowered to run on a tiny model) against
    the direct path: the same slots freed at every step, so the same logits to the bit."""
    from caote import bounds

    model = tiny_model("llama")
    ids = random_ids(3 * BLOCK + 5, batch=2, seed=8)
    settings = dict(budget=BUDGET, policy=policy, block_size=BLOCK, decode_eviction_interval=interval)
    bounded = {"ran": 0}
    lowest = bounds.lowest_errors

    def counted(*args):
        result = lowest(*args)
        bounded["ran"] += result is not None
        return result

    monkeypatch.setattr(bounds, "lowest_errors", counted)
    monkeypatch.setattr(bounds, "BOUNDED_FROM", 0)
    monkeypatch.setattr(bounds, "MOST_CANDIDATES", 1.0)  # a tiny model's rows: the bounds run at every step
    with EvictionCache(model, **settings) as candidates:
        got = decode(model, candidates, ids, 12)
    assert bounded["ran"] >= 12 // interval
    monkeypatch.setattr(bounds, "BOUNDED_FROM", float("inf"))
    with EvictionCache(model, **settings) as every:
        want = decode(model, every, ids, 12)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(kept(candidates), kept(every)))


def attribute(layer: EvictionLayer, name: str) -> torch.Tensor:
    """``layer``'s tensor ``name``, or its slot buffer's for ``slots.<name>``."""
    holder, _, field = name.rpartition(".")
    return getattr(layer.slots if holder else layer, field)
