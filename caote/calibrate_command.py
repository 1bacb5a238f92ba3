"""``caote calibrate``: fit the learned policy's predictor for a model (`caote.evaluation.calibration`) and save it.

Every argument is checked before torch, transformers and the model load; a bad one is a `UsageError` (exit 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from caote.arguments import UsageError, add_subcommand, hide_loading_bars, parse_int_list, positive_int
from caote.commands import check_model
from caote.defaults import (
    CALIBRATION_BUDGETS,
    CALIBRATION_MASS_WEIGHT,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CALIBRATION_DOMAIN,
    FEATURE_GROUPS,
)

HELP = "fit the learned policy's importance predictor for a model to the hindsight oracle"
DESCRIPTION = (
    "Fit the 'learned' policy's predictor of each token's future attention for one model: full-cache passes over "
    "calibration texts record what later queries attend to, evicting passes record what the policy will see, and a "
    "ridge regression per layer and KV head links the two. Texts: the dev split of the essays or of the Python code "
    "(never a text the evaluation grids read), or the .txt files of a folder."
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``caote calibrate``."""
    return add_subcommand(subparsers, "calibrate", run_calibrate, HELP, DESCRIPTION, add_arguments)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``caote calibrate``'s options, in --help order: the model, its texts, the output file, the fit."""
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
        "--length", type=positive_int, default=1024, help="tokens per calibration excerpt (default: %(default)s)"
    )
    parser.add_argument("--count", type=positive_int, help="use only the first COUNT excerpts (default: all)")
    parser.add_argument(
        "--budgets",
        default=",".join(map(str, CALIBRATION_BUDGETS)),
        help="budgets of the evicting passes, comma-separated (default: %(default)s)",
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
        help="evict the calibration passes by learned+caote with this predictor (an earlier round's, of the same "
        "model and features) instead of H2O's mass: a second, on-policy round",
    )
    parser.add_argument(
        "--mass-weight",
        type=float,
        default=CALIBRATION_MASS_WEIGHT,
        metavar="POWER",
        help="weigh each token's row by its future attention relative to its eviction's mean, to this power, so the "
        "fit is decided by the tokens whose eviction would be felt (0: every row alike; default: %(default)s)",
    )


def feature_groups(text: str) -> list[str]:
    """``"scalars,key"`` -> the feature groups, each one of `FEATURE_GROUPS`."""
    groups = [item.strip() for item in text.split(",") if item.strip()]
    if not groups or any(group not in FEATURE_GROUPS for group in groups):
        raise UsageError(f"--features takes {', '.join(FEATURE_GROUPS)}, got {text!r}")
    return groups


def run_calibrate(args: argparse.Namespace) -> int:
    """Fit and save a predictor (`caote.evaluation.calibration.calibrate`), printing what it cost."""
    try:
        budgets = parse_int_list(args.budgets, minimum=1)
    except ValueError:
        raise UsageError(f"--budgets must be comma-separated values, got {args.budgets!r}") from None
    groups = feature_groups(args.features)
    if args.texts is not None and not args.texts.is_dir():
        raise UsageError(f"--texts '{args.texts}' is not a folder")
    if args.texts is not None and not any(args.texts.glob("*.txt")):
        raise UsageError(f"--texts '{args.texts}' holds no .txt file")
    if args.out.is_dir():
        raise UsageError(f"--out '{args.out}' is a directory; give a file path")
    if not args.out.parent.is_dir():
        raise UsageError(f"--out '{args.out}': folder '{args.out.parent}' does not exist")
    if args.length < DEFAULT_BLOCK_SIZE:
        raise UsageError(
            f"--length must be at least one prefill block ({DEFAULT_BLOCK_SIZE} tokens), got {args.length}"
        )
    if args.rollout_predictor is not None and not args.rollout_predictor.is_file():
        raise UsageError(f"--rollout-predictor '{args.rollout_predictor}' is not a file (write one with calibrate)")
    check_model(args.model)
    # start-up: calibration imports torch and transformers, which argument errors do not need
    from caote.evaluation.calibration import (
        calibrate,
        calibration_texts,
        check_mass_weight,
        folder_texts,
        rollout_settings,
    )
    from caote.learned import Predictor
    from caote.models import load_model

    try:
        for budget in budgets:  # refused before the model loads
            rollout_settings(budget)
    except ValueError as error:
        raise UsageError(f"--budgets: {error}") from None
    try:
        check_mass_weight(args.mass_weight, "--mass-weight")
    except ValueError as error:
        raise UsageError(str(error)) from None
    rollout = None
    if args.rollout_predictor is not None:  # its file and features checked before the model loads too
        try:
            rollout = Predictor.load(args.rollout_predictor)
        except ValueError as error:
            raise UsageError(f"--rollout-predictor: {error}") from None
        if set(rollout.groups) != set(groups):
            raise UsageError(
                f"--rollout-predictor has features {','.join(rollout.groups)}, not --features {','.join(groups)}"
            )
    hide_loading_bars()
    model, tokenizer = load_model(args.model)
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and args.length > positions:
        raise UsageError(f"--length {args.length} exceeds the {positions} positions of {args.model!r}")
    try:
        if args.texts is not None:
            texts = folder_texts(tokenizer, args.texts, args.length, args.count)
        else:
            texts = calibration_texts(tokenizer, args.domain, args.length, args.count)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if not texts:
        raise UsageError(f"no text reaches --length {args.length} tokens: give longer texts or a smaller --length")
    predictor = calibrate(
        model,
        tokenizer,
        texts,
        tuple(budgets),
        tuple(groups),
        model_name=args.model,
        rollout=rollout,
        mass_weight=args.mass_weight,
    )
    path = predictor.save(args.out)
    details = predictor.details
    print(
        f"caote calibrate: {len(texts)} texts x {len(budgets)} budgets, {details['rows']:,} rows, "
        f"{details['seconds']:.0f} s; held-out error {details['held_out_mse']:.3g} of variance "
        f"{details['held_out_variance']:.3g}; wrote {path} ({path.stat().st_size / 1024:.0f} KiB)"
    )
    return 0
