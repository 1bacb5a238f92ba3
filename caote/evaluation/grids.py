"""The grids of ``caote eval report``: which tasks run at which sizes, and how many rows a complete run writes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from caote.evaluation.config import DEFAULT_POLICIES, EvalConfig
from caote.evaluation.reference import FULL
from caote.evaluation.registry import TASKS
from caote.policies import expand_policies, hindsight_policies


@dataclass(frozen=True)
class GridPart:
    """One task of a grid at its sizes (``subtasks`` and ``depths`` None: the task's defaults; ``model``,
    ``policies`` and ``budgets`` None: the run's model, the grid's policies and budgets)."""

    task: str
    lengths: tuple[int, ...]
    samples: int
    subtasks: tuple[str, ...] | None = None
    depths: tuple[float, ...] | None = None
    protocols: tuple[str, ...] | None = None
    extra_policies: tuple[str, ...] = ()  # run on this part only (ablations), after the grid's policies
    model: str | None = None
    policies: tuple[str, ...] | None = None
    budgets: tuple[int, ...] | None = None
    scored_tail: int | None = None  # texts: score only the last tokens' predictions (`lockstep.scored_blocks`)
    fidelity: bool = True  # texts: measure the attention-output error
    label: str | None = None  # its name in the report and its rows' folder (None: the task's name)

    @property
    def key(self) -> str:
        return self.label or self.task


@dataclass(frozen=True)
class Grid:
    """Budgets, answer length and the parts (run, and shown as sections of docs/results.md, in this order)."""

    name: str
    budgets: tuple[int, ...]
    max_new_tokens: int
    parts: tuple[GridPart, ...]
    policies: tuple[str, ...] | None = None  # the grid's own policies, used unless --policies is given
    notes: tuple[str, ...] = ()  # lines for the Setup section of results.md
    beyond: tuple[str, ...] = ()  # our policies beyond the paper: run on every part, judged in their own section
    own_document: str | None = None  # with --docs: its own file under docs/results/, linked from results.md


# try: the README's first command, real work on the bundled model in minutes (its measured time:
# `caote.evaluation.cli.TRY_GRID_TIME`): the full cache vs the paper's bases, each plain and with +caote, and
# streamingllm, at two budgets; NIAH hits and KL from the full cache
TRY_GRID = Grid(
    "try",
    budgets=(128, 256),
    max_new_tokens=24,
    parts=(
        GridPart("niah", lengths=(1024,), samples=1, depths=(50, 90)),
        GridPart("perplexity", lengths=(1024,), samples=1),
    ),
    policies=("full", "streamingllm", "h2o", "h2o+caote", "tova", "tova+caote", "snapkv", "snapkv+caote"),
)


# quick (the smoke grid; docs/results.md until the standard grid replaced it): about 23 min of rows on 2 idle cores
# (31 policy x budget settings: ~124 answers of ~1k-token prompts plus two 1k-token texts; summed row seconds of its
# rows of 2026-11-29); the full grid takes hours
QUICK_GRID = Grid(
    "quick",
    budgets=(128, 256, 512),
    max_new_tokens=24,
    parts=(
        GridPart("perplexity", lengths=(1024,), samples=2),
        GridPart("niah", lengths=(1024,), samples=1, depths=(50, 90)),
        GridPart("ruler", lengths=(1024,), samples=1, subtasks=("niah_multikey", "variable_tracking")),
    ),
)
# standard (docs/results.md): the grid whose intervals separate policies: 20 excerpts of distinct essays for PPL / KL
# / fidelity (the essay is the bootstrap unit), 10 NIAH examples per policy x budget cell and question protocol,
# every paper policy plus the oracle ceiling (texts only) at three budgets, and our policies beyond the paper (judged
# in their own section of docs/results.md). NIAH depths are those the full cache solves with the bundled model at 1k
# tokens (20-90 %: checked on two samples each; at 10 % it repeats the question); RULER stays out while the full
# cache scores 0 on it with the bundled model. Hours on two cores: it saves every row and resumes.
STANDARD_GRID = Grid(
    "standard",
    budgets=(128, 256, 512),
    max_new_tokens=16,
    parts=(
        GridPart(
            "perplexity",
            lengths=(1024,),
            samples=20,
            # ablation: rss vs mean over a KV group (not for H2O: its rows cost the most, and the ablation asks the
            # same question of every base); the learned base plain and with FastCAOTE beside learned+caote
            extra_policies=("tova+caote/mean", "snapkv+caote/mean", "learned", "learned+fastcaote"),
        ),
        GridPart(
            "niah", lengths=(1024,), samples=2, depths=(20, 40, 60, 80, 90), protocols=("in-prompt", "question-after")
        ),
    ),
    policies=tuple(expand_policies("paper")) + ("oracle",),
    beyond=("caote-window", "caote-block", "caote-ahead", "learned+caote"),
    notes=(
        "RULER-style tasks are not in this grid: with the bundled 135M model the full cache itself scores 0 on them "
        "(the quick grid's rows, in git history), so they cannot separate policies; `--grid full` keeps them for "
        "bigger models.",
        "NIAH depth 10 % is left out: the full cache answers it by repeating the question with this model.",
    ),
)
# long (docs/results/long.md): eviction where it is used, at 4k-8k tokens on two models and two kinds of text; only
# the last 1,024 tokens' predictions are scored (a pass costs the model body over every token) and the fidelity
# probe is off. Essays at these lengths are windows of the split's essays joined into one stream (9 test essays
# reach 4k, one 8k). Parts by model (one load each): SmolLM2 at 4k (essays, code, NIAH), Gemma-3 270M at 8k
# (essays, code, NIAH in both protocols at three budgets: the model finds 9 of 10 pass keys with the full cache).
LONG_POLICIES = (
    "streamingllm",
    "h2o",
    "h2o+caote",
    "tova",
    "tova+caote",
    "snapkv+caote",
    "caote-block",
    "oracle",
    "learned+caote",
)
LONG_TAIL = 1024
LONG_NIAH_POLICIES = ("full", "h2o", "h2o+caote", "tova+caote")
LONG_NIAH_DEPTHS = (20, 40, 60, 80, 90)  # x 2 samples: 10 examples per cell and protocol
# Gemma-3 at 8k, where retrieval survives the length: every causal policy family of the long grid but plain H2O /
# TOVA, at the budgets where a quarter, an eighth and a thirty-second of the prompt is kept
GEMMA_NIAH_POLICIES = (
    "full",
    "streamingllm",
    "h2o+caote",
    "tova+caote",
    "snapkv+caote",
    "caote-block",
    "learned+caote",
)
GEMMA_NIAH_BUDGETS = (256, 1024, 2048)
# Gemma-3's texts also run learned-block, the learned policy its predictor's validation names (auto's choice there)
GEMMA_EXTRA = ("learned-block",)


def _long_text_part(task: str, length: int, model: str, label: str, extra: tuple[str, ...] = ()) -> GridPart:
    """A texts part of the long grid: 10 texts, the last `LONG_TAIL` tokens scored, no fidelity; ``extra``: policies
    beyond the grid's."""
    return GridPart(
        task, (length,), 10, model=model, scored_tail=LONG_TAIL, fidelity=False, label=label, extra_policies=extra
    )


def _long_niah_part(
    length: int,
    model: str,
    label: str,
    policies: tuple[str, ...] = LONG_NIAH_POLICIES,
    budgets: tuple[int, ...] = (256,),
    protocols: tuple[str, ...] = ("in-prompt",),
) -> GridPart:
    """A NIAH part of the long grid: 10 examples per cell and protocol (default: in-prompt, `LONG_NIAH_POLICIES`
    at budget 256)."""
    return GridPart(
        "niah",
        (length,),
        2,
        depths=LONG_NIAH_DEPTHS,
        protocols=protocols,
        model=model,
        policies=policies,
        budgets=budgets,
        label=label,
    )


LONG_GRID = Grid(
    "long",
    budgets=(256, 1024),
    max_new_tokens=16,
    parts=(
        _long_text_part("perplexity-joined", 4096, "smollm2-135m", "smollm2-essays-4k"),
        _long_text_part("perplexity-code", 4096, "smollm2-135m", "smollm2-code-4k"),
        _long_niah_part(4096, "smollm2-135m", "smollm2-niah-4k"),
        _long_text_part("perplexity-joined", 8192, "gemma3-270m", "gemma3-essays-8k", GEMMA_EXTRA),
        _long_niah_part(
            8192,
            "gemma3-270m",
            "gemma3-niah-8k",
            GEMMA_NIAH_POLICIES,
            GEMMA_NIAH_BUDGETS,
            ("in-prompt", "question-after"),
        ),
        _long_text_part("perplexity-code", 8192, "gemma3-270m", "gemma3-code-8k", GEMMA_EXTRA),
    ),
    policies=LONG_POLICIES,
    notes=(
        f"Only the predictions of each text's last {LONG_TAIL} tokens are scored (logits only there, in every pass); "
        "no attention-output fidelity.",
        "Essays at 4k-8k tokens are windows of the test split's essays joined into one stream (file-name order, a "
        "blank line between essays): a window spans several essays and is the unit the intervals resample.",
        "learned+caote uses the model's committed predictor for the budget, each from two weighted rounds of "
        "`caote calibrate` on dev code: Gemma-3's on 20 excerpts of 2,048 tokens (four sliding windows) at budget "
        "128; SmolLM2's, at these budgets, on 40 excerpts of 1,024 and 10 of 4,096, each length weighed alike, at "
        "budgets 128 and 1024.",
    ),
    own_document="long.md",
)
FULL_GRID = Grid(
    "full",
    budgets=(128, 256, 512),
    max_new_tokens=64,
    parts=(
        GridPart("perplexity", lengths=(2048,), samples=6),
        GridPart("niah", lengths=(1024, 2048), samples=2, depths=(10, 30, 50, 70, 90)),
        GridPart(
            "ruler",
            lengths=(1024, 2048),
            samples=3,
            subtasks=("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words"),
        ),
    ),
)


def part_configs(grid: Grid, config: EvalConfig, runs: Path) -> dict[str, EvalConfig]:
    """One `EvalConfig` per part of ``grid``, by `GridPart.key` (seed, split and progress from ``config``; its model
    unless the part names one; its policies, or when none were given the part's or the grid's own, hindsight ones
    on texts tasks only), writing rows to ``runs/<key>``."""
    configs = {}
    if len({part.key for part in grid.parts}) < len(grid.parts):
        raise ValueError(f"grid {grid.name!r} has two parts of one name: give them distinct labels")
    for part in grid.parts:
        policies = list(config.policies or part.policies or grid.policies or expand_policies(DEFAULT_POLICIES))
        causal = [name for name in policies if name not in hindsight_policies(policies)]
        configs[part.key] = EvalConfig(
            benchmark=part.task,
            model=part.model or config.model,
            policies=(policies if TASKS[part.task].texts is not None else causal)
            + list(part.extra_policies)
            + [name for name in grid.beyond if name not in policies],
            budgets=list(part.budgets or grid.budgets),
            lengths=list(part.lengths),
            samples=part.samples,
            seed=config.seed,
            split=config.split,
            out=runs / part.key,
            tasks=list(part.subtasks) if part.subtasks else None,
            depths=list(part.depths) if part.depths else None,
            protocols=list(part.protocols) if part.protocols else None,
            progress=config.progress,
            max_new_tokens=grid.max_new_tokens,
            scored_tail=part.scored_tail,
            fidelity=part.fidelity,
        )
    return configs


GRIDS = {grid.name: grid for grid in (TRY_GRID, QUICK_GRID, STANDARD_GRID, LONG_GRID, FULL_GRID)}


def planned_rows(configs: dict[str, EvalConfig]) -> dict[str, int]:
    """Rows a complete run writes per part (full once per example + evicting policies x budgets), for every part
    whose task can count its examples."""
    planned = {}
    for name, config in configs.items():
        count = TASKS[config.benchmark].count
        if count is not None:
            per_example = 1 + len([p for p in config.policies if p != FULL]) * len(config.budgets)
            planned[name] = per_example * count(config)
    return planned
