"""Every figure (matplotlib, in the look of `style`: PNG and vector PDF, without timestamps): Leviathan curves, cost
decompositions, the batch curves, tree sizes."""
from __future__ import annotations

from pathlib import Path
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, NullLocator

from specbench.core.metrics import leviathan_improvement
from specbench.bench.report import style
from specbench.bench.report.cells import below_one, dynamic_size, value
from specbench.bench.report.style import PNG_META, save  # noqa: F401  (save: logs and scaling draw through it)

# Leviathan et al.'s reference curves: (γ, c), grey by γ, solid for the cheap draft (c = 0.05), dashed for c = 0.3
REFERENCE = [(1, 0.05), (3, 0.05), (5, 0.05), (3, 0.3), (5, 0.3)]
_GREY = {1: "#c7c7c7", 3: "#8a8a8a", 5: "#3f3f3f"}
# one fill per dataset in the Leviathan figure (filled: the first, hollow: the second, ...)
_FILLS = ["full", "none", "left", "bottom", "right", "top"]


def figure_leviathan(runs: dict, out: Path, stem: str) -> None:
    """Leviathan et al.'s speedup against α (Thm 3.8) for a few (γ, c), with our measured chain runs as points: one
    panel per temperature; a drafter's colour and marker (its measured γ and c in the legend), filled or hollow by
    dataset. No text at the points: twelve labels in one corner of the plot piled up."""
    points = {}
    for (drafter, dataset, temp), s in sorted(runs.items()):
        lev = s.get("leviathan")  # chain runs only (specbench.metrics)
        if lev and lev["measured_speedup"] is not None:
            points[(temp, drafter, dataset)] = lev
    temps = sorted({t for t, _, _ in points}) or [0.0]
    datasets = sorted({ds for _, _, ds in points})
    fill = {ds: _FILLS[i % len(_FILLS)] for i, ds in enumerate(datasets)}
    fig, axes = style.subplots(1, len(temps), figsize=(3.4 * len(temps) + 0.4, 3.4), sharey=True, squeeze=False)
    xs = [i / 100 for i in range(1, 100)]
    for ax, temp in zip(axes[0], temps):
        for gamma, c in REFERENCE:
            ax.plot(xs, [leviathan_improvement(a, gamma, c) for a in xs], color=_GREY[gamma], lw=1,
                    ls="-" if c < 0.1 else "--", zorder=1)
        ax.axhline(1, color=style.BASELINE, lw=0.6, zorder=1)
        for drafter in sorted({d for t, d, _ in points if t == temp}):
            mine = {ds: lev for (t, d, ds), lev in points.items() if t == temp and d == drafter}
            gammas, cs = [lev["gamma"] for lev in mine.values()], [lev["c"] for lev in mine.values()]
            spread = (lambda v, f: f"{min(v):{f}}" if f"{min(v):{f}}" == f"{max(v):{f}}"
                      else f"{min(v):{f}}–{max(v):{f}}")
            for i, (ds, lev) in enumerate(sorted(mine.items())):
                ax.plot([lev["alpha"]], [lev["measured_speedup"]], ls="none", marker=style.marker(drafter), ms=6,
                        color=style.colour(drafter), fillstyle=fill[ds], mew=1.2, zorder=3,
                        label=f"{drafter} (γ {spread(gammas, '.1f')}, c {spread(cs, '.2f')})" if i == 0 else None)
        ax.set_xlim(0, 1)
        ax.set_xlabel("α (mean acceptance)")
        ax.set_title(f"T = {temp:g}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", title="measured chain runs")
    axes[0][0].set_ylabel("speedup")
    key = [Line2D([], [], color=_GREY[g], ls="-" if c < 0.1 else "--", label=f"γ = {g}, c = {c}") for g, c in REFERENCE]
    key += [Line2D([], [], ls="none", marker="o", color="k", fillstyle=fill[ds], label=style.dataset_name(ds))
            for ds in datasets]
    fig.legend(handles=key, loc="outside right center", title="Leviathan et al.\n(Thm 3.8) / dataset")
    fig.suptitle(f"{out.name}: measured chain speedup against α, with Leviathan et al.'s prediction")
    save(fig, out / f"leviathan.{stem}.png")


def figure_cost(runs: dict, out: Path, dataset: str, stem: str) -> None:
    """Each drafter's step split into draft and verify ms (as papers/000 Fig. 11 does), T=0."""
    items = [(d, s) for (d, ds, t), s in sorted(runs.items()) if ds == dataset and t == 0 and s.get("steps")]
    if not items:
        return
    fig, ax = style.subplots(figsize=(6, 3.2))
    names = [d for d, _ in items]
    draft = [s["draft_ms_per_step"] for _, s in items]
    verify = [s["verify_ms_per_step"] for _, s in items]
    ax.bar(names, draft, color=style.PARTS["draft"], label="draft")
    ax.bar(names, verify, bottom=draft, color=style.PARTS["verify"], label="verify")
    ax.grid(axis="x", visible=False)
    ax.set_ylabel("ms per SD iteration")
    ax.set_title(f"{out.name}: draft and verify ms per step on {style.dataset_name(dataset)}, T = 0\n"
                 "(as papers/000 Fig. 11)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), title="ms per step")  # beside the bars, not on them
    ax.tick_params(axis="x", rotation=35)
    for label in ax.get_xticklabels():
        label.set_horizontalalignment("right")
        label.set_rotation_mode("anchor")
    save(fig, out / f"cost_{dataset}.{stem}.png")


def curve_label(name: str, speedups: dict[int, float]) -> tuple[str, int | None]:
    """A batch curve's reading, naming the B from which it stays below 1.0x (`below_one`), and that B (None when the
    curve is not below 1.0x at its largest B): the batch figure rings that B on the curve."""
    drop = below_one(speedups)
    if drop.startswith(">"):
        return f"{name}: >= 1.0x at B = {max(speedups)}", None
    return f"{name}: < 1.0x from B = {drop}", int(drop)


def batch_families(cells: dict, dataset: str | None) -> dict[str, list[str]]:
    """The batch figure's panels: the families (`style.FAMILIES`, in its order) of the drafters run on `dataset`, each
    with its drafters in the family's order."""
    drafters = {k[0] for k in cells if k[0] != "none" and k[1] == dataset}
    order = [d for names in style.FAMILIES.values() for d in names]
    panels: dict[str, list[str]] = {}
    for d in sorted(drafters, key=lambda d: (order.index(d) if d in order else len(order), d)):
        panels.setdefault(style.family(d), []).append(d)
    return panels


def figure_batch(cells: dict, sizes: list[int], dataset: str | None, path: Path) -> None:
    """Speedup against batch size as small multiples: one panel per drafter family (`batch_families`), shared axes,
    each drafter in its colour and marker, solid at its paper tree and dashed at tree=auto sized per B, the 1.0x line.
    The B from which a curve stays below 1.0x (`below_one`, the table's column) is ringed on it and named in the
    panel's legend, paper | auto."""
    panels = batch_families(cells, dataset)
    ncols = min(len(panels), 3) or 1
    nrows = -(-len(panels) // ncols) or 1
    fig, grid = style.subplots(nrows, ncols, figsize=(2.45 * ncols + 0.3, 2.55 * nrows + 0.5), sharex=True,
                               sharey=True, squeeze=False)
    axes = [ax for row in grid for ax in row]
    for i, ax in enumerate(axes[len(panels):], len(panels)):  # the grid's empty cells: no axes for them, and the
        fig.delaxes(ax)                                          # panel above them shows the B ticks
        if i >= ncols:
            axes[i - ncols].xaxis.set_tick_params(labelbottom=True)
    for ax, (name, drafters) in zip(axes, panels.items()):
        ax.axhline(1.0, color=style.BASELINE, lw=0.8, zorder=1)
        for d in drafters:
            drops = []
            for variant, ls in (("paper", "-"), ("auto", "--")):
                pts = [(b, value(cells.get((d, dataset, variant, b, 0.0)), "spu")) for b in sizes]
                pts = [(b, v) for b, v in pts if v is not None]
                if not pts:
                    drops.append("–")
                    continue
                drops.append(below_one(dict(pts)))
                ax.plot(*zip(*pts), ls=ls, marker=style.marker(d), ms=4, color=style.colour(d),
                        mfc=style.colour(d) if variant == "paper" else "white")
                _, drop = curve_label(d, dict(pts))
                if drop is not None:
                    ax.plot(drop, dict(pts)[drop], "o", ms=10, mfc="none", mew=0.8, color=style.colour(d))
            ax.plot([], [], ls="-", marker=style.marker(d), color=style.colour(d), label=f"{d} ({' | '.join(drops)})")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(sizes or [1]))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(b) for b in sizes or [1]])
        ax.set_ylim(bottom=0)
        # above the panel, titled by the family: inside, it would cover the curves of B = 1 to 2 it names
        ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=2, title=name, handlelength=1.6,
                  columnspacing=1.0, borderaxespad=0.3)
    fig.supxlabel("batch size B")
    fig.supylabel(f"speedup vs the baseline at the same B ({style.dataset_name(dataset)})")
    fig.suptitle(f"{path.parent.name}: speedup against batch size B, one panel per drafter family\n"
                 "solid, filled: paper tree; dashed, hollow: tree=auto sized per B\n"
                 "ringed, and in the legend as (paper | auto): the B from which the curve stays below 1.0x")
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
    the measured tokens/s of their paper-tree (hollow) and auto-tree (filled) runs on MT-Bench as points."""
    fig, ax = style.subplots(figsize=(6, 3.6))
    shown = [d for d in ("sd_tree", "eagle2", "hass", "coral_router") if (d, "mtbench", "auto") in cells]
    for d in shown:
        a = cells[(d, "mtbench", "auto")]
        curve = {int(n): v for n, v in a["_head"]["tree_auto"]["curve"].items()}
        color, mark = style.drafter_style(d)
        ax.plot(sorted(curve), [curve[n] for n in sorted(curve)], color=color, lw=1.2, zorder=2)
        ax.plot([], [], color=color, marker=mark, label=d)  # the legend's entry: the line and the points' marker
        chosen = a["_head"]["tree_auto"]["chosen"]
        ax.plot([drafted_nodes(chosen)], [value(a, "speed")], ls="none", color=color, marker=mark, ms=7, zorder=3)
        p = cells.get((d, "mtbench", "paper"))
        if p:
            ax.plot([drafted_nodes(p["_head"]["config"]["drafter"]["tree"])], [value(p, "speed")], ls="none",
                    color=color, marker=mark, ms=7, mfc="white", mew=1.2, zorder=3)
    base = cells.get(("none", "mtbench", "none"))
    handles = ax.get_legend_handles_labels()[0]
    if base:
        handles.append(ax.axhline(value(base, "speed"), color=style.BASELINE, lw=0.8, ls=":",
                                  label="baseline (measured)"))
    if shown:
        handles += [Line2D([], [], ls="none", marker="o", color="k", ms=6, label="measured, tree=auto"),
                    Line2D([], [], ls="none", marker="o", color="k", mfc="white", ms=6,
                           label="measured, paper tree\n(depth 6, top-k 10)")]
    ax.set_xlabel("drafted tokens in the tree (the root not counted)"), ax.set_ylabel("tokens/s (MT-Bench)")
    fig.suptitle(f"{path.parent.name}: predicted tokens/s of the best tree of each size (lines, over depth and "
                 "top-k)\nand the measured runs (points)")
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save(fig, path)
