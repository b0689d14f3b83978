"""Rename run directories written before run names hashed the resolved target (specbench/bench/run.py model_identity).

    python scripts/migrate_run_names.py [results]

Each run's new name is computed from its own run.json (specbench.run.recorded_key: the recorded config, with `auto`
resolved as the loader resolves it on the recorded device), the directory is renamed, and the names it is known by
inside results/ (run.json "run", summary.json "run" and "baseline_run") follow. Records are not touched. Re-running it
is a no-op. Afterwards `make bench` finds the committed runs under the names it computes, and skips them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from specbench.core.records import atomic_write_json
from specbench.bench.run import recorded_key, run_name


def migrate(results: Path) -> dict[Path, str]:
    renames: dict[Path, str] = {}
    for head_path in sorted(results.glob("*/*/run.json")):
        head = json.loads(head_path.read_text())
        new = run_name(recorded_key(head))
        if new != head_path.parent.name:
            renames[head_path.parent] = new
    by_exp: dict[Path, dict[str, str]] = {}
    for old, new in renames.items():
        if (old.parent / new).exists():
            raise SystemExit(f"{old.parent / new} exists already: two runs map onto one name")
        by_exp.setdefault(old.parent, {})[old.name] = new
    for old, new in renames.items():
        old.rename(old.parent / new)
    for exp, names in by_exp.items():
        for run in sorted(p for p in exp.iterdir() if p.is_dir()):
            for file, keys in (("run.json", ("run",)), ("summary.json", ("run", "baseline_run"))):
                path = run / file
                if not path.is_file():
                    continue
                obj = json.loads(path.read_text())
                if any(obj.get(k) in names for k in keys):
                    atomic_write_json(path, {**obj, **{k: names[obj[k]] for k in keys if obj.get(k) in names}})
    return renames


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "results")
    done = migrate(root)
    for old, new in done.items():
        print(f"{old} -> {new}")
    print(f"{len(done)} run(s) renamed")
