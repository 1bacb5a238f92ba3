"""Parallel processes and damaged files: the bundled model's conversion and the rows shards under two processes,
rows files with lines that are not rows, and complete rows files that cannot be written."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from caote import models
from caote.cli import main
from caote.evaluation.rows import RowStore, load_rows, row_key

TESTS = Path(__file__).resolve().parent
COPY = "smollm2-135m-instruct"


def fake_conversion_modules(log: Path, seconds: float, on_save=None) -> dict[str, types.ModuleType]:
    """Stand-ins for ``torch`` and ``transformers`` in the bundled model's conversion (the 25 s conversion in
    miniature): loading the model appends this process's pid to ``log``; saving it writes config.json, calls
    ``on_save(folder)`` and sleeps ``seconds``; the tokenizer saves a tokenizer.json."""

    class Saved:
        def __init__(self, file: str):
            self.file = file
            self.config = types.SimpleNamespace(quantization_config="gguf")
            self.hf_quantizer = "gguf"

        def save_pretrained(self, folder):
            (Path(folder) / self.file).write_text("{}")
            if self.file == "config.json":
                if on_save is not None:
                    on_save(Path(folder))
                time.sleep(seconds)

    class Loader:
        def __init__(self, file: str):
            self.file = file

        def from_pretrained(self, *args, **kwargs):
            if self.file == "config.json":
                with open(log, "a") as handle:
                    handle.write(f"{os.getpid()}\n")
            return Saved(self.file)

    torch = types.ModuleType("torch")
    torch.float32 = "float32"
    transformers = types.ModuleType("transformers")
    transformers.AutoModelForCausalLM = Loader("config.json")
    transformers.AutoTokenizer = Loader("tokenizer.json")
    return {"torch": torch, "transformers": transformers}


def _python(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kwargs,
    )


def _wait_for_line(process: subprocess.Popen, expected: str) -> None:
    line = process.stdout.readline().strip()
    assert line == expected, (line, process.stderr.read() if process.poll() is not None else "")


# -- the bundled model's conversion ----------------------------------------------------------------------------------


def test_two_processes_converting_at_once_share_one_copy_and_drop_a_killed_ones_folder(tmp_path):
    stale = tmp_path / ".convert-killed"  # left by a conversion killed half-way
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1024)
    log = tmp_path / "conversions.log"
    code = f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(TESTS)!r})
        from test_robustness_files import fake_conversion_modules
        from caote import models
        models.bundled_gguf_path = lambda: Path({str(tmp_path / "model.gguf")!r})
        sys.modules.update(fake_conversion_modules(Path({str(log)!r}), seconds=2.0))
        print(models.resolve_model_path("smollm2-135m"))
    """
    environment = {**os.environ, "CAOTE_CACHE_DIR": str(tmp_path)}
    processes = [_python(code, env=environment) for _ in range(2)]
    outputs = [process.communicate(timeout=120) for process in processes]
    for process, (out, err) in zip(processes, outputs):
        assert process.returncode == 0, err
        assert out.strip() == str(tmp_path / COPY)
    assert len(log.read_text().splitlines()) == 1  # converted once, the other process waited for that copy
    assert any("waiting for another process converting" in err for _, err in outputs)
    assert sorted(path.name for path in (tmp_path / COPY).iterdir()) == ["config.json", "tokenizer.json"]
    assert not list(tmp_path.glob(".convert-*"))


def test_a_copy_finished_meanwhile_by_another_process_is_kept(tmp_path, monkeypatch):
    target = tmp_path / COPY

    def finished_elsewhere(staging: Path) -> None:  # a process that did not take the lock renames its copy first
        target.mkdir()
        (target / "config.json").write_text('{"elsewhere": true}')

    monkeypatch.setenv("CAOTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(models, "bundled_gguf_path", lambda: tmp_path / "model.gguf")
    for name, module in fake_conversion_modules(tmp_path / "log", 0.0, on_save=finished_elsewhere).items():
        monkeypatch.setitem(sys.modules, name, module)
    assert models.resolve_model_path("smollm2-135m") == str(target)
    assert json.loads((target / "config.json").read_text()) == {"elsewhere": True}
    assert not list(tmp_path.glob(".convert-*"))


def test_staging_folders_are_removed_only_when_no_conversion_is_running(tmp_path, monkeypatch):
    target = tmp_path / COPY
    target.mkdir()
    (target / "config.json").write_text("{}")
    (tmp_path / ".convert-killed").mkdir()
    monkeypatch.setenv("CAOTE_CACHE_DIR", str(tmp_path))
    # a conversion running in another process: it holds the conversion lock while it writes its staging folder
    running = _python(
        f"""
        import sys
        from pathlib import Path
        from filelock import FileLock
        lock = FileLock({str(target)!r} + ".lock")
        lock.acquire()
        (Path({str(tmp_path)!r}) / ".convert-running").mkdir()
        print("converting", flush=True)
        sys.stdin.read()
        """,
        stdin=subprocess.PIPE,
    )
    try:
        _wait_for_line(running, "converting")
        assert models.resolve_model_path("smollm2-135m") == str(target)
        assert sorted(path.name for path in tmp_path.glob(".convert-*")) == [".convert-killed", ".convert-running"]
    finally:
        running.kill()  # killed half-way: its folder is stale now
        running.communicate(timeout=60)
    assert models.resolve_model_path("smollm2-135m") == str(target)
    assert not list(tmp_path.glob(".convert-*"))
    assert (target / "config.json").is_file()


# -- rows shards under two processes ---------------------------------------------------------------------------------


def _rows_writer(out: Path) -> subprocess.Popen:
    """A process that holds the rows shard ``out/rows.0.jsonl`` until its stdin closes."""
    writer = _python(
        f"""
        import sys
        from caote.evaluation.rows import RowStore
        with RowStore({str(out)!r}):
            print("writing", flush=True)
            sys.stdin.read()
        """,
        stdin=subprocess.PIPE,
    )
    _wait_for_line(writer, "writing")
    return writer


def test_a_second_process_writing_the_same_rows_is_refused_naming_the_holder(tmp_path):
    writer = _rows_writer(tmp_path)
    try:
        with pytest.raises(RuntimeError, match=f"pid {writer.pid}") as error:
            RowStore(tmp_path)
        assert "\n" not in str(error.value) and str(tmp_path / "rows.0.jsonl") in str(error.value)
        assert load_rows(tmp_path) == []  # reading needs no lock
    finally:
        writer.communicate("", timeout=60)
    with RowStore(tmp_path) as store:  # free again once the holder has ended
        assert store.rows == {}


def test_a_writer_leaves_only_its_rows_behind_even_after_a_killed_one(tmp_path):
    with RowStore(tmp_path) as store:
        store.append(_row("a"))
    assert [path.name for path in tmp_path.iterdir()] == ["rows.0.jsonl"]
    writer = _rows_writer(tmp_path)
    writer.kill()  # killed: its lock file stays, the OS lock goes
    writer.communicate(timeout=60)
    assert (tmp_path / "rows.0.jsonl.lock").read_text().strip() == str(writer.pid)
    with RowStore(tmp_path) as store:
        assert list(store.rows) == [_row("a")["key"]]
    assert [path.name for path in tmp_path.iterdir()] == ["rows.0.jsonl"]


def test_a_lock_taken_on_a_removed_lock_file_is_taken_again_on_the_file_at_its_path(tmp_path, monkeypatch):
    lock_path = tmp_path / "rows.0.jsonl.lock"
    first = RowStore(tmp_path)
    waiting = os.open(lock_path, os.O_RDWR)  # a second writer that opened the lock file before the first let go
    first.close()  # removes the file, then lets go: the second writer's lock now succeeds on a removed file
    assert not lock_path.exists()
    real_open = os.open
    opened = iter([waiting])
    monkeypatch.setattr(os, "open", lambda *args, **kwargs: next(opened, None) or real_open(*args, **kwargs))
    with RowStore(tmp_path):
        monkeypatch.undo()
        assert lock_path.read_text().strip() == str(os.getpid())  # it holds the file at the path ...
        with pytest.raises(RuntimeError, match=f"pid {os.getpid()}"):  # ... so a third writer is refused
            RowStore(tmp_path)
    assert not lock_path.exists()


def test_caote_eval_on_a_folder_another_process_writes_exits_1_with_one_line(tmp_path, monkeypatch, capsys, tokenizer):
    from caote.evaluation import report  # imports torch: not at the top, which the converting processes import

    monkeypatch.setattr(report, "_load", lambda config, state: (None, tokenizer))
    argv = ["eval", "niah", "--out", str(tmp_path), "--lengths", "256", "--samples", "1", "--depths", "50"]
    argv += ["--policies", "tova", "--budgets", "64", "--no-progress"]
    writer = _rows_writer(tmp_path)
    try:
        assert main(argv) == 1
    finally:
        writer.communicate("", timeout=60)
    error = capsys.readouterr().err.strip()
    assert error.startswith("caote eval: error: ") and f"pid {writer.pid}" in error
    assert len(error.splitlines()) == 1, error


# -- rows files with lines that are not rows -------------------------------------------------------------------------


def _row(example_id: str) -> dict:
    return {
        "key": row_key("tiny", example_id, "tova", 64),
        "benchmark": "toy",
        "model": "tiny",
        "example_id": example_id,
        "policy": "tova",
        "budget": 64,
        "score": 1.0,
    }


def _line(row: dict) -> bytes:
    return json.dumps(row).encode() + b"\n"


NOT_ROWS = {
    "a JSON list": (b"[1, 2, 3]\n", "a JSON list, not a row object"),
    "an object without key": (json.dumps({"benchmark": "toy", "score": 1}).encode() + b"\n", "no 'key'"),
    "garbage": (b"this is not JSON\n", "not JSON"),
    "a line cut in the middle": (_line(_row("cut"))[:30] + b"\n", "not JSON"),
    "a byte that is not UTF-8": (_line(_row("stray")).replace(b"stray", b"str\xffy"), "not UTF-8"),
}


@pytest.mark.parametrize("case", NOT_ROWS)
def test_a_line_that_is_not_a_row_is_skipped_with_one_warning(tmp_path, capsys, case):
    line, reason = NOT_ROWS[case]
    shard = tmp_path / "rows.0.jsonl"
    shard.write_bytes(_line(_row("a")) + line + _line(_row("b")))
    assert [row["example_id"] for row in load_rows(tmp_path)] == ["a", "b"]
    with RowStore(tmp_path) as store:  # a rerun reads the file again: still one warning
        assert len(store.rows) == 2
    warning = capsys.readouterr().err.strip()
    assert len(warning.splitlines()) == 1, warning
    assert warning.startswith(f"caote: warning: skipped line 2 of {shard}: ") and reason in warning


def test_a_torn_last_line_is_skipped_quietly_and_cut_before_appending(tmp_path, capsys):
    shard = tmp_path / "rows.0.jsonl"
    shard.write_bytes(_line(_row("a")) + _line(_row("b"))[:25])  # killed mid-write
    assert [row["example_id"] for row in load_rows(tmp_path)] == ["a"]
    with RowStore(tmp_path) as store:
        store.append(_row("b"))
    assert [row["example_id"] for row in load_rows(tmp_path)] == ["a", "b"]
    assert capsys.readouterr().err == ""


# -- complete rows files that cannot be written ----------------------------------------------------------------------


def test_a_complete_read_only_rows_file_is_read_without_opening_it_for_writing(tmp_path, monkeypatch):
    shard = tmp_path / "rows.0.jsonl"
    shard.write_bytes(_line(_row("a")) + _line(_row("b")))
    shard.chmod(0o444)  # enough for a user; root writes anyway, hence the guard below
    real_open, real_truncate = builtins.open, os.truncate

    def refused(file) -> PermissionError:
        return PermissionError(errno.EACCES, "Permission denied (read-only, simulated)", str(file))

    def is_shard(file) -> bool:
        return isinstance(file, (str, os.PathLike)) and Path(file).resolve() == shard.resolve()

    def guarded_open(file, mode="r", *args, **kwargs):
        if is_shard(file) and any(flag in mode for flag in "wax+"):
            raise refused(file)
        return real_open(file, mode, *args, **kwargs)

    def guarded_truncate(file, length):
        if is_shard(file):
            raise refused(file)
        return real_truncate(file, length)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)
    monkeypatch.setattr(os, "truncate", guarded_truncate)
    with RowStore(tmp_path) as store:
        assert sorted(row["example_id"] for row in store.rows.values()) == ["a", "b"]
        with pytest.raises(PermissionError):  # only appending needs write access
            store.append(_row("c"))
    assert [row["example_id"] for row in load_rows(tmp_path)] == ["a", "b"]
