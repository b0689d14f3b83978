"""The experiments whose tables are more than cells: tree_auto (paper vs auto tree), draft_vocab, batch_sweep,
two_baselines and the Spec-Bench board."""
from __future__ import annotations

import itertools
from pathlib import Path
from specbench.core.records import RunDir, read_jsonl
from specbench.bench.report.cells import (
    MISSING, below_one, cell, file_stem, load_runs, md_table, provenance, tree_key, tree_of, value, write_md)
from specbench.bench.report.tables import AutoTable, BaselinesTable, BatchTable, BoardTable, VocabTable
from specbench.bench.report.figures import cut_of, figure_batch, figure_tree_size


def tree_auto_report(exp_dir: Path, table: "AutoTable", figure: bool) -> list[Path]:
    """Each drafter with its paper's tree and with the tree sized for the device (tree=auto), the predicted speedup
    (specbench/bench/costmodel.py, from run.json's `tree_auto`) next to the measured one, per model setting; with `figure`,
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
                   f"specbench/bench/costmodel.py; a static list or chain: its first n paths), T=0; {setting.describe()}. "
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
                   f"frequent in the training answers, specbench/decode/vocab.py; lossless, the target verifies), T=0, at each "
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


def predicted_speedup(auto_run: dict | None, variant: str) -> float | None:
    """The cost model's speedup at a B, from that B's tree=auto run (run.json `tree_auto`, specbench/bench/costmodel.py): its
    chosen tree's prediction for the auto row, and for the paper row its prediction of the tree it cut, `base` =
    the drafter's paper tree (conf/tree/auto.yaml: base = ${paper_tree}; pld / sd / medusa: their own default), both
    with the target timed at that B. None without an auto run."""
    auto = auto_run["_head"].get("tree_auto") if auto_run else None
    if not auto:
        return None
    return (auto["predicted"] if variant == "auto" else auto["base_predicted"])["speedup"]


def _batch_one_path(cells: dict[tuple, dict]) -> str:
    """How the table's batch-1 runs decoded: through the batch's own path (a preallocated cache of ragged rows,
    per-row masks, as every B > 1: every run since issue 77, whose config has no decoding.ragged, and the runs of
    before that set decoding.ragged=true) or through model.cache with the causal mask (decoding.ragged=false, the
    batch runs of before issue 77; batch runs did not exist before the option)."""
    ragged = {bool(r["_head"]["config"]["decoding"].get("ragged", True)) for k, r in cells.items() if k[3] == 1}
    batched = "ragged rows in a preallocated cache with per-row masks"
    if ragged == {True}:
        return f"every B, batch 1 included, decodes {batched}"
    if ragged == {False}:
        return f"B = 1 decodes on model.cache with the causal mask, B > 1 {batched}"
    if ragged:
        return f"B > 1 decodes {batched}; the batch-1 runs took both paths (decoding.ragged true and false)"
    return f"no batch-1 run; B > 1 decodes {batched}"


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
        rows, use_rows, wait_rows, time_rows = [], [], [], []
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
                    wait_rows.append([f"{d} ({variant})", ds] + [_wait(_records(exp_dir, r)) for r in runs.values()])
                    time_rows.append([f"{d} ({variant})", ds] + [MISSING if r is None else
                                                                 f"{cell(r, 'draft_ms')} / {cell(r, 'verify_ms')}"
                                                                 for r in runs.values()])
        base_head = ["dataset"] + [f"B={b}" for b in sizes]
        base_rows = []
        for ds in datasets:
            bases = {b: cells.get(("none", ds, "none", b, 0.0)) for b in sizes}
            recs = {b: _records(exp_dir, r) for b, r in bases.items()}  # each baseline's records read once
            one = _token_ids(recs.get(1))
            base_rows.append([f"{ds}: throughput (tokens/s)"] + [cell(r, "speed") for r in bases.values()])
            base_rows.append([f"{ds}: peak memory (GiB)"] + [cell(r, "mem") for r in bases.values()])
            base_rows.append([f"{ds}: turns ≠ batch 1"] + [_differ(one, _token_ids(r)) for r in recs.values()])
            wait_rows.append(["none", ds] + [_wait(r) for r in recs.values()])
            time_rows.append(["none", ds] + [MISSING if r is None else f"– / {cell(r, 'verify_ms')}"
                                             for r in bases.values()])
        used = list(cells.values())
        caption = (f"Speedup (per-row τ) against the baseline at the same batch size B (decoding.batch_size: B questions "
                   f"decoded together, each row its own tree, one target forward verifying all rows; speed = the "
                   f"batch's throughput), T=0, at each drafter's paper tree and at tree=auto sized per B (the cost "
                   f"model times B x (tree + 1) tokens per forward and the batch's draft per step); {setting.describe()}. "
                   f"'≠k/n': k of the n compared turns differ from the baseline's at the same B (each classified in "
                   f"its record, near-tie or mismatch, by replaying both runs' own batches). 'predicted': the same "
                   f"column from the cost model's predicted speedups (each B's tree=auto run: its chosen tree for the "
                   f"auto row, the paper tree it cut for the paper row, the target timed at that B), so a reader sees "
                   f"whether the model that sizes the trees foresaw where drafting stops paying. "
                   f"{provenance(used) if used else 'no runs yet'}.")
        md = md_table(caption, head, rows) + [""] + md_table(
            "The baseline per batch size: throughput, peak memory, and its turns whose output differs from its own "
            f"batch-1 output ({_batch_one_path(cells)}: a difference is the rounding of batched matmuls or of the "
            "other path; each drafter is compared with the baseline at its own B).",
            base_head, base_rows) + [""] + md_table(
            "Each drafter's throughput (tokens/s, summed over the batch's rows) / peak memory (GiB: the target, the "
            "drafter, their caches) per batch size; the baseline's are in the table above.",
            ["method (tree)", "dataset"] + [f"B={b}" for b in sizes], use_rows) + [""] + md_table(
            "How long a batch waits for its slowest row: the target forwards of the run's batches over their rows' "
            "mean steps (summed over batches; 1.00: every row of a batch took as many steps). A batch decodes until "
            "its last row is done, the rows that finished early leaving it, so a drafter whose rows accept unevenly "
            "pays for its slowest row's τ, not its mean; the baseline's rows all take their budget's steps unless "
            "one stops at EOS. A server that refills a finished row with the next request would not wait. In "
            "parentheses: the ratio expected if each batch held any B of the run's turns, each taking the steps it "
            "took (the largest of B of them over their mean): the part of the wait that the questions' spread in "
            "acceptance explains, without any step-to-step noise. B = 1: –.",
            ["method (tree)", "dataset"] + [f"B={b}" for b in sizes], wait_rows) + [""] + md_table(
            "Where a row-step's time goes: Td / Tv, the batch's draft / verify ms of a step over the rows in it "
            "(summed over the run's batches, over its rows' steps: specbench/core/metrics.py draft_ms_per_step). "
            "Drafting that batches well makes Td fall as B grows (one forward per draft level for every row); "
            "the baseline's Tv is a one-token forward's share. Times of one sitting; compare across B only within "
            "one sitting's runs (the provenance line gives their commits).",
            ["method (tree)", "dataset"] + [f"B={b}" for b in sizes], time_rows)
        written.append(write_md(exp_dir / f"{table.name}.{stem}.md", md))
        if figure:
            figure_batch(cells, sizes, datasets[0] if datasets else None, exp_dir / f"batch.{stem}.png")
    return written


def _records(exp_dir: Path, run: dict | None) -> list[dict] | None:
    """A run's records (None: no run)."""
    return None if run is None else RunDir(exp_dir / run["run"]).records()


def _wait(records: list[dict] | None) -> str:
    """Σ over a run's batches of its target forwards / Σ of its rows' mean steps (records' `batch`), and in
    parentheses the same ratio expected from the spread of its turns' steps alone (_spread_wait), 'x.xx (y.yy)'; '–'
    without a run or batch records (batch 1)."""
    if records is None:
        return MISSING
    batches: dict[str, tuple[int, list[int]]] = {}
    for r in records:
        if r.get("batch"):
            batches.setdefault(r["batch"]["id"], (r["batch"]["steps"], []))[1].append(r["steps"])
    mean_steps = sum(sum(s) / len(s) for _, s in batches.values())
    if not mean_steps:
        return MISSING
    size = max(r["batch"]["size"] for r in records if r.get("batch"))
    return (f"{sum(b for b, _ in batches.values()) / mean_steps:.2f} "
            f"({_spread_wait([s for _, rows in batches.values() for s in rows], size):.2f})")


def _spread_wait(steps: list[int], b: int) -> float:
    """E[the most steps among b turns drawn at random from `steps`] / their mean: the wait a batch of b rows would
    show if it held any b of the run's turns, each taking the steps it took. Exact over draws with replacement: the
    i-th smallest of n is the largest of b draws with probability (i/n)^b - ((i-1)/n)^b."""
    s, n = sorted(steps), len(steps)
    top = sum(v * ((i / n) ** b - ((i - 1) / n) ** b) for i, v in enumerate(s, 1))
    return top / (sum(s) / n)


def _unequal(run: dict) -> str:
    """' ≠k/n' when k of a run's n compared turns differ from its baseline's output (none: '')."""
    ll = run.get("lossless") or {}
    n, k = ll.get("compared") or 0, (ll.get("compared") or 0) - (ll.get("matches") or 0)
    return f" ≠{k}/{n}" if k else ""


def _token_ids(records: list[dict] | None) -> dict | None:
    """A run's output per (question, turn, repeat), from its records."""
    if records is None:
        return None
    return {(r["question_id"], r["turn"], r["repeat"]): r["new_token_ids"] for r in records}


def _differ_runs(exp_dir: Path, one: dict | None, other: dict | None) -> str:
    """_differ of two runs' outputs, from their records."""
    return _differ(_token_ids(_records(exp_dir, one)), _token_ids(_records(exp_dir, other)))


def _differ(one: dict | None, other: dict | None) -> str:
    if one is None or other is None:
        return MISSING
    common = set(one) & set(other)
    return f"{sum(one[k] != other[k] for k in common)} / {len(common)}"


def compiled_key(summary: dict, head: dict) -> tuple:
    """The two_baselines table's cell: (drafter, dataset, the compile backend: "" when eager, temperature, batch size
    B), so that runs of another backend, temperature or B never overwrite one another. The run's identity says
    `compile: true` for inductor (run names before the option took a backend's name) and the backend's name for any
    other. (Every eager decode runs on one cache kind since issue 77: a run's model.cache, which old runs record, is not
    a setting of its own.)"""
    compile_ = (head.get("model_identity") or {}).get("compile") or ""
    backend = "inductor" if compile_ is True else str(compile_)
    batch = int(head["config"]["decoding"].get("batch_size", 1))
    return summary["drafter"], summary["dataset"], backend, float(summary["temperature"]), batch


def baselines_report(exp_dir: Path, table: BaselinesTable) -> list[Path]:
    """Each drafter's speedup against the eager baseline (the papers' comparison) and against the compiled one
    (model.compile: a baseline with less overhead per step), τ of both runs side by side with the turns whose tokens
    differ between them (compiled kernels may round differently: τ then differs too, and 'speedup kept' mixes the two),
    and the share of the eager speedup that survives the compiled baseline, per batch size B (decoding.batch_size:
    each B's drafters against that B's baselines). conf/experiment/two_baselines.yaml."""
    by_setting = load_runs(exp_dir, compiled_key, batched=True)
    written = []
    for setting, cells in sorted(by_setting.items()):
        present = {k[1] for k in cells}
        datasets = [d for d in table.datasets if d in present] + sorted(present - set(table.datasets))
        drafters = sorted({k[0] for k in cells if k[0] != "none"})
        variants = sorted({(k[3], k[4]) for k in cells if not k[2]})  # (temperature, B) of the eager runs
        # each compile backend against the eager runs in rows of its own: a cell never mixes two backends' kernels
        backends = sorted({k[2] for k in cells if k[2]}) or ["inductor"]
        head = ["method", "dataset", "τ eager", "τ compiled", "turns ≠ (eager vs compiled)", "eager vs eager baseline",
                "compiled vs compiled baseline", "eager vs compiled baseline", "speedup kept"]
        rows = []
        for ds in datasets:
            for (temp, b), backend in itertools.product(variants, backends):
                label = ((ds if {t for t, _ in variants} == {0.0} else f"{ds} (T={temp:g})")
                         + (f", B={b}" if b > 1 else "") + (f", compiled: {backend}" if len(backends) > 1 else ""))
                runs = {d: (cells.get((d, ds, "", temp, b)), cells.get((d, ds, backend, temp, b)))
                        for d in ["none", *drafters]}
                base_e, base_c = runs["none"]
                rows.append(["none (tokens/s)", label, "", "", _differ_runs(exp_dir, base_e, base_c) if temp == 0 else "",
                             cell(base_e, "speed"), cell(base_c, "speed"), "", ""])
                for d in drafters:
                    e, c = runs[d]
                    cross = (value(e, "speed") / value(base_c, "speed")
                             if value(e, "speed") and value(base_c, "speed") else None)
                    spu_c = value(c, "spu")
                    kept = spu_c / value(e, "spu") if spu_c and value(e, "spu") else None
                    rows.append([d, label, cell(e, "tau"), cell(c, "tau"),
                                 _differ_runs(exp_dir, e, c) if temp == 0 else "",
                                 cell(e, "spu"), cell(c, "spu"),
                                 MISSING if cross is None else f"{cross:.2f}x", MISSING if kept is None else f"{kept:.0%}"])
        used = list(cells.values())
        caption = (f"Every drafter against two baselines; {setting.describe()}: the eager one (the papers' "
                   f"comparison, every other table's) and the compiled one (model.compile: the target's forwards "
                   f"through torch.compile ({', '.join(backends)}) over a static cache, CUDA graphs on a GPU; EAGLE's "
                   f"head and sd's draft "
                   f"model compiled the same way, the other drafters' modules eager). 'turns ≠': T=0 turns whose "
                   f"tokens differ between the eager and the compiled run (where any do, τ may differ and 'speedup "
                   f"kept' mixes τ with speed). 'speedup kept': compiled-vs-compiled over eager-vs-eager. 'B=b': "
                   f"b questions decoded together (decoding.batch_size), against both baselines at the same b. "
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
