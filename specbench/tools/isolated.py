"""One part of a long check in a process of its own under a hard time limit (gpu_check's parts).

A lent GPU comes as a short slot, so no part may end the whole call or outlast its share: a part runs in a child
process; one that raises, crashes or overruns is recorded as such (its process group killed: inductor's compile
workers go with it) and the caller goes on to the next part. What the part recorded before it stopped is kept: the
child rewrites its data file after every item it measures (`Progress.save`).

Children come from a fork server that has imported torch, transformers and the caller's module once (`preload`):
a fresh interpreter per part would import them again (seconds each) and a fork of the caller would inherit its
CUDA state. Linux and macOS; elsewhere the children are spawned.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from specbench.core.records import atomic_write_text

OK, FAILED, TIMEOUT, SKIPPED = "ok", "failed", "timeout", "skipped (deadline)"


@dataclass
class Progress:
    """A part's data as it goes (the child's side): `save` after each item, so a kill keeps what was measured."""

    path: Path
    data: dict = field(default_factory=dict)

    def save(self, error: str | None = None) -> None:
        # in the part's own order (not sorted): the markdown lists paths and drafters as they were measured
        atomic_write_text(self.path, json.dumps({"data": self.data, "error": error}))


@dataclass
class Outcome:
    """How a part ended (the parent's side), and the data it had saved by then."""

    status: str  # OK, FAILED, TIMEOUT
    seconds: float
    limit_s: float
    data: dict = field(default_factory=dict)
    error: str | None = None

    def record(self) -> dict:
        out: dict[str, Any] = {"status": self.status, "seconds": round(self.seconds, 1), "limit_s": round(self.limit_s, 1)}
        if self.error:
            out["error"] = self.error
        return out


def last_line(exc: BaseException) -> str:
    """An exception in one line: its type and the last line of its message (a traceback goes to stderr)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1].strip()}" if lines else type(exc).__name__


def _die_with_caller(lifeline) -> None:
    """The caller holds the other end of `lifeline` and never writes: it reads EOF when the caller is gone, however
    it went (killed outright as a slot ended), and the part goes too, with its process group, not left holding the
    device. (The fork server outlives the caller while a child lives, so its death says nothing in time.)"""
    try:
        lifeline.recv()
    except (EOFError, OSError):
        pass
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _child(fn: Callable[[Any, Progress], None], payload: Any, path: str, lifeline) -> None:
    os.setsid()  # a process group of its own: the parent kills the part and whatever it started, nothing else
    threading.Thread(target=_die_with_caller, args=(lifeline,), daemon=True).start()
    progress = Progress(Path(path))
    try:
        fn(payload, progress)
    except Exception as exc:  # the part's boundary: recorded as failed, the caller goes on with the next part
        traceback.print_exc()
        progress.save(error=last_line(exc))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    progress.save()


def context(preload: list[str]):
    """The multiprocessing context parts run in: a fork server with `preload` imported, or spawn where none is."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    return ctx


def _kill(proc) -> None:
    """SIGKILL the part's process group (the part and its compile workers); the part alone if it had not yet made
    its group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.kill()
    proc.join(5)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def run(ctx, fn: Callable[[Any, Progress], None], payload: Any, limit_s: float, path: Path) -> Outcome:
    """fn(payload, progress) in a child process for at most limit_s seconds; never raises for what the part does."""
    path.unlink(missing_ok=True)
    lifeline, held = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, payload, str(path), lifeline), daemon=False)
    t0 = time.perf_counter()
    proc.start()
    lifeline.close()  # the child's end, now in the child
    try:
        proc.join(max(0.0, limit_s))
        overran = proc.is_alive()
    finally:  # the caller interrupted (Ctrl-C, SIGTERM): the part goes too, not left holding the device
        if proc.is_alive():
            _kill(proc)
        held.close()
    seconds = time.perf_counter() - t0
    saved = _read(path)
    data = saved.get("data") or {}
    if overran:
        return Outcome(TIMEOUT, seconds, limit_s, data, f"over its limit of {limit_s:.0f} s, killed")
    if proc.exitcode == 0:
        return Outcome(OK, seconds, limit_s, data)
    return Outcome(FAILED, seconds, limit_s, data, saved.get("error") or _exit_reason(proc.exitcode))


def _read(path: Path) -> dict:
    """The child's last saved file; none (it died before its first save) or unreadable: nothing saved."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
