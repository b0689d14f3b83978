"""The data-scaling experiment's table and figure (`make train-scaling`, issue 79): validation sim τ against the number
of training conversations, one line per method, the seed spread where a point was trained with several seeds.

Points: results/train_scaling/<model>/<drafter>/n<subset>[_seed<s>]/{log.jsonl,config.json} (a subset above the
budget's count: its conversations and the next ones after its held-out set); the whole budget (1x) is the committed
weights' run, results/training/<model>/<drafter>/log.jsonl, at the budget's conversation count (its
scaling points' config.json: train.conversations).
Measured τ (`make train-scaling-tau`): results/train_scaling_tau/<run>/{run.json,summary.json}, each run's point read
back from its drafter.checkpoint (weights/<model>/scaling/<point>/<drafter>, or weights/<model>/<drafter>: the 1x
point).
The trend table reads each ordering the papers claim and this budget reverses (ORDERINGS) as the gap in measured τ,
the method's less the other's (the mean over the decoded datasets), each with its standard error over the decoded
turns (a delete-one-turn jackknife: a handful of questions decodes each point, and the turns are the same for every
method, so the gap is paired), against log2 of the conversations: a least-squares line gives the change per doubling,
its standard error (the larger of the points' scatter about the line and what their own errors imply), and where the
gap's sign would flip if the line held, an extrapolation said as one."""
from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from specbench.bench.report import style
from specbench.core.records import read_jsonl

POINT = re.compile(r"^n(?P<n>\d+)(?:_seed(?P<seed>\d+))?$")
# (the method, the one its paper puts it above): MoA > EAGLE-2, EAGLE-3 > EAGLE-2, HASS > EAGLE-2, TLI 1 > TLI 0. `eagle`
# is the head `eagle2` decodes.
ORDERINGS = (("moa", "eagle"), ("eagle3", "eagle"), ("hass", "eagle"), ("moa_tli1", "moa"))
CHECKPOINT = re.compile(r"(?:^|/)(?:scaling/(?P<point>n\d+(?:_seed\d+)?)/)?(?P<drafter>[^/]+)/?$")


@dataclass(frozen=True)
class Point:
    drafter: str
    conversations: int
    seed: int
    sim_tau: float  # the last epoch's validation simulated τ
    alpha0: float  # its first-position acceptance


@dataclass(frozen=True)
class Measured:
    """One decoded point: its weights' measured τ on one dataset (MoA Table 2's tree, conf/experiment/train_scaling_tau)."""

    drafter: str  # the trained name (the weights' directory), e.g. eagle (decoded as eagle2)
    conversations: int | None  # None: the committed 1x weights (the budget's count, filled in by the caller)
    seed: int
    dataset: str
    tau: float  # tau_micro, as Table 2's τ column
    lossless: bool | None
    # each decoded turn (question_id/turn/repeat, its steps' tokens, its steps), from records.jsonl: the jackknife's
    # units; empty where the run kept no records (no standard error then)
    turns: tuple[tuple[str, int, int], ...] = ()


def measured(root: Path, model: str) -> list[Measured]:
    """Every finished decode of a scaling point (or of the 1x weights) of `model` under results/train_scaling_tau/."""
    out = []
    for summary in sorted(root.glob("*/summary.json")) if root.is_dir() else []:
        run = json.loads((summary.parent / "run.json").read_text())
        config, s = run["config"], json.loads(summary.read_text())
        ck = config["drafter"].get("checkpoint")
        if config["model"]["name"] != model or not ck or (m := CHECKPOINT.search(str(ck))) is None:
            continue  # the baseline runs (no checkpoint)
        point = POINT.match(m["point"]) if m["point"] else None
        records = summary.parent / "records.jsonl"
        turns = tuple((f"{r['question_id']}/{r['turn']}/{r.get('repeat', 0)}", sum(r["tokens_per_step"]), r["steps"])
                      for r in (read_jsonl(records) if records.is_file() else []))
        out.append(Measured(m["drafter"], int(point["n"]) if point else None, int(point["seed"] or 0) if point else 0,
                            config["dataset"]["name"], s["tau_micro"], _lossless(s.get("lossless")), turns))
    return out


def _lossless(record: dict | bool | None) -> bool | None:
    """A summary's lossless check ({compared, matches, rate}): every compared turn equal to the baseline's."""
    return record.get("rate") == 1.0 if isinstance(record, dict) else record


@dataclass(frozen=True)
class Line:
    """gap = intercept + slope · log2(n), by least squares."""

    slope: float  # per doubling of the conversations
    intercept: float
    se: float | None  # the slope's standard error; None with two points and no errors given (no residual left)

    def at(self, n: float) -> float:
        return self.intercept + self.slope * math.log2(n)


def fit(ns: list[int], gaps: list[float], errors: list[float] | None = None) -> Line:
    """The least-squares line through (log2 n, gap); at least two distinct n. The slope's standard error is the larger
    of the one from the residuals (three points or more) and the one the points' own standard errors (`errors`)
    propagate to the slope, Var = sum((x - mean x)^2 err^2) / Sxx^2: five points can lie closer to a line than their
    errors allow, and a residual estimate from three degrees of freedom is itself loose."""
    xs = [math.log2(n) for n in ns]
    slope, intercept = statistics.linear_regression(xs, gaps)
    mx = statistics.fmean(xs)
    sxx = sum((x - mx) ** 2 for x in xs)
    variances = []
    if len(xs) >= 3:
        rss = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, gaps, strict=True))
        variances.append(rss / (len(xs) - 2) / sxx)
    if errors is not None:
        variances.append(sum((x - mx) ** 2 * e ** 2 for x, e in zip(xs, errors, strict=True)) / sxx ** 2)
    return Line(slope, intercept, math.sqrt(max(variances)) if variances else None)


def flip(line: Line, last_n: int) -> float | None:
    """The n past `last_n` at which the line's gap reaches 0, or None where it moves away from 0 (or is flat)."""
    gap = line.at(last_n)
    if line.slope == 0 or gap * line.slope >= 0:
        return None
    return last_n * 2 ** (-gap / line.slope)


def extrapolation(line: Line, last_n: int) -> str:
    """Where the gap's sign would flip if the line held, and where at the slope ± one standard error."""
    def said(n: float | None) -> str:
        return "never" if n is None else f"n ≈ {n:,.0f}" if n < 1e7 else "n > 10,000,000"

    at = flip(line, last_n)
    head = f"flips near {said(at)}" if at else "no flip: the gap moves away from 0"
    if line.se is None:
        return head + " (two points: no error estimate)"
    gap = line.at(last_n)
    ends = sorted((flip(Line(s, gap - s * math.log2(last_n), None), last_n) for s in (line.slope - line.se,
                                                                                      line.slope + line.se)),
                  key=lambda n: math.inf if n is None else n)
    if ends == [None, None]:
        return head + (" (nor at ±1 s.e.)" if at is None else " (never at ±1 s.e.)")
    return head + f" (at ±1 s.e.: {said(ends[0])} to {said(ends[1])})"


def _mean_spread(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (max(values) - min(values)) / 2


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


def _tau(run: Measured, drop: tuple[str, str] | None) -> float:
    """The run's τ (tokens over steps), without the turn `drop` = (dataset, turn key) if it is one of the run's."""
    if drop is None or drop[0] != run.dataset:
        return run.tau
    kept = [(tokens, steps) for key, tokens, steps in run.turns if key != drop[1]]
    return sum(t for t, _ in kept) / sum(s for _, s in kept)


def gap_with_error(runs: list[Measured], method: str, other: str, datasets: list[str]) -> tuple[float, float | None]:
    """The gap in measured τ, method less other (each the mean over `datasets` of its seeds' mean), from the runs of
    one n, and its standard error by a delete-one-turn jackknife over the turns every run decoded (None where a run
    kept no turns, or with fewer than two)."""
    def tau(drafter: str, drop: tuple[str, str] | None = None) -> float:
        return statistics.fmean(statistics.fmean(_tau(t, drop) for t in runs if (t.drafter, t.dataset) == (drafter, d))
                                for d in datasets)

    def gap(drop: tuple[str, str] | None = None) -> float:
        return tau(method, drop) - tau(other, drop)

    mine = [t for t in runs if t.drafter in (method, other)]
    if not all(t.turns for t in mine):
        return gap(), None
    keys = [(d, key) for d in datasets for key in sorted(set.intersection(
        *({k for k, _, _ in t.turns} for t in mine if t.dataset == d)))]
    if len(keys) < 2:
        return gap(), None
    left_out = [gap(k) for k in keys]
    mean = statistics.fmean(left_out)
    return gap(), math.sqrt((len(keys) - 1) / len(keys) * sum((g - mean) ** 2 for g in left_out))


def trend_table(decoded: list[Measured], sizes: list[int], datasets: list[str]) -> list[str]:
    """The ORDERINGS' gaps in measured τ per n (± their jackknife errors), the line through them and its
    extrapolation -> markdown lines."""
    def both(drafter: str, n: int) -> bool:  # decoded on every dataset at n
        return all(any((t.drafter, t.conversations, t.dataset) == (drafter, n, d) for t in decoded) for d in datasets)

    rows = []
    for method, other in ORDERINGS:
        at = {n: gap_with_error([t for t in decoded if t.conversations == n], method, other, datasets)
              for n in sizes if both(method, n) and both(other, n)}
        if not at:
            continue
        gaps = {n: g for n, (g, _) in at.items()}
        errors = [e for _, e in at.values()]
        cells = [("–" if n not in at else f"{at[n][0]:+.2f}" + (f" ± {at[n][1]:.2f}" if at[n][1] is not None else ""))
                 for n in sizes]
        if len(gaps) > 1:
            line = fit(list(gaps), list(gaps.values()), errors if None not in errors else None)
            per = f"{line.slope:+.3f}" + (f" ± {line.se:.3f}" if line.se is not None else "")
            said = extrapolation(line, max(gaps))
        else:
            per, said = "–", "one point"
        rows.append(f"| {method} > {other} | " + " | ".join(cells) + f" | {per} | {said} |")
    if not rows:
        return []
    names = " and ".join(style.dataset_name(d) for d in datasets)
    return ["", f"**The papers' orderings against data: the gap in measured τ (the method's less the other's, the mean "
            f"of {names}) at each n, ± its standard error over the decoded turns (a delete-one-turn jackknife; every "
            f"method decodes the same turns), its change per doubling of the conversations (a least-squares line in "
            f"log2 n, ± the slope's standard error: the larger of the points' scatter about the line and what their "
            f"own errors imply), and the n at which its sign would flip if that line held: an extrapolation, not a "
            f"measurement. `eagle` is the head `eagle2` decodes.**", "",
            "| ordering (the paper's) | " + " | ".join(f"{n} conv." for n in sizes) + " | per doubling | if the line "
            "held |", "|---|" + "---|" * len(sizes) + "---|---|", *rows]


def train_scaling(root: Path, training: Path) -> list[Path]:
    """results/train_scaling/<model>/scaling.{md,png}, from the records alone."""
    written = []
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        pts = points(root, training, model_dir.name)
        if not pts:
            continue
        drafters = sorted({p.drafter for p in pts})
        decoded = measured(root.parent / "train_scaling_tau", model_dir.name)
        budget = max(json.loads(c.read_text())["train"]["conversations"] for c in model_dir.glob("*/*/config.json"))
        decoded = [t if t.conversations is not None else replace(t, conversations=budget) for t in decoded]
        datasets = sorted({t.dataset for t in decoded})
        sizes = sorted({p.conversations for p in pts} | {t.conversations for t in decoded})
        head = "| method | " + " | ".join(f"{n} conv. sim τ (0-α)" for n in sizes) + " |"
        above = " (above it, the budget's and the next ones after its held-out set)" if sizes[-1] > budget else ""
        md = [f"**Validation simulated τ (and first-position acceptance) against training conversations, model "
              f"{model_dir.name}: the budget's recipe on its first n conversations{above}, the same held-out set; "
              f"the {budget} point is the committed weights' run. a ± b: mean ± spread (max - min) / 2 over seeds.**",
              "",
              head, "|---|" + "---|" * len(sizes)]
        fig, axes = style.subplots(1, 1 + len(datasets), figsize=(6 + 4 * len(datasets), 4), squeeze=False)
        ax = axes[0][0]
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
        ax.set_title(f"validation τ ({model_dir.name})")
        ax.legend()
        if decoded:
            md += ["", f"**Measured τ against training conversations, model {model_dir.name}: each point's weights "
                   f"decoded at MoA Table 2's tree (depth 6, top-k 8, 62 drafted nodes), T = 0, the cpu preset's "
                   f"questions (`make train-scaling-tau`); the {budget} point is the committed weights. a ± b over seeds; "
                   f"every decode lossless unless marked.**", "",
                   "| method | dataset | " + " | ".join(f"{n} conv." for n in sizes) + " |",
                   "|---|---|" + "---|" * len(sizes)]
            for i, dataset in enumerate(datasets, 1):
                for drafter in sorted({t.drafter for t in decoded}):
                    cells, xs, ys, errs = [], [], [], []
                    for n in sizes:
                        at = [t for t in decoded if (t.drafter, t.dataset, t.conversations) == (drafter, dataset, n)]
                        if not at:
                            cells.append("–")
                            continue
                        mean, half = _mean_spread([t.tau for t in at])
                        flag = "" if all(t.lossless is not False for t in at) else " (not lossless)"
                        cells.append(f"{mean:.2f}" + (f" ± {half:.2f}" if len(at) > 1 else "") + flag)
                        xs.append(n), ys.append(mean), errs.append(half)
                    md.append(f"| {drafter} | {style.dataset_name(dataset)} | " + " | ".join(cells) + " |")
                    axes[0][i].errorbar(xs, ys, yerr=errs, marker=style.marker(drafter), color=style.colour(drafter),
                                        capsize=3, label=drafter)
                axes[0][i].set_xscale("log", base=2)
                axes[0][i].set_xticks(sizes, [str(n) for n in sizes])
                axes[0][i].set_xlabel("training conversations (log scale)")
                axes[0][i].set_ylabel("measured τ")
                axes[0][i].set_title(f"measured τ, {style.dataset_name(dataset)}")
            axes[0][-1].legend()  # the decoded methods (moa_tli1 has no validation line in the first panel)
            md += trend_table(decoded, sizes, datasets)
        fig.suptitle(f"train_scaling: τ against training data ({model_dir.name})")
        style.save(fig, model_dir / "scaling.png")
        (model_dir / "scaling.md").write_text("\n".join(md) + "\n")
        written += [model_dir / "scaling.md", model_dir / "scaling.png", model_dir / "scaling.pdf"]
    return written
