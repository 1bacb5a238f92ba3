"""Resumable JSONL rows: one JSON object per line in ``<out>/rows.<rank>.jsonl``, one per (model, example id,
policy, budget).

Each row is written, flushed and fsynced before the next one starts, so a killed run loses at most the row in
flight; a rerun reads every shard, skips the keys already present and cuts a torn last line off its own shard
before appending. A line that is not a row (garbage, a JSON value that is not a row object, bytes that are not UTF-8)
is skipped with a one-line warning naming the file and line; a torn last line is skipped quietly (its row is simply
recomputed). Reading never opens a shard for writing. A process writing a shard holds an OS lock on ``<shard>.lock``
(released when the process ends, however it ends) with its pid written in it; a second process is refused in one line
naming that pid. The lock file is removed when its writer lets go (a killed writer's is removed by the next one). Rows
do not depend on the sharding (see `caote.evaluation.runner`).
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

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


def _lock_shard(path: Path) -> int:
    """The descriptor of ``<path>.lock``, locked, with this process's pid written in it; a `RuntimeError` naming the
    holder's pid when another process holds it.

    A writer removes the lock file while it still holds it (`_unlock_shard`), so a lock taken on a file that is no
    longer at the path was taken after its holder let go: it is dropped and taken again on the file there now. Two
    writers can therefore never hold locks on two different files of the same path."""
    lock_path = f"{path}.lock"
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # held (some file systems say EACCES)
            holder = os.read(fd, 32).decode("utf-8", "replace").strip() or "unknown"  # unknown: not written yet
            os.close(fd)
            raise RuntimeError(
                f"{path} is being written by another process (pid {holder}); wait for it to end or write the rows to "
                "another output folder"
            ) from None
        if _is_at(fd, lock_path):
            os.ftruncate(fd, 0)  # a killed writer's pid
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)


def _is_at(fd: int, path: str) -> bool:
    """Whether the file open as ``fd`` is the one at ``path``."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _unlock_shard(path: Path, fd: int) -> None:
    """Remove ``<path>.lock`` while ``fd`` still holds it, then let go."""
    lock_path = f"{path}.lock"
    try:
        if _is_at(fd, lock_path):  # never a file another writer created after this one was removed by hand
            os.unlink(lock_path)
    finally:
        os.close(fd)


class RowStore:
    """This process's shard plus the keys done by every shard; `append` is durable before it returns. The shard is
    locked from the start until `close` (or the end of a ``with`` block): a second process writing it is refused."""

    def __init__(self, out: Path, rank: int = 0):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / f"rows.{rank}.jsonl"
        self._lock: int | None = _lock_shard(self.path)
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
        """Release the shard, removing its lock file."""
        if self._lock is not None:
            fd, self._lock = self._lock, None
            _unlock_shard(self.path, fd)

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
