"""``caote validate``: judge a predictor file again and write it with its verdict (`caote.evaluation.validation`).

Every argument is checked before torch, transformers and the model load; a bad one is a `UsageError` (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from caote.arguments import (
    UsageError,
    add_subcommand,
    check_loaded_predictor,
    check_model,
    warn_if_threads_share_cores,
)
from caote.calibration_cli import (
    add_run_arguments,
    add_source_arguments,
    add_validation_budgets,
    all_texts,
    check_source,
    check_validation_budgets,
    default_validation_budgets,
    excerpt_length,
    load_for,
    load_predictor,
    save,
    validate_into,
)
from caote.defaults import CALIBRATION_BUDGETS

HELP = "judge a predictor file again: does its learned policy beat the best training-free policy?"
DESCRIPTION = (
    "Validate a predictor written by caote calibrate again and write it with its verdict to --out, where the 'auto' "
    "policy reads it: each excerpt is read with the full cache and under every learned and training-free policy, "
    "whose KL from the full cache decides whether a learned policy is lower at every budget. It reads the excerpts "
    "of the predictor's stored validation when the texts hold them (a like-for-like table), otherwise excerpts of "
    "documents the predictor was not fitted on."
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``caote validate``."""
    return add_subcommand(subparsers, "validate", run_validate, HELP, DESCRIPTION, add_arguments)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``caote validate``'s options, in --help order: the predictor, what it reads and writes, the validation."""
    parser.add_argument("predictor", type=Path, metavar="PREDICTOR", help="the predictor file (of --model) to judge")
    add_source_arguments(parser)
    add_validation_budgets(parser)
    parser.add_argument(
        "--recompute",
        metavar="POLICIES",
        help="recompute only these policies' rows, comma-separated, and keep the others' from the stored validation "
        "(which must be read again: same excerpts and budgets); a policy it lacks is computed too",
    )
    add_run_arguments(parser)


def recompute_list(text: str) -> list[str]:
    """``"learned-block,caote-block"`` -> the validation's policies to recompute, or a `UsageError`."""
    from caote.evaluation.validation import CANDIDATES, LEARNED

    policies = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [policy for policy in policies if policy not in LEARNED + CANDIDATES]
    if not policies or unknown:
        raise UsageError(
            f"--recompute takes policies of the validation ({', '.join(LEARNED + CANDIDATES)}), got {text!r}"
        )
    return policies


def run_validate(args: argparse.Namespace) -> int:
    """Validate the predictor again, save it with its verdict and print the table."""
    budgets = check_source(args)
    if not args.predictor.is_file():
        raise UsageError(f"'{args.predictor}' is not a file (write one with caote calibrate)")
    check_model(args.model)
    given = load_predictor(args.predictor, "PREDICTOR", args.model)
    check_validation_budgets(budgets)
    policies, kept = validation_plan(args, given, budgets)
    model, tokenizer = load_for(args)
    check_loaded_predictor(args.predictor, model, "PREDICTOR")
    length, _ = excerpt_length(args, model, stored_length(given))
    held, read_before = held_excerpts(args, tokenizer, length, given, recompute=kept is not None)
    warn_if_threads_share_cores(args.threads)  # after every check, so that a refusal stays one line
    if budgets is None:
        stored = given.validation
        first = given.details.get("budgets", CALIBRATION_BUDGETS)[0]
        budgets = list(stored["budgets"]) if stored is not None else default_validation_budgets(first)
    from tqdm.auto import tqdm

    from caote.evaluation.validation import logits_cost, validation_units

    total = validation_units(held, policies, budgets, logits_cost(model))
    with tqdm(total=total, desc="caote validate", unit="block") as bar:
        verdict = validate_into(given, model, tokenizer, held, budgets, bar, policies, kept)
    path = save(given, args)
    excerpts = (
        f"the {len(held)} excerpts of its stored validation"
        if read_before
        else f"{len(held)} excerpts of documents it was not fitted on"
    )
    print(f"caote validate: validated {args.predictor} on {excerpts}; wrote {path}")
    print(verdict)
    return 0


def stored_length(predictor) -> int | None:
    """The excerpt length of ``predictor``'s stored validation, else of its fit, as their text ids name it
    (`caote.evaluation.splits.TEXT_ID`); None when no id names one."""
    from caote.evaluation.splits import TEXT_ID

    stored = predictor.validation["texts"] if predictor.validation is not None else []
    for text_id in [*stored, *predictor.texts]:
        match = TEXT_ID.fullmatch(text_id)
        if match:
            return int(match.group(3))
    return None


def held_excerpts(args: argparse.Namespace, tokenizer, length: int, given, recompute: bool) -> tuple[list, bool]:
    """``(held, read_before)``: the excerpts of ``given``'s stored validation (``read_before``) when the texts hold
    them, else excerpts of every document it was not fitted on, which ``recompute`` (``--recompute``: rows kept
    from the stored validation) refuses."""
    from caote.evaluation.splits import MIN_EXCERPTS, document_of

    texts = all_texts(args, tokenizer, length)
    stored, missing = stored_excerpts(given, texts)
    if stored:
        return stored, True
    if recompute:
        raise UsageError(f"--recompute keeps rows of the stored validation's excerpts, but {missing}")
    seen = {document_of(text_id) for text_id in [*given.texts, *sum(given.details.get("rolled_out_by", []), [])]}
    held = [text for text in texts if document_of(text.id) not in seen][:MIN_EXCERPTS]
    if len(held) < MIN_EXCERPTS:
        raise UsageError(
            f"only {len(held)} excerpts of {length} tokens come from documents the predictor was not fitted on; "
            f"{MIN_EXCERPTS} are needed (try --domain essays, or --texts FOLDER)"
        )
    if given.validation is not None:
        print(f"caote validate: not the stored validation's excerpts: {missing}", file=sys.stderr)
    return held, False


def stored_excerpts(predictor, texts: list) -> tuple[list, str]:
    """``(excerpts, missing)``: the excerpts of ``texts`` that ``predictor``'s stored validation read, in its order,
    or none and why. Where the validation stored the excerpts' digests, an excerpt counts only if its text has the
    same digest."""
    from caote.evaluation.validation import digest

    validation = predictor.validation
    if validation is None:
        return [], "the predictor has no stored validation"
    by_id = {text.id: text for text in texts}
    stored = [by_id.get(text_id) for text_id in validation["texts"]]
    if any(text is None for text in stored):
        return [], "the texts lack some of them (another --length, --domain or --texts?)"
    digests = validation.get("digests")
    if digests is not None and [digest(text.text) for text in stored] != digests:
        return (
            [],
            "the texts hold their ids, not all of their text (edited files, or a tokenizer that decodes otherwise)",
        )
    return stored, ""


def validation_plan(args: argparse.Namespace, given, budgets: list[int] | None) -> tuple[tuple[str, ...], dict | None]:
    """``(policies, kept)``: the policies the validation runs and the stored rows it keeps for the others (None:
    it runs every policy). With ``--recompute``, those named and any the stored validation lacks; a `UsageError`
    when ``given`` has no stored validation, one without excerpt digests, or ``budgets`` (``--validation-budgets``)
    other than its own."""
    from caote.evaluation.validation import CANDIDATES, LEARNED

    if args.recompute is None:
        return LEARNED + CANDIDATES, None
    named = recompute_list(args.recompute)
    stored = given.validation
    if stored is None:
        raise UsageError(f"--recompute: '{args.predictor}' has no stored validation to keep rows of")
    if "digests" not in stored:  # its excerpts could not be told from other text of the same name
        raise UsageError(
            f"--recompute: the validation of '{args.predictor}' predates excerpt digests: validate it whole"
        )
    if budgets is not None and budgets != list(stored["budgets"]):
        raise UsageError(
            f"--recompute: --validation-budgets must be the stored validation's, "
            f"{','.join(map(str, stored['budgets']))}, or left out"
        )
    policies = tuple(policy for policy in LEARNED + CANDIDATES if policy in named or policy not in stored["kl"])
    kept = {policy: rows for policy, rows in stored["kl"].items() if policy not in policies}
    return policies, kept or None  # every policy named: a whole validation
