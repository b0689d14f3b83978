"""Command-line plumbing shared by every entry point (run, train, perf, perf_drafters, peer, trainmem, download):
one-line errors for unknown group choices and for SpecbenchError, the config hash that names output directories, and
the measuring entry points' report writing. Nothing here loads a model."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from specbench.core import envinfo
from specbench.errors import SpecbenchError
from specbench.core.records import atomic_write_json

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ("model", "drafter", "dataset", "decoding", "bench")


def check_group_choices(argv: list[str]) -> None:
    """One-line error for an unknown model/drafter/dataset name, before Hydra prints its multi-line report."""
    for arg in argv:
        key, eq, value = arg.lstrip("+~").partition("=")
        if not eq or key not in GROUPS or value.startswith(("glob(", "range(", "choice(")):
            continue
        valid = sorted(p.stem for p in (CONF_DIR / key).glob("*.yaml"))
        for v in value.split(","):
            if v and v not in valid:
                raise SpecbenchError(f"unknown {key} {v!r}; valid: {', '.join(valid)}")


def config_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:8]


def fail(e: SpecbenchError) -> None:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def cli(hydra_entry) -> None:
    """Check group names and removed options (one-line errors) before handing argv to a Hydra entry point."""
    from specbench.core.config import check_removed

    try:
        check_group_choices(sys.argv[1:])
        check_removed(sys.argv[1:])
    except SpecbenchError as e:
        fail(e)
    hydra_entry()


def entry(fn: Callable[[DictConfig], Any], config_name: str = "config") -> Callable[[], None]:
    """A command: Hydra composes conf/<config_name>.yaml with the command line and `fn` runs on it; an unknown group
    name or a SpecbenchError is one line (exit 2)."""
    import hydra

    from specbench.core.config import register_schema

    register_schema()

    @hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")
    def _main(cfg: DictConfig) -> None:
        try:
            fn(cfg)
        except SpecbenchError as e:
            fail(e)

    return lambda: cli(_main)


def save_report(cfg: DictConfig, kind: str, report: dict, module: str) -> Path:
    """results/<experiment>/<model>__<kind>__<config hash>/<module's last name>.json, with the run header."""
    from specbench.core.models import pick_device

    config = OmegaConf.to_container(cfg, resolve=True)
    out = (Path(cfg.out.root) / cfg.out.experiment / f"{cfg.model.name}__{kind}__{config_hash(config)}"
           / f"{module.rsplit('.', 1)[-1]}.json")
    atomic_write_json(out, {"report": report, "config": config,
                            **envinfo.header(module, pick_device(cfg.model.device))})
    print(f"written: {out}")
    return out


def measure_and_save(cfg: DictConfig, measure: Callable[[DictConfig], dict], show: Callable[[dict], None], kind: str,
                     module: str) -> None:
    """A measuring entry point: run it (one-line errors), print its report, save it with the run header."""
    try:
        report = measure(cfg)
    except SpecbenchError as e:
        fail(e)
    show(report)
    save_report(cfg, kind, report, module)
