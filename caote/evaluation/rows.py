"""Resumable JSONL rows: one JSON object per line in ``<out>/rows.<rank>.jsonl``, one per (model, example id,
policy, budget).

Each row is written, flushed and fsynced before the next one starts, so a killed run loses at most the row in
flight; a rerun reads every shard, skips the keys already present and cuts a torn last line off its own shard
before appending. Rows do not depend on the sharding (see `caote.evaluation.runner`).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

from caote.evaluation.reference import FULL

# fields that depend on the machine or the sharding, not on the computation (ignored when rows are compared)
VOLATILE_FIELDS = ("seconds", "rank", "num_processes", "finished_at", "commit")


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


def read_rows(path: Path) -> list[dict]:
    """The rows of one shard; an undecodable line (a torn write) is skipped."""
    rows = []
    if not path.is_file():
        return rows
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
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
    """Drop a last line that was cut mid-write (no trailing newline) so that appends start on a fresh line."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as handle:
        data = handle.read()
        if data.endswith(b"\n"):
            return
        handle.truncate(data.rfind(b"\n") + 1)


class RowStore:
    """This process's shard plus the keys done by every shard; `append` is durable before it returns."""

    def __init__(self, out: Path, rank: int = 0):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / f"rows.{rank}.jsonl"
        _cut_torn_tail(self.path)
        self.rows: dict[str, dict] = {row["key"]: row for row in load_rows(self.out)}

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
