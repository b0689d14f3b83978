"""A sweep that checks before it decodes and survives a failed job (Hydra callbacks, conf/config.yaml).

- `on_multirun_start`: the pre-flight. Every job of the sweep is composed as the sweeper will compose it; its target
  must be there (checked without loading weights), its question set readable (`make data` fetches the files no
  package ships), and every drafter with a `checkpoint` must find its weights for that model; all the missing pieces are listed at once, each with the command that makes or downloads it, and
  nothing is decoded.
- a job that fails (specbench.run records it in the sweep directory, `failed/<job>.json`) does not end the sweep;
- `on_multirun_end`: the sweep exits non-zero naming every failed job.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hydra import compose
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


def job_overrides(config: DictConfig) -> list[list[str]]:
    """The override list of every job, as the basic sweeper expands them (its params, then the command line)."""
    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    task = OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
    overrides = OverridesParser.create().parse_overrides(params + list(task))
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def missing_weights(cfg: DictConfig) -> str | None:
    """The drafter's checkpoint for this model, if it is missing: one line with the command that trains it."""
    from specbench.decode.checkpoints import weight_file, weights_root

    ckpt = cfg.drafter.get("checkpoint")
    if not ckpt or cfg.drafter.get("model_path") or weight_file(ckpt) is not None:  # an HF draft needs no checkpoint
        return None
    trains = Path(ckpt).name  # weights/<model>/<drafter that trains them> (eagle2 decodes eagle's weights)
    head = f"drafter={cfg.drafter.name} on model={cfg.model.name}: no weights at {ckpt} — "
    if Path(ckpt).parent != weights_root() / cfg.model.name:  # a path of the user's own: `make train` writes elsewhere
        return head + "no checkpoint is at that path (check drafter.checkpoint)"
    published = (cfg.model.get("published") or {}).get(trains)
    if published and Path(ckpt) == weights_root() / cfg.model.name / trains:
        return head + f"download the authors' ({published}) with `make download MODEL={cfg.model.name}`"
    return (head + f"train them with `make train MODEL={cfg.model.name} TRAIN_DRAFTERS={trains}` (python -m "
            f"specbench.train drafter={trains} model={cfg.model.name})")


def missing_questions(cfg: DictConfig) -> str | None:
    """The job's question set, if it cannot be read (a user's clone has no ../shared/data: `make data` fetches it)."""
    from specbench.core.config import DatasetConfig, to_dataclass
    from specbench.data.data import load_questions
    from specbench.errors import SpecbenchError

    try:
        load_questions(to_dataclass(DatasetConfig, cfg.dataset))
    except SpecbenchError as e:
        return f"dataset={cfg.dataset.name}: {e}"
    return None


def failures_dir(sweep_dir: str | Path) -> Path:
    return Path(sweep_dir) / "failed"


def record_failure(sweep_dir: str | Path, job: int, overrides: list[str], error: BaseException) -> Path:
    path = failures_dir(sweep_dir) / f"{job}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"job": job, "overrides": overrides, "error": f"{type(error).__name__}: {error}"}))
    return path


class SweepChecks(Callback):
    def on_multirun_start(self, config: DictConfig, config_name: str | None = None, **kwargs: Any) -> None:
        from specbench.core.config import ModelConfig, to_dataclass
        from specbench.core.models import unavailable

        problems: list[str] = []
        ready: list[str] = []  # drafters whose every job can run
        blocked: set[str] = set()
        for job in job_overrides(config):
            cfg = compose(config_name=config_name or "config", overrides=job)
            target, weights = unavailable(to_dataclass(ModelConfig, cfg.model)), missing_weights(cfg)
            (blocked.add if target or weights else ready.append)(cfg.drafter.name)  # (a missing set blocks no drafter)
            found = [target, weights, missing_questions(cfg)]
            problems += [p for p in found if p and p not in problems]
        if problems:
            print(f"error: pre-flight: {len(problems)} missing piece(s) for this sweep; nothing was decoded:",
                  file=sys.stderr)
            for p in problems:
                print(f"  {p}", file=sys.stderr)
            runnable = [d for d in dict.fromkeys(ready) if d not in blocked]
            if runnable:  # e.g. a GPU target with published weights for some drafters only
                print(f"  or decode only the drafters that can run: drafter={','.join(runnable)} "
                      f"(make bench ARGS='drafter={','.join(runnable)}')", file=sys.stderr)
            sys.exit(2)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        failed = sorted(failures_dir(config.hydra.sweep.dir).glob("*.json"), key=lambda p: int(p.stem))
        if failed:
            print(f"error: {len(failed)} job(s) of the sweep failed (the others finished):", file=sys.stderr)
            for f in failed:
                r = json.loads(f.read_text())
                print(f"  #{r['job']} {' '.join(r['overrides'])}: {r['error']}", file=sys.stderr)
            sys.exit(1)
