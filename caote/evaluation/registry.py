"""Every task of ``caote eval``, by name: the one place a task is registered (one line each, in report order).

The headline table and the Setup section of docs/results.md list tasks in this order; ``caote eval`` accepts these
names plus `REPORT`, the grid that writes docs/results.md (`caote.evaluation.grids`).
"""

from __future__ import annotations

from caote.evaluation import longbench, niah, passkey, perplexity, ruler
from caote.evaluation.tasks import Task

TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        niah.TASK,
        passkey.TASK,
        ruler.TASK,
        longbench.TASK,
        perplexity.TASK,
        perplexity.FIDELITY_TASK,
        perplexity.CODE_TASK,
        perplexity.JOINED_TASK,
    )
}

REPORT = "report"
BENCHMARKS = (*TASKS, REPORT)
