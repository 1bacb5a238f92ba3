"""Tiny random models built in-process (no hub access): the test suite's models and the benchmark's smoke model."""

from __future__ import annotations

import torch

from caote.families import FAMILIES


def tiny_model(
    family: str = "llama", attn_implementation: str = "sdpa", seed: int = 0, sharpen: float = 4.0, **overrides
):
    """A random 2-layer model of ``family`` (a key of `FAMILIES`) with GQA (4 query heads over 2 KV heads), in eval
    mode.

    ``sharpen`` scales every attention logit (the module's ``scaling``): random initialisation gives near-uniform
    attention, under which eviction choices hardly matter (1 keeps the random weights as they are). ``overrides``
    replace `TINY` fields."""
    config, model_class = FAMILIES[family].build(**overrides)
    torch.manual_seed(seed)
    config._attn_implementation = attn_implementation
    model = model_class(config).eval()
    for layer in model.get_decoder().layers:  # every family passes `scaling=self.scaling` to its attention
        layer.self_attn.scaling *= sharpen
    return model
