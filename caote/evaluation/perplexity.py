"""The perplexity / KL / fidelity tasks: Paul Graham essay excerpts read in lockstep with the full cache.

The texts are excerpts of distinct essays of the chosen split (`caote.evaluation.data.essay_excerpts`, ordered by
seed); every policy x budget of a text is compared with one full-cache pass over it (`caote.evaluation.lockstep`),
which measures PPL, KL from the full cache and the attention-output fidelity together. ``perplexity`` reports all
three, ``fidelity`` only the last.
"""

from __future__ import annotations

from caote.evaluation.data import code_excerpts, essay_excerpts, joined_essay_excerpts
from caote.evaluation.reference import FULL
from caote.evaluation.tasks import MetricSpec, Task, Text, joined

DEFAULT_TEXTS = 2


# the kinds of text (`caote.evaluation.data`): Paul Graham essays, Python source, and for lengths few essays reach the
# essays of a split joined into one stream; each with its excerpt function and text-id prefix
SOURCES = {
    "essays": (essay_excerpts, "essay"),
    "code": (code_excerpts, "code"),
    "essays-joined": (joined_essay_excerpts, "essays"),
}
DOMAINS = tuple(SOURCES)


def domain_texts(
    tokenizer, domain: str, lengths: list[int], samples: int | None, split: str = "test", seed: int = 0, every=False
) -> list[Text]:
    """``samples`` excerpts of each length (tokens) of ``domain``, one per distinct document while there are enough
    (`caote.evaluation.data.document_excerpts`; ``every``: all non-overlapping excerpts), ids
    ``essay-<name>-<length>``, ``code-<module>-<length>`` (``-k`` for a document's k-th excerpt) or
    ``essays-joined<k>-<length>`` (the k-th window of the joined essays)."""
    if domain not in SOURCES:
        raise ValueError(f"unknown domain {domain!r}; expected one of {', '.join(DOMAINS)}")
    excerpts, prefix = SOURCES[domain]
    result = []
    for length in lengths:
        seen: dict[str, int] = {}
        for unit, text in excerpts(tokenizer, length, None if every else samples, split, seed):
            seen[unit] = seen.get(unit, 0) + 1
            stem = unit.removesuffix(".py")
            text_id = f"{prefix}-{stem}-{length}" + (f"-{seen[unit]}" if seen[unit] > 1 else "")
            result.append(Text(text_id, length, text, unit))
    return result


def domain_config_texts(domain: str):
    """``texts(config, tokenizer)`` of a task over ``domain``: `domain_texts` of the config's lengths, split and seed
    (`DEFAULT_TEXTS` per length unless ``config.samples``)."""

    def config_domain_texts(config, tokenizer) -> list[Text]:
        samples = config.samples or DEFAULT_TEXTS
        return domain_texts(tokenizer, domain, config.lengths, samples, config.split, config.seed)

    return config_domain_texts


config_texts = domain_config_texts("essays")  # the essay tasks' texts


def count(config) -> int:
    return len(config.lengths) * (config.samples or DEFAULT_TEXTS)


def describe(config, rows: list[dict], kind: str = "excerpts of distinct Paul Graham essays") -> str:
    full_ppl = [row["ppl_full"] for row in rows if row["policy"] == FULL]
    if rows and not all(row.get("unit") for row in rows):  # rows written before texts were distinct essays
        kind = "Paul Graham essay excerpts (seeded shuffles of the split, which can repeat essays)"
    measured = "Perplexity / KL"
    if config.scored_tail:
        measured += f" (of the last {config.scored_tail} tokens' predictions)"
    if config.fidelity:
        measured += " / fidelity"
    return (
        f"{measured}: {config.samples or DEFAULT_TEXTS} {kind} "
        f"({config.split} split) of up to {joined(config.lengths)} tokens, each policy against one full-cache pass "
        f"({len(rows)} rows). "
        + ("Full-cache PPL per text: " + ", ".join(f"{ppl:.2f}" for ppl in full_ppl) + "." if full_ppl else "")
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


def domain_task(name: str, title: str, domain: str, kind: str) -> Task:
    """A perplexity / KL task (the metrics of `TASK`) over the texts of ``domain``, described as ``kind``."""
    return Task(
        name=name,
        title=title,
        metrics=TASK.metrics,
        texts=domain_config_texts(domain),
        count=count,
        describe=lambda config, rows: describe(config, rows, kind),
        figures=("fidelity_layers",),
    )


CODE_TASK = domain_task(
    "perplexity-code",
    "Perplexity and KL on Python source code",
    "code",
    "excerpts of distinct Python 3.11.7 standard-library files",
)
JOINED_TASK = domain_task(
    "perplexity-joined",
    "Perplexity and KL on joined essays",
    "essays-joined",
    "windows of the split's Paul Graham essays joined into one stream (a window spans essays)",
)
