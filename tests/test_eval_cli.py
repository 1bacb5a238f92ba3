"""``caote eval``: bad arguments are rejected with one clear line and exit code 2, before any model loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from caote.cli import build_parser, main
from caote.evaluation.config import config_from_args

REPO = Path(__file__).resolve().parents[1]


def _rejected(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    return error


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["eval", "niah", "--policies", "tova,h2o+cote"], "unknown policy 'h2o+cote'; did you mean 'h2o+caote'"),
        (["eval", "niah", "--budgets", "128,big"], "--budgets: 'big' is not an integer"),
        (["eval", "niah", "--budgets", "0"], "--budgets: 0 is below the minimum 1"),
        (["eval", "niah", "--policies", "snapkv", "--budgets", "32"], "--budgets: 32 is too small for snapkv"),
        (["eval", "haystack"], "unknown benchmark 'haystack'"),
        (["eval", "longbench"], "longbench needs --data-dir"),
        (["eval", "longbench", "--data-dir", "/nonexistent/longbench"], "is not a folder"),
        (["eval", "ruler", "--split", "train"], "--split: 'train' is not 'dev' or 'test'"),
        (["eval", "niah", "--lengths", "1024,2k"], "--lengths: '2k' is not an integer"),
        (["eval", "niah", "--depths", "50,150"], "must be percentages in 0..100"),
        (["eval", "niah", "--quick"], "--quick applies to 'report' only"),
        (["eval", "ruler", "--samples", "-3"], "--samples: -3 is below the minimum 1"),
        (["eval", "ruler", "--tasks", "niah_single,summarise"], "--tasks: unknown ruler tasks ['summarise']"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, argv, expected):
    error = _rejected(capsys, argv)
    assert error.startswith("caote eval: error: ") and expected in error


def test_good_arguments_build_the_config(tmp_path):
    args = build_parser().parse_args(
        [
            "eval",
            "perplexity",
            "--policies",
            "paper",
            "--budgets",
            "256,128,256",
            "--lengths",
            "2048",
            "--samples",
            "3",
            "--out",
            str(tmp_path),
        ]
    )
    config = config_from_args(args)
    assert config.benchmark == "perplexity" and config.budgets == [256, 128] and config.lengths == [2048]
    assert len(config.policies) == 11 and config.policies[0] == "full" and config.samples == 3
    assert config.out == tmp_path and config.split == "test"


def test_unknown_ruler_task_is_refused_before_any_work(tmp_path):
    args = build_parser().parse_args(["eval", "ruler", "--tasks", "niah_single,summarise", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="unknown ruler tasks"):
        config_from_args(args)


def test_command_line_process_exits_2_with_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "caote.cli", "eval", "niah", "--budgets", "12x"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "caote eval: error: --budgets: '12x' is not an integer"
    assert result.stdout == ""
