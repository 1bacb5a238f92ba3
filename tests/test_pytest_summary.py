"""The README's test command, with the repository's pytest configuration, ends with the "N passed" summary line."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_pytest_arguments() -> list[str]:
    """The arguments the README passes to ``python -m pytest`` (e.g. ``["-q"]``)."""
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        match = re.search(r"python -m pytest(?P<args>[^&|;]*)", line)
        if match:
            return shlex.split(match["args"])
    raise AssertionError("the README has no `python -m pytest` command")


def test_the_readme_test_command_prints_the_summary_line(tmp_path):
    (tmp_path / "test_tiny.py").write_text("def test_one():\n    pass\n\n\ndef test_two():\n    pass\n")
    command = [sys.executable, "-m", "pytest", *readme_pytest_arguments()]
    # the repository's configuration (its addopts), run on the two tests above only
    command += ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, str(tmp_path / "test_tiny.py")], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^2 passed\b", done.stdout, flags=re.MULTILINE), done.stdout
