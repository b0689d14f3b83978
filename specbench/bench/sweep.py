"""A sweep that checks before it decodes, runs what it can and survives a failed job (Hydra callbacks,
conf/config.yaml).

- `on_multirun_start`: the pre-flight. Every job of the sweep is composed as the sweeper will compose it; its target
  must be there (checked without loading weights), its question set readable (`make data` fetches the files no
  package ships), and every drafter with a `checkpoint` must find its weights for that model. A missing target or
  question set stops the sweep before anything is decoded, listing every missing piece with its command. A job whose
  drafter has no weights is skipped: one line names the command that makes them, the job decodes nothing (not even
  its baseline) and the others run; if no drafted job is left, nothing is decoded. `strict: true`
  (`make bench STRICT=1`) refuses the whole sweep on any missing piece instead, as the pre-flight did before.
- a job that fails (specbench.run records it in the sweep directory, `failed/<job>.json`) does not end the sweep;
- `on_multirun_end`: which jobs finished and which were skipped; the sweep exits non-zero naming every failed job.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
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


def job_labels(jobs: list[list[str]]) -> list[str]:
    """Each job by the overrides that tell it from the sweep's other jobs (a sweep of one: all of its overrides)."""
    common = set.intersection(*(set(job) for job in jobs)) if len(jobs) > 1 else set()
    return [" ".join(o for o in job if o not in common) for job in jobs]


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


@dataclass(frozen=True)
class Skip:
    """A job the pre-flight leaves out: its drafter has no weights for its target."""

    job: int
    overrides: list[str]
    reason: str  # missing_weights' line, with the command that makes the weights


def skips_path(sweep_dir: str | Path) -> Path:
    return Path(sweep_dir) / "skipped.json"


def write_skips(sweep_dir: str | Path, skips: list[Skip]) -> None:
    """Written by every pre-flight that lets the sweep run (an empty list too: a reused sweep directory's old list
    must not skip this sweep's jobs)."""
    path = skips_path(sweep_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(s) for s in skips]))


def read_skips(sweep_dir: str | Path) -> list[Skip]:
    path = skips_path(sweep_dir)
    return [Skip(**s) for s in json.loads(path.read_text())] if path.is_file() else []


def skip_reason(sweep_dir: str | Path, overrides: list[str]) -> str | None:
    """Why the pre-flight skipped the job of these overrides (the job's hydra.overrides.task), or None: it runs. The
    jobs are matched by their overrides, which the sweeper and the pre-flight expand alike (job_overrides)."""
    return next((s.reason for s in read_skips(sweep_dir) if s.overrides == overrides), None)


@dataclass
class Preflight:
    """What the pre-flight found over every job of a sweep."""

    problems: list[str] = field(default_factory=list)  # every missing piece, once each
    hard: bool = False  # a missing target or question set: no job can be trusted to run
    skips: list[Skip] = field(default_factory=list)  # the jobs whose drafter has no weights
    drafted: int = 0  # jobs of a drafter (not the baseline) that can run
    runnable: list[str] = field(default_factory=list)  # drafters whose every job can run

    def refuse(self, header: str, offer: bool = True) -> None:
        """Print every missing piece and end the sweep before anything is decoded (exit 2); `offer`: name the
        drafters that could run."""
        print(f"error: pre-flight: {header}; nothing was decoded:", file=sys.stderr)
        for p in self.problems:
            print(f"  {p}", file=sys.stderr)
        if offer and self.runnable:  # e.g. a GPU target with published weights for some drafters only
            print(f"  or decode only the drafters that can run: drafter={','.join(self.runnable)} "
                  f"(make bench ARGS='drafter={','.join(self.runnable)}')", file=sys.stderr)
        sys.exit(2)


def preflight(config: DictConfig, config_name: str | None) -> Preflight:
    """Compose every job as the sweeper will and check its target, question set and drafter weights."""
    from specbench.core.config import ModelConfig, to_dataclass
    from specbench.core.models import unavailable

    out = Preflight()
    ready: list[str] = []
    blocked: set[str] = set()
    for num, job in enumerate(job_overrides(config)):
        cfg = compose(config_name=config_name or "config", overrides=job)
        target, weights = unavailable(to_dataclass(ModelConfig, cfg.model)), missing_weights(cfg)
        questions = missing_questions(cfg)
        (blocked.add if target or weights else ready.append)(cfg.drafter.name)  # (a missing set blocks no drafter)
        out.problems += [p for p in (target, weights, questions) if p and p not in out.problems]
        out.hard = out.hard or bool(target or questions)
        if weights:
            out.skips.append(Skip(num, job, weights))
        elif cfg.drafter.name != "none":
            out.drafted += 1
    out.runnable = [d for d in dict.fromkeys(ready) if d not in blocked]
    return out


class SweepChecks(Callback):
    def __init__(self, strict: bool = False) -> None:
        self.strict = strict  # any missing piece refuses the whole sweep (conf/config.yaml; make bench STRICT=1)

    def on_multirun_start(self, config: DictConfig, config_name: str | None = None, **kwargs: Any) -> None:
        found = preflight(config, config_name)
        if found.hard or (self.strict and found.problems):
            found.refuse(f"{len(found.problems)} missing piece(s) for this sweep")
        if found.skips and not found.drafted:  # only baselines would run: nothing to compare them with
            found.refuse("no drafted job of this sweep has its drafter's weights", offer=False)
        write_skips(config.hydra.sweep.dir, found.skips)
        if found.skips:
            labels = job_labels(job_overrides(config))
            print(f"pre-flight: {len(found.skips)} job(s) skipped, their drafter has no weights for the target "
                  "(the other jobs run; `make bench STRICT=1`, hydra.callbacks.checks.strict=true, refuses the "
                  "sweep instead):", file=sys.stderr)
            for s in found.skips:
                print(f"  skip #{s.job} {labels[s.job]}: {s.reason}", file=sys.stderr)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = config.hydra.sweep.dir
        jobs = job_overrides(config)
        labels = job_labels(jobs)
        skipped = read_skips(sweep_dir)
        failed = [json.loads(f.read_text()) for f in
                  sorted(failures_dir(sweep_dir).glob("*.json"), key=lambda p: int(p.stem))]
        left = {s.job for s in skipped} | {r["job"] for r in failed}
        finished = [n for n in range(len(jobs)) if n not in left]
        print(f"sweep: {len(finished)} of {len(jobs)} job(s) finished: "
              f"{', '.join(f'#{n} {labels[n]}' for n in finished) or 'none'}", file=sys.stderr)
        if skipped:  # repeated here: the pre-flight's lines are far up by the end of a long sweep
            print(f"sweep: {len(skipped)} job(s) skipped for want of drafter weights (nothing decoded for them):",
                  file=sys.stderr)
            for s in skipped:
                print(f"  #{s.job} {labels[s.job]}: {s.reason}", file=sys.stderr)
        if failed:
            print(f"error: {len(failed)} job(s) of the sweep failed (the others finished):", file=sys.stderr)
            for r in failed:
                print(f"  #{r['job']} {' '.join(r['overrides'])}: {r['error']}", file=sys.stderr)
            sys.exit(1)
