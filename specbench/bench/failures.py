"""Failed jobs, kept where the tables are made: results/<experiment>/failed/<job>.json.

A sweep records each failed job in Hydra's sweep directory (specbench/bench/sweep.py) to name it at the end; that directory
is gone by the time `make figures` runs, and a table must say why a cell is empty. So the job's failure is also written
next to its experiment's runs, with the part of its config a table is keyed by (model, dtype, budget, drafter, dataset,
temperature: the same `config` shape as a run's run.json), and the report prints "failed" in its cells and the error
under the table. A later job of the same config that finishes removes the record: a table never shows a failure that a
re-run has since fixed.
"""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from specbench.core import envinfo
from specbench.core.cli import config_hash
from specbench.errors import SpecbenchError
from specbench.core.records import atomic_write_json

FAILED = "failed"


def _identity(cfg: DictConfig) -> dict:
    """The config a table cell is keyed by, in run.json's `config` shape (report.Setting.of and cell_key read it)."""
    part = lambda key: OmegaConf.to_container(cfg[key], resolve=True) if cfg.get(key) is not None else {}
    # the drafter whole: two jobs that differ only in a drafter option (moa_tli_context's tli_context, draft_vocab's N)
    # fail into two records, and a table whose rows are an option's values (report option_key) reads it back
    return {"model": part("model"), "dataset": part("dataset"), "decoding": part("decoding"),
            "drafter": part("drafter"), "seed": cfg.get("seed")}


def failure_path(cfg: DictConfig) -> Path:
    ident = _identity(cfg)
    name = (f"{ident['model'].get('name')}__{ident['drafter']['name']}__{ident['dataset'].get('name')}__"
            f"T{float(ident['decoding'].get('temperature', 0.0)):g}__{config_hash(ident)}")
    return Path(cfg.out.root) / cfg.out.experiment / FAILED / f"{name}.json"


def record(cfg: DictConfig, error: BaseException, overrides: list[str]) -> Path:
    """Write the job's failure (one line of error) under its experiment; returns the file."""
    from specbench.core.models import pick_device, pick_dtype

    path = failure_path(cfg)
    try:  # the dtype the job would have run in (`auto` resolved as the loader resolves it), for the table it belongs to
        device = pick_device(cfg.model.device)
        resolved = {"dtype": str(pick_dtype(cfg.model.dtype, device)).removeprefix("torch."), "device": device.type}
    except (SpecbenchError, RuntimeError):  # an invalid dtype or device is what failed: no resolved target
        resolved = {}
    message = str(error).splitlines()[0] if str(error) else ""
    atomic_write_json(path, {"config": _identity(cfg), "model_identity": resolved, "overrides": overrides,
                             "error": f"{type(error).__name__}: {message}", "date": envinfo.now_utc(),
                             "git": envinfo.git_commit()})
    return path


def clear(cfg: DictConfig) -> None:
    """The job finished: an earlier failure of the same config no longer describes it."""
    failure_path(cfg).unlink(missing_ok=True)


def load(exp_dir: Path) -> list[dict]:
    """Every failure record of an experiment directory, in file order."""
    return [json.loads(p.read_text()) for p in sorted((exp_dir / FAILED).glob("*.json"))]
