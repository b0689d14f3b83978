"""What run.json records about where and with what a run was made."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def git_commit() -> dict[str, str | bool | None]:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    # results/ holds outputs (records, regenerated tables): a table rewritten by the last `make figures` is not a
    # change to the code that made a run
    if os.environ.get("SPECBENCH_GIT_COMMIT"):  # a copy of the tree (a cluster node, a GPU box): the commit it was
        return {"commit": os.environ["SPECBENCH_GIT_COMMIT"], "dirty": None}  # copied from (its .git may be stale)
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for pkg in ("torch", "transformers", "hydra-core", "safetensors", "specbench"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def device_info(device: torch.device) -> dict[str, str | int | None]:
    info: dict[str, str | int | None] = {
        "device": str(device),
        "cpu": cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "gpu": None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def header(command: str, device: torch.device) -> dict:
    """The provenance every result file carries: commit, date, command line, device, versions."""
    return {"git": git_commit(), "date": now_utc(), "command": " ".join([command, *sys.argv[1:]]),
            "env": device_info(device), "versions": versions()}
