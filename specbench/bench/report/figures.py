"""Every figure (matplotlib, PNG without timestamps): Leviathan curves, cost decompositions, the batch curves, tree
sizes."""
from __future__ import annotations

from pathlib import Path
import matplotlib.pyplot as plt

from specbench.core.metrics import leviathan_improvement
from specbench.bench.report.cells import below_one, dynamic_size, value




PNG_META = {"Software": None}  # no version/time stamps: byte-identical re-runs


def save(fig, path: Path) -> None:
    fig.savefig(path, dpi=110, metadata=PNG_META)
    plt.close(fig)


def figure_leviathan(runs: dict, out: Path, stem: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [i / 100 for i in range(1, 100)]
    for gamma, c in [(1, 0.05), (3, 0.05), (5, 0.05), (3, 0.3), (5, 0.3)]:
        ax.plot(xs, [leviathan_improvement(a, gamma, c) for a in xs], lw=1, label=f"γ={gamma}, c={c}")
    for (drafter, dataset, temp), s in sorted(runs.items()):
        lev = s.get("leviathan")  # chain runs only (specbench.metrics)
        if lev and lev["measured_speedup"] is not None:
            ax.scatter([lev["alpha"]], [lev["measured_speedup"]], marker="o", zorder=3)
            ax.annotate(f"{drafter}/{dataset}/T{temp:g} (γ={lev['gamma']:.1f}, c={lev['c']:.2f})",
                        (lev["alpha"], lev["measured_speedup"]), fontsize=6)
    ax.axhline(1, color="grey", lw=0.5)
    ax.set_xlabel("α (mean acceptance)"), ax.set_ylabel("speedup")
    ax.set_title("Leviathan et al. speedup vs α; points: our chain runs (measured)")
    ax.legend(fontsize=6)
    save(fig, out / f"leviathan.{stem}.png")


def figure_cost(runs: dict, out: Path, dataset: str, stem: str) -> None:
    items = [(d, s) for (d, ds, t), s in sorted(runs.items()) if ds == dataset and t == 0 and s.get("steps")]
    if not items:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [d for d, _ in items]
    draft = [s["draft_ms_per_step"] for _, s in items]
    verify = [s["verify_ms_per_step"] for _, s in items]
    ax.bar(names, draft, label="draft ms/step")
    ax.bar(names, verify, bottom=draft, label="verify ms/step")
    ax.set_ylabel("ms per SD iteration"), ax.set_title(f"Cost decomposition on {dataset} (papers/000 Fig. 11)")
    ax.legend(fontsize=7)
    plt.setp(ax.get_xticklabels(), rotation=30, fontsize=7)
    fig.tight_layout()
    save(fig, out / f"cost_{dataset}.{stem}.png")


def curve_label(name: str, speedups: dict[int, float]) -> tuple[str, int | None]:
    """A batch curve's legend entry, naming the B from which it stays below 1.0x (`below_one`), and that B (None when
    the curve is not below 1.0x at its largest B)."""
    drop = below_one(speedups)
    if drop.startswith(">"):
        return f"{name}: >= 1.0x at B = {max(speedups)}", None
    return f"{name}: < 1.0x from B = {drop}", int(drop)


def figure_batch(cells: dict, sizes: list[int], dataset: str | None, path: Path) -> None:
    """Speedup against batch size per drafter (solid: paper tree, dashed: tree=auto), the 1.0x line; each line's label
    names the B from which it stays below 1.0x (`below_one`, the table's column), ringed on the curve."""
    fig, ax = plt.subplots(figsize=(7.5, 4))
    drafters = sorted({k[0] for k in cells if k[0] != "none" and k[1] == dataset})
    # 15 distinct hues: tab20's ten dark tones, then tab20b's five darkest. Not the 10-colour cycle (13+ drafters would
    # repeat it) and not tab20 in order (its light/dark pairs made neighbouring drafters read as one drafter's two trees).
    tones = [plt.get_cmap("tab20")(2 * k) for k in range(10)] + [plt.get_cmap("tab20b")(4 * k) for k in range(5)]
    for i, d in enumerate(drafters):
        for variant, style in (("paper", "-"), ("auto", "--")):
            pts = [(b, value(cells.get((d, dataset, variant, b, 0.0)), "spu")) for b in sizes]
            pts = [(b, v) for b, v in pts if v is not None]
            if pts:
                label, drop = curve_label(f"{d} ({variant})", dict(pts))
                ax.plot(*zip(*pts), style, marker="o", ms=3, color=tones[i % len(tones)], label=label)
                if drop is not None:
                    ax.plot(drop, dict(pts)[drop], "o", ms=7, mfc="none", color=tones[i % len(tones)])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B"), ax.set_ylabel(f"speedup vs the baseline at B ({dataset})")
    ax.set_title("solid: paper tree, dashed: tree=auto per B", fontsize=7)
    if ax.get_legend_handles_labels()[0]:
        # Outside the axes: inside, the legend of 2 x 13 lines covers the curves it names.
        ax.legend(fontsize=6, ncol=2, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
    save(fig, path)


def cut_of(tree: dict) -> str:
    """A tree=auto choice in a table cell: a dynamic tree's depth, top-k and tokens; a static cut's depth and tokens."""
    if tree.get("kind") == "dynamic":
        return f"depth {tree['depth']}, top-k {tree['topk']}, {dynamic_size(tree)}"
    n = len(tree["paths"])
    return f"depth {max(len(p) for p in tree['paths'])}, {n} token{'s' if n > 1 else ''}"


def drafted_nodes(tree: dict) -> int:
    """A tree's drafted tokens, the root not counted (costmodel's `nodes`): a static list's paths; a dynamic tree's
    total_tokens - 1, or total_tokens in a run recorded before `root_counted` existed (it kept that many drafted)."""
    if tree.get("kind") == "dynamic":
        return tree["total_tokens"] - tree.get("root_counted", False)
    return len(tree["paths"])


def figure_tree_size(cells: dict, path: Path) -> None:
    """Predicted tokens/s against tree size (the cost model's curve, mtbench's calibration) for a few drafters, with
    the measured tokens/s of their paper-tree and auto-tree runs on MT-Bench as points."""
    fig, ax = plt.subplots(figsize=(6, 4))
    shown = [d for d in ("sd_tree", "eagle2", "hass", "coral_router") if (d, "mtbench", "auto") in cells]
    for i, d in enumerate(shown):
        a = cells[(d, "mtbench", "auto")]
        curve = {int(n): v for n, v in a["_head"]["tree_auto"]["curve"].items()}
        color = f"C{i}"
        ax.plot(sorted(curve), [curve[n] for n in sorted(curve)], color=color, lw=1, label=f"{d} predicted")
        chosen = a["_head"]["tree_auto"]["chosen"]
        ax.scatter([drafted_nodes(chosen)], [value(a, "speed")], color=color, marker="o")
        p = cells.get((d, "mtbench", "paper"))
        if p:
            ax.scatter([drafted_nodes(p["_head"]["config"]["drafter"]["tree"])], [value(p, "speed")], color=color,
                       marker="x")
    base = cells.get(("none", "mtbench", "none"))
    if base:
        ax.axhline(value(base, "speed"), color="grey", lw=0.8, label="baseline (measured)")
    ax.set_xlabel("drafted tokens in the tree (the root not counted)"), ax.set_ylabel("tokens/s (MT-Bench)")
    ax.set_title("Lines: the best predicted tree of each size (over depth and top-k)\n"
                 "measured: o = tree=auto, x = paper tree (depth 6, top-k 10)", fontsize=7)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)
    save(fig, path)
