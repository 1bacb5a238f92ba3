"""``caote calibrate``: fit the learned policy's predictor for a model (`caote.evaluation.calibration`), validate
it and save it (what it shares with ``caote validate``: `caote.calibration_cli`).

Every argument is checked before torch, transformers and the model load; a bad one is a `UsageError` (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from caote.arguments import (
    UsageError,
    add_subcommand,
    check_loaded_predictor,
    check_model,
    non_negative_int,
    positive_int,
    warn_if_threads_share_cores,
)
from caote.calibration_cli import (
    add_run_arguments,
    add_source_arguments,
    add_validation_budgets,
    all_texts,
    budget_list,
    check_source,
    check_validation_budgets,
    default_validation_budgets,
    excerpt_length,
    load_for,
    load_predictor,
    save,
    source_texts,
    validate_into,
)
from caote.defaults import (
    CALIBRATION_BUDGETS,
    CALIBRATION_FIRST_ROUND_SHARE,
    CALIBRATION_LONG_FACTOR,
    CALIBRATION_MASS_WEIGHT,
    CALIBRATION_ROUNDS,
    CALIBRATION_TARGET,
    CALIBRATION_TOKENS,
    DEFAULT_BLOCK_SIZE,
    FEATURE_GROUPS,
    FUTURE_TARGETS,
)

HELP = "fit the learned policy's importance predictor for a model to the hindsight oracle"
DESCRIPTION = (
    "Fit the 'learned' policy's predictor of each token's future attention for one model: full-cache passes over "
    "calibration texts record what later queries attend to, evicting passes record what the policy will see, and a "
    "ridge regression per layer and KV head links the two; a second round evicts by the first round's predictor. "
    "Texts: the dev split of the essays or of the Python code (never a text the evaluation grids read), or the .txt "
    "files of a folder. At the end the predictor is validated on excerpts of documents the fit did not read, against "
    "the best training-free policy, and the verdict ('helps' or 'does not help') is printed and stored in the file, "
    "where the 'auto' policy reads it (caote validate judges a predictor file again). Quick try: --count 8 "
    "--no-validation."
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``caote calibrate``."""
    return add_subcommand(subparsers, "calibrate", run_calibrate, HELP, DESCRIPTION, add_arguments)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``caote calibrate``'s options, in --help order: what it reads and writes, the fit, the validation, the run."""
    add_source_arguments(parser)
    add_fit_texts_arguments(parser)
    add_fit_arguments(parser)
    add_validation_budgets(parser)
    parser.add_argument(
        "--no-validation", action="store_true", help="skip the validation (the predictor then carries no verdict)"
    )
    add_run_arguments(parser)


def add_fit_texts_arguments(parser: argparse.ArgumentParser) -> None:
    """How many excerpts the fit reads, and the long ones beside them."""
    parser.add_argument(
        "--count",
        type=positive_int,
        help=f"excerpts to fit on (default: {CALIBRATION_TOKENS:,} tokens' worth: "
        f"{CALIBRATION_TOKENS // 1024} excerpts of 1,024 tokens)",
    )
    parser.add_argument(
        "--long-length",
        type=positive_int,
        help=f"tokens per long excerpt, fitted on besides the others (default: {CALIBRATION_LONG_FACTOR}x --length, at "
        "most the model's positions)",
    )
    parser.add_argument(
        "--long-count",
        type=non_negative_int,
        default=0,
        help="long excerpts to fit on besides the others, for use at long contexts and large budgets (e.g. 10 of "
        "4,096 tokens beside 40 of 1,024, with --budgets 128,1024; default: none)",
    )


def add_fit_arguments(parser: argparse.ArgumentParser) -> None:
    """The fit: rounds, the evicting passes' budgets, features, rollout, row weights and target."""
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=CALIBRATION_ROUNDS,
        help="calibration rounds, each evicting by the previous round's predictor (default: %(default)s)",
    )
    parser.add_argument(
        "--first-round-share",
        type=float,
        default=CALIBRATION_FIRST_ROUND_SHARE,
        metavar="SHARE",
        help="with more than one round, the share of the texts the first round reads: its predictor only ranks the "
        "next round's passes (1: all of them; default: %(default)s)",
    )
    parser.add_argument(
        "--budgets",
        default=",".join(map(str, CALIBRATION_BUDGETS)),
        help="budgets of the evicting passes, comma-separated; an excerpt no longer than a budget skips it "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--features",
        default="scalars,key",
        help="feature groups: scalars, key, value, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--rollout-predictor",
        type=Path,
        metavar="FILE",
        help="evict the first round's passes by learned+caote with this predictor (an earlier calibration's, of the "
        "same model and features) instead of H2O's mass",
    )
    parser.add_argument(
        "--mass-weight",
        type=float,
        default=CALIBRATION_MASS_WEIGHT,
        metavar="POWER",
        help="weigh each token's row by its future attention relative to its eviction's mean, to this power, so the "
        "fit is decided by the tokens whose eviction would be felt (0: every row alike; default: %(default)s)",
    )
    parser.add_argument(
        "--no-balance-lengths",
        dest="balance_lengths",
        action="store_false",
        help="with --long-count: let each excerpt length weigh by its rows (tokens times evicting passes: the "
        "long excerpts usually hold most of them) instead of giving every length an equal share of the fit (the "
        "default)",
    )
    parser.add_argument(
        "--target",
        choices=FUTURE_TARGETS,
        default=CALIBRATION_TARGET,
        help="what the predictor learns to rank tokens by: the attention later queries give them (mass), or how much "
        "the later queries' outputs would change were each evicted alone (change: CAOTE's error summed over them; "
        "default: %(default)s)",
    )


def feature_groups(text: str) -> list[str]:
    """``"scalars,key"`` -> the feature groups, each one of `FEATURE_GROUPS`."""
    groups = [item.strip() for item in text.split(",") if item.strip()]
    if not groups or any(group not in FEATURE_GROUPS for group in groups):
        raise UsageError(f"--features takes {', '.join(FEATURE_GROUPS)}, got {text!r}")
    return groups


def check_arguments(args: argparse.Namespace) -> tuple[list[int], list[int] | None, list[str]]:
    """The budgets, validation budgets (None: the default) and feature groups, after every check that needs no
    torch: a bad argument is a `UsageError` before the model loads."""
    validation = check_source(args)
    budgets = budget_list(args.budgets, "--budgets")
    groups = feature_groups(args.features)
    if args.long_length is not None and args.length is not None and args.long_length <= args.length:
        raise UsageError(f"--long-length ({args.long_length}) must exceed --length ({args.length})")
    if args.long_length is not None and not args.long_count:
        raise UsageError("--long-length takes effect with --long-count N, the number of long excerpts to fit on")
    if not args.balance_lengths and not args.long_count:
        raise UsageError("--no-balance-lengths takes effect with --long-count N: without it, excerpts have one length")
    if args.length is not None and min(budgets) >= (args.length - 1) // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE:
        raise UsageError(
            f"--length {args.length}: an evicting pass stops before the last block (its eviction has no later "
            f"query), at token {(args.length - 1) // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE}, which no --budgets "
            "value lies below: give a longer --length or smaller --budgets"
        )
    if args.rollout_predictor is not None and not args.rollout_predictor.is_file():
        raise UsageError(
            f"--rollout-predictor '{args.rollout_predictor}' is not a file (write one with caote calibrate)"
        )
    return budgets, validation, groups


def run_calibrate(args: argparse.Namespace) -> int:
    """Fit a predictor, validate it, save it with its verdict and print what it cost and what validation found."""
    budgets, validation_budgets, groups = check_arguments(args)
    check_model(args.model)
    rollout = (
        None
        if args.rollout_predictor is None
        else load_predictor(args.rollout_predictor, "--rollout-predictor", args.model, groups)
    )
    # start-up: calibration imports torch and transformers, which argument errors do not need
    from caote.evaluation.calibration.recipe import Recipe, calibrate
    from caote.evaluation.validation import CANDIDATES, LEARNED, logits_cost, validation_units

    try:  # refused before the model loads
        recipe = Recipe(
            budgets=tuple(budgets),
            groups=tuple(groups),
            rounds=args.rounds,
            first_round_share=args.first_round_share,
            mass_weight=args.mass_weight,
            target=args.target,
            balance_lengths=args.balance_lengths,
        )
    except ValueError as error:
        message = str(error)
        for field in ("mass_weight", "first_round_share"):  # the recipe's fields, as the command spells them
            message = message.replace(field, "--" + field.replace("_", "-"))
        raise UsageError(message) from None
    if not args.no_validation:
        given = validation_budgets is not None
        check_validation_budgets(validation_budgets or default_validation_budgets(budgets[0]), given)
    model, tokenizer = load_for(args)
    check_loaded_predictor(args.rollout_predictor, model, "--rollout-predictor")
    length, positions = excerpt_length(args, model)
    long_length, long_count = long_excerpts(args, length, positions)
    fit, held = split_texts(args, tokenizer, length)
    if long_count:
        fit += long_texts(args, tokenizer, long_length, long_count, held)
    warn_if_threads_share_cores(args.threads)  # after every check, so that a refusal stays one line
    validation_budgets = validation_budgets or default_validation_budgets(budgets[0])
    policies = LEARNED + CANDIDATES
    # the bar counts blocks read, a validation block weighing what its logits add (`logits_cost`)
    cost = logits_cost(model)
    blocks = recipe.blocks(fit) + (
        0 if args.no_validation else validation_units(held, policies, validation_budgets, cost)
    )
    from tqdm.auto import tqdm

    with tqdm(total=blocks, desc="caote calibrate", unit="block") as bar:
        predictor = calibrate(model, tokenizer, fit, recipe, rollout=rollout, model_name=args.model, bar=bar)
        verdict = (
            None
            if args.no_validation
            else validate_into(predictor, model, tokenizer, held, validation_budgets, bar, policies)
        )
    path = save(predictor, args)
    details = predictor.details
    print(
        f"caote calibrate: {described(fit)} x {len(budgets)} budgets x {args.rounds} rounds, "
        f"{details['rows']:,} rows, {details['seconds']:.0f} s; held-out error {details['held_out_mse']:.3g} of "
        f"variance {details['held_out_variance']:.3g}; wrote {path} ({path.stat().st_size / 1024:.0f} KiB)"
    )
    print(verdict or "caote calibrate: not validated (--no-validation): the predictor carries no verdict")
    return 0


def long_excerpts(args: argparse.Namespace, length: int, positions: int | None) -> tuple[int, int]:
    """``(long_length, long_count)``: the ``--long-count`` excerpts fitted on besides the ``length``-token ones (0:
    none), of ``--long-length`` tokens or by default `CALIBRATION_LONG_FACTOR` times ``length`` (at most the model's
    ``positions``)."""
    long_length = args.long_length or CALIBRATION_LONG_FACTOR * length
    if positions is not None and long_length > positions:
        if args.long_length is not None:
            raise UsageError(f"--long-length {long_length} exceeds the {positions} positions of {args.model!r}")
        long_length = positions
    if args.long_count == 0:
        return long_length, 0
    if long_length <= length:
        raise UsageError(f"--long-length ({long_length}) must exceed --length ({length})")
    return long_length, args.long_count


def long_texts(args: argparse.Namespace, tokenizer, long_length: int, long_count: int, held: list) -> list:
    """``long_count`` excerpts of ``long_length`` tokens from the documents not held out (``held``) for the
    validation (a `UsageError` when the texts hold fewer)."""
    from caote.evaluation.splits import document_of

    try:
        texts = source_texts(args, tokenizer, long_length)
    except ValueError:  # no document that long
        texts = []
    held_documents = {document_of(text.id) for text in held}
    texts = [text for text in texts if document_of(text.id) not in held_documents]
    if len(texts) < long_count:
        raise UsageError(
            f"--long-count: {len(texts)} excerpts of {long_length} tokens come from the documents not held out to "
            f"validate, not {long_count}: give a smaller --long-count or --long-length"
        )
    return texts[:long_count]


def described(texts: list) -> str:
    """``"40 texts of 1024 tokens and 10 of 4096"``: how many calibration texts of each length."""
    (length, count), *others = Counter(text.length for text in texts).items()
    return f"{count} texts of {length} tokens" + "".join(f" and {count} of {length}" for length, count in others)


def split_texts(args: argparse.Namespace, tokenizer, length: int) -> tuple[list, list]:
    """``(fit, held)``: the excerpts to fit on (``--count`` of them, or `CALIBRATION_TOKENS`' worth) and the
    excerpts of held-out documents to validate on (none with ``--no-validation``)."""
    from caote.evaluation.calibration.texts import default_count
    from caote.evaluation.splits import MIN_EXCERPTS, hold_out

    texts = all_texts(args, tokenizer, length)
    fit, held = hold_out(texts) if not args.no_validation else (texts, [])
    count = args.count or default_count(length)
    if args.count is not None and len(fit) < args.count:
        raise UsageError(
            f"{len(fit)} excerpts of {length} tokens are left to fit on (after {len(held)} held out to validate), "
            f"not --count {args.count}: give a smaller --count or --length"
        )
    if not args.no_validation and not held:
        print(
            f"caote calibrate: the texts' documents leave fewer than {MIN_EXCERPTS} excerpts to validate on while "
            "half of them are fitted on: the predictor will carry no verdict (give more documents)",
            file=sys.stderr,
        )
    return fit[:count], held
