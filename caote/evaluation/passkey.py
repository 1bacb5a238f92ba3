"""Pass keys in plain text: the retrieval prompts on-device runtimes are compared on.

A 5-digit pass key ("The pass key is 60494. Remember it. 60494 is the pass key.") hidden in repetitive filler at
depths from 20 to 90 %, asked for after the document, in plain text with no chat template ("... What is the pass
key? The pass key is"), answered greedily; scored by substring match. The same prompts as `caote.evaluation.niah`'s
pass keys but for the template, which on SmolLM2-135M costs the full cache itself the shallow needles. Protocols as
in NIAH (`--protocols`: the question in the prompt, or asked after the context was compressed).
"""

from __future__ import annotations

from dataclasses import replace

from caote.evaluation.examples import Example
from caote.evaluation.niah import niah_example
from caote.evaluation.tasks import MetricSpec, Task, joined

NAME = "passkey"
DEFAULT_DEPTHS = (20, 28, 36, 43, 51, 59, 67, 74, 82, 90)  # ten depths evenly spaced over 20-90 %


def examples(config, tokenizer) -> list[Example]:
    """One plain-text pass key per context length, depth (default `DEFAULT_DEPTHS`), sample index and protocol."""
    made = []
    for length in config.lengths:
        for depth in config.depths or DEFAULT_DEPTHS:
            for index in range(config.samples or 1):
                for protocol in config.protocols or ("in-prompt",):
                    example = niah_example(
                        tokenizer,
                        length,
                        depth,
                        "passkey",
                        config.seed,
                        config.split,
                        "repeat",
                        16,
                        index,
                        protocol,
                        True,
                    )
                    made.append(replace(example, id=f"{NAME}/{example.id}", task=NAME))
    return made


def count(config) -> int:
    protocols = len(config.protocols or ("in-prompt",))
    return len(config.lengths) * len(config.depths or DEFAULT_DEPTHS) * (config.samples or 1) * protocols


def describe(config, rows: list[dict]) -> str:
    return (
        f"Pass keys: a 5-digit key in repetitive filler, plain text, context {joined(config.lengths)} tokens × depths "
        f"{joined(config.depths or DEFAULT_DEPTHS, '%')} × {config.samples or 1} sample(s) × protocol "
        f"{joined(config.protocols or ('in-prompt',))}; substring match ({len(rows)} rows)."
    )


TASK = Task(
    name=NAME,
    title="Pass keys (plain text)",
    metrics=(MetricSpec("score", "accuracy", 2, higher_is_better=True, binary=True, headline="pass keys"),),
    examples=examples,
    count=count,
    describe=describe,
    figures=("niah_heatmaps",),
)
