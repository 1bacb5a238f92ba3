"""LongBench (Bai et al. 2023, arXiv 2308.14508): the 16 English tasks the CAOTE paper reports, from local files.

Data: the official JSONL files (one JSON object a line with keys ``input, context, answers, length, dataset,
language, all_classes, _id``), read from a directory the user points to as ``<data_dir>/<dataset>.jsonl`` (the
layout of the official ``data.zip``). Nothing is downloaded.

Each row becomes one `Example`, mirroring the official ``pred.py``/``eval.py``:

* the prompt is the official per-dataset template (`DATASET_PROMPTS`) filled with ``context`` and ``input``;
* with ``max_prompt_tokens`` a longer prompt is truncated in the middle: its first and last
  ``max_prompt_tokens // 2`` tokens are kept (official ``pred.py``; it cuts the whole formatted prompt, before
  any chat template);
* ``messages`` is one user message holding that prompt; ``answer_prefix`` is empty;
* ``meta["raw_prompt"]`` is True for trec, triviaqa, samsum, lsht, lcc and repobench-p: the official code feeds
  these few-shot/code prompts **without** the chat template, so a runner must then tokenise
  ``messages[0]["content"]`` as plain text (for example ``caote.generation.generate(model, tokenizer,
  messages[0]["content"], ...)``), and otherwise pass ``messages`` through the chat template;
* ``max_new_tokens`` is the official ``dataset2maxlen``; ``metric`` the official ``dataset2metric`` (names of
  `caote.evaluation.metrics`); ``meta["metric_kwargs"]`` holds what that metric needs beyond the answers
  (``all_classes`` for trec, ``first_line_only`` for trec/triviaqa/samsum): score with
  ``caote.evaluation.metrics.score_example(example, prediction)``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from caote.evaluation.examples import Example
from caote.evaluation.tasks import MetricSpec, Task

LONGBENCH_TASKS = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "gov_report",
    "qmsum",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
_MULTI_DOC = (
    "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
    "given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\n"
    "Answer:"
)
_QASPER_RULES = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question cannot "
    'be answered based on the information in the article, write "unanswerable". If the question is '
    'a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.'
)
DATASET_PROMPTS = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer "
        "the question as concisely as you can, using a single phrase if possible. Do not provide any "
        "explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely "
        "as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: "
        "{input}\n\nAnswer:"
    ),
    "qasper": (
        f"You are given a scientific article and a question. Answer the question {_QASPER_RULES}\n\n"
        f"Article: {{context}}\n\n Answer the question based on the above article {_QASPER_RULES}\n\n"
        "Question: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
        "question based on the above text, only give me the answer and do not output any other "
        "words.\n\nQuestion: {input}\nAnswer:"
    ),
    "hotpotqa": _MULTI_DOC,
    "2wikimqa": _MULTI_DOC,
    "musique": _MULTI_DOC,
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the "
        "query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the "
        "above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n"
        "{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:"
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any "
        "other words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n"
    "{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. "
        "Please carefully read these paragraphs and determine how many unique paragraphs there are "
        "after removing duplicates. In other words, how many non-repeating paragraphs are there in "
        "total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing "
        "duplicates. The output format should only contain the number, such as 1, 2, 3, and so on."
        "\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine "
        "which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract."
        "\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. "
        'The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\n'
        "The answer is: "
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
DATASET_MAX_NEW_TOKENS = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "lcc": 64,
    "repobench-p": 64,
}
DATASET_METRIC = {
    "narrativeqa": "qa_f1",
    "qasper": "qa_f1",
    "multifieldqa_en": "qa_f1",
    "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1",
    "musique": "qa_f1",
    "gov_report": "rouge_l",
    "qmsum": "rouge_l",
    "multi_news": "rouge_l",
    "trec": "classification",
    "triviaqa": "qa_f1",
    "samsum": "rouge_l",
    "passage_count": "count",
    "passage_retrieval_en": "retrieval",
    "lcc": "code_sim",
    "repobench-p": "code_sim",
}
# Official eval.py keeps only the first line of predictions for these (lsht is Chinese, listed for completeness).
FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht"})
# Official pred.py skips the chat template for these.
RAW_PROMPT_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
REQUIRED_KEYS = ("input", "context", "answers", "_id")


def dataset_file(data_dir: str | Path, dataset: str) -> Path:
    """``<data_dir>/<dataset>.jsonl``; a clear error when the dataset is unknown or the file is missing."""
    if dataset not in DATASET_PROMPTS:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; expected one of {LONGBENCH_TASKS}")
    path = Path(data_dir) / f"{dataset}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"LongBench file {path} is missing; put the official {dataset}.jsonl (from the "
            "THUDM/LongBench data.zip) in that directory"
        )
    return path


def read_rows(path: str | Path, max_samples: int | None = None) -> list[dict]:
    """The first ``max_samples`` (all when None) JSON rows of a JSONL file, checked for the required keys."""
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if max_samples is not None and len(rows) >= max_samples:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            missing = [key for key in REQUIRED_KEYS if key not in row]
            if missing:
                raise ValueError(f"{path}:{number}: a LongBench row needs the keys {missing}")
            rows.append(row)
    return rows


def format_prompt(dataset: str, row: dict) -> str:
    """The official prompt of ``dataset`` with the row's ``context`` and ``input`` filled in."""
    return DATASET_PROMPTS[dataset].format(context=row["context"], input=row["input"])


def truncate_middle(tokenizer, text: str, max_tokens: int) -> tuple[str, bool]:
    """``text`` cut to its first and last ``max_tokens // 2`` tokens when it is longer than ``max_tokens`` tokens
    (LongBench's truncate-in-the-middle), and whether it was cut. Slices the text at token offsets."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if len(offsets) <= max_tokens:
        return text, False
    half = max_tokens // 2
    head = text[: offsets[half - 1][1]] if half else ""
    tail = text[offsets[len(offsets) - half][0] :] if half else ""
    return head + tail, True


def longbench_example(dataset: str, row: dict, tokenizer=None, max_prompt_tokens: int | None = None) -> Example:
    """One `Example` from an official row (see the module docstring for how each field is filled)."""
    prompt = format_prompt(dataset, row)
    truncated = False
    if max_prompt_tokens is not None:
        if tokenizer is None:
            raise ValueError("truncating to max_prompt_tokens needs a tokenizer")
        prompt, truncated = truncate_middle(tokenizer, prompt, max_prompt_tokens)
    metric_kwargs: dict = {}
    if DATASET_METRIC[dataset] == "classification":
        metric_kwargs["all_classes"] = list(row.get("all_classes") or [])
    if dataset in FIRST_LINE_TASKS:
        metric_kwargs["first_line_only"] = True
    answers = row["answers"] if isinstance(row["answers"], list) else [row["answers"]]
    meta = dict(
        dataset=dataset,
        length=row.get("length"),
        language=row.get("language"),
        source_id=row["_id"],
        raw_prompt=dataset in RAW_PROMPT_TASKS,
        truncated=truncated,
        metric_kwargs=metric_kwargs,
    )
    return Example(
        id=f"longbench/{dataset}/{row['_id']}",
        task=f"longbench_{dataset}",
        messages=(dict(role="user", content=prompt),),
        answers=tuple(str(a) for a in answers),
        metric=DATASET_METRIC[dataset],
        max_new_tokens=DATASET_MAX_NEW_TOKENS[dataset],
        meta=meta,
    )


def load_longbench(
    data_dir: str | Path,
    datasets: Sequence[str] = LONGBENCH_TASKS,
    tokenizer=None,
    max_prompt_tokens: int | None = None,
    max_samples: int | None = None,
) -> list[Example]:
    """Examples of every dataset in ``datasets`` read from ``<data_dir>/<dataset>.jsonl``, at most ``max_samples``
    each (file order), prompts middle-truncated to ``max_prompt_tokens`` tokens when given (needs ``tokenizer``)."""
    paths = {dataset: dataset_file(data_dir, dataset) for dataset in datasets}  # fail before any work
    return [
        longbench_example(dataset, row, tokenizer, max_prompt_tokens)
        for dataset, path in paths.items()
        for row in read_rows(path, max_samples)
    ]


def longbench_examples(
    tokenizer,
    data_dir: str | Path,
    tasks: Sequence[str] | None = None,
    samples: int | None = None,
    max_length: int | None = None,
) -> list[Example]:
    """Runner entry point, shaped like the NIAH/RULER ones: `load_longbench` of ``tasks`` (default: all 16) with at
    most ``samples`` rows each and prompts middle-truncated to ``max_length`` tokens (no cut when None)."""
    return load_longbench(
        data_dir,
        tuple(tasks) if tasks else LONGBENCH_TASKS,
        tokenizer=tokenizer,
        max_prompt_tokens=max_length,
        max_samples=samples,
    )


# -- the task ----------------------------------------------------------------------------------------------------


def examples(config, tokenizer) -> list[Example]:
    """`longbench_examples` from ``config.data_dir``: the config's tasks (default: all 16), at most
    ``config.samples`` rows each, prompts cut to the longest of ``config.lengths``."""
    return longbench_examples(
        tokenizer, config.data_dir, tasks=config.tasks, samples=config.samples, max_length=max(config.lengths)
    )


TASK = Task(
    name="longbench",
    title="LongBench",
    metrics=(MetricSpec("score", "score", 3, higher_is_better=True, headline="LongBench score"),),
    examples=examples,
    subtasks=LONGBENCH_TASKS,
    needs_data_dir=True,
)
