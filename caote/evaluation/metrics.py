"""Answer scores in [0, 1]: RULER string matching and the LongBench metrics.

Every metric has the signature ``metric(prediction: str, answers: Sequence[str], **kw) -> float`` and is registered
in `METRICS` under the name an `Example.metric` uses. `score` looks a metric up by name; `score_example` also
applies the example's ``meta["metric_kwargs"]`` (LongBench's ``all_classes`` and first-line post-processing).

LongBench metrics follow the official ``metrics.py``/``eval.py`` of THUDM/LongBench (Bai et al. 2023, arXiv
2308.14508): each ground truth is scored separately and the best score counts. ROUGE-L is the ``rouge`` package's
"rouge-l" F (the package LongBench's scorer calls, in the eval extra), so summarisation scores sit next to published
tables; the code similarity uses ``difflib.SequenceMatcher``, which is what ``fuzzywuzzy`` (GPL, unmaintained)
computes without python-Levenshtein.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"\d+")
_PARAGRAPH_ID = re.compile(r"Paragraph (\d+)")


def _checked(answers: Sequence[str]) -> list[str]:
    if isinstance(answers, str):
        answers = [answers]
    answers = list(answers)
    if not answers:
        raise ValueError("a metric needs at least one reference answer")
    return answers


# --- RULER / needle-in-a-haystack string matching -------------------------------------------------------------


def string_match_all(prediction: str, answers: Sequence[str], **kw) -> float:
    """RULER's ``string_match_all``: the fraction of ``answers`` found (case-insensitively) in ``prediction``."""
    answers = _checked(answers)
    lowered = prediction.lower()
    return sum(answer.lower() in lowered for answer in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str], **kw) -> float:
    """RULER's ``string_match_part``: 1 if any of ``answers`` occurs (case-insensitively) in ``prediction``."""
    answers = _checked(answers)
    lowered = prediction.lower()
    return float(any(answer.lower() in lowered for answer in answers))


def substring_match(prediction: str, answers: Sequence[str], **kw) -> float:
    """Needle-in-a-haystack exact match: 1 if an answer is a case-insensitive substring of ``prediction``.

    The same rule as `string_match_part`, under the name the NIAH task reports.
    """
    return string_match_part(prediction, answers)


# --- LongBench ----------------------------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """SQuAD/LongBench normalisation: lowercase, drop ASCII punctuation, drop articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1: overlap = |P ∩ R| (multiset), precision = overlap/|P|, recall = overlap/|R|."""
    overlap = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, answers: Sequence[str], **kw) -> float:
    """LongBench ``qa_f1_score``: max over answers of `token_f1` on `normalize_answer`-ed whitespace tokens."""
    predicted = normalize_answer(prediction).split()
    return max(token_f1(predicted, normalize_answer(answer).split()) for answer in _checked(answers))


def rouge_l(prediction: str, answers: Sequence[str], **kw) -> float:
    """LongBench ``rouge_score`` (summaries): max over answers of the ``rouge`` package's ROUGE-L F (its union-LCS
    "rouge-l", Lin 2004), on the texts as they are; 0 where the package refuses a pair (an empty text)."""
    from rouge import Rouge  # the eval extra

    scorer = Rouge(metrics=["rouge-l"])
    best = 0.0
    for answer in _checked(answers):
        try:
            best = max(best, float(scorer.get_scores([prediction], [answer], avg=True)["rouge-l"]["f"]))
        except Exception:  # noqa: BLE001 - LongBench's scorer scores any pair the package refuses as 0
            continue
    return best


def classification(prediction: str, answers: Sequence[str], all_classes: Sequence[str] = (), **kw) -> float:
    """LongBench ``classification_score`` (trec): 1/k when the true class is among the k class names found in
    ``prediction``, else 0.

    Found names that are proper substrings of the true class are not counted (official rule; the official loop
    removes while iterating, which can skip a removal; this function removes all of them). ``all_classes`` is
    required (it comes from the dataset row).
    """
    if not all_classes:
        raise ValueError("classification needs all_classes")
    best = 0.0
    for truth in _checked(answers):
        found = [name for name in all_classes if name in prediction]
        found = [name for name in found if not (name in truth and name != truth)]
        if truth in found:
            best = max(best, 1.0 / len(found))
    return best


def _number_share(prediction: str, target: str) -> float:
    numbers = _NUMBER.findall(prediction)
    return sum(number == target for number in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction: str, answers: Sequence[str], **kw) -> float:
    """LongBench ``retrieval_score`` (passage_retrieval_en): share of the numbers in ``prediction`` equal to N of
    the answer ``"Paragraph N"`` (0 when the prediction holds no number)."""
    best = 0.0
    for answer in _checked(answers):
        match = _PARAGRAPH_ID.search(answer)
        if match is None:
            raise ValueError(f"a retrieval answer must look like 'Paragraph N', got {answer!r}")
        best = max(best, _number_share(prediction, match.group(1)))
    return best


def count(prediction: str, answers: Sequence[str], **kw) -> float:
    """LongBench ``count_score`` (passage_count): share of the numbers in ``prediction`` equal to the answer."""
    return max(_number_share(prediction, str(answer).strip()) for answer in _checked(answers))


def first_code_line(prediction: str) -> str:
    """LongBench code post-processing: the first line (after leading newlines) holding no `` ` ``, ``#`` or ``//``;
    empty when there is none."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim(prediction: str, answers: Sequence[str], **kw) -> float:
    """LongBench ``code_sim_score`` (lcc, repobench-p): fuzzy ratio of `first_code_line` to the answer.

    Ratio = ``round(100 · difflib.SequenceMatcher(None, line, answer).ratio()) / 100``, i.e. 2·matches/(len+len)
    rounded to whole percent, as ``fuzzywuzzy.fuzz.ratio`` computes it without python-Levenshtein.
    """
    line = first_code_line(prediction)
    return max(round(100 * difflib.SequenceMatcher(None, line, answer).ratio()) / 100 for answer in _checked(answers))


def first_line(prediction: str) -> str:
    """LongBench post-processing for few-shot tasks (trec, triviaqa, samsum, lsht): the first line after leading
    newlines."""
    return prediction.lstrip("\n").split("\n")[0]


METRICS = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "substring_match": substring_match,
    "qa_f1": qa_f1,
    "rouge_l": rouge_l,
    "classification": classification,
    "retrieval": retrieval,
    "count": count,
    "code_sim": code_sim,
}


def score(metric: str, prediction: str, answers: Sequence[str], first_line_only: bool = False, **kw) -> float:
    """``METRICS[metric](prediction, answers, **kw)``; with ``first_line_only`` the prediction is cut to its
    `first_line` first (LongBench's trec/triviaqa/samsum/lsht rule)."""
    try:
        function = METRICS[metric]
    except KeyError:
        raise ValueError(f"unknown metric {metric!r}; expected one of {sorted(METRICS)}") from None
    if first_line_only:
        prediction = first_line(prediction)
    return float(function(prediction, answers, **kw))


def score_example(example, prediction: str) -> float:
    """Score ``prediction`` for an `Example`, passing its ``meta["metric_kwargs"]`` (if any) to `score`."""
    return score(example.metric, prediction, example.answers, **example.meta.get("metric_kwargs", {}))
