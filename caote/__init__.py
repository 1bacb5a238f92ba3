"""caote: bounded KV-cache memory for Hugging Face causal LMs with value-aware token eviction (CAOTE).

``caote.generate(model, tokenizer, prompt, budget=256, policy="tova+caote")`` answers a prompt while every layer keeps
at most ``budget`` KV tokens; ``EvictionCache`` plugs the same bounded cache into ``model.generate``; importing caote
also registers the ``caote-text-generation`` transformers pipeline (one compressed context, several questions).
"""

from caote.cache import CacheSnapshot, CacheStats, EvictionCache
from caote.generation import GenerationResult, generate
from caote.pipeline import CaoteTextGenerationPipeline
from caote.pipeline import register as _register_pipeline
from caote.policies import describe, expand_policies, parse_policy, policy_names
from caote.scoring import caote_score, fast_caote_score

__version__ = "0.1.0"

_register_pipeline()

__all__ = [
    "CacheSnapshot",
    "CacheStats",
    "CaoteTextGenerationPipeline",
    "EvictionCache",
    "GenerationResult",
    "caote_score",
    "describe",
    "expand_policies",
    "fast_caote_score",
    "generate",
    "parse_policy",
    "policy_names",
]
