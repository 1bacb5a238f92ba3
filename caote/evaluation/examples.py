"""The unit every generation task produces and the runner answers."""

from __future__ import annotations

from dataclasses import dataclass, field

# How a prompt meets the cache: ``in-prompt`` feeds the whole prompt block by block, the question inside its last
# block; the others compress the context first and then append the question, either uncompressed with the answer
# (``question-after``: kvpress and most leaderboards) or evicted like everything else, within the budget
# (``question-after-bounded``: `caote.pipeline`'s default). Values: the pipeline's ``compress`` setting.
PROTOCOLS = {"in-prompt": None, "question-after": "context", "question-after-bounded": "all"}


def row_protocol(row: dict) -> str:
    """The protocol a row was answered under (rows written before protocols existed were ``in-prompt``)."""
    return row.get("protocol") or "in-prompt"


@dataclass(frozen=True)
class Example:
    """One prompt to answer and how to score the answer.

    ``messages`` go through the model's chat template (``answer_prefix`` is appended after the assistant turn
    opens and counts as part of the prompt); ``metric`` names a function of `caote.evaluation.metrics` taking
    ``(prediction, answers)`` and returning a score in [0, 1]. ``meta`` holds grid coordinates (context length,
    depth, ...) that summaries group by. ``question``: the end of the last user message that the question-after
    protocols append after the context is compressed (``protocol``, see `PROTOCOLS`).
    """

    id: str
    task: str
    messages: tuple[dict, ...]
    answers: tuple[str, ...]
    metric: str
    max_new_tokens: int
    answer_prefix: str = ""
    meta: dict = field(default_factory=dict)
    question: str = ""
    protocol: str = "in-prompt"

    def __post_init__(self):
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {self.protocol!r} (choose from {', '.join(PROTOCOLS)})")
        if self.protocol != "in-prompt" and not self.messages[-1]["content"].endswith(self.question or "\0"):
            raise ValueError(f"{self.protocol} needs the question that ends the last message")

    def context(self) -> str:
        """The last user message without its question (what question-after protocols compress first)."""
        content = self.messages[-1]["content"]
        return content[: len(content) - len(self.question)]
