"""Tables and figures of the tools' results: training curves, training memory and speed, acceptance per depth."""
from __future__ import annotations

import json
from pathlib import Path
from matplotlib.ticker import MaxNLocator
from specbench.core.cli import CONF_DIR
from specbench.core.records import read_jsonl
from specbench.bench.report import style
from specbench.bench.report.figures import save


def training_curves(root: Path, out: Path) -> None:
    """results/training/<model>/<name>/log.jsonl: the validation after each epoch. A <name> that is a drafter
    (conf/drafter/<name>.yaml) is the committed weights' run, drawn in the figure; any other is a variant trained to
    measure a deviation (its command in its config.json), listed in the tables only, with that command."""
    logs = sorted(root.glob("*/*/log.jsonl"))
    if not logs:
        return
    out.mkdir(parents=True, exist_ok=True)
    drafters = {p.stem for p in (CONF_DIR / "drafter").glob("*.yaml")}
    fig, axes = style.subplots(1, 2, figsize=(7.5, 3))
    head = ["| model | drafter | epoch | sim τ | " + " | ".join(f"{i}-α" for i in range(5)) + " |", "|" + "---|" * 9]
    lines, variants, commands = list(head), list(head), []
    for log in logs:
        vals = [r for r in read_jsonl(log) if r.get("kind") == "val"]
        if not vals:
            continue
        model, drafter = log.parent.parent.name, log.parent.name
        rows = [f"| {model} | {drafter} | {r['epoch'] + 1} | {r['sim_tau']:.3f} | "
                + " | ".join(f"{a:.3f}" for a in r["alpha"][:5]) + " |" for r in vals]
        if drafter not in drafters:
            variants += rows
            config = log.parent / "config.json"
            meta = json.loads(config.read_text()) if config.exists() else {}
            commit = (meta.get("git") or {}).get("commit") or "?"
            commands.append(f"- `{drafter}`: `python -m {meta.get('command', '?')}` at {commit[:7]}")
            continue
        lines += rows
        epochs = [r["epoch"] + 1 for r in vals]
        color, mark = style.drafter_style(drafter)
        axes[0].plot(epochs, [r["sim_tau"] for r in vals], marker=mark, color=color, label=drafter)
        axes[1].plot(range(1, len(vals[-1]["alpha"]) + 1), vals[-1]["alpha"], marker=mark, color=color)
    axes[0].set_xlabel("epoch"), axes[0].set_ylabel("validation simulated τ")
    axes[1].set_xlabel("draft position n"), axes[1].set_ylabel("acceptance (last epoch)")
    for ax in axes:  # epochs and positions are whole numbers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if axes[0].get_legend_handles_labels()[0]:  # one legend for both panels, beside them: on a panel it hid lines
        fig.legend(loc="outside right upper", title="drafter")
    fig.suptitle(f"{out.name}: validation after each epoch (as papers/000 Fig. 3-5, papers/003 Fig. 6)")
    save(fig, out / "training_curves.png")
    md = "**Per-epoch validation (chain, own predictions)**\n\n" + "\n".join(lines) + "\n"
    if commands:
        md += ("\n**Variants trained to measure a deviation (not committed weights; the same validation)**\n\n"
               + "\n".join(variants) + "\n\n" + "\n".join(commands) + "\n")
    (out / "training.md").write_text(md)


def trainmem(root: Path) -> None:
    for f in sorted(root.glob("*/trainmem.json")):
        data = json.loads(f.read_text())
        rows = data["rows"]
        dev = data["env"].get("gpu") or data["env"].get("cpu")
        md = [f"**Training memory vs simulated steps s (batch {rows[0]['tokens']} tokens). device: {dev}; commit "
              f"{(data['git'].get('commit') or '?')[:7]}.**", "",
              "| method | s | peak MiB | over base MiB | autograd graph MiB | s/step |", "|---|---|---|---|---|---|"]
        md += [f"| {r['method']} | {r['steps']} | {r['peak_bytes'] / 2**20:.0f} | "
               f"{(r['peak_bytes'] - r['base_bytes']) / 2**20:.0f} | {r['graph_bytes'] / 2**20:.1f} | {r['step_s']:.2f} |"
               for r in rows]
        (f.parent / "trainmem.md").write_text("\n".join(md) + "\n")
        fig, axes = style.subplots(1, 2, figsize=(7, 2.8))
        for method in sorted({r["method"] for r in rows}):
            pts = sorted((r["steps"], r) for r in rows if r["method"] == method)
            color, mark = style.drafter_style(method)
            axes[0].plot([s for s, _ in pts], [r["graph_bytes"] / 2**20 for _, r in pts], marker=mark, color=color,
                         label=method)
            axes[1].plot([s for s, _ in pts], [r["step_s"] for _, r in pts], marker=mark, color=color)
        axes[0].set_xlabel("simulated steps s"), axes[0].set_ylabel("autograd graph MiB")
        axes[1].set_xlabel("simulated steps s"), axes[1].set_ylabel("s / training step")
        for ax in axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.legend(loc="outside right upper", title="method")
        fig.suptitle(f"trainmem: training memory and time against simulated steps (batch {rows[0]['tokens']} tokens)")
        save(fig, f.parent / "trainmem.png")


def trainspeed(root: Path) -> None:
    """results/trainspeed/*: training tokens/s per method in fp32 and under bf16 autocast (make trainspeed)."""
    for f in sorted(root.glob("*/trainmem.json")):
        data = json.loads(f.read_text())
        by = {(r["method"], r["precision"]): r for r in data["rows"]}
        dev = data["env"].get("gpu") or data["env"].get("cpu")
        md = [f"**Training tokens/s, fp32 vs bf16 autocast (one batch of {data['rows'][0]['tokens']} tokens, mean ± std "
              f"over {data['config']['bench']['repeats']} steps after {data['config']['bench']['warmup']} warm-up). "
              f"device: {dev}; commit {(data['git'].get('commit') or '?')[:7]}.**", "",
              "| method | fp32 tokens/s | bf16 tokens/s | bf16 / fp32 | fp32 peak MiB | bf16 peak MiB |",
              "|---|---|---|---|---|---|"]

        def cell(r: dict) -> str:  # tokens/s from the step time; its std by the first-order propagation
            return f"{r['tokens_per_s']:.0f} ± {r['tokens_per_s'] * r['step_s_std'] / r['step_s']:.0f}"

        for method in dict.fromkeys(r["method"] for r in data["rows"]):
            a, b = by.get((method, "fp32")), by.get((method, "bf16"))
            if a and b:
                md.append(f"| {method} | {cell(a)} | {cell(b)} | {b['tokens_per_s'] / a['tokens_per_s']:.2f}x | "
                          f"{a['peak_bytes'] / 2**20:.0f} | {b['peak_bytes'] / 2**20:.0f} |")
        (f.parent / "trainspeed.md").write_text("\n".join(md) + "\n")
    acceptance(root / "acceptance")


def acceptance(root: Path) -> None:
    """results/trainspeed/acceptance/<drafter>__<precision>__s<seed>/: the last epoch's validation of trainings that
    differ only in train.precision and seed (scripts/bf16_acceptance.sh)."""
    rows = []
    for log in sorted(root.glob("*/log.jsonl")):
        drafter, precision, seed = log.parent.name.split("__")
        meta = json.loads((log.parent / "config.json").read_text())
        val = [r for r in read_jsonl(log) if r["kind"] == "val"][-1]
        rows.append((drafter, precision, seed, val, meta))
    if not rows:
        return
    first = rows[0][4]
    md = [f"**Validation after training in fp32 and under bf16 autocast (the embedded budget cut to "
          f"{first['train']['conversations']} conversations, {first['train']['epochs']} epochs; chain acceptance on "
          f"the drafter's own predictions, last epoch). device: {first['env'].get('cpu') or first['env'].get('gpu')}; "
          f"commit {(first.get('git') or {}).get('commit', '?')[:7]}. Speed: `make trainspeed` (these trainings shared the "
          f"CPU with other work).**", "",
          "| drafter | precision | seed | sim τ | 0-α | 1-α |", "|---|---|---|---|---|---|"]
    for drafter, precision, seed, val, _ in rows:
        md.append(f"| {drafter} | {precision} | {seed.removeprefix('s')} | {val['sim_tau']:.3f} | {val['alpha'][0]:.3f} "
                  f"| {val['alpha'][1]:.3f} |")
    (root / "acceptance.md").write_text("\n".join(md) + "\n")
