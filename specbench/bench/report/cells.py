"""Reading runs into table cells: the run records of an experiment keyed by their setting, each cell's number formatted
(or "–" / "failed"), the caption's provenance and trees, markdown and LaTeX tables."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from specbench.bench import failures


MISSING = "–"


FAILED = "failed"  # a cell whose job failed and has not finished since (results/<experiment>/failed/)


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
    # a run option whose values are rows (a dotted path into run.json's config, e.g. drafter.module.tli_context): a
    # row is then named "<drafter> <leaf>=<value>" (option_key), one drafter's ablation in the paper's layout
    option: str = ""


# metric -> (column title, how to read it from a summary, format)
METRICS = {
    "speed": ("Speed", lambda s: s["tokens_per_s"]["mean"], "{:.1f}"),
    "spu": ("Spu", lambda s: (s.get("speedup") or {}).get("mean"), "{:.2f}x"),
    "tau": ("τ", lambda s: s["tau_micro"], "{:.2f}"),
    "mem": ("M (GiB)", lambda s: s["peak_mem_bytes"] / 2**30 if s.get("peak_mem_bytes") else None, "{:.2f}"),
    "draft_ms": ("Td ms/step", lambda s: s["draft_ms_per_step"], "{:.1f}"),
    "verify_ms": ("Tv ms/step", lambda s: s["verify_ms_per_step"], "{:.1f}"),
    # turns equal to the baseline's output (T=0) out of those compared; none for the baseline itself
    "lossless": ("lossless", lambda s: f"{s['lossless']['matches']}/{s['lossless']['compared']}"
                 if s["lossless"]["compared"] else None, "{}"),
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


def option_key(option: str):
    """A cell key that names the row by the run's value of `option` too: ("<drafter> <leaf>=<value>", dataset,
    temperature), so the runs of one drafter at two values of an option fill two rows, not one cell."""
    path = option.split(".")

    def key(summary: dict, head: dict) -> tuple:
        node = head["config"]
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        return f"{summary['drafter']} {path[-1]}={node}", summary["dataset"], float(summary["temperature"])
    return key


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
    paired = sum(r.get("speedup_against") == "paired" for r in runs)
    drafted = sum(r.get("drafter") != "none" for r in runs)
    # (said only where a run was paired: the tables of runs without bench.paired stay as they were)
    pairs = (f"; speedup against the baseline decoded beside each turn (bench.paired) in {paired} of {drafted} drafted "
             f"runs{', the others against the baseline run' if paired < drafted else ''}") if paired else ""
    return f"device: {', '.join(devices)}{mixed}; commit(s): {', '.join(commits)}{pairs}"


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


def trees(table: Table, used: dict[tuple, dict]) -> str:
    """Which tree each row of the table decoded with, grouped: 'a, b: <tree>; c: <tree>' (table order). used: cell
    key -> run, the row's name first in the key."""
    groups: dict[str, list[str]] = {}
    for name in table.drafters:
        for desc in sorted({tree_of(r["_head"]["config"]["drafter"], r["_head"].get("tree_used"))
                            for k, r in used.items() if k[0] == name} - {None}):
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
    """failed: cell key -> failure record (specbench/bench/failures.py) of jobs that failed and have no finished run."""
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
    keys = [k for k in sorted(runs) if k[0] in table.drafters and k[1] in table.datasets]
    used = [runs[k] for k in keys]
    ours = trees(table, {k: runs[k] for k in keys})
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


def load_failures(exp_dir: Path, key_of=cell_key) -> dict[Setting, dict[tuple, dict]]:
    """Per setting, key_of(...) -> the failure record of a job that failed there (the newest, where several did); a
    record has a run.json's `config`, so it is keyed as a finished run of the same config would be."""
    out: dict[Setting, dict[tuple, dict]] = {}
    for f in failures.load(exp_dir):
        cfg = f["config"]
        key = key_of({"drafter": cfg["drafter"]["name"], "dataset": cfg["dataset"]["name"],
                      "temperature": cfg["decoding"]["temperature"]}, f)
        cells = out.setdefault(Setting.of(f), {})
        if key not in cells or f["date"] > cells[key]["date"]:
            cells[key] = f
    return out


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


def file_stem(setting: Setting, settings: dict) -> str:
    """Tables and figures are named by their model; the dtype and budget are added only where the same model has runs
    of several settings in the experiment."""
    same_model = [x for x in settings if x.model == setting.model]
    if len(same_model) == 1:
        return setting.model
    limit = f".{setting.limit}q" if setting.limit else ".full"
    return f"{setting.model}.{setting.dtype}.{setting.max_new_tokens}tok{limit}"
