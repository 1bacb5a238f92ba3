"""``caote generate``, ``caote policies`` and ``caote calibrate``: the user-facing subcommands of the ``caote`` CLI.

``caote generate`` answers one prompt with a bounded KV cache, streaming the answer to stdout; ``caote policies``
prints every eviction policy with a one-line description and its reference; ``caote calibrate`` fits the learned
policy's predictor for a model (`caote.evaluation.calibration`).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
from pathlib import Path

from caote.arguments import (
    UsageError,
    hide_loading_bars,
    memory_limits,
    non_negative_int,
    parse_int_list,
    positive_int,
    probability,
    temperature,
)
from caote.defaults import (
    CALIBRATION_BUDGETS,
    CALIBRATION_MASS_WEIGHT,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BUDGET,
    DEFAULT_CALIBRATION_DOMAIN,
    DEFAULT_POLICY,
    DEFAULT_SEED,
    FEATURE_GROUPS,
)

DEFAULT_MAX_NEW_TOKENS = 64
DTYPES = ("float32", "bfloat16", "float16")


def add_parser(subparsers) -> None:
    """Register ``generate``, ``policies`` and ``calibrate`` on the ``caote`` subcommand parser."""
    generate = subparsers.add_parser(
        "generate",
        help="answer a prompt with a bounded KV cache, streaming tokens to stdout",
        description=(
            "Answer a prompt while every layer keeps at most --budget KV tokens. The prompt comes from the PROMPT "
            "argument, from --prompt-file, or from stdin with '-'. The answer streams to stdout as it is decoded. "
            "Decoding is greedy unless --temperature > 0 or --top-p is given."
        ),
    )
    generate.add_argument("prompt", nargs="?", metavar="PROMPT", help="the prompt text, or '-' to read it from stdin")
    generate.add_argument("--prompt-file", type=Path, metavar="PATH", help="read the prompt from this file")
    generate.add_argument(
        "--model",
        default="smollm2-135m",
        help="'smollm2-135m' (bundled, offline), a local path or a hub id (default: %(default)s)",
    )
    generate.add_argument(
        "--budget", type=positive_int, default=DEFAULT_BUDGET, help="KV tokens kept per layer (default: %(default)s)"
    )
    generate.add_argument(
        "--policy", default=DEFAULT_POLICY, help="eviction policy, see 'caote policies' (default: %(default)s)"
    )
    generate.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help="most tokens to generate (default: %(default)s)",
    )
    generate.add_argument(
        "--block-size",
        type=positive_int,
        default=DEFAULT_BLOCK_SIZE,
        help="prompt tokens per prefill block (default: %(default)s)",
    )
    generate.add_argument(
        "--temperature",
        type=temperature,
        metavar="T",
        help="sample with this temperature; > 0 turns sampling on, 0 is greedy (default: greedy decoding)",
    )
    generate.add_argument(
        "--top-p",
        type=probability,
        metavar="P",
        help="nucleus sampling: draw from the likeliest tokens whose probabilities add up to P; turns sampling on",
    )
    generate.add_argument(
        "--seed",
        type=non_negative_int,
        default=DEFAULT_SEED,
        help="seed of the sampling and of the 'random' policy (default: %(default)s)",
    )
    generate.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap the prompt in the model's chat template as a user message (default: on)",
    )
    generate.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="weights and KV cache dtype; scores are computed in float32 whatever it is (default: %(default)s)",
    )
    generate.add_argument(
        "--device-map",
        metavar="MAP",
        help="accelerate device map, e.g. 'auto' (with --max-memory, layers that do not fit go to CPU or disk)",
    )
    generate.add_argument(
        "--max-memory",
        type=memory_limits,
        metavar="DEV=SIZE,...",
        help="with --device-map: most memory per device, e.g. 'cpu=200MiB' or '0=6GiB,cpu=16GiB'; the rest of the "
        "model is offloaded to disk (a temporary folder)",
    )
    generate.add_argument(
        "--predictor",
        type=Path,
        metavar="FILE",
        help="for the learned policies: a predictor file written by 'caote calibrate' (default: the one committed for "
        "the model; the bundled model has one)",
    )
    generate.add_argument(
        "--compile-decode",
        action="store_true",
        help="compute the decode steps' CAOTE errors in one torch.compile kernel: faster, equal to the exact default "
        "up to float32 rounding; the first steps compile (needs a C++ compiler on a CPU)",
    )
    generate.add_argument("--stats", action="store_true", help="print tokens seen / kept and KV bytes saved to stderr")
    generate.add_argument(
        "--output",
        type=Path,
        metavar="PATH",
        help="also write the answer to PATH (atomically; nothing is written on failure)",
    )
    generate.set_defaults(func=run_generate)

    policies = subparsers.add_parser(
        "policies",
        help="list the eviction policies",
        description="List every eviction policy accepted by --policy, with a one-line description and reference.",
    )
    policies.set_defaults(func=run_policies)

    calibrate = subparsers.add_parser(
        "calibrate",
        help="fit the learned policy's importance predictor for a model to the hindsight oracle",
        description=(
            "Fit the 'learned' policy's predictor of each token's future attention for one model: full-cache passes "
            "over calibration texts record what later queries attend to, evicting passes record what the policy "
            "will see, and a ridge regression per layer and KV head links the two. Texts: the dev split of the "
            "essays or of the Python code (never a text the evaluation grids read), or the .txt files of a folder."
        ),
    )
    calibrate.add_argument("--model", default="smollm2-135m", help="the model (default: %(default)s)")
    source = calibrate.add_mutually_exclusive_group()
    source.add_argument(
        "--domain",
        choices=("essays", "code"),
        default=DEFAULT_CALIBRATION_DOMAIN,
        help="read the dev split of these texts (default: %(default)s)",
    )
    source.add_argument("--texts", type=Path, metavar="FOLDER", help="read the .txt files of FOLDER instead")
    calibrate.add_argument("--out", type=Path, required=True, metavar="FILE", help="where to write the predictor")
    calibrate.add_argument(
        "--length", type=positive_int, default=1024, help="tokens per calibration excerpt (default: %(default)s)"
    )
    calibrate.add_argument("--count", type=positive_int, help="use only the first COUNT excerpts (default: all)")
    calibrate.add_argument(
        "--budgets",
        default=",".join(map(str, CALIBRATION_BUDGETS)),
        help="budgets of the evicting passes, comma-separated (default: %(default)s)",
    )
    calibrate.add_argument(
        "--features",
        default="scalars,key",
        help="feature groups: scalars, key, value, comma-separated (default: %(default)s)",
    )
    calibrate.add_argument(
        "--rollout-predictor",
        type=Path,
        metavar="FILE",
        help="evict the calibration passes by learned+caote with this predictor (an earlier round's, of the same "
        "model and features) instead of H2O's mass: a second, on-policy round",
    )
    calibrate.add_argument(
        "--mass-weight",
        type=float,
        default=CALIBRATION_MASS_WEIGHT,
        metavar="POWER",
        help="weigh each token's row by its future attention relative to its eviction's mean, to this power, so the "
        "fit is decided by the tokens whose eviction would be felt (0: every row alike; default: %(default)s)",
    )
    calibrate.set_defaults(func=run_calibrate)


# -- caote policies -----------------------------------------------------------------------------------------------


def policy_table() -> str:
    """The Markdown table of every policy (``| policy | description |``), as printed by ``caote policies``."""
    # start-up: the policies import torch, which `caote --help` does not need
    from caote.policies import describe, policy_names

    lines = ["| policy | description |", "|---|---|"]
    lines += [f"| `{name}` | {describe(name)} |" for name in policy_names(hindsight=True)]
    return "\n".join(lines)


def run_policies(args: argparse.Namespace) -> int:
    """Print `policy_table`."""
    print(policy_table())
    return 0


# -- caote generate -----------------------------------------------------------------------------------------------


def read_prompt(prompt: str | None, prompt_file: Path | None, stdin=None) -> str:
    """The prompt text from the argument, ``-`` (stdin) or a file; `UsageError` when missing, doubled or empty."""
    if prompt is not None and prompt_file is not None:
        raise UsageError("give the prompt either as an argument or with --prompt-file, not both")
    if prompt_file is not None:
        try:
            text = prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            raise UsageError(f"cannot read prompt file '{prompt_file}': {reason}") from None
        source = f"prompt file '{prompt_file}'"
    elif prompt == "-":
        text = (stdin or sys.stdin).read()
        source = "stdin"
    elif prompt is not None:
        text, source = prompt, "the PROMPT argument"
    else:
        raise UsageError("no prompt: give PROMPT, '-' to read stdin, or --prompt-file PATH")
    if not text.strip():
        raise UsageError(f"the prompt from {source} is empty")
    return text


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a new temporary file in the same folder and a rename: never a partial file. The
    file ends with a newline and gets a new file's usual mode (0666 less the umask, applied by the kernel)."""
    if not text.endswith("\n"):
        text += "\n"
    temporary = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def format_stats(stats) -> str:
    """Lines for ``--stats``: tokens seen / kept / evicted per layer, KV bytes held and saved."""
    mib = 1024 * 1024
    saved = stats.kv_bytes_saved
    share = 100.0 * saved / stats.full_kv_bytes if stats.full_kv_bytes else 0.0
    return "\n".join(
        [
            f"tokens seen: {stats.tokens_seen}, kept: {stats.tokens_kept}, evicted: {stats.tokens_evicted} (per layer)",
            f"KV cache: {stats.kv_bytes / mib:.2f} MiB held (peak {stats.peak_kv_bytes / mib:.2f} MiB) vs "
            f"{stats.full_kv_bytes / mib:.2f} MiB for a full cache; saved {saved / mib:.2f} MiB ({share:.1f}%)",
        ]
    )


def check_model(name: str) -> None:
    """A `UsageError` for a ``--model`` that names no model (a missing directory, a file, a folder without
    config.json, a malformed hub id), before torch is imported; a hub id that cannot be fetched stays a runtime
    error (exit 1)."""
    from caote.models import BUNDLED, check_model_name  # torch-free at import

    if name in BUNDLED:
        return
    try:
        check_model_name(name)
    except ValueError as error:
        raise UsageError(str(error)) from None


def sampling_options(args: argparse.Namespace) -> dict:
    """The ``model.generate`` options of ``--temperature`` / ``--top-p``: sampling when the temperature is above 0 or
    a top-p is given, else none (greedy decoding)."""
    if args.temperature == 0 and args.top_p is not None:
        raise UsageError("--top-p samples, but --temperature 0 asks for greedy decoding; drop one of them")
    if not args.temperature and args.top_p is None:
        return {}
    options = {"temperature": args.temperature, "top_p": args.top_p}
    return {"do_sample": True, **{name: value for name, value in options.items() if value is not None}}


def check_settings(args: argparse.Namespace):
    """The `CacheSettings` of the arguments; a `UsageError` for a bad one or a policy that cannot generate."""
    # start-up: the settings import torch, which `caote --help` and argument errors do not need
    from caote.settings import CacheSettings

    try:
        predictor = getattr(args, "predictor", None)
        if predictor is not None and not predictor.is_file():
            raise UsageError(f"--predictor '{predictor}' is not a file; write one with 'caote calibrate'")
        settings = CacheSettings(
            budget=args.budget,
            policy=args.policy,
            block_size=args.block_size,
            seed=args.seed,
            predictor=None if predictor is None else str(predictor),
            compile_decode=args.compile_decode,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    if settings.policy.evicts and settings.policy.base.hindsight:
        raise UsageError(
            f"--policy {args.policy!r} is a hindsight ceiling (teacher-forced evaluation only) and cannot generate; "
            "pick another, see 'caote policies'"
        )
    return settings


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
    if args.out.is_dir():
        raise UsageError(f"--out '{args.out}' is a directory; give a file path")
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
    if args.texts is not None:
        texts = folder_texts(tokenizer, args.texts, args.length, args.count)
    else:
        texts = calibration_texts(tokenizer, args.domain, args.length, args.count)
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


def run_generate(args: argparse.Namespace) -> int:
    """Validate every input before loading the model, then stream the answer (and write/print what was asked)."""
    text = read_prompt(args.prompt, args.prompt_file)
    check_model(args.model)
    sampling = sampling_options(args)
    settings = check_settings(args)
    # start-up: loading imports transformers, which `caote --help` and argument errors do not need
    from caote.models import load_model

    if args.output is not None:
        if args.output.is_dir():
            raise UsageError(f"--output '{args.output}' is a directory; give a file path")
        if not args.output.parent.is_dir():
            raise UsageError(f"--output '{args.output}': folder '{args.output.parent}' does not exist")

    if args.max_memory is not None and args.device_map is None:
        raise UsageError("--max-memory needs --device-map (e.g. --device-map auto)")
    hide_loading_bars()
    with tempfile.TemporaryDirectory(prefix="caote-offload-") as offload_folder:
        model, tokenizer = load_model(
            args.model,
            dtype=args.dtype,
            device_map=args.device_map,
            max_memory=args.max_memory,
            offload_folder=offload_folder if args.device_map else None,
        )
        return _answer(args, settings, sampling, text, model, tokenizer)


def _answer(args, settings, sampling: dict, text, model, tokenizer) -> int:
    """Check what the loaded model cannot serve (a `UsageError`), then stream its answer and write / print what was
    asked."""
    import torch
    from transformers import TextStreamer

    from caote.generation import check_inputs, generate_checked

    prompt = text
    if args.chat:
        if getattr(tokenizer, "chat_template", None):
            prompt = [{"role": "user", "content": text}]
        else:
            print(f"caote generate: note: {args.model!r} has no chat template; using the raw prompt", file=sys.stderr)
    options = dict(sampling)
    try:  # the length limit and the model's class, known once it is loaded
        input_ids, settings, max_new_tokens = check_inputs(
            model, tokenizer, prompt, args.max_new_tokens, settings, options
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    torch.manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = generate_checked(model, tokenizer, input_ids, settings, max_new_tokens, streamer=streamer, **options)
    sys.stdout.flush()
    if args.output is not None:
        write_atomically(args.output, result.text)
    if args.stats:
        print(format_stats(result.stats), file=sys.stderr)
    return 0
