"""``caote calibrate``: fit the learned policy's predictor for a model (`caote.evaluation.calibration`) and save it.

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
    check_model,
    check_predictor_file,
    non_negative_int,
    parse_int_list,
    positive_int,
    warn_if_threads_share_cores,
)
from caote.defaults import (
    CALIBRATION_BUDGETS,
    CALIBRATION_LENGTH,
    CALIBRATION_LONG_FACTOR,
    CALIBRATION_MASS_WEIGHT,
    CALIBRATION_ROUNDS,
    CALIBRATION_TARGET,
    CALIBRATION_TOKENS,
    CALIBRATION_WINDOWS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CALIBRATION_DOMAIN,
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
    "where the 'auto' policy reads it. Quick try: --count 8 (about a minute on the bundled model)."
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``caote calibrate``."""
    return add_subcommand(subparsers, "calibrate", run_calibrate, HELP, DESCRIPTION, add_arguments)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``caote calibrate``'s options, in --help order: what it reads and writes, the fit, the validation."""
    add_input_arguments(parser)
    add_fit_arguments(parser)
    add_validation_arguments(parser)


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, its calibration texts (source, lengths, counts) and the output file."""
    parser.add_argument("--model", default="smollm2-135m", help="the model (default: %(default)s)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--domain",
        choices=("essays", "code"),
        default=DEFAULT_CALIBRATION_DOMAIN,
        help="read the dev split of these texts (default: %(default)s)",
    )
    source.add_argument("--texts", type=Path, metavar="FOLDER", help="read the .txt files of FOLDER instead")
    parser.add_argument("--out", type=Path, required=True, metavar="FILE", help="where to write the predictor")
    parser.add_argument(
        "--length",
        type=positive_int,
        help=f"tokens per calibration excerpt (default: {CALIBRATION_LENGTH}, or {CALIBRATION_WINDOWS} sliding "
        "windows for a model mixing sliding-window and full layers, e.g. 2,048 for Gemma-3)",
    )
    parser.add_argument(
        "--count",
        type=positive_int,
        help=f"excerpts to fit on (default: {CALIBRATION_TOKENS:,} tokens' worth, 40 excerpts of 1,024 tokens)",
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


def add_validation_arguments(parser: argparse.ArgumentParser) -> None:
    """The validation and what the file records of it, and the run's threads."""
    parser.add_argument(
        "--validation-budgets",
        metavar="BUDGETS",
        help="budgets the validation compares policies at, comma-separated (default: the first calibration budget "
        "and 4x it)",
    )
    parser.add_argument(
        "--validate",
        type=Path,
        metavar="FILE",
        help="fit nothing: validate the predictor FILE (of this model) again and write it with its verdict to --out; "
        "on the excerpts and budgets its stored validation read when the texts hold them (a like-for-like table), "
        "otherwise on excerpts of documents it was not fitted on",
    )
    parser.add_argument(
        "--recompute",
        metavar="POLICIES",
        help="with --validate: recompute only these policies' rows, comma-separated, and keep the others' from the "
        "stored validation (which must be read again: same excerpts and budgets); a policy it lacks is computed too",
    )
    parser.add_argument(
        "--min-budget",
        type=positive_int,
        help="record that the predictor is for budgets from this one on; it matters only for the files caote ships "
        "(caote/predictors/), of which a cache takes the one of the largest --min-budget not above its budget "
        "(default: every budget)",
    )
    parser.add_argument(
        "--no-validation", action="store_true", help="skip the validation (the predictor then carries no verdict)"
    )
    parser.add_argument(
        "--threads", type=positive_int, help="torch CPU threads (default: torch's choice; 1 on a busy machine)"
    )


def feature_groups(text: str) -> list[str]:
    """``"scalars,key"`` -> the feature groups, each one of `FEATURE_GROUPS`."""
    groups = [item.strip() for item in text.split(",") if item.strip()]
    if not groups or any(group not in FEATURE_GROUPS for group in groups):
        raise UsageError(f"--features takes {', '.join(FEATURE_GROUPS)}, got {text!r}")
    return groups


def budget_list(text: str, option: str) -> list[int]:
    """``"128,512"`` -> ``[128, 512]``, or a `UsageError` naming ``option``."""
    try:
        return parse_int_list(text, minimum=1)
    except ValueError:
        raise UsageError(f"{option} must be comma-separated values, got {text!r}") from None


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


def check_arguments(args: argparse.Namespace) -> tuple[list[int], list[int] | None, list[str]]:
    """The budgets, validation budgets (None: the default) and feature groups, after every check that needs no
    torch: a bad argument is a `UsageError` before the model loads."""
    budgets = budget_list(args.budgets, "--budgets")
    validation = (
        None if args.validation_budgets is None else budget_list(args.validation_budgets, "--validation-budgets")
    )
    groups = feature_groups(args.features)
    if args.texts is not None and not args.texts.is_dir():
        raise UsageError(f"--texts '{args.texts}' is not a folder")
    if args.texts is not None and not any(args.texts.glob("*.txt")):
        raise UsageError(f"--texts '{args.texts}' holds no .txt file")
    if args.out.is_dir():
        raise UsageError(f"--out '{args.out}' is a directory; give a file path")
    if not args.out.parent.is_dir():
        raise UsageError(f"--out '{args.out}': folder '{args.out.parent}' does not exist")
    if args.length is not None and args.length < DEFAULT_BLOCK_SIZE:
        raise UsageError(
            f"--length must be at least one prefill block ({DEFAULT_BLOCK_SIZE} tokens), got {args.length}"
        )
    if args.long_length is not None and args.length is not None and args.long_length <= args.length:
        raise UsageError(f"--long-length ({args.long_length}) must exceed --length ({args.length})")
    if args.long_length is not None and not args.long_count:
        raise UsageError("--long-length takes effect with --long-count N, the number of long excerpts to fit on")
    if not args.balance_lengths and not args.long_count:
        raise UsageError("--no-balance-lengths takes effect with --long-count N: without it, excerpts have one length")
    for option in ("rollout_predictor", "validate"):
        path = getattr(args, option)
        if path is not None and not path.is_file():
            raise UsageError(f"--{option.replace('_', '-')} '{path}' is not a file (write one with caote calibrate)")
    if args.validate is not None and args.no_validation:
        raise UsageError("--validate and --no-validation contradict each other")
    if args.recompute is not None and args.validate is None:
        raise UsageError("--recompute takes effect with --validate FILE, whose stored rows it keeps")
    return budgets, validation, groups


def load_predictor(path: Path, option: str, model: str, groups: list[str] | None = None):
    """The predictor at ``path`` given with ``option`` for ``model``: a `UsageError` when unreadable, of other features
    than ``groups`` (when given) or unfit for the model before it loads (`caote.arguments.check_predictor_file`)."""
    from caote.predictor import Predictor

    try:
        predictor = Predictor.load(path)
    except ValueError as error:
        raise UsageError(f"{option}: {error}") from None
    if groups is not None and set(predictor.groups) != set(groups):
        raise UsageError(f"{option} has features {','.join(predictor.groups)}, not --features {','.join(groups)}")
    return check_predictor_file(path, model, option)


def check_loaded(path: Path | None, option: str, model) -> None:
    """A `UsageError` when the predictor at ``path`` does not fit the loaded ``model`` (`Predictor.for_model`): what
    its name did not tell before it loaded (another local model of the same shapes)."""
    from caote.predictor import Predictor

    if path is None:
        return
    try:
        Predictor.for_model(model, path)
    except ValueError as error:
        raise UsageError(f"{option}: {error}") from None


def run_calibrate(args: argparse.Namespace) -> int:
    """Fit (or, with ``--validate``, only check) a predictor, validate it, save it with its verdict and print
    what it cost and what validation found."""
    budgets, validation_budgets, groups = check_arguments(args)
    check_model(args.model)
    rollout = (
        None
        if args.rollout_predictor is None
        else load_predictor(args.rollout_predictor, "--rollout-predictor", args.model, groups)
    )
    given = None if args.validate is None else load_predictor(args.validate, "--validate", args.model)
    # start-up: calibration imports torch and transformers, which argument errors do not need
    from caote.evaluation.calibration.recipe import Recipe
    from caote.evaluation.lockstep import cell_settings
    from caote.evaluation.validation import CANDIDATES, LEARNED

    try:  # refused before the model loads
        recipe = Recipe(
            budgets=tuple(budgets),
            groups=tuple(groups),
            rounds=args.rounds,
            mass_weight=args.mass_weight,
            target=args.target,
            balance_lengths=args.balance_lengths,
        )
    except ValueError as error:
        raise UsageError(str(error).replace("mass_weight", "--mass-weight")) from None
    try:
        for budget in validation_budgets or []:
            for policy in LEARNED + CANDIDATES:
                cell_settings(policy, budget)
    except ValueError as error:
        raise UsageError(f"--validation-budgets: {error}") from None
    policies, kept = validation_plan(args, given, validation_budgets)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from caote.evaluation.calibration.recipe import calibrate
    from caote.models import load_model

    model, tokenizer = load_model(args.model)
    check_loaded(args.rollout_predictor, "--rollout-predictor", model)
    check_loaded(args.validate, "--validate", model)
    from caote.evaluation.calibration.texts import calibration_length

    length = args.length or calibration_length(model)
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and length > positions:
        raise UsageError(f"--length {length} exceeds the {positions} positions of {args.model!r}")
    long_length, long_count = long_excerpts(args, length, positions)
    fit, held, read_before = split_texts(args, tokenizer, length, given, recompute=kept is not None)
    if given is None and long_count:
        fit += long_texts(args, tokenizer, long_length, long_count, held)
    warn_if_threads_share_cores(args.threads)  # after every check, so that a refusal stays one line
    validation_budgets = validation_budgets or default_validation_budgets(budgets, given)
    from tqdm.auto import tqdm

    from caote.evaluation.validation import validation_blocks

    blocks = 0 if given is not None else recipe.blocks(fit)
    if not args.no_validation:
        blocks += validation_blocks(held, policies, validation_budgets, recipe.block_size)
    with tqdm(total=blocks, desc="caote calibrate", unit="block") as bar:
        predictor = (
            given
            if given is not None
            else calibrate(model, tokenizer, fit, recipe, rollout=rollout, model_name=args.model, bar=bar)
        )
        verdict = (
            None
            if args.no_validation
            else validate_into(predictor, model, tokenizer, held, validation_budgets, bar, policies, kept)
        )
    if args.min_budget is not None:
        predictor.details["min_budget"] = args.min_budget
    path = predictor.save(args.out)
    details = predictor.details
    if given is None:
        print(
            f"caote calibrate: {described(fit)} x {len(budgets)} budgets x {args.rounds} rounds, "
            f"{details['rows']:,} rows, {details['seconds']:.0f} s; held-out error {details['held_out_mse']:.3g} of "
            f"variance {details['held_out_variance']:.3g}; wrote {path} ({path.stat().st_size / 1024:.0f} KiB)"
        )
    else:
        excerpts = (
            f"the {len(held)} excerpts of its stored validation"
            if read_before
            else f"{len(held)} excerpts of documents it was not fitted on"
        )
        print(f"caote calibrate: validated {args.validate} again on {excerpts}; wrote {path}")
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
    if args.long_count == 0 or args.validate is not None:
        return long_length, 0
    if long_length <= length:
        raise UsageError(f"--long-length ({long_length}) must exceed --length ({length})")
    return long_length, args.long_count


def source_texts(args: argparse.Namespace, tokenizer, length: int) -> list:
    """Every excerpt of ``length`` tokens of the texts the command reads: the ``--texts`` folder's, or the dev split
    of ``--domain`` (a `ValueError` when none can be had)."""
    from caote.evaluation.calibration.texts import calibration_texts, folder_texts

    if args.texts is not None:
        return folder_texts(tokenizer, args.texts, length)
    return calibration_texts(tokenizer, args.domain, length)


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


def split_texts(
    args: argparse.Namespace, tokenizer, length: int, given, recompute: bool = False
) -> tuple[list, list, bool]:
    """``(fit, held, read_before)``: the excerpts to fit on (``--count`` of them, or `CALIBRATION_TOKENS`' worth)
    and the excerpts of held-out documents to validate on; with ``given`` (``--validate``), nothing to fit and the
    excerpts of its stored validation (``read_before``) when the texts hold them, else of every document it was not
    fitted on, which ``recompute`` (``--recompute``: rows kept from the stored validation) refuses."""
    from caote.evaluation.calibration.texts import default_count
    from caote.evaluation.splits import MIN_EXCERPTS, document_of, hold_out

    try:
        texts = source_texts(args, tokenizer, length)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if not texts:
        raise UsageError(f"no text reaches --length {length} tokens: give longer texts or a smaller --length")
    if given is not None:
        stored, missing = stored_excerpts(given, texts)
        if stored:
            return [], stored, True
        if recompute:
            raise UsageError(f"--recompute keeps rows of the stored validation's excerpts, but {missing}")
        seen = {document_of(text_id) for text_id in [*given.texts, *sum(given.details.get("rolled_out_by", []), [])]}
        held = [text for text in texts if document_of(text.id) not in seen][:MIN_EXCERPTS]
        if len(held) < MIN_EXCERPTS:
            raise UsageError(
                f"--validate: only {len(held)} excerpts of {length} tokens come from documents the predictor was not "
                f"fitted on; {MIN_EXCERPTS} are needed (try --domain essays, or --texts FOLDER)"
            )
        if given.validation is not None:
            print(f"caote calibrate: not the stored validation's excerpts: {missing}", file=sys.stderr)
        return [], held, False
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
    return fit[:count], held, False


def stored_excerpts(predictor, texts: list) -> tuple[list, str]:
    """``(excerpts, missing)``: the excerpts of ``texts`` that ``predictor``'s stored validation read, in its order,
    or none and why. Where the validation stored the excerpts' digests (since 2026-12-07), an excerpt counts only if
    its text has the same digest."""
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
        raise UsageError(f"--recompute: '{args.validate}' has no stored validation to keep rows of")
    if "digests" not in stored:  # its excerpts could not be told from other text of the same name
        raise UsageError(
            f"--recompute: the validation of '{args.validate}' predates excerpt digests: validate it whole"
        )
    if budgets is not None and budgets != list(stored["budgets"]):
        raise UsageError(
            f"--recompute: --validation-budgets must be the stored validation's, "
            f"{','.join(map(str, stored['budgets']))}, or left out"
        )
    policies = tuple(policy for policy in LEARNED + CANDIDATES if policy in named or policy not in stored["kl"])
    kept = {policy: rows for policy, rows in stored["kl"].items() if policy not in policies}
    return policies, kept or None  # every policy named: a whole validation


def default_validation_budgets(budgets: list[int], given) -> list[int]:
    """The budgets ``given``'s (``--validate``) stored validation compared at, else the first calibration budget and
    4x it."""
    if given is not None and given.validation is not None:
        return list(given.validation["budgets"])
    return [budgets[0], 4 * budgets[0]]


def validate_into(
    predictor, model, tokenizer, held: list, budgets: list[int], bar, policies: tuple[str, ...], kept: dict | None
) -> str | None:
    """Validate ``predictor`` on ``held`` (`caote.evaluation.validation.validate` of ``policies``, keeping the
    ``kept`` rows, reading a temporary copy of it, so a killed run leaves no predictor at --out), store the result
    in its details and return the printed table; None when there is nothing to validate on."""
    import tempfile

    from caote.evaluation.validation import validate, validation_table

    if not held:
        return None
    with tempfile.TemporaryDirectory(prefix="caote-calibrate-") as folder:
        draft = predictor.save(Path(folder) / "draft.safetensors")
        predictor.details["validation"] = validate(model, tokenizer, draft, held, budgets, bar, policies, kept)
    return validation_table(predictor.details["validation"])
