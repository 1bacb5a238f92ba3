"""``caote generate`` and ``caote policies``: the user-facing subcommands of the ``caote`` CLI (``caote calibrate``
is `caote.calibrate_command`, ``caote validate`` `caote.validate_command`).

``caote generate`` answers one prompt with a bounded KV cache, streaming the answer to stdout; ``caote policies``
prints every eviction policy with a one-line description and its reference.
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
    add_subcommand,
    check_model,
    check_predictor_file,
    memory_limits,
    non_negative_int,
    positive_int,
    probability,
    temperature,
    warn_if_threads_share_cores,
)
from caote.defaults import (
    AUTO_POLICY,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BUDGET,
    DEFAULT_POLICY,
    DEFAULT_PREFILL,
    DEFAULT_SEED,
    PREFILL_MODES,
)

DEFAULT_MAX_NEW_TOKENS = 64
DTYPES = ("float32", "bfloat16", "float16")
GENERATE_HELP = "answer a prompt with a bounded KV cache, streaming tokens to stdout"
GENERATE_DESCRIPTION = (
    "Answer a prompt while every layer keeps at most --budget KV tokens. The prompt comes from the PROMPT argument, "
    "from --prompt-file, or from stdin with '-'. The answer streams to stdout as it is decoded. Decoding is greedy "
    "unless --temperature > 0 or --top-p is given."
)
POLICIES_HELP = "list the eviction policies"
POLICIES_DESCRIPTION = "List every eviction policy accepted by --policy, with a one-line description and reference."


def add_parser(subparsers) -> None:
    """Register ``generate`` and ``policies`` on the ``caote`` subcommand parser."""
    add_subcommand(subparsers, "generate", run_generate, GENERATE_HELP, GENERATE_DESCRIPTION, add_generate_arguments)
    add_subcommand(subparsers, "policies", run_policies, POLICIES_HELP, POLICIES_DESCRIPTION)


# -- caote policies -----------------------------------------------------------------------------------------------


def policy_table() -> str:
    """The Markdown table of every policy (``| policy | description |``), as printed by ``caote policies``,
    ``auto`` first."""
    # start-up: the policies import torch, which `caote --help` does not need
    from caote.policies import describe, policy_names

    lines = ["| policy | description |", "|---|---|"]
    lines += [f"| `{name}` | {describe(name)} |" for name in (AUTO_POLICY, *policy_names(hindsight=True))]
    return "\n".join(lines)


def run_policies(args: argparse.Namespace) -> int:
    """Print `policy_table`."""
    print(policy_table())
    return 0


# -- caote generate -----------------------------------------------------------------------------------------------


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """``caote generate``'s options, in --help order."""
    _add_prompt_and_model_arguments(parser)
    _add_decoding_arguments(parser)
    _add_runtime_arguments(parser)
    _add_output_arguments(parser)


def _add_prompt_and_model_arguments(parser: argparse.ArgumentParser) -> None:
    """What to answer, and with which model."""
    parser.add_argument("prompt", nargs="?", metavar="PROMPT", help="the prompt text, or '-' to read it from stdin")
    parser.add_argument("--prompt-file", type=Path, metavar="PATH", help="read the prompt from this file")
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="'smollm2-135m' (bundled, offline), a local path or a hub id (default: %(default)s)",
    )


def _add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """How the answer is decoded: the cache's budget and policy, the length, sampling, the chat template."""
    parser.add_argument(
        "--budget", type=positive_int, default=DEFAULT_BUDGET, help="KV tokens kept per layer (default: %(default)s)"
    )
    parser.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        help="eviction policy, see 'caote policies' (default: %(default)s: the model's learned policy when its "
        "predictor helps, else tova+caote below budget 512 and h2o+caote from 512; --stats names the one used)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help="most tokens to generate (default: %(default)s)",
    )
    parser.add_argument(
        "--block-size",
        type=positive_int,
        default=DEFAULT_BLOCK_SIZE,
        help="prompt tokens per prefill block (default: %(default)s)",
    )
    parser.add_argument(
        "--prefill",
        choices=PREFILL_MODES,
        default=DEFAULT_PREFILL,
        help="blocks: read the prompt in blocks, each evicted to the budget (memory never above budget + block); "
        "compress: read it whole with the full cache, then evict to the budget once (retrieval of a fact the "
        "question asks for; peak memory holds the prompt in one layer) (default: %(default)s)",
    )
    parser.add_argument(
        "--temperature",
        type=temperature,
        metavar="T",
        help="sample with this temperature; > 0 turns sampling on, 0 is greedy (default: greedy decoding)",
    )
    parser.add_argument(
        "--top-p",
        type=probability,
        metavar="P",
        help="nucleus sampling: draw from the likeliest tokens whose probabilities add up to P; turns sampling on",
    )
    parser.add_argument(
        "--seed",
        type=non_negative_int,
        default=DEFAULT_SEED,
        help="seed of the sampling and of the 'random' policy (default: %(default)s)",
    )
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap the prompt in the model's chat template as a user message (default: on)",
    )


def _add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """How the model and the policy's scoring run: dtype, device placement, the learned predictor, compiled decode."""
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="weights and KV cache dtype; scores are computed in float32 whatever it is (default: %(default)s)",
    )
    parser.add_argument(
        "--device-map",
        metavar="MAP",
        help="accelerate device map, e.g. 'auto' (with --max-memory, layers that do not fit go to CPU or disk)",
    )
    parser.add_argument(
        "--max-memory",
        type=memory_limits,
        metavar="DEV=SIZE,...",
        help="with --device-map: most memory per device, e.g. 'cpu=200MiB' or '0=6GiB,cpu=16GiB'; the rest of the "
        "model is offloaded to disk (a temporary folder)",
    )
    parser.add_argument(
        "--predictor",
        type=Path,
        metavar="FILE",
        help="for the learned policies and auto: a predictor file written by 'caote calibrate' (default: the one "
        "committed for the model; the bundled model has one)",
    )
    parser.add_argument(
        "--compile-decode",
        action="store_true",
        help="compute the decode steps' CAOTE errors in one torch.compile kernel: faster, equal to the exact default "
        "up to float32 rounding; the first steps compile (needs a C++ compiler on a CPU)",
    )
    parser.add_argument(
        "--threads", type=positive_int, help="torch CPU threads (default: torch's choice; 1 on a busy machine)"
    )


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """What is reported besides the streamed answer."""
    parser.add_argument("--stats", action="store_true", help="print tokens seen / kept and KV bytes saved to stderr")
    parser.add_argument(
        "--output",
        type=Path,
        metavar="PATH",
        help="also write the answer to PATH (atomically; nothing is written on failure)",
    )


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
    """Lines for ``--stats``: the policy (``auto -> caote-block`` when auto chose it), tokens seen / kept / evicted per
    layer, KV bytes held and saved."""
    mib = 1024 * 1024
    saved = stats.kv_bytes_saved
    share = 100.0 * saved / stats.full_kv_bytes if stats.full_kv_bytes else 0.0
    policy = stats.policy if stats.requested == stats.policy else f"{stats.requested} -> {stats.policy}"
    return "\n".join(
        [
            f"policy {policy}",
            f"tokens seen: {stats.tokens_seen}, kept: {stats.tokens_kept}, evicted: {stats.tokens_evicted} (per layer)",
            f"KV cache: {stats.kv_bytes / mib:.2f} MiB held (peak {stats.peak_kv_bytes / mib:.2f} MiB) vs "
            f"{stats.full_kv_bytes / mib:.2f} MiB for a full cache; saved {saved / mib:.2f} MiB ({share:.1f}%)",
        ]
    )


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
            prefill=args.prefill,
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
    if settings.predictor is not None:  # readable, finite, of this feature set and model: known before it loads
        check_predictor_file(settings.predictor, args.model)
    if args.threads is not None:
        import torch  # start-up: imported by the settings already

        torch.set_num_threads(args.threads)
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

    from caote.generation import announce_predictor, check_inputs, generate_checked

    prompt = text
    if args.chat:
        if getattr(tokenizer, "chat_template", None):
            prompt = [{"role": "user", "content": text}]
        else:
            print(f"caote generate: note: {args.model!r} has no chat template; using the raw prompt", file=sys.stderr)
    options = dict(sampling)
    try:  # the length limit, the model's class and its predictor (its verdict printed), known once it is loaded
        input_ids, settings, max_new_tokens = check_inputs(
            model, tokenizer, prompt, args.max_new_tokens, settings, options
        )
        announce_predictor(model, settings)
    except ValueError as error:
        raise UsageError(str(error)) from None
    warn_if_threads_share_cores(args.threads)  # after every check, so that a refusal stays one line
    torch.manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = generate_checked(model, tokenizer, input_ids, settings, max_new_tokens, streamer=streamer, **options)
    sys.stdout.flush()
    if args.output is not None:
        write_atomically(args.output, result.text)
    if args.stats:
        print(format_stats(result.stats), file=sys.stderr)
    return 0
