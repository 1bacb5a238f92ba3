"""The perplexity / KL / fidelity tasks: Paul Graham essay excerpts read in lockstep with the full cache.

The texts are essays of the chosen split (`caote.evaluation.data.haystack`, shuffled by seed); every policy x
budget of a text runs in one `caote.evaluation.lockstep` pass, which measures PPL, KL from the full cache and the
attention-output fidelity together. ``perplexity`` reports all three, ``fidelity`` only the last.
"""

from __future__ import annotations

from caote.evaluation.data import haystack
from caote.evaluation.reference import FULL
from caote.evaluation.tasks import MetricSpec, Task, joined

DEFAULT_TEXTS = 2


def texts(
    tokenizer, lengths: list[int], samples: int, split: str = "test", seed: int = 0
) -> list[tuple[str, int, str]]:
    """``(id, length, text)`` triples: ``samples`` essay excerpts of each length (tokens), shuffled by ``seed + i``."""
    return [
        (
            f"essays-{split}-{length}-seed{seed + index}",
            length,
            haystack(tokenizer, length, split=split, seed=seed + index, kind="essays"),
        )
        for length in lengths
        for index in range(samples)
    ]


def config_texts(config, tokenizer) -> list[tuple[str, int, str]]:
    """`texts` of the config's lengths, split and seed (`DEFAULT_TEXTS` per length unless ``config.samples``)."""
    return texts(tokenizer, config.lengths, config.samples or DEFAULT_TEXTS, config.split, config.seed)


def count(config) -> int:
    return len(config.lengths) * (config.samples or DEFAULT_TEXTS)


def describe(config, rows: list[dict]) -> str:
    full_ppl = [row["ppl_full"] for row in rows if row["policy"] == FULL]
    return (
        f"Perplexity / KL / fidelity: {config.samples or DEFAULT_TEXTS} Paul Graham essay excerpts ({config.split} "
        f"split) of {joined(config.lengths)} tokens, each policy in lockstep with the full cache ({len(rows)} rows). "
        "Full-cache PPL per text: " + ", ".join(f"{ppl:.2f}" for ppl in full_ppl) + "."
    )


FIDELITY = MetricSpec(
    "fidelity",
    "attention-output relative error (mean over layers)",
    3,
    higher_is_better=False,
    headline="attn-output error",
    blocks="fidelity_per_block",
)

TASK = Task(
    name="perplexity",
    title="Perplexity, KL from the full cache, attention-output fidelity",
    metrics=(
        MetricSpec(
            "ppl_delta",
            "PPL − PPL(full)",
            3,
            higher_is_better=False,
            headline="PPL − full",
            blocks="nll_blocks",
            blocks_label="NLL/token",
        ),
        MetricSpec("kl", "KL(full ‖ policy), nats/token", 4, higher_is_better=False, headline="KL", blocks="kl_blocks"),
        FIDELITY,
    ),
    texts=config_texts,
    count=count,
    describe=describe,
    figures=("fidelity_layers",),
)

FIDELITY_TASK = Task(
    name="fidelity",
    title="Attention-output fidelity",
    metrics=(FIDELITY,),
    texts=config_texts,
    count=count,
    describe=describe,
    figures=("fidelity_layers",),
)
