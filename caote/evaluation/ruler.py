"""RULER-style synthetic long-context tasks, generated on the fly (Hsieh et al. 2024, arXiv 2404.06654).

Five task families, each sized with the tokenizer so that the whole prompt (chat template + answer prefix, see
`caote.evaluation.data.prompt_text`) holds at most ``context_length`` tokens:

* ``niah_single``: one needle "One of the special magic numbers for {key} is: {value}." in filler; return the value.
* ``niah_multikey``: the same with ``num_keys - 1`` distractor needles under other keys; return the queried value.
* ``niah_multivalue``: ``num_values`` needles with the same key and different values; return all of them.
* ``variable_tracking``: chains ``VAR X1 = 12345. VAR X2 = X1. ...`` (``num_hops`` hops, ``num_chains`` chains, the
  others distractors) in filler; return every variable of the chain holding the queried value.
* ``common_words`` (cwe): a numbered list where ``num_common`` words appear ``common_freq`` times and the rest
  ``uncommon_freq`` times; return the ``num_common`` most frequent words.

Templates and answer prefixes follow RULER's ``template.py``/``constants.py`` wording (the leading space of RULER's
prefixes is dropped because the prefix follows the opened assistant turn); RULER's in-context example for vt and
cwe is left out to keep short contexts for the task itself. Keys are adjective-noun pairs, values 7-digit numbers
(RULER's "words"/"numbers" types), drawn with the chains and word lists in `caote.evaluation.ruler_content`. The
filler is ``"repeat"`` (RULER's noise haystack, niah_single_1) or ``"essays"`` (Paul Graham essays,
niah_single_2). Every task is scored with ``string_match_all`` (the fraction of answers found in the prediction,
RULER's metric for these tasks). Deterministic given ``seed``.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Sequence

from caote.evaluation.data import essay_words, haystack, insert_sentences, prompt_token_count, split_sentences
from caote.evaluation.examples import Example
from caote.evaluation.ruler_content import (
    assignment_chains,
    distinct_keys,
    distinct_numbers,
    interleave,
    numbered,
    word_list,
)
from caote.evaluation.tasks import MetricSpec, Task, joined

METRIC = "string_match_all"
NIAH_TEMPLATE = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n{context}\n"
    "What are all the special magic numbers for {query} mentioned in the provided text?"
)
NIAH_PREFIX = "The special magic numbers for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, {count} variables are "
    "assigned the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
    "ones that appear most often.\n{context}\nQuestion: What are the {count} most common words in the "
    "above list?"
)
CWE_PREFIX = "Answer: The top {count} words that appear most often in the list are:"
# RULER's tokens_to_generate per task family.
MAX_NEW_TOKENS = {"niah": 128, "variable_tracking": 30, "common_words": 120}


def _rng(task: str, seed: int, context_length: int, index: int) -> random.Random:
    return random.Random(f"ruler:{task}:{seed}:{context_length}:{index}")


def _user(text: str) -> tuple[dict, ...]:
    return (dict(role="user", content=text),)


def _filled(
    tokenizer,
    context_length: int,
    render: Callable[[str], tuple[str, str]],
    statements: list[str],
    rng: random.Random,
    split: str,
    filler: str,
    ordered: bool,
) -> tuple[str, str, int]:
    """Filler sized so that ``render(context)`` fits ``context_length`` tokens, with ``statements`` inserted at
    random sentence positions (kept in order when ``ordered``). Returns (user text, answer prefix, prompt tokens)."""
    user, prefix = render(" ".join(statements))
    overhead = prompt_token_count(tokenizer, _user(user), prefix)
    if overhead >= context_length:
        raise ValueError(
            f"context_length {context_length} is too short: the task without filler takes {overhead} tokens"
        )
    filler_text = haystack(tokenizer, context_length - overhead, split, rng.randrange(2**31), filler)
    positions = [rng.randint(0, len(split_sentences(filler_text))) for _ in statements]
    if ordered:
        positions.sort()
    context = insert_sentences(filler_text, statements, positions)
    user, prefix = render(context)
    return user, prefix, prompt_token_count(tokenizer, _user(user), prefix)


def _niah(
    tokenizer,
    task: str,
    context_length: int,
    seed: int,
    index: int,
    num_keys: int,
    num_values: int,
    split: str,
    filler: str,
) -> Example:
    rng = _rng(task, seed, context_length, index)
    keys = distinct_keys(rng, num_keys)
    values = distinct_numbers(rng, num_keys * num_values)
    query = keys[0]
    needles = [
        NIAH_NEEDLE.format(key=key, value=values[k * num_values + v])
        for k, key in enumerate(keys)
        for v in range(num_values)
    ]
    rng.shuffle(needles)
    answers = tuple(values[:num_values])

    def render(context):
        return NIAH_TEMPLATE.format(context=context, query=query), NIAH_PREFIX.format(query=query)

    user, prefix, tokens = _filled(tokenizer, context_length, render, needles, rng, split, filler, ordered=False)
    meta = dict(
        context_length=context_length,
        prompt_tokens=tokens,
        query=query,
        num_keys=num_keys,
        num_values=num_values,
        filler=filler,
        split=split,
        seed=seed,
    )
    return Example(
        id=f"ruler/{task}/{filler}/len{context_length}/seed{seed}/{index}",
        task=f"ruler_{task}",
        messages=_user(user),
        answers=answers,
        metric=METRIC,
        max_new_tokens=MAX_NEW_TOKENS["niah"],
        answer_prefix=prefix,
        meta=meta,
    )


def niah_single(
    tokenizer, context_length: int, seed: int = 0, samples: int = 1, split: str = "test", filler: str = "repeat"
) -> list[Example]:
    """RULER niah_single: one key-value needle; the answer is its 7-digit value."""
    return [_niah(tokenizer, "niah_single", context_length, seed, i, 1, 1, split, filler) for i in range(samples)]


def niah_multikey(
    tokenizer,
    context_length: int,
    seed: int = 0,
    samples: int = 1,
    num_keys: int = 4,
    split: str = "test",
    filler: str = "repeat",
) -> list[Example]:
    """RULER niah_multikey: ``num_keys`` needles with different keys (one queried, the rest distractors)."""
    if num_keys < 2:
        raise ValueError("niah_multikey needs at least two keys")
    return [
        _niah(tokenizer, "niah_multikey", context_length, seed, i, num_keys, 1, split, filler) for i in range(samples)
    ]


def niah_multivalue(
    tokenizer,
    context_length: int,
    seed: int = 0,
    samples: int = 1,
    num_values: int = 4,
    split: str = "test",
    filler: str = "repeat",
) -> list[Example]:
    """RULER niah_multivalue: ``num_values`` needles for one key; every value must be returned."""
    if num_values < 2:
        raise ValueError("niah_multivalue needs at least two values")
    return [
        _niah(tokenizer, "niah_multivalue", context_length, seed, i, 1, num_values, split, filler)
        for i in range(samples)
    ]


def variable_tracking(
    tokenizer,
    context_length: int,
    seed: int = 0,
    samples: int = 1,
    num_chains: int = 1,
    num_hops: int = 4,
    split: str = "test",
    filler: str = "repeat",
) -> list[Example]:
    """RULER variable tracking: answers are the ``num_hops + 1`` variables bound (directly or through copies) to
    the queried value; the other chains are distractors."""
    examples = []
    for index in range(samples):
        rng = _rng("variable_tracking", seed, context_length, index)
        chains, values, answers = assignment_chains(rng, num_chains, num_hops)
        statements = interleave(rng, chains)
        query = values[0]

        def render(context, query=query):
            return VT_TEMPLATE.format(context=context, query=query), VT_PREFIX.format(count=num_hops + 1, query=query)

        user, prefix, tokens = _filled(tokenizer, context_length, render, statements, rng, split, filler, ordered=True)
        meta = dict(
            context_length=context_length,
            prompt_tokens=tokens,
            query=query,
            num_chains=num_chains,
            num_hops=num_hops,
            filler=filler,
            split=split,
            seed=seed,
        )
        examples.append(
            Example(
                id=f"ruler/variable_tracking/{filler}/len{context_length}/seed{seed}/{index}",
                task="ruler_variable_tracking",
                messages=_user(user),
                answers=tuple(answers),
                metric=METRIC,
                max_new_tokens=MAX_NEW_TOKENS["variable_tracking"],
                answer_prefix=prefix,
                meta=meta,
            )
        )
    return examples


def default_common_freq(context_length: int, uncommon_freq: int = 3) -> int:
    """RULER's 30 repetitions, reduced for short contexts: ``min(30, max(uncommon_freq + 2, context_length // 100))``
    (RULER's 10 × 30 common words alone take about 1.2k tokens; this keeps them near 40 % of the context)."""
    return min(30, max(uncommon_freq + 2, context_length // 100))


def common_words(
    tokenizer,
    context_length: int,
    seed: int = 0,
    samples: int = 1,
    num_common: int = 10,
    common_freq: int | None = None,
    uncommon_freq: int = 3,
    split: str = "test",
) -> list[Example]:
    """RULER common-words extraction (cwe): the largest number of uncommon words that fits ``context_length``
    (binary search) around ``num_common`` words repeated ``common_freq`` times; answers: the common words.

    Words are distinct lowercase words of ``split``'s essays. ``common_freq=None`` picks `default_common_freq`.
    """
    if common_freq is None:
        common_freq = default_common_freq(context_length, uncommon_freq)
    if common_freq <= uncommon_freq:
        raise ValueError("common_freq must exceed uncommon_freq")
    vocabulary = essay_words(split)
    examples = []
    for index in range(samples):
        rng = _rng("common_words", seed, context_length, index)
        pool = rng.sample(vocabulary, len(vocabulary))
        common, rest = pool[:num_common], pool[num_common:]
        prefix = CWE_PREFIX.format(count=num_common)

        def render(n_uncommon: int) -> str:
            words = word_list(
                random.Random(f"{seed}:{index}:{n_uncommon}"), common, rest[:n_uncommon], common_freq, uncommon_freq
            )
            return CWE_TEMPLATE.format(context=numbered(words), count=num_common)

        def fits(n):
            return prompt_token_count(tokenizer, _user(render(n)), prefix) <= context_length

        if not fits(0):
            raise ValueError(f"context_length {context_length} cannot hold {num_common} words × {common_freq}")
        # Every list entry takes at least one token, which bounds the search.
        n_uncommon = _largest_fitting(fits, min(len(rest), context_length // uncommon_freq))
        user = render(n_uncommon)
        meta = dict(
            context_length=context_length,
            prompt_tokens=prompt_token_count(tokenizer, _user(user), prefix),
            num_common=num_common,
            common_freq=common_freq,
            uncommon_freq=uncommon_freq,
            num_uncommon=n_uncommon,
            split=split,
            seed=seed,
        )
        examples.append(
            Example(
                id=f"ruler/common_words/len{context_length}/seed{seed}/{index}",
                task="ruler_common_words",
                messages=_user(user),
                answers=tuple(common),
                metric=METRIC,
                max_new_tokens=MAX_NEW_TOKENS["common_words"],
                answer_prefix=prefix,
                meta=meta,
            )
        )
    return examples


def _largest_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """The largest n in [0, upper] with ``fits(n)``, given ``fits(0)`` and monotonicity (binary search)."""
    low, high = 0, upper
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


RULER_TASKS = {
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
}


def ruler_examples(
    tokenizer,
    tasks: Sequence[str] = tuple(RULER_TASKS),
    context_lengths: Sequence[int] = (1024,),
    samples: int = 1,
    seed: int = 0,
    split: str = "test",
    **task_kwargs,
) -> list[Example]:
    """``samples`` examples of every task in ``tasks`` at every context length. ``task_kwargs`` go to each task
    function that accepts them (e.g. ``filler="essays"``, ``common_freq=10``)."""
    unknown = sorted(set(tasks) - set(RULER_TASKS))
    if unknown:
        raise ValueError(f"unknown RULER tasks {unknown}; expected some of {sorted(RULER_TASKS)}")
    examples = []
    for task in tasks:
        function = RULER_TASKS[task]
        accepted = inspect.signature(function).parameters
        kwargs = {key: value for key, value in task_kwargs.items() if key in accepted}
        for length in context_lengths:
            examples.extend(function(tokenizer, length, seed=seed, samples=samples, split=split, **kwargs))
    return examples


# -- the task ----------------------------------------------------------------------------------------------------


def examples(config, tokenizer) -> list[Example]:
    """`ruler_examples` of the config's tasks (default: all) at its context lengths, one sample each unless
    ``config.samples`` says otherwise."""
    return ruler_examples(
        tokenizer,
        tasks=config.tasks or tuple(RULER_TASKS),
        context_lengths=config.lengths,
        samples=config.samples or 1,
        seed=config.seed,
        split=config.split,
    )


def count(config) -> int:
    return len(config.lengths) * len(config.tasks or RULER_TASKS) * (config.samples or 1)


def describe(config, rows: list[dict]) -> str:
    return (
        f"RULER-style: {joined(config.tasks or RULER_TASKS)} at {joined(config.lengths)} tokens × "
        f"{config.samples or 1} sample(s); {METRIC} ({len(rows)} rows)."
    )


TASK = Task(
    name="ruler",
    title="RULER-style tasks",
    metrics=(MetricSpec("score", f"score ({METRIC})", 2, higher_is_better=True, headline="RULER score"),),
    examples=examples,
    count=count,
    describe=describe,
    subtasks=tuple(RULER_TASKS),
)
