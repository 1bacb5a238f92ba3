"""Resumable JSONL rows: one JSON object per line in ``<out>/rows.<rank>.jsonl``, one per (model, example id,
policy, budget).

Each row is written, flushed and fsynced before the next one starts, so a killed run loses at most the row in
flight; a rerun reads every shard, skips the keys already present and cuts a torn last line off its own shard
before appending. A line that is not a row (garbage, a JSON value that is not a row object, bytes that are not UTF-8)
is skipped with a one-line warning naming the file and line; a torn last line is skipped quietly (its row is simply
recomputed). Reading never opens a shard for writing. A process writing a shard holds ``<shard>.lock`` (an OS lock,
released when the process ends, however it ends) and records its pid in ``<shard>.pid``; a second process is
refused in one line naming that pid. Rows do not depend on the sharding (see `caote.evaluation.runner`).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

from filelock import FileLock, Timeout

from caote.evaluation.reference import FULL

# fields that depend on the machine or the sharding, not on the computation (ignored when rows are compared)
VOLATILE_FIELDS = ("seconds", "rank", "num_processes", "finished_at", "commit")
# fields every row has, whatever its task: a line without one of them is not a row
ROW_FIELDS = ("key", "benchmark", "model", "example_id", "policy", "budget")

_warned_lines: set[tuple[str, int]] = set()  # (shard, line number) already reported by this process


@functools.lru_cache(maxsize=1)
def code_commit() -> str:
    """The short commit of the caote checkout the rows are computed with (``+dirty`` when tracked files differ),
    stored in every row so that a document names the code its rows came from; ``"unknown"`` outside git."""
    folder = Path(__file__).resolve().parents[1]  # the caote package: its files are the code of the rows
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=folder, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
            capture_output=True,
            text=True,
            cwd=folder,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}+dirty" if commit and dirty else (commit or "unknown")


def row_commits(rows) -> list[str]:
    """The distinct commits stored in ``rows`` (``"not recorded"`` for rows written before the field existed)."""
    return sorted({str(row.get("commit") or "not recorded") for row in rows})


def row_key(model: str, example_id: str, policy: str, budget: int | None) -> str:
    return f"{model}\t{example_id}\t{policy}\t{FULL if budget is None else int(budget)}"


def _parse_row(line: bytes) -> dict:
    """The row stored on one line; a `ValueError` saying why the line is not a row."""
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError:
        raise ValueError("not JSON") from None
    if not isinstance(row, dict):
        raise ValueError(f"a JSON {type(row).__name__}, not a row object")
    missing = [field for field in ROW_FIELDS if field not in row]
    if missing:
        raise ValueError(f"no {', '.join(map(repr, missing))} field")
    if not isinstance(row["key"], str):
        raise ValueError(f"its key is {row['key']!r}, not a string")
    return row


def read_rows(path: Path) -> list[dict]:
    """The rows of one shard. A line that is not a row is skipped with a one-line warning on stderr (once per process
    and line); a torn last line (a write cut by a kill) is skipped quietly."""
    rows = []
    if not path.is_file():
        return rows
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append(_parse_row(line))
            except ValueError as reason:
                torn = not line.endswith(b"\n")  # only the last line can lack its newline
                if not torn and (str(path), number) not in _warned_lines:
                    _warned_lines.add((str(path), number))
                    print(f"caote: warning: skipped line {number} of {path}: {reason}", file=sys.stderr, flush=True)
    return rows


def shard_paths(out: Path) -> list[Path]:
    return sorted(Path(out).glob("rows.*.jsonl"))


def load_rows(out: Path) -> list[dict]:
    """Every row of every shard under ``out``, once per key (the first written wins), in a stable order."""
    seen: dict[str, dict] = {}
    for path in shard_paths(out):
        for row in read_rows(path):
            seen.setdefault(row["key"], row)
    return [seen[key] for key in sorted(seen)]


def _cut_torn_tail(path: Path) -> None:
    """Drop a last line that was cut mid-write (no trailing newline) so that appends start on a fresh line; a shard
    that ends with a newline is only read."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        os.truncate(path, data.rfind(b"\n") + 1)


def _lock_shard(path: Path) -> FileLock:
    """Hold ``<path>.lock`` and record this process's pid in ``<path>.pid``; a `RuntimeError` naming the holder's
    pid when another process holds it."""
    lock = FileLock(f"{path}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise RuntimeError(
            f"{path} is being written by another process (pid {_holder_pid(path)}); wait for it to end or write the "
            "rows to another output folder"
        ) from None
    _pid_path(path).write_text(f"{os.getpid()}\n", encoding="utf-8")
    return lock


def _pid_path(path: Path) -> Path:
    return path.with_name(f"{path.name}.pid")


def _holder_pid(path: Path) -> str:
    try:
        return _pid_path(path).read_text(encoding="utf-8").strip() or "unknown"
    except OSError:  # the holder has just taken the lock and not written its pid yet
        return "unknown"


class RowStore:
    """This process's shard plus the keys done by every shard; `append` is durable before it returns. The shard is
    locked from the start until `close` (or the end of a ``with`` block): a second process writing it is refused."""

    def __init__(self, out: Path, rank: int = 0):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / f"rows.{rank}.jsonl"
        self._lock = _lock_shard(self.path)
        try:
            _cut_torn_tail(self.path)
            self.rows: dict[str, dict] = {row["key"]: row for row in load_rows(self.out)}
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> RowStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Release the shard (its pid file is removed first, so that it never names a process that let go)."""
        if self._lock.is_locked:
            _pid_path(self.path).unlink(missing_ok=True)
            self._lock.release()

    def __contains__(self, key: str) -> bool:
        return key in self.rows

    def get(self, key: str) -> dict | None:
        return self.rows.get(key)

    def append(self, row: dict) -> None:
        if row["key"] in self.rows:
            return
        line = json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n"
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
        self.rows[row["key"]] = row
