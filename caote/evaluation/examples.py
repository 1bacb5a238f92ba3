"""The unit every generation task produces and the runner answers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    """One prompt to answer and how to score the answer.

    ``messages`` go through the model's chat template (``answer_prefix`` is appended after the assistant turn
    opens and counts as part of the prompt); ``metric`` names a function of `caote.evaluation.metrics` taking
    ``(prediction, answers)`` and returning a score in [0, 1]. ``meta`` holds grid coordinates (context length,
    depth, ...) that summaries group by.
    """

    id: str
    task: str
    messages: tuple[dict, ...]
    answers: tuple[str, ...]
    metric: str
    max_new_tokens: int
    answer_prefix: str = ""
    meta: dict = field(default_factory=dict)
