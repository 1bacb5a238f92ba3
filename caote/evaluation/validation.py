"""Does a predictor help? ``caote calibrate``'s check on dev excerpts of documents its fit never read.

Each excerpt is read once with the full cache and once per (policy, budget) in lockstep with it
(`caote.evaluation.lockstep`), giving each policy's KL from the full cache. The verdict compares the learned policies
(`LEARNED`) with the best training-free candidate (`CANDIDATES`) at each budget:

    helps  <=>  for one of the learned policies, at every budget b:
                mean KL(learned, b) < mean KL(best candidate at b)  and  lower on >= 2/3 of the excerpts

and "does not help" otherwise; of several that pass, the one of lowest mean KL at the smallest budget is the one
`auto` takes. The table, the verdict and the excerpts' ids are stored in the predictor's metadata
(`caote.predictor.Predictor.validation`); `auto` reads the verdict.
"""

from __future__ import annotations

import hashlib

from caote.defaults import DEFAULT_BLOCK_SIZE
from caote.evaluation.lockstep import block_count, lockstep_results, skippable_blocks
from caote.predictor import VERDICT_DOES_NOT_HELP, VERDICT_HELPS

# the learned policies a predictor serves (plain `learned` is not judged: in every stored validation, three predictors
# at two budgets each, `learned+caote` was lower)
LEARNED = ("learned+caote", "learned-block")
# the training-free policies a learned one must beat, those that can be the best: the paper's bases with CAOTE (plain
# and FastCAOTE left out: on the long grid +caote was the better variant in most cells; TOVA+CAOTE was never the best
# candidate in a stored validation), StreamingLLM at the smallest budget (`SMALLEST_BUDGET_ONLY`), and caote-block,
# the best training-free policy at budget 256 on every long-grid part
CANDIDATES = ("streamingllm", "h2o+caote", "snapkv+caote", "caote-block")
# a window of recent tokens can be the best policy only where the budget is small: in the stored validations
# StreamingLLM came within 5 % of the best candidate at budget 128 and had 1.9-4.4x its KL at 512
SMALLEST_BUDGET_ONLY = ("streamingllm",)
WIN_SHARE = 2 / 3  # the share of excerpts on which the learned policy must be lower


def validate(
    model, tokenizer, predictor_path, texts: list, budgets, bar=None, policies=LEARNED + CANDIDATES, kept=None
) -> dict:
    """KL from the full cache of `LEARNED` (with the predictor at ``predictor_path``) and `CANDIDATES` at every
    budget on ``texts``, and the verdict (`judge`). ``bar``: a progress bar advanced by the blocks each pass
    reads, weighed by what a block costs (`validation_units`). ``policies``: those to run; ``kept``: the rows
    (policy -> budget -> per-excerpt KL) of a validation stored on the same texts and budgets, taken for the others
    as they are (the result lists the ``recomputed`` ones)."""
    runs = validation_runs(policies, budgets)
    fresh: dict[str, dict[str, list[float]]] = {}
    for policy, budget in runs:
        fresh.setdefault(policy, {})[str(budget)] = []
    cost = logits_cost(model)
    for text in texts:
        ids = tokenizer(text.text, return_tensors="pt").input_ids.to(model.device)
        if bar is not None:
            bar.update(pass_units(text.length, None, None, cost))  # the full-cache pass, read before the first result
        for result in lockstep_results(model, ids, runs, predictor=str(predictor_path)):
            fresh[result["policy"]][str(result["budget"])].append(result["kl"])
            if bar is not None:
                bar.update(pass_units(text.length, result["policy"], result["budget"], cost))
    allowed = set(validation_runs(LEARNED + CANDIDATES, budgets))  # a kept row of a cell no longer run is left out
    kept = {
        policy: {b: kl for b, kl in cells.items() if (policy, int(b)) in allowed}
        for policy, cells in (kept or {}).items()
    }
    rows = {**kept, **fresh}
    kl = {policy: rows[policy] for policy in LEARNED + CANDIDATES if policy in rows}
    return {
        "texts": [text.id for text in texts],
        "digests": [digest(text.text) for text in texts],
        "budgets": list(budgets),
        "kl": kl,
        **({} if kept is None else {"recomputed": list(policies)}),
        **judge(kl, list(budgets)),
    }


def validation_runs(policies, budgets) -> list[tuple[str, int]]:
    """The ``(policy, budget)`` pairs a validation of ``policies`` at ``budgets`` runs: every pair but those of
    `SMALLEST_BUDGET_ONLY` above the smallest budget."""
    return [
        (policy, budget)
        for policy in policies
        for budget in budgets
        if policy not in SMALLEST_BUDGET_ONLY or budget == min(budgets)
    ]


def logits_cost(model) -> float:
    """What a validation block costs against a calibration block: every row's logits over the vocabulary besides the
    model's body, ``1 + (vocabulary x hidden) / (the body's weights)`` (SmolLM2-135M: 1.27, as measured)."""
    weights = sum(parameter.numel() for parameter in model.parameters())  # tied weights counted once
    embedding = model.get_input_embeddings().weight
    projection = model.get_output_embeddings().weight
    body = weights - embedding.numel() - (0 if projection is embedding else projection.numel())
    return 1 + projection.numel() / max(body, 1)


def pass_units(length: int, policy: str | None, budget: int | None, cost: float, block_size: int = DEFAULT_BLOCK_SIZE):
    """One validation pass of a ``length``-token excerpt in progress units (a calibration block each): the full
    cache's (``policy`` None) or ``policy`` at ``budget`` from its first block that differs from the full cache's
    (`caote.evaluation.lockstep.skippable_blocks`), each block weighing ``cost`` (`logits_cost`)."""
    blocks = block_count(length, block_size)
    skipped = 0 if policy is None else skippable_blocks(policy, budget, block_size, length)
    return round((blocks - skipped) * cost)


def validation_units(texts: list, policies, budgets, cost: float) -> int:
    """The progress units `validate` advances by: per excerpt its full-cache pass and each of its
    `validation_runs` (`pass_units`)."""
    runs = validation_runs(policies, budgets)
    return sum(
        pass_units(text.length, None, None, cost) + sum(pass_units(text.length, *run, cost) for run in runs)
        for text in texts
    )


def digest(text: str) -> str:
    """A short fingerprint of an excerpt's text, stored beside its id: ``caote validate`` reads a stored
    validation's excerpts again only where both match (a folder may reuse a file name for other text)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def judge(kl: dict, budgets: list[int]) -> dict:
    """The verdict of a validation's ``kl`` (policy -> budget -> per-excerpt KL): ``verdict``, ``learned`` (the
    learned policy it is about: of those meeting the rule, else of all, the one with the lowest mean KL at the
    smallest budget) and a one-line ``summary``."""
    best = {
        budget: min(
            (policy for policy in CANDIDATES if str(budget) in kl.get(policy, {})),
            key=lambda policy: mean(kl[policy][str(budget)]),
        )
        for budget in budgets
    }

    def wins(policy: str, budget: int) -> int:
        ours, theirs = kl[policy][str(budget)], kl[best[budget]][str(budget)]
        return sum(a < b for a, b in zip(ours, theirs))

    def meets(policy: str) -> bool:
        return all(
            mean(kl[policy][str(b)]) < mean(kl[best[b]][str(b)])
            and wins(policy, b) >= WIN_SHARE * len(kl[policy][str(b)])
            for b in budgets
        )

    validated = [policy for policy in LEARNED if policy in kl]
    passing = [policy for policy in validated if meets(policy)]
    learned = min(passing or validated, key=lambda policy: mean(kl[policy][str(budgets[0])]))
    parts = []
    for budget in budgets:
        ours, theirs = mean(kl[learned][str(budget)]), mean(kl[best[budget]][str(budget)])
        count = len(kl[learned][str(budget)])
        parts.append(
            f"b={budget}: {learned} {ours:.4f} vs {best[budget]} {theirs:.4f} "
            f"({f'{ours / theirs - 1:+.0%}' if theirs > 0 else 'both zero' if ours == 0 else 'above zero'}), "
            f"lower on {wins(learned, budget)} of {count}"
        )
    verdict = VERDICT_HELPS if passing else VERDICT_DOES_NOT_HELP
    return {
        "verdict": verdict,
        "learned": learned,
        "best": {str(b): best[b] for b in budgets},
        "summary": "; ".join(parts),
    }


def validation_table(validation: dict) -> str:
    """The validation as a Markdown table (mean KL per policy and budget, the best of each column in bold, – where a
    policy did not run), then the verdict."""
    budgets = [str(budget) for budget in validation["budgets"]]
    kl = validation["kl"]
    lowest = {budget: min(mean(rows[budget]) for rows in kl.values() if budget in rows) for budget in budgets}
    recomputed = validation.get("recomputed")
    note = "" if recomputed is None else f"; rows of {', '.join(recomputed)} recomputed, the others as stored"
    lines = [
        f"validation on {len(validation['texts'])} dev excerpts of documents the fit did not read "
        f"(mean KL from the full cache; lower is better{note}):",
        "| policy | " + " | ".join(f"b={budget}" for budget in budgets) + " |",
        "|---|" + "---|" * len(budgets),
    ]
    for policy in kl:
        cells = []
        for budget in budgets:
            value = mean(kl[policy][budget]) if budget in kl[policy] else None
            cells.append("–" if value is None else f"**{value:.4f}**" if value == lowest[budget] else f"{value:.4f}")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    lines.append(f"verdict: the predictor {validation['verdict']} ({validation['summary']})")
    return "\n".join(lines)
