"""Metrics against hand-computed values (LongBench and RULER definitions)."""

from __future__ import annotations

import pytest

from caote.evaluation import metrics
from caote.evaluation.examples import Example
from caote.evaluation.metrics import (
    METRICS,
    classification,
    code_sim,
    count,
    first_code_line,
    first_line,
    normalize_answer,
    qa_f1,
    retrieval,
    rouge_l,
    score,
    score_example,
    string_match_all,
    string_match_part,
    substring_match,
)


def test_normalize_answer_drops_case_punctuation_articles_and_extra_spaces():
    assert normalize_answer("The  Cat's hat, a THING!") == "cats hat thing"
    assert normalize_answer("An apple\tand an\norange.") == "apple and orange"


def test_qa_f1_by_hand():
    # "the cat sat" -> [cat, sat]; "cat sat on mat" -> [cat, sat, on, mat]; overlap 2: P = 1, R = 1/2, F1 = 2/3.
    assert qa_f1("the cat sat", ["cat sat on mat"]) == pytest.approx(2 / 3)
    # Multiset overlap: [dog, dog, cat] vs [dog, bird]: overlap 1, P = 1/3, R = 1/2, F1 = 0.4.
    assert qa_f1("dog dog cat", ["dog bird"]) == pytest.approx(0.4)
    assert qa_f1("nothing shared", ["cat"]) == 0.0
    # Best of several ground truths counts.
    assert qa_f1("Paris.", ["London", "paris"]) == 1.0


def test_rouge_l_is_the_rouge_package_as_longbench_scores_it():
    # the package's union-LCS counts distinct words: "the cat on mat" are 4 of the 5 distinct words on each side
    assert rouge_l("the cat sat on the mat", ["the cat lay on the mat"]) == pytest.approx(0.8)
    # LCS of [a b c d] and [b d e] is [b d]: P = 2/4, R = 2/3, F = 2PR/(P+R) = 4/7
    assert rouge_l("a b c d", ["b d e"]) == pytest.approx(4 / 7)
    # no lower-casing or punctuation stripping (LongBench passes the texts as they are)
    assert rouge_l("The Cat, sat.", ["the cat sat"]) == pytest.approx(1 / 3)
    assert rouge_l("", ["anything"]) == 0.0 and rouge_l("words", [""]) == 0.0  # the package refuses empty texts
    assert rouge_l("same words here", ["x y", "same words here"]) == pytest.approx(1.0)  # best ground truth


def test_classification_counts_matched_class_names():
    classes = ["Food", "Food item", "City"]
    assert classification("Food item", ["Food item"], all_classes=classes) == 1.0  # "Food" is inside the truth
    assert classification("City or Food item", ["Food item"], all_classes=classes) == 0.5
    assert classification("City", ["Food item"], all_classes=classes) == 0.0
    assert classification("Food item", ["Food"], all_classes=classes) == 0.5  # both "Food" and "Food item" found
    assert classification("no class at all", ["City"], all_classes=classes) == 0.0
    with pytest.raises(ValueError):
        classification("City", ["City"])


def test_retrieval_share_of_numbers_naming_the_paragraph():
    assert retrieval("Paragraph 12", ["Paragraph 12"]) == 1.0
    assert retrieval("Paragraph 3 or Paragraph 12", ["Paragraph 12"]) == 0.5
    assert retrieval("I do not know", ["Paragraph 12"]) == 0.0
    assert retrieval("Paragraph 1", ["Paragraph 12"]) == 0.0
    with pytest.raises(ValueError):
        retrieval("1", ["twelve"])


def test_count_share_of_numbers_equal_to_the_answer():
    assert count("There are 7 unique paragraphs, not 8", ["7"]) == 0.5
    assert count("7", ["7"]) == 1.0
    assert count("seven", ["7"]) == 0.0


def test_code_sim_uses_first_non_comment_line_and_fuzzy_ratio():
    assert first_code_line("\n# comment\n// also\n```python\n    return x + 1\nmore") == "    return x + 1"
    assert first_code_line("# only comments") == ""
    assert code_sim("# comment\n    return x + 1\n", ["    return x + 1"]) == 1.0
    # "retur x" vs "return x": 7 matching characters, ratio 2*7/(7+8) = 0.9333 -> rounded to 0.93.
    assert code_sim("retur x", ["return x"]) == pytest.approx(0.93)
    assert code_sim("# nothing", ["return x"]) == 0.0


def test_ruler_string_matching():
    assert string_match_all("A 123, b 456", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_part("A 123, b 456", ["123", "456", "789"]) == 1.0
    assert string_match_part("none", ["123"]) == 0.0
    assert substring_match("The pass key is 71432.", ["71432"]) == 1.0
    assert substring_match("the SECRET word is Violet", ["violet"]) == 1.0
    assert substring_match("7143", ["71432"]) == 0.0


def test_first_line_post_processing_through_score():
    assert first_line("\n\nParis\nis the capital") == "Paris"
    assert score("qa_f1", "\nParis\nis the capital", ["Paris"], first_line_only=True) == 1.0
    # Without it: [paris, is, capital] vs [paris]: P = 1/3, R = 1, F1 = 0.5.
    assert score("qa_f1", "\nParis\nis the capital", ["Paris"]) == pytest.approx(0.5)


def test_score_example_passes_metric_kwargs():
    example = Example(
        id="x",
        task="longbench_trec",
        messages=({"role": "user", "content": "q"},),
        answers=("City",),
        metric="classification",
        max_new_tokens=8,
        meta={"metric_kwargs": {"all_classes": ["City", "Food"], "first_line_only": True}},
    )
    assert score_example(example, "City\nFood") == 1.0  # the second line is cut before matching
    assert score_example(example, "Food or City") == 0.5


def test_registry_and_errors():
    assert set(METRICS) == {
        "string_match_all",
        "string_match_part",
        "substring_match",
        "qa_f1",
        "rouge_l",
        "classification",
        "retrieval",
        "count",
        "code_sim",
    }
    assert all(callable(function) for function in METRICS.values())
    with pytest.raises(ValueError, match="unknown metric"):
        score("bleu", "a", ["a"])
    with pytest.raises(ValueError):
        metrics.qa_f1("a", [])
    assert string_match_all("abc", "abc") == 1.0  # a bare string is one answer, not a list of characters


@pytest.mark.parametrize("name", sorted(METRICS))
def test_every_metric_stays_in_unit_interval(name):
    kwargs = {"all_classes": ["City", "Paragraph 2"]} if name == "classification" else {}
    answers = ["Paragraph 2"]
    for prediction in ("", "Paragraph 2", "Paragraph 2 and 2 and 3", "completely different text 9"):
        value = score(name, prediction, answers, **kwargs)
        assert 0.0 <= value <= 1.0
