"""results/<experiment>/<run>/: run.json, records.jsonl, summary.json. Every write is temp file + rename, so a crash
leaves either the old file or the new one; records are appended question by question (all turns of a question at
once), and a re-run of the same run resumes after the last finished question."""
from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextmanager
def exclusive(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock named after a run while it is computed, so that parallel jobs (a sweep on a cluster,
    hydra-submitit-launcher) that share it compute it once: the others wait, then find it finished and skip it.
    A POSIX lock (fcntl.lockf) on `<experiment>/.locks/<run>`, which NFS and Lustre honour across nodes."""
    lock = run_dir.parent / ".locks" / run_dir.name
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as f:
        fcntl.lockf(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(f, fcntl.LOCK_UN)


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class RunDir:
    """One run: a fixed config (its hash is in the name) on one dataset."""

    def __init__(self, path: Path):
        self.path = path
        self.run_json = path / "run.json"
        self.records_path = path / "records.jsonl"
        self.summary_path = path / "summary.json"

    def exists(self) -> bool:
        return self.run_json.is_file()

    def records(self) -> list[dict]:
        return read_jsonl(self.records_path)

    def append(self, new: Iterable[dict]) -> None:
        """Rewrites the file with the new lines added (records are small: one line per turn)."""
        old = self.records_path.read_text(encoding="utf-8") if self.records_path.is_file() else ""
        add = "".join(json.dumps(r, sort_keys=True) + "\n" for r in new)
        atomic_write_text(self.records_path, old + add)

    def done_keys(self) -> set[tuple[int, str]]:
        return {(r["repeat"], r["question_id"]) for r in self.records()}
