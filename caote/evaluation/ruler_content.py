"""What RULER-style prompts are made of, drawn from a seeded `random.Random`: adjective-noun keys and 7-digit
values (RULER's "words"/"numbers" types) for the needles, five-letter variable names and their assignment chains
for variable tracking, and the shuffled, numbered word lists of common-words extraction. The tasks that size these
into prompts are `caote.evaluation.ruler`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

ADJECTIVES = (
    "wry",
    "calm",
    "bold",
    "brave",
    "bright",
    "shy",
    "quiet",
    "eager",
    "fancy",
    "gentle",
    "grumpy",
    "happy",
    "jolly",
    "kind",
    "lively",
    "proud",
    "silly",
    "witty",
    "zealous",
    "ancient",
    "bitter",
    "brisk",
    "clumsy",
    "dusty",
    "fierce",
    "frosty",
    "golden",
    "hollow",
    "icy",
    "misty",
    "noisy",
    "polite",
    "rapid",
    "rusty",
    "sleepy",
    "smooth",
    "stormy",
    "tender",
    "vivid",
    "wooden",
)
NOUNS = (
    "sunlight",
    "river",
    "mountain",
    "garden",
    "lantern",
    "harbor",
    "meadow",
    "window",
    "forest",
    "canyon",
    "pillow",
    "rocket",
    "castle",
    "island",
    "kitten",
    "ladder",
    "mirror",
    "needle",
    "orchard",
    "pepper",
    "quarry",
    "saddle",
    "teapot",
    "umbrella",
    "valley",
    "wagon",
    "anchor",
    "basket",
    "candle",
    "dolphin",
    "engine",
    "feather",
    "glacier",
    "hammer",
    "jacket",
    "kettle",
    "lemon",
    "marble",
    "nugget",
    "oyster",
)


def distinct_keys(rng: random.Random, count: int) -> list[str]:
    """``count`` different adjective-noun keys such as ``"wry-sunlight"``."""
    pairs = rng.sample([(a, n) for a in ADJECTIVES for n in NOUNS], count)
    return [f"{adjective}-{noun}" for adjective, noun in pairs]


def distinct_numbers(rng: random.Random, count: int, digits: int = 7) -> list[str]:
    """``count`` different ``digits``-digit numbers as strings."""
    return [str(number) for number in rng.sample(range(10 ** (digits - 1), 10**digits), count)]


def variable_names(rng: random.Random, count: int) -> list[str]:
    """``count`` different names of five uppercase letters (RULER's variable names)."""
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    return names


def assignment_chains(
    rng: random.Random, num_chains: int, num_hops: int
) -> tuple[list[list[str]], list[str], list[str]]:
    """``num_chains`` chains of ``num_hops + 1`` variables: statements per chain, the chains' values, and the names
    of the first chain. Chain ``c`` reads ``VAR A = v_c. VAR B = A. ...`` (each hop copies the previous name)."""
    names = variable_names(rng, num_chains * (num_hops + 1))
    values = distinct_numbers(rng, num_chains, digits=5)
    chains = []
    for c in range(num_chains):
        chain_names = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        statements = [f"VAR {chain_names[0]} = {values[c]}."]
        statements += [f"VAR {chain_names[h]} = {chain_names[h - 1]}." for h in range(1, num_hops + 1)]
        chains.append(statements)
    return chains, values, names[: num_hops + 1]


def interleave(rng: random.Random, chains: list[list[str]]) -> list[str]:
    """Merge chains into one statement list in a random interleaving that keeps each chain's own order."""
    pending = [list(chain) for chain in chains]
    merged: list[str] = []
    while any(pending):
        chain = rng.choice([c for c in pending if c])
        merged.append(chain.pop(0))
    return merged


def word_list(
    rng: random.Random, common: Sequence[str], uncommon: Sequence[str], common_freq: int, uncommon_freq: int
) -> list[str]:
    """Each common word ``common_freq`` times and each uncommon word ``uncommon_freq`` times, shuffled."""
    words = [word for word in common for _ in range(common_freq)]
    words += [word for word in uncommon for _ in range(uncommon_freq)]
    rng.shuffle(words)
    return words


def numbered(words: Sequence[str]) -> str:
    """RULER's list format: ``"1. apple 2. pear ..."``."""
    return " ".join(f"{i}. {word}" for i, word in enumerate(words, start=1))
