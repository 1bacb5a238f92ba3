"""``import caote`` is cheap (no torch, no transformers) and still registers the pipeline when transformers' pipelines
are first imported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import caote

HEAVY = ("torch", "transformers", "transformers.pipelines")


def run_python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object, returned here."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_caote_imports_neither_torch_nor_transformers_and_the_pipeline_still_registers():
    result = run_python(
        """
        import json, sys
        import caote
        after_import = {name: name in sys.modules for name in ("torch", "transformers", "transformers.pipelines")}
        from transformers import pipeline
        from transformers.pipelines import PIPELINE_REGISTRY
        task = PIPELINE_REGISTRY.check_task("caote-text-generation")
        print(json.dumps({"after_import": after_import, "class": task[1]["impl"].__name__}))
        """
    )
    assert result["after_import"] == dict.fromkeys(HEAVY, False)
    assert result["class"] == "CaoteTextGenerationPipeline"


def test_public_names_resolve_on_first_use():
    from caote import EvictionCache, generate

    assert EvictionCache is caote.cache.EvictionCache and generate is caote.generation.generate
    assert set(caote.__all__) <= set(dir(caote))
    for name in caote.__all__:
        getattr(caote, name)  # an unknown name raises AttributeError
    assert callable(caote.models.load_model)  # submodules too, without importing them first
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(caote, "no_such_name")
