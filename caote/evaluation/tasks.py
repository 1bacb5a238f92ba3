"""What a task is: a `Task` spec with its `MetricSpec` list. `caote.evaluation.registry` lists the tasks.

A task module (``niah.py``, ``ruler.py``, ...) builds its inputs and ends with one ``Task(...)``; the runner, the
summaries and the results document read everything else from the spec, so adding a task is that module plus its
line in the registry. Tasks come in two kinds:

* **examples**: prompts answered by greedy generation under each policy x budget and scored per example by the
  answer metric named in `Example.metric` (`caote.evaluation.metrics`); the row field is ``score``;
* **texts**: texts read in lockstep with the full cache (`caote.evaluation.lockstep`), giving PPL, KL and
  attention-output fidelity per text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from caote.evaluation.examples import Example


@dataclass(frozen=True)
class MetricSpec:
    """One summarised row field: how to read it, interval it and show it.

    ``binary``: hit-or-miss per example (0 or 1), so means get Wilson intervals; otherwise continuous (percentile
    bootstrap). ``headline``: its column label in the headline table of docs/results.md (None: not there).
    ``blocks``: a row field listing one value per text block, used as the paired units of variant-versus-base
    comparisons when rows have it, and ``blocks_label`` what those values are when not the metric itself.
    """

    name: str
    label: str
    digits: int
    higher_is_better: bool
    binary: bool = False
    headline: str | None = None
    blocks: str | None = None
    blocks_label: str | None = None


class Text(NamedTuple):
    """One text of a texts task: ``unit`` is what intervals resample (its essay: two excerpts of one essay are not
    independent)."""

    id: str
    length: int
    text: str
    unit: str


@dataclass(frozen=True)
class Task:
    """A benchmark of ``caote eval``: its inputs, its metrics and how it shows in the report.

    Exactly one of ``examples`` (``(config, tokenizer) -> list[Example]``) and ``texts`` (``(config, tokenizer) ->
    [Text]``) is set; ``config`` is a `caote.evaluation.config.EvalConfig`. ``count(config)`` is how
    many examples or texts a complete run has (None when only the data knows). ``describe(config, rows)`` is the
    task's line in the Setup section of docs/results.md. ``subtasks``: the names ``--tasks`` accepts (summaries then
    add one table per sub-task). ``figures``: extra plots by name in `caote.reports.plots.FIGURES`.
    """

    name: str
    title: str
    metrics: tuple[MetricSpec, ...]
    examples: Callable[..., list[Example]] | None = None
    texts: Callable[..., list[Text]] | None = None
    count: Callable[..., int] | None = None
    describe: Callable[..., str] | None = None
    subtasks: tuple[str, ...] = ()
    figures: tuple[str, ...] = ()
    needs_data_dir: bool = False

    def __post_init__(self):
        if (self.examples is None) == (self.texts is None):
            raise ValueError(f"task {self.name!r} needs exactly one of examples= and texts=")


def joined(values, suffix: str = "") -> str:
    """``"1024, 2048"``, ``"50%, 90%"`` (floats written with ``:g``): how Setup lines list a grid axis."""
    return ", ".join(f"{value:g}{suffix}" if isinstance(value, float) else f"{value}{suffix}" for value in values)
