"""The data-scaling experiment's table and figure (`make train-scaling`, issue 79): validation sim τ against the number
of training conversations, one line per method, the seed spread where a point was trained with several seeds.

Points: results/train_scaling/<model>/<drafter>/n<subset>[_seed<s>]/{log.jsonl,config.json}; the whole budget (1x)
is the committed weights' run, results/training/<model>/<drafter>/log.jsonl, at the budget's conversation count (its
scaling points' config.json: train.conversations)."""
from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from specbench.bench.report import style
from specbench.core.records import read_jsonl

POINT = re.compile(r"^n(?P<n>\d+)(?:_seed(?P<seed>\d+))?$")


@dataclass(frozen=True)
class Point:
    drafter: str
    conversations: int
    seed: int
    sim_tau: float  # the last epoch's validation simulated τ
    alpha0: float  # its first-position acceptance


def last_val(log: Path) -> dict | None:
    vals = [r for r in read_jsonl(log) if r.get("kind") == "val"]
    return vals[-1] if vals else None


def points(root: Path, training: Path, model: str) -> list[Point]:
    """Every finished point of `model` (a point still training has no final config.json: left out), with the 1x
    point from the committed run of each drafter that has a scaling point."""
    out, budgets = [], {}
    for log in sorted((root / model).glob("*/*/log.jsonl")):
        m, config = POINT.match(log.parent.name), log.parent / "config.json"
        val = last_val(log)
        if m is None or val is None or not config.is_file():
            continue
        drafter = log.parent.parent.name
        budgets[drafter] = json.loads(config.read_text())["train"]["conversations"]
        out.append(Point(drafter, int(m["n"]), int(m["seed"] or 0), val["sim_tau"], val["alpha"][0]))
    for drafter, n in budgets.items():
        full = training / model / drafter / "log.jsonl"
        if full.is_file() and (val := last_val(full)) is not None:
            out.append(Point(drafter, n, 0, val["sim_tau"], val["alpha"][0]))
    return out


def train_scaling(root: Path, training: Path) -> list[Path]:
    """results/train_scaling/<model>/scaling.{md,png}, from the records alone."""
    written = []
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        pts = points(root, training, model_dir.name)
        if not pts:
            continue
        drafters = sorted({p.drafter for p in pts})
        sizes = sorted({p.conversations for p in pts})
        head = "| method | " + " | ".join(f"{n} conv. sim τ (0-α)" for n in sizes) + " |"
        md = [f"**Validation simulated τ (and first-position acceptance) against training conversations, model "
              f"{model_dir.name}: the budget's recipe on its first n conversations, the same held-out set; the "
              f"largest n is the committed weights' run. a ± b: mean ± spread (max - min) / 2 over seeds.**", "",
              head, "|---|" + "---|" * len(sizes)]
        fig, ax = style.subplots(figsize=(6, 4))
        for drafter in drafters:
            cells, xs, ys, errs = [], [], [], []
            for n in sizes:
                at = [p for p in pts if p.drafter == drafter and p.conversations == n]
                if not at:
                    cells.append("–")
                    continue
                taus = [p.sim_tau for p in at]
                mean, half = statistics.fmean(taus), (max(taus) - min(taus)) / 2
                spread = f" ± {half:.3f}" if len(at) > 1 else ""
                cells.append(f"{mean:.3f}{spread} ({statistics.fmean(p.alpha0 for p in at):.2f})")
                xs.append(n), ys.append(mean), errs.append(half)
            md.append(f"| {drafter} | " + " | ".join(cells) + " |")
            ax.errorbar(xs, ys, yerr=errs, marker=style.marker(drafter), color=style.colour(drafter), capsize=3,
                        label=drafter)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("training conversations (log scale)")
        ax.set_ylabel("validation simulated τ")
        ax.set_title(f"train_scaling: validation τ against training data ({model_dir.name})")
        ax.legend()
        style.save(fig, model_dir / "scaling.png")
        (model_dir / "scaling.md").write_text("\n".join(md) + "\n")
        written += [model_dir / "scaling.md", model_dir / "scaling.png", model_dir / "scaling.pdf"]
    return written
