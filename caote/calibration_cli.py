"""What ``caote calibrate`` (`caote.calibrate_command`) and ``caote validate`` (`caote.validate_command`) share: the
options naming the model, its texts and the output file, the validation budgets and the run's threads and device;
their checks before torch loads; loading the model; validating a predictor into its file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from caote.arguments import UsageError, check_predictor_file, parse_int_list, positive_int
from caote.defaults import CALIBRATION_LENGTH, CALIBRATION_WINDOWS, DEFAULT_BLOCK_SIZE, DEFAULT_CALIBRATION_DOMAIN


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, the texts it reads (source, excerpt length) and the output file."""
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
        help=f"tokens per excerpt (default: caote validate's, that of the predictor's own excerpts; else "
        f"{CALIBRATION_LENGTH}, or {CALIBRATION_WINDOWS} sliding windows for a model mixing sliding-window and full "
        "layers, e.g. 2,048 for Gemma-3)",
    )


def add_validation_budgets(parser: argparse.ArgumentParser) -> None:
    """``--validation-budgets``: the budgets the learned policies are judged at."""
    parser.add_argument(
        "--validation-budgets",
        metavar="BUDGETS",
        help="budgets the validation compares policies at, comma-separated (default: those of the file's stored "
        "validation, else the first calibration budget and 4x it)",
    )


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """What the written file records of its budgets, and where the run computes."""
    parser.add_argument(
        "--min-budget",
        type=positive_int,
        help="record that the predictor is for budgets from this one on; it matters only for the files caote ships "
        "(caote/predictors/), of which a cache takes the one of the largest --min-budget not above its budget "
        "(default: every budget)",
    )
    parser.add_argument(
        "--threads", type=positive_int, help="torch CPU threads (default: torch's choice; 1 on a busy machine)"
    )
    parser.add_argument(
        "--device", help="where the model runs: cpu, cuda, cuda:1, mps (default: cpu; a GPU makes every pass faster)"
    )


def budget_list(text: str, option: str) -> list[int]:
    """``"128,512"`` -> ``[128, 512]``, or a `UsageError` naming ``option``."""
    try:
        return parse_int_list(text, minimum=1)
    except ValueError:
        raise UsageError(f"{option} must be comma-separated values, got {text!r}") from None


def check_source(args: argparse.Namespace) -> list[int] | None:
    """The validation budgets (None: the default) after the checks of the texts, the output file and the excerpt
    length, which need no torch."""
    if args.texts is not None and not args.texts.is_dir():
        raise UsageError(f"--texts '{args.texts}' is not a folder")
    if args.texts is not None and not any(args.texts.glob("*.txt")):
        raise UsageError(f"--texts '{args.texts}' holds no .txt file")
    if args.out.is_dir():
        raise UsageError(f"--out '{args.out}' is a directory; give a file path")
    if not args.out.parent.is_dir():
        raise UsageError(f"--out '{args.out}': folder '{args.out.parent}' does not exist")
    if args.length is not None and args.length <= DEFAULT_BLOCK_SIZE:
        raise UsageError(
            f"--length must exceed one prefill block ({DEFAULT_BLOCK_SIZE} tokens: the eviction after an excerpt's "
            f"last block has no later query to fit or judge by), got {args.length}"
        )
    if args.validation_budgets is None:
        return None
    return budget_list(args.validation_budgets, "--validation-budgets")


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


def check_validation_budgets(budgets: list[int] | None, given: bool = True) -> None:
    """A `UsageError` for a validation budget a validated policy cannot run at (``given``: named by
    ``--validation-budgets``, else the default ones)."""
    from caote.evaluation.lockstep import cell_settings
    from caote.evaluation.validation import CANDIDATES, LEARNED

    try:
        for budget in budgets or []:
            for policy in LEARNED + CANDIDATES:
                cell_settings(policy, budget)
    except ValueError as error:
        where = "--validation-budgets" if given else f"the validation budgets {','.join(map(str, budgets))}"
        raise UsageError(f"{where}: {error}" + ("" if given else " (give --validation-budgets)")) from None


def load_for(args: argparse.Namespace):
    """``(model, tokenizer)`` of ``--model`` on ``--device`` with ``--threads`` (a `UsageError` for a device torch
    does not have)."""
    import torch

    from caote.models import load_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.device is not None:
        try:
            device = torch.device(args.device)
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UsageError(f"--device {args.device!r} cannot be used here: {first}") from None
    return load_model(args.model, device=args.device)


def excerpt_length(args: argparse.Namespace, model, default: int | None = None) -> tuple[int, int | None]:
    """``(length, positions)``: the excerpt length (``--length``, else ``default``, else `calibration_length`) and
    the model's positions, a `UsageError` when the length exceeds them."""
    from caote.evaluation.calibration.texts import calibration_length

    length = args.length or default or calibration_length(model)
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and length > positions:
        raise UsageError(f"--length {length} exceeds the {positions} positions of {args.model!r}")
    return length, positions


def save(predictor, args: argparse.Namespace) -> Path:
    """Write ``predictor`` to ``--out``, recording ``--min-budget`` when given."""
    if args.min_budget is not None:
        predictor.details["min_budget"] = args.min_budget
    return predictor.save(args.out)


def source_texts(args: argparse.Namespace, tokenizer, length: int) -> list:
    """Every excerpt of ``length`` tokens of the texts the command reads: the ``--texts`` folder's, or the dev split
    of ``--domain`` (a `ValueError` when none can be had)."""
    from caote.evaluation.calibration.texts import calibration_texts, folder_texts

    if args.texts is not None:
        return folder_texts(tokenizer, args.texts, length)
    return calibration_texts(tokenizer, args.domain, length)


def all_texts(args: argparse.Namespace, tokenizer, length: int) -> list:
    """`source_texts`, or a `UsageError` when they hold no excerpt of ``length`` tokens."""
    try:
        texts = source_texts(args, tokenizer, length)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if not texts:
        raise UsageError(f"no text reaches --length {length} tokens: give longer texts or a smaller --length")
    return texts


def default_validation_budgets(first: int) -> list[int]:
    """The budgets a validation compares at by default: the first calibration budget and 4x it."""
    return [first, 4 * first]


def validate_into(
    predictor,
    model,
    tokenizer,
    held: list,
    budgets: list[int],
    bar,
    policies: tuple[str, ...],
    kept: dict | None = None,
) -> str | None:
    """Validate ``predictor`` on ``held`` (`caote.evaluation.validation.validate` of ``policies``, keeping the
    ``kept`` rows, reading a temporary copy of it, so a killed run leaves no predictor at --out), store the result
    in its details and return the printed table; None when there is nothing to validate on."""
    import tempfile

    from caote.evaluation.validation import validate, validation_table

    if not held:
        return None
    with tempfile.TemporaryDirectory(prefix="caote-predictor-") as folder:
        draft = predictor.save(Path(folder) / "draft.safetensors")
        predictor.details["validation"] = validate(model, tokenizer, draft, held, budgets, bar, policies, kept)
    return validation_table(predictor.details["validation"])
