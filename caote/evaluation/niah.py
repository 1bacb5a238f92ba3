"""Needle in a haystack (Kamradt 2023; passkey retrieval of Mohtashami & Jaggi 2023): one fact hidden in filler.

A grid of context lengths × depths × needles. Each example hides one needle sentence (a pass key, a secret word, a
door code) at ``depth`` percent of a filler text (`caote.evaluation.data.haystack`) and asks for it; the assistant
turn is pre-filled with ``answer_prefix`` (e.g. "The pass key is") so that even a tiny model answers directly.
Scored by ``substring_match``: the answer must appear, case-insensitively, in the prediction.

``context_length`` is the token count of the whole prompt as the runner feeds it (chat template + answer prefix,
see `caote.evaluation.data.prompt_text`), up to a few tokens lost where the filler is cut at a sentence end.
The needle goes to the sentence boundary nearest to ``depth`` percent of the filler's characters (0: first, 100:
last). Everything is deterministic given ``seed``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from caote.evaluation.data import count_tokens, haystack, insert_sentences, prompt_token_count, split_sentences
from caote.evaluation.examples import Example
from caote.evaluation.tasks import MetricSpec, Task, joined

NAME = "niah"
METRIC = "substring_match"
INSTRUCTION = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it."
)
SECRET_WORDS = (
    "apricot",
    "harbor",
    "violet",
    "lantern",
    "meadow",
    "compass",
    "granite",
    "falcon",
    "saffron",
    "orchid",
    "glacier",
    "velvet",
    "thimble",
    "walnut",
    "cobalt",
    "marigold",
    "pebble",
    "quartz",
    "sparrow",
    "tundra",
    "juniper",
    "mosaic",
    "nectar",
    "oyster",
)


@dataclass(frozen=True)
class Needle:
    """A fact to hide: ``statement`` (with ``{value}``), the ``question`` asking for it, the ``answer_prefix`` that
    opens the answer, and how to draw a fresh ``value``."""

    name: str
    statement: str
    question: str
    answer_prefix: str
    draw_value: Callable[[random.Random], str]

    def sentence(self, value: str) -> str:
        return self.statement.format(value=value)


def _digits(count: int) -> Callable[[random.Random], str]:
    def draw(rng: random.Random) -> str:
        return str(rng.randint(10 ** (count - 1), 10**count - 1))

    return draw


NEEDLES = {
    "passkey": Needle(
        "passkey",
        "The pass key is {value}. Remember it. {value} is the pass key.",
        "What is the pass key?",
        "The pass key is",
        _digits(5),
    ),
    "secret_word": Needle(
        "secret_word",
        "The secret word is {value}. Remember it. {value} is the secret word.",
        "What is the secret word?",
        "The secret word is",
        lambda rng: rng.choice(SECRET_WORDS),
    ),
    "door_code": Needle(
        "door_code",
        "The code to open the blue door is {value}.",
        "What is the code to open the blue door?",
        "The code to open the blue door is",
        _digits(4),
    ),
}


def niah_user_message(filler_with_needle: str, question: str) -> str:
    """The user turn: instruction, the filler holding the needle, then the question."""
    return f"{INSTRUCTION}\n\n{filler_with_needle}\n\n{question}"


def insert_at_depth(filler: str, sentence: str, depth: float) -> tuple[str, float]:
    """``filler`` with ``sentence`` inserted at the sentence boundary nearest to ``depth`` percent of its
    characters, and the depth (percent of the result's characters) where the sentence actually starts."""
    if not 0 <= depth <= 100:
        raise ValueError(f"depth must be a percentage in [0, 100], got {depth}")
    sentences = split_sentences(filler)
    boundaries = [0]
    for piece in sentences:
        boundaries.append(boundaries[-1] + len(piece) + 1)  # where the next sentence starts
    target = depth / 100 * len(filler)
    position = min(range(len(boundaries)), key=lambda index: (abs(boundaries[index] - target), index))
    text = insert_sentences(filler, [sentence], [position])
    start = text.index(sentence)
    return text, 100 * start / max(len(text) - len(sentence), 1)


def niah_example(
    tokenizer,
    context_length: int,
    depth: float,
    needle: str = "passkey",
    seed: int = 0,
    split: str = "test",
    filler: str = "repeat",
    max_new_tokens: int = 16,
    index: int = 0,
    protocol: str = "in-prompt",
    plain: bool = False,
) -> Example:
    """One needle-in-a-haystack `Example` of about ``context_length`` prompt tokens with the needle at ``depth`` %.

    ``filler``: ``"repeat"`` (the grass-is-green filler; what the bundled 135M model can solve) or ``"essays"``
    (Paul Graham essays of ``split``). ``seed`` and ``index`` fix the needle's value and the essay order;
    ``protocol`` (`caote.evaluation.examples.PROTOCOLS`) says whether the question is compressed with the context.
    ``plain``: the prompt is the text itself, no chat template, the answer prefix after the question (the pass-key
    prompts runtimes are compared on, `caote.evaluation.passkey`).
    """
    spec = NEEDLES[needle]
    prefix = f" {spec.answer_prefix}" if plain else spec.answer_prefix
    rng = random.Random(f"niah:{seed}:{needle}:{context_length}:{depth}:{index}")
    value = spec.draw_value(rng)
    sentence = spec.sentence(value)
    empty = (dict(role="user", content=niah_user_message(sentence, spec.question)),)
    overhead = prompt_token_count(tokenizer, empty, prefix, plain)
    if overhead >= context_length:
        raise ValueError(
            f"context_length {context_length} leaves no room for filler (the prompt alone is {overhead} tokens)"
        )
    filler_text = haystack(tokenizer, context_length - overhead, split, rng.randrange(2**31), filler)
    text, actual_depth = insert_at_depth(filler_text, sentence, depth)
    messages = (dict(role="user", content=niah_user_message(text, spec.question)),)
    meta = dict(
        context_length=context_length,
        depth=depth,
        needle=needle,
        filler=filler,
        split=split,
        actual_depth=round(actual_depth, 2),
        seed=seed,
        protocol=protocol,
        prompt_tokens=prompt_token_count(tokenizer, messages, prefix, plain),
        filler_tokens=count_tokens(tokenizer, filler_text),
        **({"raw_prompt": True} if plain else {}),
    )
    return Example(
        id=f"{NAME}/{needle}/{filler}/len{context_length}/depth{depth:g}/seed{seed}/{index}"
        + ("" if protocol == "in-prompt" else f"/{protocol}"),
        task=NAME,
        messages=messages,
        answers=(value,),
        metric=METRIC,
        max_new_tokens=max_new_tokens,
        answer_prefix=prefix,
        meta=meta,
        question=spec.question,
        protocol=protocol,
    )


def niah_examples(
    tokenizer,
    context_lengths: Sequence[int] = (1024, 2048, 4096),
    depths: Sequence[float] = (10, 50, 90),
    needles: Sequence[str] = ("passkey",),
    samples_per_cell: int = 1,
    seed: int = 0,
    split: str = "test",
    filler: str = "repeat",
    max_new_tokens: int = 16,
    protocols: Sequence[str] = ("in-prompt",),
    plain: bool = False,
) -> list[Example]:
    """The full grid: for each context length, depth, needle, sample index and protocol, one `niah_example`."""
    unknown = sorted(set(needles) - set(NEEDLES))
    if unknown:
        raise ValueError(f"unknown needles {unknown}; expected some of {sorted(NEEDLES)}")
    return [
        niah_example(tokenizer, length, depth, needle, seed, split, filler, max_new_tokens, index, protocol, plain)
        for length in context_lengths
        for depth in depths
        for needle in needles
        for index in range(samples_per_cell)
        for protocol in protocols
    ]


# -- the task ----------------------------------------------------------------------------------------------------

DEFAULT_DEPTHS = (10, 50, 90)


def needle_task(name: str, title: str, headline: str, depths: tuple[float, ...], plain: bool, what: str) -> Task:
    """A pass-key task over the config's context lengths, depths (default ``depths``), samples (default one per
    cell) and protocols: `niah_examples` in the chat template, or ``plain`` text; ``what`` opens its Setup line."""

    def examples(config, tokenizer) -> list[Example]:
        made = niah_examples(
            tokenizer,
            context_lengths=config.lengths,
            depths=config.depths or depths,
            samples_per_cell=config.samples or 1,
            seed=config.seed,
            split=config.split,
            protocols=config.protocols or ("in-prompt",),
            plain=plain,
        )
        return made if name == NAME else [replace(example, id=f"{name}/{example.id}", task=name) for example in made]

    def count(config) -> int:
        protocols = len(config.protocols or ("in-prompt",))
        return len(config.lengths) * len(config.depths or depths) * (config.samples or 1) * protocols

    def describe(config, rows: list[dict]) -> str:
        return (
            f"{what}, context {joined(config.lengths)} tokens × depths {joined(config.depths or depths, '%')} × "
            f"{config.samples or 1} sample(s) × protocol {joined(config.protocols or ('in-prompt',))}; substring "
            f"match ({len(rows)} rows)."
        )

    return Task(
        name=name,
        title=title,
        metrics=(MetricSpec("score", "accuracy", 2, higher_is_better=True, binary=True, headline=headline),),
        examples=examples,
        count=count,
        describe=describe,
        figures=("niah_heatmaps",),
    )


TASK = needle_task(
    NAME, "Needle in a haystack", "NIAH acc", DEFAULT_DEPTHS, False, "NIAH: passkey in repetitive filler"
)
