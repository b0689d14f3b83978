"""`make rehearse` (`python -m specbench.rehearse`): day one on a GPU box, rehearsed on any machine with no network.

It writes tiny replicas of every target and published drafter a GPU user downloads (specbench/tools/replicas.py) into a
private Hugging Face cache under their real hub ids, then runs the runbook's own day-one commands (docs/gpu.md) against them,
unmodified but for environment variables (HF_HOME and offline mode; SPECBENCH_CACHE, SPECBENCH_WEIGHTS and RESULTS
pointing into the rehearsal's directory, so nothing of the working tree is touched):

    make download MODEL=<m>
    make bench MODEL=<m> PRESET=paper ARGS='drafter=<none,pld and the drafters with published weights>
                                            dataset.limit=<2> model.dtype=<dtype>'

for each model and dtype (fp32, bf16, fp16), the report included (make bench writes the tables). Then it checks:
every job finished; every drafted T=0 turn is lossless or a near-tie by the replay rule (specbench/bench/divergence.py);
one table per model and dtype exists; a failed job is named in its table. It prints one line per model x dtype x
drafter x set and exits non-zero on any failure.

    python -m specbench.rehearse [--models vicuna-7b,...] [--dtypes float32,bfloat16,float16] [--limit 2]
                                 [--max-new-tokens N (default: the paper preset's 1024)] [--dir rehearsal]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from specbench.core.cli import CONF_DIR
from specbench.core.records import read_jsonl

REPO = Path(__file__).resolve().parents[2]
DTYPES = ("float32", "bfloat16", "float16")
# drafters that decode from a published drafter's weights (eagle2 decodes eagle's head)
USES = {"eagle": ["eagle", "eagle2"], "hass": ["hass"], "medusa": ["medusa"], "sd": ["sd"], "moa": ["moa"],
        "eagle3": ["eagle3"]}


def published(model: str) -> dict[str, str]:
    return dict(OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{model}.yaml")).get("published") or {})


def drafters_for(model: str) -> list[str]:
    return ["none", "pld"] + [d for key in sorted(published(model)) for d in USES.get(key, [])]


def write(root: Path, models: list[str]) -> None:
    from specbench.tools import replicas

    root.mkdir(parents=True, exist_ok=True)  # (scratch files of the safetensors writers go there)
    cache = replicas.HubCache(root / "hf")
    texts = replicas.corpus()
    for m in models:
        target = replicas.write_target(cache, m, texts, root)
        replicas.write_published(cache, target, published(m))


def environment(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SPECBENCH_DATA",)}
    return {**env, "HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "SPECBENCH_CACHE": str(root / "cache"), "SPECBENCH_WEIGHTS": str(root / "weights"),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))}


@dataclass
class Outcome:
    steps: list[tuple[str, int]] = field(default_factory=list)  # (command, exit status)
    rows: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def run(cmd: list[str], env: dict, log: Path) -> int:
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode


def rehearse(root: Path, models: list[str], dtypes: list[str], limit: int, max_new_tokens: int | None,
             make: str = "make", replicas: bool = True) -> Outcome:
    """replicas=False: the cache under root/hf is written already (a test that alters one replica first)."""
    root.mkdir(parents=True, exist_ok=True)
    if replicas:
        write(root, models)
    env, out, log = environment(root), Outcome(), root / "rehearsal.log"
    results = root / "results"
    for m in models:
        cmd = [make, "download", f"MODEL={m}"]
        out.steps.append((" ".join(cmd), run(cmd, env, log)))
        for dtype in dtypes:
            args = [f"drafter={','.join(drafters_for(m))}", f"dataset.limit={limit}", f"model.dtype={dtype}"]
            if max_new_tokens:
                args.append(f"decoding.max_new_tokens={max_new_tokens}")
            # STRICT=1: a published drafter whose download did not land is a failure here, not a skipped job
            cmd = [make, "bench", f"MODEL={m}", "PRESET=paper", "STRICT=1", f"RESULTS={results}",
                   f"ARGS={' '.join(args)}"]
            out.steps.append((" ".join(cmd), run(cmd, env, log)))
    check(results / "beagle_table1", models, dtypes, out)
    return out


def check(exp: Path, models: list[str], dtypes: list[str], out: Outcome) -> None:
    for cmd, rc in out.steps:
        if rc != 0:
            out.problems.append(f"`{cmd}` exited {rc}")
    for summary_path in sorted(exp.glob("*/summary.json")):
        s = json.loads(summary_path.read_text())
        head = json.loads((summary_path.parent / "run.json").read_text())
        recs = read_jsonl(summary_path.parent / "records.jsonl")
        kinds = [r["divergence"]["kind"] for r in recs if r.get("divergence")]
        row = {"model": s["model"], "dtype": head["model_identity"]["dtype"], "drafter": s["drafter"],
               "dataset": s["dataset"], "turns": s["turns"], "lossless": s["lossless"]["matches"],
               "compared": s["lossless"]["compared"], "near_tie": kinds.count("near_tie"),
               "mismatch": kinds.count("mismatch"), "context": s.get("stopped_by_context", 0),
               "tau": s.get("tau_micro")}
        out.rows.append(row)
        unexplained = row["compared"] - row["lossless"] - row["near_tie"]
        if unexplained:
            out.problems.append(f"{row['model']} {row['dtype']} {row['drafter']} {row['dataset']}: {unexplained} "
                                f"turn(s) neither lossless nor a near-tie")
    for f in sorted((exp / "failed").glob("*.json")):
        rec = json.loads(f.read_text())
        out.problems.append(f"failed job {rec['config']['drafter']['name']} on {rec['config']['dataset']['name']} "
                            f"({rec['config']['model']['name']}): {rec['error']}")
        table = list(exp.glob(f"table1.{rec['config']['model']['name']}*.md"))
        if not any(rec["error"] in t.read_text() for t in table):
            out.problems.append(f"the failure of {f.name} is named in no table")
    for m in models:
        tables = sorted(exp.glob(f"table1.{m}*.md"))
        stems = {t.name for t in tables}
        if len(dtypes) == 1 and f"table1.{m}.md" not in stems:
            out.problems.append(f"no table for {m}")
        for dtype in dtypes if len(dtypes) > 1 else []:
            if not any(f".{dtype}." in t for t in stems):
                out.problems.append(f"no table for {m} in {dtype}")


def show(out: Outcome) -> str:
    lines = ["model      dtype     drafter  dataset  turns lossless near-tie mismatch ctx  tau"]
    for r in out.rows:
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        lines.append(f"{r['model']:10} {r['dtype']:9} {r['drafter']:8} {r['dataset']:8} {r['turns']:5} "
                     f"{r['lossless']:4}/{r['compared']:<3} {r['near_tie']:8} {r['mismatch']:8} {r['context']:3} {tau}")
    lines += [f"step: {cmd} -> exit {rc}" for cmd, rc in out.steps]
    lines += [f"PROBLEM: {p}" for p in out.problems] or ["every job finished; every drafted turn lossless or a near-tie;"
                                                          " one table per model and dtype"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="vicuna-7b,llama2-7b,llama3-8b,llama3.1-8b,vicuna-13b")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--limit", type=int, default=2, help="questions per set")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the paper preset's")
    ap.add_argument("--dir", type=Path, default=REPO / "rehearsal", help="replaced on every rehearsal")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    out = rehearse(args.dir.resolve(), args.models.split(","), args.dtypes.split(","), args.limit, args.max_new_tokens)
    print(show(out))
    (args.dir / "rehearsal.md").write_text(show(out) + "\n")
    sys.exit(1 if out.problems else 0)


if __name__ == "__main__":
    main()
