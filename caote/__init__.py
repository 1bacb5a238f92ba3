"""caote: bounded KV-cache memory for Hugging Face causal LMs with value-aware token eviction (CAOTE)."""

from caote.cache import CacheStats, EvictionCache
from caote.policies import describe, expand_policies, parse_policy, policy_names
from caote.scoring import caote_score, fast_caote_score

__version__ = "0.1.0"

__all__ = [
    "CacheStats",
    "EvictionCache",
    "caote_score",
    "describe",
    "expand_policies",
    "fast_caote_score",
    "parse_policy",
    "policy_names",
]
