"""What calibration reads: dev-split excerpts of the bundled essays or code, or the ``.txt`` files of a folder."""

from __future__ import annotations

from caote.defaults import CALIBRATION_LENGTH, CALIBRATION_TOKENS, CALIBRATION_WINDOWS
from caote.evaluation.calibration.ridge import HELD_OUT_EVERY
from caote.evaluation.data import document_excerpts
from caote.evaluation.perplexity import domain_texts
from caote.evaluation.tasks import Text


def calibration_texts(tokenizer, domain: str, length: int, count: int | None = None, seed: int = 0) -> list:
    """Texts of the dev split of ``domain`` (``essays`` or ``code``): the non-overlapping excerpts of ``length``
    tokens (`caote.evaluation.tasks.Text`; the first excerpt of every document, then the second, ...), the first
    ``count`` of them (None: all)."""
    return domain_texts(tokenizer, domain, [length], None, "dev", seed, every=True)[:count]


def folder_texts(tokenizer, folder, length: int, count: int | None = None) -> list:
    """Every non-overlapping excerpt of ``length`` tokens of the ``.txt`` files of ``folder`` (ids
    ``file-<name>-<length>[-k]``): the user's own calibration texts."""
    documents = [
        (path.stem, path.read_text(encoding="utf-8", errors="replace")) for path in sorted(folder.glob("*.txt"))
    ]
    if not documents:
        raise ValueError(f"no .txt files in {str(folder)!r}")
    excerpts = document_excerpts(tokenizer, documents, length, count, 0, str(folder), sentence_boundary=False)
    seen: dict[str, int] = {}
    texts = []
    for unit, text in excerpts:
        seen[unit] = seen.get(unit, 0) + 1
        texts.append(Text(f"file-{unit}-{length}" + (f"-{seen[unit]}" if seen[unit] > 1 else ""), length, text, unit))
    return texts


def calibration_length(model) -> int:
    """The calibration excerpts' length for ``model``: `CALIBRATION_WINDOWS` sliding windows for a model whose
    layers mix sliding-window and full attention (the full layers, which evict, then see context the sliding ones
    no longer cover), else `CALIBRATION_LENGTH` (the standard grid's texts)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if window and "full_attention" in layer_types and "sliding_attention" in layer_types:
        return max(CALIBRATION_LENGTH, CALIBRATION_WINDOWS * window)
    return CALIBRATION_LENGTH


def default_count(length: int) -> int:
    """How many excerpts of ``length`` tokens make `CALIBRATION_TOKENS`, at least `HELD_OUT_EVERY` so a ridge
    strength can be chosen."""
    return max(HELD_OUT_EVERY, round(CALIBRATION_TOKENS / length))
