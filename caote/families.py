"""The model families caote supports: the test matrix behind the README's family table (no model code here).

Each entry names the transformers classes of a family and what makes a tiny random config of it realistic;
`tests/test_families.py` runs every guarantee on each, and `caote.attention` refuses every other model type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import transformers

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)

HYBRID = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=40)


@dataclass(frozen=True)
class Family:
    """A model family caote supports: its classes (by transformers name), what makes a tiny config of it realistic,
    and what the README's family table says about it."""

    config: str
    model: str
    extra: dict = field(default_factory=dict)
    backends: tuple[str, ...] = ("sdpa", "eager")
    layers: str = "full attention"
    note: str = ""

    def build(self, **overrides):
        config = getattr(transformers, self.config)(**{**TINY, **self.extra, **overrides})
        return config, getattr(transformers, self.model)


# The test matrix (tests/test_families.py) and the README's family table; keys are `config.model_type`.
FAMILIES = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", note="Llama 2/3.x, SmolLM2 (the bundled model)"),
    "mistral": Family(
        "MistralConfig",
        "MistralForCausalLM",
        {"sliding_window": None},
        note="with a window (v0.1): exact while the sequence fits in it, refused beyond",
    ),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", note="Qwen2, Qwen2.5"),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, note="QK-norm"),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", note="Phi-3 / 3.5 / 4-mini: fused qkv projection"),
    "gemma2": Family(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 16, **HYBRID},
        backends=("eager",),
        layers="sliding + full",
        note="logit soft-capping (eager only)",
    ),
    "gemma3_text": Family(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": 16, **HYBRID},
        layers="sliding + full",
        note="Gemma-3 text: QK-norm, local and global RoPE",
    ),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", note="norm over the whole q / k projection"),
    "granite": Family("GraniteConfig", "GraniteForCausalLM", note="its own attention multiplier"),
    "smollm3": Family(
        "SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layers": [1, 0]}, note="layers without RoPE (NoPE)"
    ),
    "glm4": Family("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16}, note="partial rotary embedding"),
    "cohere2": Family(
        "Cohere2Config", "Cohere2ForCausalLM", {"head_dim": 16, **HYBRID}, layers="sliding + full", note="Command R7B"
    ),
    "starcoder2": Family("Starcoder2Config", "Starcoder2ForCausalLM", note="biased projections"),
    "helium": Family("HeliumConfig", "HeliumForCausalLM", {"head_dim": 16}),
}

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family_table() -> str:
    """The README's family table (Markdown), generated from `FAMILIES`."""
    lines = ["| model type | classes | layers | backends | notes |", "|---|---|---|---|---|"]
    for name, family in FAMILIES.items():
        backends = " / ".join(family.backends)
        lines.append(f"| `{name}` | `{family.model}` | {family.layers} | {backends} | {family.note} |")
    return "\n".join(lines)
