"""caote: bounded KV-cache memory for Hugging Face causal LMs with value-aware token eviction (CAOTE).

``caote.generate(model, tokenizer, prompt, budget=256, policy="h2o+caote")`` answers a prompt while every layer keeps
at most ``budget`` KV tokens; ``EvictionCache`` plugs the same bounded cache into ``model.generate``; importing caote
also registers the ``caote-text-generation`` transformers pipeline (one compressed context, several questions).

``import caote`` itself is cheap: torch and transformers are imported on first use of a name below, and the pipeline
is registered when ``transformers.pipelines`` is first imported (see `caote._registration`).
"""

from __future__ import annotations

import importlib
import importlib.util

from caote._registration import install as _install_pipeline_registration

__version__ = "0.2.0"

# public name -> the submodule that defines it (imported on first attribute access, PEP 562)
_LAZY = {
    "CacheSettings": "caote.settings",
    "CacheSnapshot": "caote.cache",
    "CacheStats": "caote.cache",
    "EvictionCache": "caote.cache",
    "GenerationResult": "caote.generation",
    "generate": "caote.generation",
    "CaoteTextGenerationPipeline": "caote.pipeline",
    "describe": "caote.policies",
    "expand_policies": "caote.policies",
    "parse_policy": "caote.policies",
    "policy_names": "caote.policies",
    "caote_score": "caote.value_aware",
    "fast_caote_score": "caote.value_aware",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"caote.{name}") is not None:
        return importlib.import_module(f"caote.{name}")  # a submodule, e.g. caote.models after `import caote`
    raise AttributeError(f"module 'caote' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


_install_pipeline_registration()
