"""`make figures` (`python -m specbench.report`): every paper table and figure, from the records in results/ only.

For each experiment directory results/<experiment>/ that holds runs, the tables and figures its experiment declares
(conf/experiment/<experiment>.yaml, `report:`; adding an experiment touches that one file):
markdown and LaTeX with the paper's rows and columns, our numbers, and in the caption the model, its dtype and the
budget, the paper's draft tree, the tree (or chain) each drafter's runs decoded with (from their run.json) and the
device(s) and commit(s) of the runs. Runs of different models (or dtypes, or presets) never share a table: each gets
its own files, `<table>.<model>.md` (the dtype and budget added where one model has several); runs
that do not exist are shown as "–" (never as zeros). Figures (matplotlib, PNG) for the training
curves (results/training/), the Leviathan speedup-vs-alpha curves with our measured chain points, the draft / verify
cost decomposition and the training-memory-vs-steps result (results/trainmem/). Output is deterministic: running it
twice gives byte-identical files (sorted inputs, fixed formats, PNGs without timestamps).
    python -m specbench.report [--results results]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from omegaconf import OmegaConf  # noqa: E402

from specbench import failures  # noqa: E402
from specbench.cli import CONF_DIR  # noqa: E402
from specbench.metrics import leviathan_improvement  # noqa: E402
from specbench.records import read_jsonl  # noqa: E402

MISSING = "–"
FAILED = "failed"  # a cell whose job failed and has not finished since (results/<experiment>/failed/)
PNG_META = {"Software": None}  # no version/time stamps: byte-identical re-runs


@dataclass(frozen=True)
class Table:
    """Rows = drafters, column groups = datasets x temperatures, metrics per group (the paper's layout)."""

    name: str
    caption: str
    drafters: tuple[str, ...]
    datasets: tuple[str, ...]
    metrics: tuple[str, ...]  # keys of METRICS
    temperatures: tuple[float, ...] = (0.0,)
    mean: bool = False  # add the paper's Mean/Average column group (mean over the datasets)
    paper_tree: str = ""  # the draft tree the paper decoded with, for the caption (ours come from the runs)


# metric -> (column title, how to read it from a summary, format)
METRICS = {
    "speed": ("Speed", lambda s: s["tokens_per_s"]["mean"], "{:.1f}"),
    "spu": ("Spu", lambda s: (s.get("speedup") or {}).get("mean"), "{:.2f}x"),
    "tau": ("τ", lambda s: s["tau_micro"], "{:.2f}"),
    "mem": ("M (GiB)", lambda s: s["peak_mem_bytes"] / 2**30 if s.get("peak_mem_bytes") else None, "{:.2f}"),
    "draft_ms": ("Td ms/step", lambda s: s["draft_ms_per_step"], "{:.1f}"),
    "verify_ms": ("Tv ms/step", lambda s: s["verify_ms_per_step"], "{:.1f}"),
    **{f"a{i}": (f"{i}-α", (lambda i: lambda s: _at(s.get("alpha"), i))(i), "{:.2f}") for i in range(5)},
}


# a dynamic tree as captions name it; depth = drafted levels, as drafters/trees.py DynamicTree counts it
DYNAMIC_TREE = "dynamic (depth {depth}, top-k {topk}, {size})"


def dynamic_size(tree: dict) -> str:
    """A dynamic tree's size as it counted: `total_tokens` verified, the root included (root_counted, EAGLE's code),
    or `total_tokens` drafted beside the root (root_counted: false, MoA's code; and every run recorded before the key
    existed, which kept that many drafted)."""
    if tree.get("root_counted", False):
        return f"{tree.get('total_tokens')} tokens"
    return f"{tree.get('total_tokens')} drafted + the root"


def router_table(*datasets: str) -> Table:
    """CORAL's LM-head router (papers/003 Sec. 3.3): the same frozen head and tree with and without the router, so the
    draft time per SD iteration (Td) differs only by the LM head; verify time (Tv) is the control."""
    return Table("router", "Draft latency of the CORAL LM-head router: Td / Tv = draft / verify ms per SD iteration "
                 "(papers/003 Sec. 3.3)", ("coral", "coral_router"), datasets, ("draft_ms", "verify_ms", "tau"))


@dataclass(frozen=True)
class DatasetsTable:
    """A report of its own kind over the experiment's runs on `datasets`, written as <name>.<model>.md."""

    name: str
    datasets: tuple[str, ...]


class AutoTable(DatasetsTable):
    """Each drafter's paper-tree and tree=auto runs side by side (tree_auto_report)."""


class VocabTable(DatasetsTable):
    """The EAGLE family's draft-vocabulary pruning (module.draft_vocab) per drafter, tree and N (vocab_report)."""


class BatchTable(DatasetsTable):
    """Every drafter's speedup against batch size (batch_report), at its paper tree and at tree=auto per B."""


class BaselinesTable(DatasetsTable):
    """Every drafter against the eager baseline and against the compiled one (baselines_report, issue 30)."""


@dataclass(frozen=True)
class BoardTable:
    """Spec-Bench's board (board_report): drafters x its six tasks in its own columns, with a published board beside."""

    name: str
    columns: tuple[tuple[str, str], ...]  # (Spec-Bench's column title, our dataset)
    drafters: tuple[str, ...]
    published: dict | None = None  # source, device, model, settings, rows {method: [6 speedups, accepted, overall]}
    ours: tuple[tuple[str, str], ...] = ()  # (published method, our drafter) where they are the same method


DATASET_KINDS = {"auto": AutoTable, "vocab": VocabTable, "batch": BatchTable, "baselines": BaselinesTable}


def experiment_report(exp: str) -> tuple[list, list[str]] | None:
    """What an experiment renders, from its own YAML (conf/experiment/<exp>.yaml, `report:`): tables (`kind: table`,
    the default, in the paper's layout; `router`; `auto`) and figures (leviathan, cost, tree_size). None when the
    directory is not an experiment's or declares nothing."""
    path = CONF_DIR / "experiment" / f"{exp}.yaml"
    node = (OmegaConf.to_container(OmegaConf.load(path)) or {}).get("report") if path.is_file() else None
    if not node:
        return None
    tables: list = []
    for t in node.get("tables", []):
        kind = t.get("kind", "table")
        if kind == "router":
            tables.append(router_table(*t["datasets"]))
        elif kind in DATASET_KINDS:
            tables.append(DATASET_KINDS[kind](t["name"], tuple(t["datasets"])))
        elif kind == "board":
            tables.append(BoardTable(t["name"], tuple(t["columns"].items()), tuple(t["drafters"]), t.get("published"),
                                     tuple((t.get("ours") or {}).items())))
        elif kind == "table":
            tables.append(Table(t["name"], t["caption"], tuple(t["drafters"]), tuple(t["datasets"]),
                                tuple(t["metrics"]), tuple(float(x) for x in t.get("temperatures", [0.0])),
                                bool(t.get("mean", False)), t.get("paper_tree", "")))
        else:
            raise ValueError(f"{path}: report table kind {kind!r} is not table, router, auto, vocab, batch, baselines or "
                             f"board")
    return tables, list(node.get("figures", []))


def _at(xs, i):
    return xs[i] if xs and i < len(xs) else None


@dataclass(frozen=True, order=True)
class Setting:
    """What must be equal for runs to share a table: the model, its dtype, and the preset's budget (new tokens per
    turn, questions per set). Runs of different settings never share a table."""

    model: str
    dtype: str
    max_new_tokens: int
    limit: int | None

    @staticmethod
    def of(head: dict) -> "Setting":
        cfg = head["config"]
        dtype = (head.get("model_identity") or {}).get("dtype") or cfg["model"].get("dtype", "float32")  # `auto` resolved
        return Setting(cfg["model"]["name"], dtype,
                       int(cfg["decoding"]["max_new_tokens"]), cfg["dataset"].get("limit"))

    def describe(self) -> str:
        sets = f"the first {self.limit} questions per set" if self.limit else "full question sets"
        return f"model {self.model} ({self.dtype}), {self.max_new_tokens} new tokens per turn, {sets}"


def cell_key(summary: dict, head: dict) -> tuple:
    """A paper table's cell: (drafter, dataset, temperature)."""
    return summary["drafter"], summary["dataset"], float(summary["temperature"])


def tree_key(summary: dict, head: dict) -> tuple:
    """The tree_auto table's cell: (drafter, dataset, none | paper | auto)."""
    variant = "none" if summary["drafter"] == "none" else "auto" if head.get("tree_auto") else "paper"
    return summary["drafter"], summary["dataset"], variant


def load_runs(exp_dir: Path, key_of=cell_key, batched: bool = False) -> dict[Setting, dict[tuple, dict]]:
    """Per setting, key_of(summary, header) -> summary + header, from every finished run of the experiment.
    Where several runs fill one cell (the drafter's weights or options changed since: a new config hash), the newest
    run does. Runs decoded in batches (decoding.batch_size > 1) only with `batched` (the batch table's key holds B):
    every other table reads batch 1, as the papers measure."""
    settings: dict[Setting, dict] = {}
    for run in sorted(exp_dir.glob("*/summary.json")):
        s = json.loads(run.read_text())
        head = json.loads((run.parent / "run.json").read_text())
        if not batched and int(head["config"]["decoding"].get("batch_size", 1)) > 1:
            continue
        runs = settings.setdefault(Setting.of(head), {})
        key = key_of(s, head)
        if key not in runs or (head["date"], run.parent.name) > (runs[key]["_head"]["date"], runs[key]["run"]):
            runs[key] = {**s, "_head": head}
    return settings


def device_of(run: dict) -> str:
    env = run["_head"]["env"]
    return env.get("gpu") or env.get("cpu") or "?"


def provenance(runs: list[dict]) -> str:
    devices = sorted({device_of(r) for r in runs})
    commits = sorted({(r["_head"]["git"].get("commit") or "?")[:7] for r in runs})
    mixed = " (the runs come from different devices: speeds are not comparable across them)" if len(devices) > 1 else ""
    return f"device: {', '.join(devices)}{mixed}; commit(s): {', '.join(commits)}"


def static_tree(paths: list, name: str | None = None) -> str:
    """A static tree by its name (if its config gives one), size, depth and nodes per depth; a chain as a chain."""
    per_depth = [sum(len(p) == d for p in paths) for d in range(1, max(map(len, paths)) + 1)]
    if set(per_depth) == {1} and not any(r for p in paths for r in p):
        return f"chain of {len(paths)}"
    label = f"static {name}" if name else "static"
    return f"{label} ({len(paths)} nodes, depth {len(per_depth)}: {'/'.join(map(str, per_depth))} per depth)"


def tree_of(drafter: dict, used: dict | None = None) -> str | None:
    """How a run's drafter drafted, from its resolved config (run.json): the tree policy it reads (conf/tree/, recorded
    under drafter.tree), Medusa's own tree, or a chain; None for the baseline. Keys a static tree ignores (an
    experiment's dynamic-tree settings merged into it) are ignored here too. `used`: the tree the drafter resolved
    itself (run.json `tree_used`, Medusa's `auto`), where recorded."""
    tree = drafter.get("tree")
    if tree == "auto" and used and used.get("name") == "mc_sim_7b_63":
        return static_tree(used["paths"], "Medusa mc_sim_7b_63")
    if isinstance(tree, dict) and tree.get("kind") == "dynamic":
        return DYNAMIC_TREE.format(depth=tree.get("depth"), topk=tree.get("topk"), size=dynamic_size(tree))
    if isinstance(tree, dict) and tree.get("kind") == "static":
        return static_tree(tree["paths"], tree.get("name"))
    if isinstance(tree, dict):
        return f"{tree.get('kind')} tree"
    if tree == "auto":  # Medusa: the most likely paths by the checkpoint's measured head accuracies
        return f"Medusa sparse ({drafter.get('tree_nodes')} nodes from the heads' accuracies)"
    if isinstance(tree, list) and tree:
        return static_tree(tree)
    if "gamma" in drafter:
        return f"chain of {drafter['gamma']}"
    if "num_pred_tokens" in drafter:
        return f"prompt lookup, up to {drafter['num_pred_tokens']} tokens"
    return None


def trees(table: Table, used: list[dict]) -> str:
    """Which tree each drafter of the table decoded with, grouped: 'a, b: <tree>; c: <tree>' (table order)."""
    groups: dict[str, list[str]] = {}
    for name in table.drafters:
        for desc in sorted({tree_of(r["_head"]["config"]["drafter"], r["_head"].get("tree_used"))
                            for r in used if r["drafter"] == name} - {None}):
            groups.setdefault(desc, []).append(name)
    return "; ".join(f"{', '.join(names)}: {desc}" for desc, names in groups.items())


def value(summary: dict | None, metric: str) -> float | None:
    if summary is None:
        return None
    if metric == "spu" and summary["drafter"] == "none":
        return 1.0  # the baseline, by definition
    try:
        return METRICS[metric][1](summary)
    except (KeyError, TypeError):
        return None


def cell(summary: dict | None, metric: str) -> str:
    v = value(summary, metric)
    return MISSING if v is None else METRICS[metric][2].format(v)


def mean_cell(summaries: list[dict | None], metric: str) -> str:
    """The paper's Mean/Average column: the plain mean over the datasets, missing unless every dataset has a value."""
    vs = [value(s, metric) for s in summaries]
    return MISSING if not vs or None in vs else METRICS[metric][2].format(sum(vs) / len(vs))


def write_md(path: Path, lines: list[str]) -> Path:
    """A report's markdown, one line per entry."""
    path.write_text("\n".join(lines) + "\n")
    return path


def md_table(caption: str, head: list[str], rows: list[list[str]]) -> list[str]:
    """A table as markdown lines: the caption in bold, the header, the rows."""
    return [f"**{caption}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(r) + " |" for r in rows]


def render(table: Table, runs: dict, setting: Setting, failed: dict | None = None) -> tuple[str, str]:
    """failed: cell key -> failure record (specbench/failures.py) of jobs that failed and have no finished run."""
    failed = {k: f for k, f in (failed or {}).items() if k not in runs}
    groups = [(d, t) for d in table.datasets for t in table.temperatures]
    label = (lambda d, t: d if len(table.temperatures) == 1 else f"{d} T={t:g}")
    head = ["method"] + [f"{label(d, t)} {METRICS[m][0]}" for d, t in groups for m in table.metrics]
    rows = [[name] + [FAILED if (name, d, t) in failed else cell(runs.get((name, d, t)), m)
                      for d, t in groups for m in table.metrics]
            for name in table.drafters]
    if table.mean:
        head += [f"{label('mean', t)} {METRICS[m][0]}" for t in table.temperatures for m in table.metrics]
        for name, row in zip(table.drafters, rows):
            row += [mean_cell([runs.get((name, d, t)) for d in table.datasets], m)
                    for t in table.temperatures for m in table.metrics]
    used = [runs[k] for k in sorted(runs) if k[0] in table.drafters and k[1] in table.datasets]
    ours = trees(table, used)
    caption = (f"{table.caption}; {setting.describe()}. "
               + (f"The paper's tree: {table.paper_tree}. " if table.paper_tree else "")
               + (f"Trees of these runs: {ours}. " if ours else "") + f"{provenance(used) if used else 'no runs yet'}."
               + failed_note(table, failed))
    md = md_table(caption, head, rows)
    esc = lambda x: x.replace("_", r"\_").replace("τ", r"$\tau$").replace("α", r"$\alpha$").replace(MISSING, "--")
    tex = [r"\begin{table}[t]", r"\centering", r"\begin{tabular}{l" + "r" * (len(head) - 1) + "}", r"\toprule",
           " & ".join(esc(h) for h in head) + r" \\", r"\midrule"]
    tex += [" & ".join(esc(c) for c in r) + r" \\" for r in rows]
    tex += [r"\bottomrule", r"\end{tabular}", rf"\caption{{{esc(caption)}}}", r"\end{table}"]
    return "\n".join(md) + "\n", "\n".join(tex) + "\n"


def failed_note(table: Table, failed: dict) -> str:
    """The failed jobs of a table's cells, each with its one-line error, for the caption."""
    keys = [k for k in sorted(failed) if k[0] in table.drafters and k[1] in table.datasets]
    if not keys:
        return ""
    label = (lambda d, t: d if len(table.temperatures) == 1 else f"{d} T={t:g}")
    return " Failed jobs: " + "; ".join(f"{k[0]} on {label(k[1], k[2])}: {failed[k]['error']}" for k in keys) + "."


def load_failures(exp_dir: Path) -> dict[Setting, dict[tuple, dict]]:
    """Per setting, cell key -> the failure record of a job that failed there (the newest, where several did)."""
    out: dict[Setting, dict[tuple, dict]] = {}
    for f in failures.load(exp_dir):
        cfg = f["config"]
        key = (cfg["drafter"]["name"], cfg["dataset"]["name"], float(cfg["decoding"]["temperature"]))
        cells = out.setdefault(Setting.of(f), {})
        if key not in cells or f["date"] > cells[key]["date"]:
            cells[key] = f
    return out


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


def training_curves(root: Path, out: Path) -> None:
    logs = sorted(root.glob("*/*/log.jsonl"))
    if not logs:
        return
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    lines = ["| model | drafter | epoch | sim τ | " + " | ".join(f"{i}-α" for i in range(5)) + " |", "|" + "---|" * 9]
    for log in logs:
        vals = [r for r in map(json.loads, log.read_text().splitlines()) if r.get("kind") == "val"]
        if not vals:
            continue
        model, drafter = log.parent.parent.name, log.parent.name
        epochs = [r["epoch"] + 1 for r in vals]
        axes[0].plot(epochs, [r["sim_tau"] for r in vals], marker="o", label=drafter)
        axes[1].plot(range(1, len(vals[-1]["alpha"]) + 1), vals[-1]["alpha"], marker="o", label=drafter)
        for r in vals:
            lines.append(f"| {model} | {drafter} | {r['epoch'] + 1} | {r['sim_tau']:.3f} | "
                         + " | ".join(f"{a:.3f}" for a in r["alpha"][:5]) + " |")
    axes[0].set_xlabel("epoch"), axes[0].set_ylabel("validation simulated τ"), axes[0].legend(fontsize=7)
    axes[1].set_xlabel("draft position n"), axes[1].set_ylabel("acceptance (last epoch)"), axes[1].legend(fontsize=7)
    fig.suptitle("Training efficiency: per-position acceptance (papers/000 Fig. 3-5, papers/003 Fig. 6)")
    fig.tight_layout()
    save(fig, out / "training_curves.png")
    (out / "training.md").write_text("**Per-epoch validation (chain, own predictions)**\n\n" + "\n".join(lines) + "\n")


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
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for method in sorted({r["method"] for r in rows}):
            pts = sorted((r["steps"], r) for r in rows if r["method"] == method)
            axes[0].plot([s for s, _ in pts], [r["graph_bytes"] / 2**20 for _, r in pts], marker="o", label=method)
            axes[1].plot([s for s, _ in pts], [r["step_s"] for _, r in pts], marker="o", label=method)
        axes[0].set_xlabel("simulated steps s"), axes[0].set_ylabel("autograd graph MiB"), axes[0].legend()
        axes[1].set_xlabel("simulated steps s"), axes[1].set_ylabel("s / training step"), axes[1].legend()
        fig.tight_layout()
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


def tree_auto_report(exp_dir: Path, table: "AutoTable", figure: bool) -> list[Path]:
    """Each drafter with its paper's tree and with the tree sized for the device (tree=auto), the predicted speedup
    (specbench/costmodel.py, from run.json's `tree_auto`) next to the measured one, per model setting; with `figure`,
    predicted tokens/s against tree size with the measured points (conf/experiment/tree_auto.yaml)."""
    by_setting = load_runs(exp_dir, tree_key)
    written = []
    for setting, cells in sorted(by_setting.items()):
        stem = file_stem(setting, by_setting)
        drafters = sorted({d for d, _, v in cells if v != "none"})
        present = {k[1] for k in cells}
        datasets = [d for d in table.datasets if d in present] + sorted(present - set(table.datasets))
        head = ["method", "dataset", "paper tree", "τ", "speedup", "predicted", "auto tree", "τ", "predicted speedup",
                "measured speedup", "error"]
        rows, errors = [], []
        for d in drafters:
            for ds in datasets:
                p, a = cells.get((d, ds, "paper")), cells.get((d, ds, "auto"))
                auto = a["_head"]["tree_auto"] if a else None
                pred = auto["predicted"]["speedup"] if auto else None
                meas = value(a, "spu")
                err = (pred - meas) / meas if pred is not None and meas else None
                if err is not None:
                    errors.append(abs(err))
                chosen = auto["chosen"] if auto else None
                base_pred = auto["base_predicted"]["speedup"] if auto else None
                paper_tree = tree_of(p["_head"]["config"]["drafter"], p["_head"].get("tree_used")) if p else None
                rows.append([d, ds, paper_tree or MISSING, cell(p, "tau"), cell(p, "spu"),
                             MISSING if base_pred is None else f"{base_pred:.2f}x",
                             cut_of(chosen) if chosen else MISSING,
                             cell(a, "tau"), MISSING if pred is None else f"{pred:.2f}x", cell(a, "spu"),
                             MISSING if err is None else f"{err:+.0%}"])
        used = [c for c in cells.values()]
        mean_err = f"mean |error| {sum(errors) / len(errors):.0%} over {len(errors)} runs" if errors else "no auto runs"
        caption = (f"Each drafter at its paper's tree and at the tree sized for this device (tree=auto: the same "
                   f"policy cut to the depth, top-k and token count that maximise predicted tokens/s, "
                   f"specbench/costmodel.py; a static list or chain: its first n paths), T=0; {setting.describe()}. "
                   f"Predicted speedups: the cost model "
                   f"before the run (one calibration per drafter, on questions no table scores), for the auto tree and "
                   f"for the paper tree; measured: against the baseline of the same job; auto tree {mean_err}. "
                   f"{provenance(used) if used else 'no runs yet'}.")
        md = md_table(caption, head, rows)
        written.append(write_md(exp_dir / f"{table.name}.{stem}.md", md))
        if figure:
            figure_tree_size(cells, exp_dir / f"tree_size.{stem}.png")
    return written


def vocab_key(summary: dict, head: dict) -> tuple:
    """The draft_vocab table's cell: (drafter, dataset, none | paper | auto, N) with N = 0 for the whole vocabulary."""
    module = head["config"]["drafter"].get("module") or {}
    return (*tree_key(summary, head), int(module.get("draft_vocab") or 0))


def vocab_report(exp_dir: Path, table: VocabTable) -> list[Path]:
    """Each EAGLE-family drafter at its paper tree and at tree=auto, with its whole vocabulary and pruned to N
    frequent tokens: draft and verify ms per step, tau, speedup, and the draft-time saving and tau cost against the
    same drafter and tree with the whole vocabulary; CORAL's router (which prunes the same LM head by groups) beside
    them."""
    by_setting = load_runs(exp_dir, vocab_key)
    written = []
    for setting, cells in sorted(by_setting.items()):
        order = {"eagle": 0, "eagle2": 1, "hass": 2, "coral": 3, "coral_router": 4}
        drafters = sorted({k[0] for k in cells if k[0] != "none"}, key=lambda d: (order.get(d, 9), d))
        present = {k[1] for k in cells}
        datasets = [d for d in table.datasets if d in present] + sorted(present - set(table.datasets))
        head = ["method", "dataset", "tree", "draft vocabulary", "Td ms/step", "Tv ms/step", "τ", "speedup",
                "Td vs whole", "τ vs whole"]
        rows = []
        for ds in datasets:
            for d in drafters:
                for variant in ("paper", "auto"):
                    ns = sorted({k[3] for k in cells if k[:3] == (d, ds, variant)}, key=lambda n: (n != 0, -n))
                    whole = cells.get((d, ds, variant, 0))
                    for n in ns:
                        r = cells[(d, ds, variant, n)]
                        auto = r["_head"].get("tree_auto")
                        tree = cut_of(auto["chosen"]) if auto else tree_of(r["_head"]["config"]["drafter"],
                                                                           r["_head"].get("tree_used"))
                        td, tau = value(r, "draft_ms"), value(r, "tau")
                        td0, tau0 = value(whole, "draft_ms"), value(whole, "tau")
                        rows.append([d, ds, f"{variant}: {tree}", "router" if d == "coral_router" else
                                     "whole" if n == 0 else f"{n:,}", cell(r, "draft_ms"), cell(r, "verify_ms"),
                                     cell(r, "tau"), cell(r, "spu"),
                                     MISSING if n == 0 or None in (td, td0) else f"{td / td0 - 1:+.0%}",
                                     MISSING if n == 0 or None in (tau, tau0) else f"{tau - tau0:+.2f}"])
        used = list(cells.values())
        caption = (f"Draft-vocabulary pruning (module.draft_vocab: the target's LM head restricted to the N tokens most "
                   f"frequent in the training answers, specbench/vocab.py; lossless, the target verifies), T=0, at each "
                   f"drafter's paper tree and at tree=auto (the cost model measures the pruned drafter); CORAL's "
                   f"LM-head router, which prunes the same head by vocabulary groups, beside them; {setting.describe()}. "
                   f"Td / Tv: draft / verify ms per SD iteration; 'vs whole': against the same drafter and tree with "
                   f"the whole vocabulary. {provenance(used) if used else 'no runs yet'}.")
        md = md_table(caption, head, rows)
        written.append(write_md(exp_dir / f"{table.name}.{file_stem(setting, by_setting)}.md", md))
    return written


def batch_key(summary: dict, head: dict) -> tuple:
    """The batch_sweep table's cell: (drafter, dataset, none | paper | auto, B, temperature): the table reads T=0."""
    return (*tree_key(summary, head), int(head["config"]["decoding"].get("batch_size", 1)),
            float(summary["temperature"]))


def below_one(speedups: dict[int, float | None]) -> str:
    """The batch size from which a drafter no longer pays: the smallest measured B such that it and every larger
    measured B are under 1.0x ('>' the largest measured when that one is not). A curve that dips and recovers (0.83x at
    B = 1, 1.02x at B = 2, as this CPU's baseline hump gives) is not said to drop at B = 1: the question the column
    answers is "up to which B does it still pay". Judged on the speedup as its cell prints it (two decimals), so a row
    never reads "1.00x" and "below 1.0x from" that B."""
    measured = sorted(b for b, v in speedups.items() if v is not None)
    if not measured:
        return MISSING
    below = [round(speedups[b], 2) < 1.0 for b in measured]
    if not below[-1]:
        return f"> {measured[-1]}"
    # walk back from the largest B while it stays below 1.0x
    i = len(measured) - 1
    while i > 0 and below[i - 1]:
        i -= 1
    return str(measured[i])


def predicted_speedup(auto_run: dict | None, variant: str) -> float | None:
    """The cost model's speedup at a B, from that B's tree=auto run (run.json `tree_auto`, specbench/costmodel.py): its
    chosen tree's prediction for the auto row, and for the paper row its prediction of the tree it cut, `base` =
    the drafter's paper tree (conf/tree/auto.yaml: base = ${paper_tree}; pld / sd / medusa: their own default), both
    with the target timed at that B. None without an auto run."""
    auto = auto_run["_head"].get("tree_auto") if auto_run else None
    if not auto:
        return None
    return (auto["predicted"] if variant == "auto" else auto["base_predicted"])["speedup"]


def batch_report(exp_dir: Path, table: BatchTable, figure: bool) -> list[Path]:
    """Each drafter's speedup (and per-row τ) against the baseline at the same batch size, B = every size run, at its
    paper tree and at tree=auto sized per B; the batch size from which it stays below 1.0x; the baseline's throughput
    and peak memory per B, and how many of its turns differ from its own batch-1 output (a batched matmul rounds
    differently: those differences are the baseline's, not a drafter's). conf/experiment/batch_sweep.yaml."""
    by_setting = load_runs(exp_dir, batch_key, batched=True)
    written = []
    for setting, cells in sorted(by_setting.items()):
        stem = file_stem(setting, by_setting)
        sizes = sorted({k[3] for k in cells if k[4] == 0})
        present = {k[1] for k in cells}
        datasets = [d for d in table.datasets if d in present] + sorted(present - set(table.datasets))
        drafters = sorted({k[0] for k in cells if k[0] != "none"})
        head = ["method", "dataset", "tree"] + [f"B={b}" for b in sizes] + ["< 1.0x from B on", "predicted"]
        rows, use_rows = [], []
        for ds in datasets:
            for d in drafters:
                for variant in ("paper", "auto"):
                    runs = {b: cells.get((d, ds, variant, b, 0.0)) for b in sizes}
                    if not any(runs.values()):
                        continue
                    rows.append([d, ds, variant] + [MISSING if r is None else
                                                    f"{cell(r, 'spu')} ({cell(r, 'tau')}){_unequal(r)}"
                                                    for r in runs.values()]
                                + [below_one({b: value(r, "spu") for b, r in runs.items()}),
                                   below_one({b: predicted_speedup(cells.get((d, ds, "auto", b, 0.0)), variant)
                                              for b in sizes})])
                    use_rows.append([f"{d} ({variant})", ds] + [MISSING if r is None else
                                                                f"{cell(r, 'speed')} / {cell(r, 'mem')}"
                                                                for r in runs.values()])
        base_head = ["dataset"] + [f"B={b}" for b in sizes]
        base_rows = []
        for ds in datasets:
            bases = {b: cells.get(("none", ds, "none", b, 0.0)) for b in sizes}
            one = _token_ids(exp_dir, bases.get(1))
            base_rows.append([f"{ds}: throughput (tokens/s)"] + [cell(r, "speed") for r in bases.values()])
            base_rows.append([f"{ds}: peak memory (GiB)"] + [cell(r, "mem") for r in bases.values()])
            base_rows.append([f"{ds}: turns ≠ batch 1"] + [_differ(one, _token_ids(exp_dir, r)) for r in bases.values()])
        used = list(cells.values())
        caption = (f"Speedup (per-row τ) against the baseline at the same batch size B (decoding.batch_size: B questions "
                   f"decoded together, each row its own tree, one target forward verifying all rows; speed = the "
                   f"batch's throughput), T=0, at each drafter's paper tree and at tree=auto sized per B (the cost "
                   f"model times B x (tree + 1) tokens per forward and B drafters per step); {setting.describe()}. "
                   f"'≠k/n': k of the n compared turns differ from the baseline's at the same B (each classified in "
                   f"its record, near-tie or mismatch, by replaying both runs' own batches). 'predicted': the same "
                   f"column from the cost model's predicted speedups (each B's tree=auto run: its chosen tree for the "
                   f"auto row, the paper tree it cut for the paper row, the target timed at that B), so a reader sees "
                   f"whether the model that sizes the trees foresaw where drafting stops paying. "
                   f"{provenance(used) if used else 'no runs yet'}.")
        md = md_table(caption, head, rows) + [""] + md_table(
            "The baseline per batch size: throughput, peak memory, and its turns whose output differs from its own "
            "batch-1 output (B = 1 decodes through Engine.generate on model.cache, B > 1 through generate_batch on a "
            "preallocated cache with explicit masks: a difference is the rounding of batched matmuls or of the other "
            "path; each drafter is compared with the baseline at its own B).",
            base_head, base_rows) + [""] + md_table(
            "Each drafter's throughput (tokens/s, summed over the batch's rows) / peak memory (GiB: the target, the "
            "drafter, their caches) per batch size; the baseline's are in the table above.",
            ["method (tree)", "dataset"] + [f"B={b}" for b in sizes], use_rows)
        written.append(write_md(exp_dir / f"{table.name}.{stem}.md", md))
        if figure:
            figure_batch(cells, sizes, datasets[0] if datasets else None, exp_dir / f"batch.{stem}.png")
    return written


def _unequal(run: dict) -> str:
    """' ≠k/n' when k of a run's n compared turns differ from its baseline's output (none: '')."""
    ll = run.get("lossless") or {}
    n, k = ll.get("compared") or 0, (ll.get("compared") or 0) - (ll.get("matches") or 0)
    return f" ≠{k}/{n}" if k else ""


def _token_ids(exp_dir: Path, run: dict | None) -> dict | None:
    """A run's output per (question, turn, repeat), from its records."""
    if run is None:
        return None
    return {(r["question_id"], r["turn"], r["repeat"]): r["new_token_ids"]
            for r in read_jsonl(exp_dir / run["run"] / "records.jsonl")}


def _differ(one: dict | None, other: dict | None) -> str:
    if one is None or other is None:
        return MISSING
    common = set(one) & set(other)
    return f"{sum(one[k] != other[k] for k in common)} / {len(common)}"


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


def compiled_key(summary: dict, head: dict) -> tuple:
    """The two_baselines table's cell: (drafter, dataset, compiled or not, temperature, cache kind: model.cache, or
    `static` when compiled), so that runs of another temperature or cache never overwrite one another."""
    compiled = bool((head.get("model_identity") or {}).get("compile"))
    cache = "static" if compiled else head["config"]["model"].get("cache", "dynamic")
    return summary["drafter"], summary["dataset"], compiled, float(summary["temperature"]), cache


def baselines_report(exp_dir: Path, table: BaselinesTable) -> list[Path]:
    """Each drafter's speedup against the eager baseline (the papers' comparison) and against the compiled one
    (model.compile: a baseline with less overhead per step), τ of both runs side by side with the turns whose tokens
    differ between them (compiled kernels may round differently: τ then differs too, and 'speedup kept' mixes the two),
    and the share of the eager speedup that survives the compiled baseline. conf/experiment/two_baselines.yaml."""
    by_setting = load_runs(exp_dir, compiled_key)
    written = []
    for setting, cells in sorted(by_setting.items()):
        present = {k[1] for k in cells}
        datasets = [d for d in table.datasets if d in present] + sorted(present - set(table.datasets))
        drafters = sorted({k[0] for k in cells if k[0] != "none"})
        variants = sorted({(k[3], k[4]) for k in cells if not k[2]})  # (temperature, eager cache)
        head = ["method", "dataset", "τ eager", "τ compiled", "turns ≠ (eager vs compiled)", "eager vs eager baseline",
                "compiled vs compiled baseline", "eager vs compiled baseline", "speedup kept"]
        rows = []
        for ds in datasets:
            for temp, kind in variants:
                label = ds if variants == [(0.0, "dynamic")] else f"{ds} (T={temp:g}, eager: {kind} cache)"
                runs = {d: (cells.get((d, ds, False, temp, kind)), cells.get((d, ds, True, temp, "static")))
                        for d in ["none", *drafters]}
                base_e, base_c = runs["none"]
                rows.append(["none (tokens/s)", label, "", "", _differ(_token_ids(exp_dir, base_e),
                                                                       _token_ids(exp_dir, base_c)) if temp == 0 else "",
                             cell(base_e, "speed"), cell(base_c, "speed"), "", ""])
                for d in drafters:
                    e, c = runs[d]
                    cross = (value(e, "speed") / value(base_c, "speed")
                             if value(e, "speed") and value(base_c, "speed") else None)
                    spu_c = value(c, "spu")
                    kept = spu_c / value(e, "spu") if spu_c and value(e, "spu") else None
                    rows.append([d, label, cell(e, "tau"), cell(c, "tau"),
                                 _differ(_token_ids(exp_dir, e), _token_ids(exp_dir, c)) if temp == 0 else "",
                                 cell(e, "spu"), cell(c, "spu"),
                                 MISSING if cross is None else f"{cross:.2f}x", MISSING if kept is None else f"{kept:.0%}"])
        used = list(cells.values())
        caption = (f"Every drafter against two baselines; {setting.describe()}: the eager one (the papers' "
                   f"comparison, every other table's) and the compiled one (model.compile: the target's forwards "
                   f"through torch.compile over a static cache, CUDA graphs on a GPU; EAGLE's head and sd's draft "
                   f"model compiled the same way, the other drafters' modules eager). 'turns ≠': T=0 turns whose "
                   f"tokens differ between the eager and the compiled run (where any do, τ may differ and 'speedup "
                   f"kept' mixes τ with speed). 'speedup kept': compiled-vs-compiled over eager-vs-eager. "
                   f"{provenance(used) if used else 'no runs'}.")
        md = md_table(caption, head, rows)
        written.append(write_md(exp_dir / f"{table.name}.{file_stem(setting, by_setting)}.md", md))
    return written


def question_speeds(run_dir: Path) -> tuple[list[float], list[int]]:
    """Spec-Bench's per-question speed (evaluation/speed.py: a question's new tokens over its wall time, its turns
    summed; each repeat a question of its own) and every step's accepted tokens (accepted + the bonus token)."""
    per_q: dict[tuple, list[float]] = {}
    steps: list[int] = []
    for r in read_jsonl(run_dir / "records.jsonl"):
        q = per_q.setdefault((r["repeat"], r["question_id"]), [0.0, 0.0])
        q[0] += r["new_tokens"]
        q[1] += r["wall_s"]
        steps += r.get("tokens_per_step") or []
    return [t / w for t, w in per_q.values() if w > 0], steps


def board_report(exp_dir: Path, table: BoardTable) -> list[Path]:
    """Spec-Bench's leaderboard in its own columns: per task the speedup (the mean per-question tokens/s of the
    method over the baseline's, as its evaluation/speed.py computes it), the mean accepted tokens per step over all
    tasks and the overall speedup (the same ratio over every question of the six tasks); then the published board
    it mirrors, marked as another target and device."""
    by_setting = load_runs(exp_dir)  # batch 1, as Spec-Bench measures (a batch's rows share one clock)
    written = []
    mean = lambda xs: sum(xs) / len(xs)
    for setting, cells in sorted(by_setting.items()):
        head = ["method"] + [title for title, _ in table.columns] + ["#Mean Accepted Tokens", "Overall"]
        rows, used = [], []
        for name in table.drafters:
            row, speeds, base_speeds, steps = [name], [], [], []
            for _, ds in table.columns:
                run = cells.get((name, ds, 0.0))
                base = run and run.get("baseline_run") and exp_dir / run["baseline_run"]
                if not run or not base or not (base / "records.jsonl").is_file():
                    row.append(MISSING)
                    continue
                used.append(run)
                sp, st = question_speeds(exp_dir / run["run"])
                b, _ = question_speeds(base)
                row.append(f"{mean(sp) / mean(b):.2f}x" if sp and b else MISSING)
                speeds, base_speeds, steps = speeds + sp, base_speeds + b, steps + st
            complete = MISSING not in row[1:]
            row += [f"{mean(steps):.2f}" if complete and steps else MISSING,
                    f"{mean(speeds) / mean(base_speeds):.2f}x" if complete and speeds else MISSING]
            rows.append(row)
        caption = (f"Spec-Bench's six tasks (Xia et al. 2024; shared/data/spec_bench), in its columns: speedup per task "
                   f"and overall (mean per-question tokens/s over the baseline's, as its evaluation/speed.py), mean "
                   f"accepted tokens per step over all tasks (1.00 for the baseline), T=0; each drafter at its paper's "
                   f"tree; {setting.describe()}. {provenance(used) if used else 'no runs yet'}.")
        md = md_table(caption, head, rows)
        pub = table.published
        if pub:
            ours = dict(table.ours)
            md += [""] + md_table(
                f"Published, another target and device: {pub['model']} on {pub['device']}, {pub['settings']} "
                f"({pub['source']}). Not comparable cell by cell with the table above (another model, another device, "
                f"full question sets); shown for the ordering of the methods. Our drafter of the same method in "
                f"brackets.", head, [[f"{m} ({ours[m]})" if m in ours else m, *map(str, vals)]
                                     for m, vals in pub["rows"].items()])
        written.append(write_md(exp_dir / f"{table.name}.{file_stem(setting, by_setting)}.md", md))
    return written


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


def file_stem(setting: Setting, settings: dict) -> str:
    """Tables and figures are named by their model; the dtype and budget are added only where the same model has runs
    of several settings in the experiment."""
    same_model = [x for x in settings if x.model == setting.model]
    if len(same_model) == 1:
        return setting.model
    limit = f".{setting.limit}q" if setting.limit else ".full"
    return f"{setting.model}.{setting.dtype}.{setting.max_new_tokens}tok{limit}"


def report(results: Path) -> list[Path]:
    written = []
    for exp_dir in sorted(p for p in results.iterdir() if p.is_dir()) if results.is_dir() else []:
        spec = experiment_report(exp_dir.name)
        if spec is None:
            continue
        tables, figures = spec
        paper = [t for t in tables if isinstance(t, Table)]
        settings = load_runs(exp_dir) if paper else {}
        failed = load_failures(exp_dir) if paper else {}
        for setting in failed:  # a setting whose every job failed still gets its tables, naming the failures
            settings.setdefault(setting, {})
        for setting, runs in sorted(settings.items()):
            stem = file_stem(setting, settings)
            for table in paper:
                md, tex = render(table, runs, setting, failed.get(setting))
                for suffix, text in ((".md", md), (".tex", tex)):
                    path = exp_dir / f"{table.name}.{stem}{suffix}"
                    path.write_text(text)
                    written.append(path)
            if "leviathan" in figures:
                figure_leviathan(runs, exp_dir, stem)
            if "cost" in figures:
                for ds in paper[0].datasets:
                    figure_cost(runs, exp_dir, ds, stem)
        for table in (t for t in tables if isinstance(t, AutoTable)):
            written += tree_auto_report(exp_dir, table, "tree_size" in figures)
        for table in (t for t in tables if isinstance(t, VocabTable)):
            written += vocab_report(exp_dir, table)
        for table in (t for t in tables if isinstance(t, BaselinesTable)):
            written += baselines_report(exp_dir, table)
        for table in (t for t in tables if isinstance(t, BatchTable)):
            written += batch_report(exp_dir, table, "batch" in figures)
        for table in (t for t in tables if isinstance(t, BoardTable)):
            written += board_report(exp_dir, table)
    training_curves(results / "training", results / "training")
    trainmem(results / "trainmem")
    trainspeed(results / "trainspeed")
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="results", type=Path)
    args = ap.parse_args()
    for p in report(args.results):
        print(f"written: {p}")


if __name__ == "__main__":
    main()
