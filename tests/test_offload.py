"""Models bigger than memory: layers offloaded to disk by accelerate evict exactly as the model held in memory."""

import argparse

import pytest
import torch
from conftest import random_ids, tiny_model
from transformers import AutoModelForCausalLM

from caote import EvictionCache
from caote.arguments import memory_limits
from caote.cli import main

BLOCK = 32


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    pytest.importorskip("accelerate")
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_model("llama", num_hidden_layers=4)
    model.save_pretrained(folder)
    # ~0.1 MB of CPU memory: the embeddings fit, most decoder layers go to disk
    offloaded = AutoModelForCausalLM.from_pretrained(
        folder, device_map="auto", max_memory={"cpu": "100KB"}, offload_folder=folder / "offload"
    ).eval()
    for layer in offloaded.get_decoder().layers:  # same sharpening as the in-memory model
        layer.self_attn.scaling = model.get_decoder().layers[0].self_attn.scaling
    return model, offloaded


def generate(model, ids, policy):
    cache = EvictionCache(model, budget=40, policy=policy, block_size=BLOCK)
    with torch.no_grad(), cache:
        return model.generate(
            ids,
            cache=cache,
            prefill_chunk_size=BLOCK,
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
        )


def test_some_layers_really_are_on_disk(offloaded):
    _, model = offloaded
    assert "disk" in set(model.hf_device_map.values()), model.hf_device_map


@pytest.mark.parametrize("policy", ["tova+caote", "snapkv+fastcaote", "h2o", "random", "streamingllm"])
def test_an_offloaded_model_keeps_the_same_tokens_as_in_memory(offloaded, policy):
    in_memory, on_disk = offloaded
    ids = random_ids(120, seed=30)
    assert torch.equal(generate(on_disk, ids, policy), generate(in_memory, ids, policy))


def test_memory_limits_parse_devices_and_sizes():
    assert memory_limits("cpu=200MiB, 0=6GiB") == {"cpu": "200MiB", 0: "6GiB"}
    for bad in ("cpu", "cpu=", "=5GiB", "cpu=lots", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            memory_limits(bad)


def test_max_memory_without_a_device_map_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--max-memory", "cpu=200MiB", "hello"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().endswith("--max-memory needs --device-map (e.g. --device-map auto)")
