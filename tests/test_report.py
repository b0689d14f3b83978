"""Experiments as Hydra sweeps (resumable, never mixing configs) and `make figures` from results/ alone."""
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from specbench.core.records import read_jsonl
from specbench.bench.report.cells import MISSING, Setting, Table, below_one, cell, load_failures, load_runs, render, tree_of
from specbench.bench.report.experiments import predicted_speedup
from specbench.bench.report.figures import curve_label
from specbench.bench.report.main import report
from specbench.bench.report.tables import experiment_report

REPO = Path(__file__).resolve().parents[1]


def sweep(tmp_path, tiny_checkpoint, question_file):
    args = [sys.executable, "-m", "specbench.run", "-m", "+experiment=eagle_alpha", "+preset=cpu",
            f"model.path={tiny_checkpoint}", "model.name=tiny", "dataset=jsonl", f"dataset.path={question_file}",
            "drafter=none,pld", "decoding.temperature=0.0", "decoding.max_new_tokens=16", "bench.warmup=0",
            f"out.root={tmp_path / 'results'}"]
    res = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    return sorted((tmp_path / "results" / "eagle_alpha").glob("*/records.jsonl"))


def only(exp_dir):
    """The one setting of an experiment's runs and its runs."""
    settings = load_runs(exp_dir)
    assert len(settings) == 1, settings.keys()
    return next(iter(settings.items()))


def test_killed_sweep_resumes_without_duplicates_and_report_is_deterministic(tmp_path, tiny_checkpoint, question_file):
    runs = sweep(tmp_path, tiny_checkpoint, question_file)
    assert [p.parent.name.split("__")[1] for p in runs] == ["none", "pld"]
    full = {p: read_jsonl(p) for p in runs}
    pld = runs[1]  # "kill" the sweep inside the pld run: the first question written (one append), no summary
    first_q = [r for r in full[pld] if r["question_id"] == full[pld][0]["question_id"]]
    pld.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in first_q))
    (pld.parent / "summary.json").unlink()
    assert sweep(tmp_path, tiny_checkpoint, question_file) == runs  # same runs, none added
    for p in runs:
        keys = [(r["repeat"], r["question_id"], r["turn"]) for r in read_jsonl(p)]
        assert len(keys) == len(set(keys)) == len(full[p])
    results = tmp_path / "results"
    written = report(results)
    table = (results / "eagle_alpha" / "alpha.tiny.md").read_text()
    # the tiny runs use dataset "jsonl", not the paper's sets: every cell of the paper's table is missing, not zero
    assert "no runs yet" in table and "| pld | – |" in table and "0.00" not in table
    assert "The paper's tree: chains" in table.splitlines()[0]  # every caption names the tree
    # ... and the model, its dtype and the budget
    assert "model tiny (float32), 16 new tokens per turn, the first 3 questions per set." in table.splitlines()[0]
    setting, runs_ = only(results / "eagle_alpha")
    md, tex = render(Table("t", "c", ("none", "pld", "eagle"), ("jsonl",), ("tau", "a0")), runs_, setting)
    rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| ")}
    assert "device:" in md and "commit(s):" in md and r"\toprule" in tex
    assert "Trees of these runs: pld: prompt lookup, up to 10 tokens." in md.splitlines()[0]  # from the run's config
    assert "Trees of these runs: pld: prompt lookup" in tex
    assert rows["none"].startswith("| none | 1.00 |") and rows["eagle"] == "| eagle | – | – |"
    assert float(rows["pld"].split(" | ")[1]) > 1.0
    md, _ = render(Table("t", "c", ("none", "pld"), ("jsonl",), ("draft_ms", "verify_ms")), runs_, setting)
    pld_row = next(line for line in md.splitlines() if line.startswith("| pld |")).split(" | ")
    assert float(pld_row[1]) >= 0.0 and float(pld_row[2].rstrip(" |")) > 0.0  # Td, Tv read from the records
    # the paper's Mean column: the mean over the datasets, and missing (not a partial mean) when a dataset is missing
    md, _ = render(Table("t", "c", ("pld",), ("jsonl",), ("tau",), mean=True), runs_, setting)
    cells = next(line for line in md.splitlines() if line.startswith("| pld |")).strip("| ").split(" | ")
    assert "mean τ" in md and cells[1] == cells[2] != "–"
    md, _ = render(Table("t", "c", ("pld",), ("jsonl", "gsm8k"), ("tau",), mean=True), runs_, setting)
    assert next(line for line in md.splitlines() if line.startswith("| pld |")).endswith("| – | – |")
    first = {p: p.read_bytes() for p in written}
    report(results)
    assert {p: p.read_bytes() for p in written} == first
    # the pld runs again with other weights (another config hash) later: the newest run fills the cell
    newer = results / "eagle_alpha" / (pld.parent.name[:-8] + "ffffffff")
    shutil.copytree(pld.parent, newer)
    head = json.loads((newer / "run.json").read_text())
    summary = json.loads((newer / "summary.json").read_text())
    (newer / "summary.json").write_text(json.dumps({**summary, "run": newer.name, "tau_micro": 9.0}))
    (newer / "run.json").write_text(json.dumps({**head, "date": "2000-01-01T00:00:00+00:00"}))
    assert only(results / "eagle_alpha")[1][("pld", "jsonl", 0.0)]["run"] == pld.parent.name  # older: ignored
    (newer / "run.json").write_text(json.dumps({**head, "date": "2999-01-01T00:00:00+00:00"}))
    assert only(results / "eagle_alpha")[1][("pld", "jsonl", 0.0)]["tau_micro"] == 9.0
    # a batched run (decoding.batch_size=2) of the same cell, newer still: a paper table reads batch 1, never it
    batched = results / "eagle_alpha" / (pld.parent.name[:-8] + "bbbbbbbb")
    shutil.copytree(newer, batched)
    bcfg = {**head["config"], "decoding": {**head["config"]["decoding"], "batch_size": 2}}
    (batched / "run.json").write_text(json.dumps({**head, "config": bcfg, "date": "2999-06-01T00:00:00+00:00"}))
    (batched / "summary.json").write_text(json.dumps({**summary, "run": batched.name, "tau_micro": 5.0}))
    assert only(results / "eagle_alpha")[1][("pld", "jsonl", 0.0)]["tau_micro"] == 9.0
    assert load_runs(results / "eagle_alpha", batched=True)  # (the batch table's reading keeps it)
    shutil.rmtree(batched)
    # a run of another model in the same experiment: its own table, never a cell of the first one's
    other = results / "eagle_alpha" / (pld.parent.name.replace("tiny__", "other__"))
    shutil.copytree(newer, other)
    cfg = {**head["config"], "model": {**head["config"]["model"], "name": "other"}}
    (other / "run.json").write_text(json.dumps({**head, "config": cfg, "env": {"gpu": "NVIDIA H100"}}))
    (other / "summary.json").write_text(json.dumps({**summary, "run": other.name, "tau_micro": 7.0}))
    settings = load_runs(results / "eagle_alpha")
    assert sorted(x.model for x in settings) == ["other", "tiny"]
    assert {k: r["tau_micro"] for k, r in settings[Setting.of(head)].items() if k[0] == "pld"} == {
        ("pld", "jsonl", 0.0): 9.0}
    written = report(results)
    assert {p.name for p in written if p.suffix == ".md"} == {"alpha.tiny.md", "alpha.other.md"}
    assert "model other (float32)" in (results / "eagle_alpha" / "alpha.other.md").read_text()


def test_caption_names_each_drafters_tree():
    """The caption gives the paper's tree and, from each run's recorded config, the tree its drafter decoded with:
    grouped by tree in table order; a static tree by name, size and nodes per depth (the dynamic-tree keys an
    experiment merges into it ignored, as StaticTree ignores them); Medusa's own tree; chains."""
    mc_sim = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [0, 0, 0], [0, 0, 1],
              [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2],
              [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]
    dynamic = {"kind": "dynamic", "depth": 6, "topk": 8, "total_tokens": 62, "root_counted": True}
    drafters = {
        "none": {"name": "none"},
        "sd": {"name": "sd", "gamma": 5},
        "medusa": {"name": "medusa", "tree": "auto", "tree_nodes": 19},
        "eagle": {"name": "eagle", "tree": {"name": "mc_sim_7b_63", "kind": "static", "paths": mc_sim, "depth": 6,
                                            "topk": 8, "total_tokens": 62}},
        "eagle2": {"name": "eagle2", "tree": dynamic},
        "moa": {"name": "moa", "tree": dynamic},
        "chain": {"name": "chain", "tree": {"kind": "static", "paths": [[0], [0, 0], [0, 0, 0]]}},
    }
    head = {"date": "2000-01-01", "env": {"cpu": "cpu0"}, "git": {"commit": "abcdef0123"}}
    runs = {(name, "mtbench", 0.0): {"drafter": name, "tau_micro": 2.0, "_head": {**head, "config": {"drafter": d}}}
            for name, d in drafters.items()}
    table = Table("t", "c", tuple(drafters), ("mtbench",), ("tau",), paper_tree="dynamic (depth 6, top-k 8, 62 tokens)")
    md, tex = render(table, runs, Setting("m", "bfloat16", 64, 3))
    assert md.splitlines()[0] == (
        "**c; model m (bfloat16), 64 new tokens per turn, the first 3 questions per set. The paper's tree: dynamic (depth 6, top-k 8, 62 tokens). Trees of these runs: sd: chain of 5; "
        "medusa: Medusa sparse (19 nodes from the heads' accuracies); eagle: static mc_sim_7b_63 (25 nodes, depth 5: "
        "4/8/8/3/2 per depth); eagle2, moa: dynamic (depth 6, top-k 8, 62 tokens); chain: chain of 3. device: cpu0; "
        "commit(s): abcdef0.**")
    assert r"static mc\_sim\_7b\_63" in tex
    # a tree that counted its drafted nodes (MoA's code; every run recorded before root_counted) says so
    assert tree_of({"tree": {**dynamic, "root_counted": False}}) == "dynamic (depth 6, top-k 8, 62 drafted + the root)"
    assert tree_of({"tree": {k: v for k, v in dynamic.items() if k != "root_counted"}}).endswith("62 drafted + the root)")
    assert tree_of({"name": "medusa", "tree": [[0], [1], [0, 0]]}) == "static (3 nodes, depth 2: 2/1 per depth)"
    # every paper table names the paper's tree
    assert all(t.paper_tree for exp in ("beagle_table1", "coral_table2", "moa_table2", "eagle_alpha")
               for t in experiment_report(exp)[0] if t.name != "router")


def test_the_lossless_column_counts_the_turns_equal_to_the_baseline():
    """`lossless` (the H100 table's column): matches/compared from a run's summary; the baseline (nothing compared)
    and a run without the check read as missing, not 0/0."""
    assert cell({"drafter": "pld", "lossless": {"compared": 6, "matches": 0, "rate": 0.0}}, "lossless") == "0/6"
    assert cell({"drafter": "none", "lossless": {"compared": 0, "matches": 0, "rate": None}}, "lossless") == MISSING
    assert cell({"drafter": "hass"}, "lossless") == MISSING
    assert experiment_report("h100")[0][0].metrics[-1] == "lossless"


def test_a_table_from_two_devices_says_so():
    head = {"date": "2000-01-01", "git": {"commit": "abcdef0123"}, "config": {"drafter": {"name": "pld"}}}
    runs = {("pld", d, 0.0): {"drafter": "pld", "tau_micro": 2.0, "_head": {**head, "env": env}}
            for d, env in (("mtbench", {"cpu": "cpu0"}), ("gsm8k", {"gpu": "NVIDIA H100"}))}
    md, _ = render(Table("t", "c", ("pld",), ("mtbench", "gsm8k"), ("tau",)), runs, Setting("m", "float32", 64, None))
    assert "full question sets" in md and "device: NVIDIA H100, cpu0 (the runs come from different devices" in md


def test_a_failed_job_is_named_in_its_table(make_cfg, tmp_path):
    """A job that failed leaves a record under results/<experiment>/failed/: the table of its setting is still written
    (even with no finished run at all), its cells say "failed" instead of "–", and the caption names the error."""
    from specbench.bench import failures

    cfg = make_cfg("drafter=eagle2", "out.experiment=eagle_alpha")
    path = failures.record(cfg, RuntimeError("mat1 and mat2 must have the same dtype\nsecond line"), ["drafter=eagle2"])
    assert path.parent == tmp_path / "results" / "eagle_alpha" / "failed"
    written = report(tmp_path / "results")
    assert tmp_path / "results" / "eagle_alpha" / "alpha.tiny.md" in written  # a table although no job finished
    (setting, cells), = load_failures(tmp_path / "results" / "eagle_alpha").items()
    md, tex = render(Table("t", "c", ("none", "eagle2"), ("jsonl",), ("tau", "spu")), {}, setting, cells)
    rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| ")}
    assert rows["eagle2"] == "| eagle2 | failed | failed |" and rows["none"] == "| none | – | – |"
    assert "Failed jobs: eagle2 on jsonl: RuntimeError: mat1 and mat2 must have the same dtype." in md.splitlines()[0]
    assert "second line" not in md and "failed" in tex
    failures.clear(cfg)
    assert not path.exists()


def test_question_speeds_are_spec_benchs(tmp_path):
    """Spec-Bench's evaluation/speed.py: a question's speed is its turns' new tokens over their summed wall time."""
    from specbench.bench.report.experiments import question_speeds

    rows = [{"repeat": 0, "question_id": "a", "turn": 0, "new_tokens": 10, "wall_s": 1.0, "tokens_per_step": [2, 3]},
            {"repeat": 0, "question_id": "a", "turn": 1, "new_tokens": 30, "wall_s": 3.0, "tokens_per_step": [1]},
            {"repeat": 0, "question_id": "b", "turn": 0, "new_tokens": 4, "wall_s": 2.0, "tokens_per_step": [4]}]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert question_speeds(tmp_path) == ([10.0, 2.0], [2, 3, 1, 4])


def test_the_specbench_board_in_its_columns_with_the_published_board(tmp_path, tiny_checkpoint):
    """conf/experiment/specbench_board.yaml narrowed to pld on two of the six tasks, one question each: those two
    cells are filled, the overall (which needs all six) is not, and the published A100 board follows, marked."""
    args = [sys.executable, "-m", "specbench.run", "-m", "+experiment=specbench_board", "+preset=cpu",
            f"model.path={tiny_checkpoint}", "model.name=tiny", "drafter=pld", "dataset=translation,qa",
            "dataset.limit=1", "decoding.max_new_tokens=8", "bench.warmup=0", f"out.root={tmp_path / 'results'}"]
    res = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    report(tmp_path / "results")
    md = (tmp_path / "results" / "specbench_board" / "board.tiny.md").read_text()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in md.splitlines() if line.startswith("| ")}
    assert rows["method"][1:3] == ["Multi-turn Conversation", "Translation"]
    pld = rows["pld"]
    assert pld[1] == "–" and pld[2].endswith("x") and pld[4].endswith("x") and pld[7:] == ["–", "– |"]
    assert rows["eagle3"][1:] == ["–"] * 7 + ["– |"]
    assert "another target and device: Vicuna-7B-v1.3" in md
    assert rows["PLD (pld)"][1:] == ["1.60x", "1.06x", "2.66x", "1.19x", "1.62x", "1.86x", "1.75", "1.66x |"]


def test_below_one_reads_the_speedup_as_printed():
    """The "< 1.0x from B" column agrees with its cells: 0.996 prints as 1.00x and is not below 1.0x (CI once saw a
    "1.00x" row marked below from B=1); 0.994 prints as 0.99x and is."""
    assert below_one({1: 0.996, 2: 1.2}) == "> 2"
    assert below_one({1: 1.1, 2: 0.994}) == "2"
    assert below_one({1: None, 2: None}) == MISSING


def test_the_figures_legend_names_where_each_curve_stops_paying():
    """Issue 29 asks the figure, not only the table, to name the B at which each drafter drops below 1.0x."""
    assert curve_label("eagle2 (auto)", {1: 0.89, 2: 1.15, 4: 0.93, 8: 0.64}) == ("eagle2 (auto): < 1.0x from B = 4", 4)
    assert curve_label("pld (auto)", {1: 1.07, 2: 1.22}) == ("pld (auto): >= 1.0x at B = 2", None)
    assert curve_label("moa (paper)", {1: 0.29, 2: 0.25}) == ("moa (paper): < 1.0x from B = 1", 1)


def test_below_one_is_where_it_stops_paying():
    """The column names the B from which every larger measured B is under 1.0x: a dip that recovers is not a drop
    (B = 2's baseline hump on this CPU lifts every auto tree above 1.0x after 0.8-0.9x at B = 1)."""
    assert below_one({1: 0.83, 2: 1.02, 4: 0.9, 8: 0.7}) == "4"
    assert below_one({1: 0.83, 2: 1.02}) == "> 2"
    assert below_one({1: 0.5, 2: 0.4, 4: 0.3}) == "1"
    assert below_one({1: 1.2, 2: 0.9, 4: 1.1, 8: 0.8}) == "8"
    assert below_one({1: 0.9, 2: None, 4: 0.8}) == "1"  # a B not run is skipped, not read as paying


def test_the_predicted_column_reads_each_bs_auto_run():
    """The 'predicted' column: the cost model's speedups from each B's tree=auto run record, its chosen tree's for
    the auto row and its paper tree's (`base_predicted`) for the paper row; a B without an auto run is skipped."""
    def auto_run(chosen, paper):
        return {"_head": {"tree_auto": {"predicted": {"speedup": chosen}, "base_predicted": {"speedup": paper}}}}

    runs = {1: auto_run(0.97, 0.35), 2: auto_run(1.21, 0.31), 4: auto_run(0.75, 0.17), 8: None}
    assert predicted_speedup(runs[2], "auto") == 1.21 and predicted_speedup(runs[2], "paper") == 0.31
    assert predicted_speedup(None, "auto") is None
    assert predicted_speedup({"_head": {}}, "paper") is None  # a paper-tree run records no prediction
    assert below_one({b: predicted_speedup(r, "auto") for b, r in runs.items()}) == "4"
    assert below_one({b: predicted_speedup(r, "paper") for b, r in runs.items()}) == "1"


def test_the_batch_sweep_table_and_figure(tmp_path, tiny_checkpoint):
    """conf/experiment/batch_sweep.yaml narrowed (one override per axis, as a GPU user widens it) to pld at its paper
    tree, B = 1 and 2, two MT-Bench questions: a speedup (τ) cell per B, the B where it drops below 1.0x, the
    baseline's rows per B (its batch-1 differences counted), and the figure."""
    args = [sys.executable, "-m", "specbench.run", "-m", "+experiment=batch_sweep", "+preset=cpu",
            f"model.path={tiny_checkpoint}", "model.name=tiny", "drafter=none,pld", "tree=paper",
            "decoding.batch_size=1,2", "dataset.limit=2", "decoding.max_new_tokens=8", "bench.warmup=0",
            f"out.root={tmp_path / 'results'}"]
    res = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    exp = tmp_path / "results" / "batch_sweep"
    assert len(list(exp.glob("*__none__*"))) == 2  # one baseline per batch size
    written = report(tmp_path / "results")
    md = (exp / "batch.tiny.md").read_text()
    assert exp / "batch.tiny.md" in written and (exp / "batch.tiny.png").is_file()
    # the experiment pairs each drafted run with the baseline decoded beside its turns (bench.paired), and says so
    assert "(bench.paired) in 2 of 2 drafted runs" in md
    rows = {tuple(line.split(" | ")[:3]): line.split(" | ") for line in md.splitlines() if line.startswith("| ")}
    assert rows[("| method", "dataset", "tree")][3:] == ["B=1", "B=2", "< 1.0x from B on", "predicted |"]
    pld = rows[("| pld", "mtbench", "paper")]
    # "speedup (τ)", and " ≠k/n" where k turns differ from the baseline at that B (near-ties of batched rounding)
    assert all(re.fullmatch(r"\d+\.\d\dx \(\d+\.\d\d\)( ≠\d+/\d+)?", c) for c in pld[3:5]), pld
    spu = [float(c.split("x")[0]) for c in pld[3:5]]
    assert pld[5] == ("> 2" if spu[1] >= 1 else "1" if spu[0] < 1 else "2")
    assert pld[6] == f"{MISSING} |"  # no tree=auto run at any B: no prediction to read
    base = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in md.splitlines()
            if line.startswith("| mtbench")}
    assert base["mtbench: turns ≠ batch 1"] == ["0 / 4", "0 / 4 |"]
    # the experiment decodes batch 1 through the batch's path (the one path since issue 77), and the caption reads it
    # from the runs
    assert "every B, batch 1 included, decodes ragged rows" in md
    # each drafter's throughput / peak memory per B (memory '–' where the device reports none)
    use = next(line.split(" | ") for line in md.splitlines() if line.startswith("| pld (paper) | mtbench"))
    assert len(use) == 4 and all(re.fullmatch(r"\d+\.\d / (\d+\.\d\d|–)( \|)?", c) for c in use[2:]), use
    # how long each batch waited for its slowest row: B = 1 has no batch; at B = 2 the run's forwards (each batch as
    # long as its longest row) over its rows' mean steps, from the records
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("**How long a batch waits"))
    end = next(i for i, line in enumerate(lines) if line.startswith("**Where a row-step's time goes"))
    waits = {tuple(w[:2]): w[2:] for w in (line.split(" | ") for line in lines[start:end] if line.startswith("| "))}
    recs = [r for run in exp.glob("*__pld__*") for r in read_jsonl(run / "records.jsonl") if r.get("batch")]
    steps = {b: [r["steps"] for r in recs if r["batch"]["id"] == b] for b in {r["batch"]["id"] for r in recs}}
    assert all(r["batch"]["steps"] == max(steps[r["batch"]["id"]]) for r in recs)
    forwards = sum(map(max, steps.values()))
    # in parentheses: E[the larger of 2 turns drawn from the run's] over their mean, by enumerating every draw
    every = [s for ss in steps.values() for s in ss]
    spread = statistics.mean(max(x, y) for x in every for y in every) / statistics.mean(every)
    assert waits[("| pld (paper)", "mtbench")] == ["–", f"{forwards / sum(map(statistics.mean, steps.values())):.2f} "
                                                        f"({spread:.2f}) |"]
    assert waits[("| none", "mtbench")][0] == "–" and float(waits[("| none", "mtbench")][1].split()[0]) >= 1.0
    # draft / verify ms per row-step: the batch's shared time over its rows' steps (summary.json), per B
    times = {tuple(w[:2]): w[2:] for w in (line.split(" | ") for line in lines[end:] if line.startswith("| "))}
    for run in exp.glob("*__pld__*"):
        s = json.loads((run / "summary.json").read_text())
        b = json.loads((run / "run.json").read_text())["config"]["decoding"]["batch_size"]
        assert times[("| pld (paper)", "mtbench")][b - 1].rstrip(" |") == \
            f"{s['draft_ms_per_step']:.1f} / {s['verify_ms_per_step']:.1f}"
    assert all(c.startswith("– / ") for c in times[("| none", "mtbench")])


def test_the_two_baselines_table(tmp_path, tiny_checkpoint):
    """conf/experiment/two_baselines.yaml narrowed to pld, two questions, at B = 1 and 2: eager and compiled runs each
    against their own baseline at their B, τ side by side (the same tokens), the cross ratio and the share of the
    speedup kept, a row per B."""
    args = [sys.executable, "-m", "specbench.run", "-m", "+experiment=two_baselines", "+preset=cpu",
            f"model.path={tiny_checkpoint}", "model.name=tiny", "drafter=none,pld", "dataset.limit=2",
            # aot_eager: the compiled path's capture, guards and static caches without inductor's C++ builds (minutes
            # of a cold CI host; test_compile keeps inductor itself in the suite)
            "model.compile=false,aot_eager",
            "decoding.batch_size=1,2", "decoding.max_new_tokens=8", "bench.warmup=1", f"out.root={tmp_path / 'results'}"]
    res = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    exp = tmp_path / "results" / "two_baselines"
    assert len(list(exp.glob("*__none__*"))) == 4  # an eager and a compiled baseline per B
    report(tmp_path / "results")
    md = (exp / "baselines.tiny.md").read_text()
    rows = {tuple(line.split(" | ")[:2]): line.split(" | ") for line in md.splitlines() if line.startswith("| ")}
    for label in ("mtbench", "mtbench, B=2"):
        pld = rows[("| pld", label)]
        assert pld[2] == pld[3] and pld[4] == "0 / 4"  # the same tokens eager and compiled, every turn
        assert all(c.endswith("x") for c in pld[5:8]) and pld[8].endswith("% |")
        assert rows[("| none (tokens/s)", label)][5] != "–" and rows[("| none (tokens/s)", label)][6] != "–"
    pld_b2_compiled = rows[("| pld", "mtbench, B=2")][6]
    for run in exp.glob("*__pld__*"):
        recs = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
        assert all(r["matches_baseline"] for r in recs)  # lossless against its own baseline, compiled or not
    for run in exp.glob("*/records.jsonl"):
        # model.compile's warm pass built every graph before the timed turns (none compiled inside one)
        recs = [json.loads(line) for line in run.read_text().splitlines()]
        assert all(r.get("graphs_compiled", 0) == 0 for r in recs)
        compiled = bool(json.loads((run.parent / "run.json").read_text())["model_identity"].get("compile"))
        assert all(("graphs_compiled" in r) == compiled for r in recs)
    # runs of a second backend in the same directory (here aot_eager's, relabelled as inductor's `compile: true`)
    # get rows of their own, each labelled; neither backend's cells read the other's runs
    for run in [r.parent for r in exp.glob("*/run.json")]:
        head = json.loads((run / "run.json").read_text())
        if head["model_identity"].get("compile") == "aot_eager":
            twin = exp / (run.name + "_inductor")
            shutil.copytree(run, twin)
            head["model_identity"]["compile"] = True
            (twin / "run.json").write_text(json.dumps(head))
            summary = json.loads((twin / "summary.json").read_text())
            if summary["drafter"] != "none":  # (the baseline has no speedup)
                summary["speedup"] = {**summary["speedup"], "mean": 9.99}
            (twin / "summary.json").write_text(json.dumps(summary))
    report(tmp_path / "results")
    md = (exp / "baselines.tiny.md").read_text()
    rows = {tuple(line.split(" | ")[:2]): line.split(" | ") for line in md.splitlines() if line.startswith("| ")}
    assert "torch.compile (aot_eager, inductor)" in md
    assert rows[("| pld", "mtbench, compiled: inductor")][6] == "9.99x"
    assert rows[("| pld", "mtbench, B=2, compiled: aot_eager")][6] == pld_b2_compiled


def test_the_every_drafter_experiments_sweep_every_drafter():
    """tree_auto, specbench_board, batch_sweep and two_baselines promise every drafter: their sweeps (and the board's
    table) list each conf/drafter YAML, so a drafter added later cannot be left out silently (eagle3 was, from two)."""
    import yaml

    drafters = {p.stem for p in (REPO / "conf" / "drafter").glob("*.yaml")} - {"none"}
    for name in ("tree_auto", "specbench_board", "batch_sweep", "two_baselines"):
        exp = yaml.safe_load((REPO / "conf" / "experiment" / f"{name}.yaml").read_text())
        assert set(exp["hydra"]["sweeper"]["params"]["drafter"].split(",")) - {"none"} == drafters, name
        for table in exp["report"]["tables"]:
            assert set(table.get("drafters", drafters)) == drafters, name


def test_make_figures_writes_the_tables_the_docs_show(tmp_path):
    """README.md and docs/*.md show tables between `<!-- table: <file> -->` markers; `make figures` rewrites them from
    the files it wrote (whole, `columns: *` its table alone, or some columns), leaves a block whose file is missing,
    and the committed docs are in sync with the committed results (no number in them typed by hand)."""
    from specbench.bench.report.docs import doc_files, sync_docs
    from specbench.core.envinfo import REPO

    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "t.md").write_text("**caption**\n\n| method | a | b |\n|---|---|---|\n| x | 1 | 2 |\n| y | 3 | 4 |\n")
    doc = tmp_path / "README.md"
    doc.write_text("intro\n<!-- table: results/t.md -->\nold\n<!-- end table -->\nmid\n"
                   "<!-- table: results/t.md columns: method, b -->\n<!-- end table -->\n"
                   "<!-- table: results/t.md columns: * -->\n| stale |\n<!-- end table -->\n"
                   "<!-- table: results/gone.md -->\nkept\n<!-- end table -->\n")
    changed, missing = sync_docs(tmp_path, doc_files(tmp_path))
    assert changed == [doc] and missing == ["README.md: results/gone.md"]
    assert doc.read_text() == (
        "intro\n<!-- table: results/t.md -->\n**caption**\n\n| method | a | b |\n|---|---|---|\n| x | 1 | 2 |\n"
        "| y | 3 | 4 |\n<!-- end table -->\nmid\n<!-- table: results/t.md columns: method, b -->\n| method | b |\n"
        "| --- | --- |\n| x | 2 |\n| y | 4 |\n<!-- end table -->\n<!-- table: results/t.md columns: * -->\n"
        "| method | a | b |\n|---|---|---|\n| x | 1 | 2 |\n| y | 3 | 4 |\n<!-- end table -->\n"
        "<!-- table: results/gone.md -->\nkept\n<!-- end table -->\n")
    assert sync_docs(tmp_path, doc_files(tmp_path))[0] == []  # a second run changes nothing
    # the repository's own docs: rendering every block from results/ changes nothing
    for path in doc_files(REPO):
        copy = tmp_path / "repo" / path.relative_to(REPO)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    (tmp_path / "repo" / "results").symlink_to(REPO / "results")
    changed, missing = sync_docs(tmp_path / "repo", doc_files(tmp_path / "repo"))
    assert changed == [] and missing == []


def test_an_option_ablation_puts_each_value_of_the_option_in_its_own_row(tmp_path):
    """moa_tli_context: the same drafter at two values of drafter.module.tli_context fills two rows (option_key), not
    one cell where the newer run would hide the other."""
    exp = tmp_path / "results" / "moa_tli_context"
    for ctx, tau, td in (("target", 1.5, 20.0), ("none", 1.25, 12.0)):
        run = exp / f"smollm2-135m__moa_tli1__mtbench__{ctx}"
        run.mkdir(parents=True)
        cfg = {"model": {"name": "m", "dtype": "float32"}, "decoding": {"max_new_tokens": 64, "batch_size": 1},
               "dataset": {"name": "mtbench", "limit": 3},
               "drafter": {"name": "moa_tli1", "module": {"tli": 1, "tli_context": ctx},
                           "tree": {"kind": "dynamic", "depth": 6, "topk": 8, "total_tokens": 62}}}
        (run / "run.json").write_text(json.dumps({"config": cfg, "date": "2000-01-01", "env": {"cpu": "cpu0"},
                                                  "git": {"commit": "abcdef0123"}}))
        (run / "summary.json").write_text(json.dumps({"drafter": "moa_tli1", "dataset": "mtbench", "temperature": 0.0,
                                                      "tau_micro": tau, "draft_ms_per_step": td,
                                                      "speedup": {"mean": tau / 2}}))
    table, = experiment_report("moa_tli_context")[0]
    assert table.option == "drafter.module.tli_context"
    report(tmp_path / "results")
    md = next(exp.glob("tli_context.*.md")).read_text()
    rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| ")}
    assert rows["moa_tli1 tli_context=target"].startswith("| moa_tli1 tli_context=target | 0.75x | 1.50 | 20.0 |")
    assert rows["moa_tli1 tli_context=none"].startswith("| moa_tli1 tli_context=none | 0.62x | 1.25 | 12.0 |")
    assert "moa_tli1 tli_context=target, moa_tli1 tli_context=none: dynamic (depth 6, top-k 8" in md.splitlines()[0]


def test_jobs_that_differ_only_in_a_drafter_option_fail_into_their_own_rows(make_cfg, tmp_path):
    """Two failed jobs of moa_tli_context (tli_context target / none) keep two failure records, each row of the option
    table says "failed" with its own error, and the one that later finishes clears only its own record."""
    from specbench.bench import failures
    from specbench.bench.report.cells import option_key

    cfgs = {ctx: make_cfg("drafter=moa_tli1", "out.experiment=moa_tli_context", f"drafter.module.tli_context={ctx}")
            for ctx in ("target", "none")}
    paths = {ctx: failures.record(cfg, RuntimeError(f"broken {ctx}"), []) for ctx, cfg in cfgs.items()}
    assert paths["target"] != paths["none"]
    exp = tmp_path / "results" / "moa_tli_context"
    (setting, cells), = load_failures(exp, option_key("drafter.module.tli_context")).items()
    assert set(cells) == {("moa_tli1 tli_context=target", "jsonl", 0.0), ("moa_tli1 tli_context=none", "jsonl", 0.0)}
    report(tmp_path / "results")
    md = next(exp.glob("tli_context.*.md")).read_text()
    assert "moa_tli1 tli_context=none on mtbench" not in md  # the table's sets are not the tiny runs' jsonl
    table = Table("t", "c", ("moa_tli1 tli_context=target", "moa_tli1 tli_context=none"), ("jsonl",), ("tau",),
                  option="drafter.module.tli_context")
    md, _ = render(table, {}, setting, cells)
    assert "| moa_tli1 tli_context=none | failed |" in md and "RuntimeError: broken none" in md.splitlines()[0]
    failures.clear(cfgs["target"])
    assert not paths["target"].exists() and paths["none"].exists()


def test_training_curves_draw_the_drafters_and_list_variants_with_their_command(tmp_path):
    """results/training: a log under a drafter's name is the committed weights' run (figure and first table); any
    other name is a variant, listed apart with the command and commit its config.json records."""
    from specbench.bench.report.logs import training_curves

    val = {"kind": "val", "epoch": 0, "sim_tau": 1.5, "alpha": [0.4, 0.3, 0.2, 0.1, 0.0]}
    for name in ("eagle", "eagle_wd001"):
        (tmp_path / "m" / name).mkdir(parents=True)
        (tmp_path / "m" / name / "log.jsonl").write_text(json.dumps({"kind": "train", "step": 1}) + "\n" + json.dumps(val) + "\n")
    (tmp_path / "m" / "eagle_wd001" / "config.json").write_text(json.dumps(
        {"command": "specbench.train drafter=eagle", "git": {"commit": "abcdef0123", "dirty": False}}))
    training_curves(tmp_path, tmp_path)
    first, variants = (tmp_path / "training.md").read_text().split("**Variants")
    assert "| m | eagle | 1 | 1.500 |" in first and "eagle_wd001" not in first
    assert "| m | eagle_wd001 | 1 | 1.500 |" in variants
    assert "- `eagle_wd001`: `python -m specbench.train drafter=eagle` at abcdef0" in variants
    assert (tmp_path / "training_curves.png").stat().st_size > 0


def test_the_scaling_table_reads_each_point_its_seeds_and_the_committed_1x_run(tmp_path):
    """results/train_scaling/<model>/<drafter>/n<k>[_seed<s>]/: the last validation of each finished point (a point
    without its config.json is still training: left out), two seeds as mean ± half their range, the budget's 1x point
    from results/training/; make figures writes the table and the figure."""
    def point(path: Path, taus: list[float], final: bool = True) -> None:
        path.mkdir(parents=True)
        (path / "log.jsonl").write_text("".join(json.dumps({"kind": "val", "epoch": i, "sim_tau": t,
                                                            "alpha": [t - 1, 0.1]}) + "\n" for i, t in enumerate(taus)))
        if final:
            (path / "config.json").write_text(json.dumps({"train": {"conversations": 1600}}))

    root = tmp_path / "results"
    point(root / "train_scaling" / "m" / "eagle" / "n200", [1.10, 1.20])
    point(root / "train_scaling" / "m" / "eagle" / "n200_seed1", [1.15, 1.30])
    point(root / "train_scaling" / "m" / "eagle" / "n400", [1.35], final=False)  # still training
    point(root / "train_scaling" / "m" / "moa" / "n200", [1.05, 1.08])
    point(root / "train_scaling" / "m" / "eagle" / "n3200", [1.45, 1.60])  # 2x: above the budget
    point(root / "training" / "m" / "eagle", [1.40, 1.50])
    report(root)
    table = (root / "train_scaling" / "m" / "scaling.md").read_text()
    assert "| method | 200 conv. sim τ (0-α) | 1600 conv. sim τ (0-α) | 3200 conv. sim τ (0-α) |" in table
    assert "| eagle | 1.250 ± 0.050 (0.25) | 1.500 (0.50) | 1.600 (0.60) |" in table
    assert "| moa | 1.080 (0.08) | – | – |" in table  # no committed moa run under results/training/m
    assert "the next ones after its held-out set" in table and "the 1600 point is the committed weights' run" in table
    assert (root / "train_scaling" / "m" / "scaling.png").is_file()


def test_the_scaling_table_adds_each_points_measured_tau_read_back_from_its_checkpoint(tmp_path):
    """results/train_scaling_tau/<run>/: a decoded point's τ under the point its drafter.checkpoint names (the 1x
    weights at the budget's count), two seeds as mean ± half their range, the baseline's run (no checkpoint) left out,
    a run of another model left out."""
    def decoded(name: str, checkpoint: str | None, dataset: str, tau: float, model: str = "m", matches: int = 2) -> None:
        run = root / "train_scaling_tau" / name
        run.mkdir(parents=True)
        (run / "run.json").write_text(json.dumps({"config": {"model": {"name": model}, "dataset": {"name": dataset},
                                                             "drafter": {"checkpoint": checkpoint}}}))
        (run / "summary.json").write_text(json.dumps({"tau_micro": tau, "lossless": {"compared": 2, "matches": matches,
                                                                                    "rate": matches / 2}}))

    root = tmp_path / "results"
    point = root / "train_scaling" / "m" / "moa" / "n200"
    point.mkdir(parents=True)
    (point / "log.jsonl").write_text(json.dumps({"kind": "val", "sim_tau": 1.1, "alpha": [0.1]}) + "\n")
    (point / "config.json").write_text(json.dumps({"train": {"conversations": 1600}}))
    decoded("a", "weights/m/scaling/n200/moa", "mtbench", 1.50)
    decoded("b", "weights/m/scaling/n200_seed1/moa", "mtbench", 1.70)
    decoded("c", "weights/m/moa", "mtbench", 2.00)
    decoded("d", None, "mtbench", 1.00)  # the baseline
    decoded("e", "weights/other/scaling/n200/moa", "mtbench", 9.00, model="other")
    decoded("f", "weights/m/moa", "gsm8k", 1.90, matches=1)  # a turn that differs from the baseline's: flagged
    report(root)
    table = (root / "train_scaling" / "m" / "scaling.md").read_text()
    assert "| method | dataset | 200 conv. | 1600 conv. |" in table
    assert "| moa | MT-Bench | 1.60 ± 0.10 | 2.00 |" in table
    assert "| moa | GSM8K | – | 1.90 (not lossless) |" in table
    assert "9.00" not in table


def test_every_drafter_has_its_own_colour_and_marker():
    """Issue 81: one fixed (colour, marker) per conf/drafter name, the same in every figure, no two drafters alike (the
    batch figure's 10-colour cycle drew sd_tree and eagle3 alike); within a family (one batch panel) the colours differ
    too; a name outside conf/drafter gets a pair from its name, the same on every call."""
    from specbench.bench.report import style

    names = sorted(p.stem for p in (REPO / "conf" / "drafter").glob("*.yaml"))
    assert {"none", "sd", "sd_tree", "eagle3", "moa_tli1"} <= set(names)
    pairs = {n: style.drafter_style(n) for n in names}
    assert len(set(pairs.values())) == len(names), pairs
    assert len({c for c, _ in pairs.values()}) == len(names)  # the colours alone differ as well
    for family, members in style.FAMILIES.items():
        assert set(members) <= set(names), family
        assert len({style.colour(n) for n in members}) == len(members), family
    assert {n for n in names if style.family(n) == "other"} == {"none"}  # every drafter has a batch panel
    other = style.drafter_style("eagle_wd001")
    assert other == style.drafter_style("eagle_wd001") and other[0].startswith("#") and other[1]
    assert style.dataset_name("mtbench") == "MT-Bench" and style.dataset_name("jsonl") == "jsonl"


def test_save_writes_a_png_and_a_vector_pdf_without_timestamps(tmp_path):
    """Every figure as PNG and, beside it, a PDF (a paper takes vectors), both the same bytes on a re-run: `save` keeps
    its name in figures (logs and scaling draw through it)."""
    import matplotlib.pyplot as plt
    from specbench.bench.report.figures import save

    def draw(path):
        fig, ax = plt.subplots()
        ax.plot([1, 2, 3], [1, 4, 9], label="x")
        ax.legend()
        save(fig, path)

    draw(tmp_path / "a.png")
    png, pdf = (tmp_path / "a.png").read_bytes(), (tmp_path / "a.pdf").read_bytes()
    assert png.startswith(b"\x89PNG") and pdf.startswith(b"%PDF")
    assert b"CreationDate" not in pdf and b"Matplotlib" not in pdf  # no time, no version stamp
    draw(tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes() == png and (tmp_path / "a.pdf").read_bytes() == pdf


def test_the_batch_figure_is_one_panel_per_drafter_family(monkeypatch, tmp_path):
    """Issue 81: the batch figure as small multiples, one axes per family of the drafters run (style.FAMILIES), shared
    axes, each drafter in its own colour, the paper tree solid and tree=auto dashed, the legend naming the B from which
    each stays below 1.0x (paper | auto) as the table's column does; the B axis ticks are the batch sizes."""
    from specbench.bench.report import figures, style

    shown = []
    monkeypatch.setattr(figures, "save", lambda fig, path: shown.append((fig, path)))
    spu = {"sd": [0.6, 0.5, 0.4], "pld": [1.3, 1.1, 0.9], "eagle": [0.5, 0.4, 0.3], "eagle2": [1.1, 1.2, 1.05],
           "moa": [0.3, 0.2, 0.1]}
    cells = {(d, "mtbench", v, b, 0.0): {"drafter": d, "speedup": {"mean": x * (1.3 if v == "auto" else 1.0)}}
             for d, xs in spu.items() for v in ("paper", "auto") for b, x in zip((1, 2, 4), xs)}
    cells[("none", "mtbench", "none", 1, 0.0)] = {"drafter": "none"}
    figures.figure_batch(cells, [1, 2, 4], "mtbench", tmp_path / "batch_sweep" / "batch.tiny.png")
    (fig, path), = shown
    assert path.name == "batch.tiny.png"
    assert [ax.get_legend().get_title().get_text() for ax in fig.axes] == [
        "independent draft / lookup", "EAGLE head", "MoA"]
    legends = [[t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes]
    assert legends == [["sd (1 | 1)", "pld (4 | > 4)"], ["eagle (1 | 1)", "eagle2 (> 4 | > 4)"], ["moa (1 | 1)"]]
    first = fig.axes[0]
    assert all(ax.get_shared_x_axes().joined(first, ax) and ax.get_shared_y_axes().joined(first, ax)
               for ax in fig.axes)
    curves = [line for line in fig.axes[1].get_lines() if len(line.get_xdata()) == 3]
    assert {(line.get_color(), line.get_linestyle()) for line in curves} == {
        (style.colour(d), ls) for d in ("eagle", "eagle2") for ls in ("-", "--")}
    assert list(first.get_xticks()) == [1, 2, 4]
    assert fig._suptitle.get_text().startswith("batch_sweep: ")  # the title names the experiment
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_the_training_curves_have_whole_epochs_and_the_legend_beside_the_panels(monkeypatch, tmp_path):
    """Issue 81: epoch and draft-position ticks are integers (three epochs once read 1.0, 1.25, ...); the legend sits
    beside the panels, not on a panel's lines; each drafter in its style colour; the title names the results."""
    from specbench.bench.report import logs, style

    shown = []
    monkeypatch.setattr(logs, "save", lambda fig, path: shown.append(fig))
    for name, taus in (("eagle", [1.2, 1.4, 1.5]), ("hass", [1.1, 1.3, 1.6])):
        (tmp_path / "m" / name).mkdir(parents=True)
        (tmp_path / "m" / name / "log.jsonl").write_text("".join(
            json.dumps({"kind": "val", "epoch": i, "sim_tau": t, "alpha": [0.4, 0.3, 0.2, 0.1, 0.0]}) + "\n"
            for i, t in enumerate(taus)))
    logs.training_curves(tmp_path, tmp_path / "training")
    fig, = shown
    fig.canvas.draw()
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks
        assert ax.get_legend() is None
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["eagle", "hass"]
    assert [line.get_color() for line in fig.axes[0].get_lines()] == [style.colour("eagle"), style.colour("hass")]
    assert fig._suptitle.get_text().startswith("training: ")
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_the_trend_line_its_error_and_where_the_gap_would_flip():
    """Issue 79's reading: the gap per doubling is a least-squares slope in log2 n with its standard error (none from
    two points), and the flip is where that line reaches 0 past the last n, or never where it moves away from 0."""
    from specbench.bench.report.scaling import extrapolation, fit, flip

    line = fit([200, 400, 800], [-0.10, -0.20, -0.30])  # exactly -0.1 per doubling
    assert math.isclose(line.slope, -0.10) and math.isclose(line.se, 0.0, abs_tol=1e-12)
    assert flip(line, 800) is None and extrapolation(line, 800) == "no flip: the gap moves away from 0 (nor at ±1 s.e.)"
    closing = fit([200, 1600], [0.09, 0.03])  # -0.02 per doubling: 0 at 1600 · 2^1.5
    assert closing.se is None and math.isclose(flip(closing, 1600), 1600 * 2 ** 1.5)
    assert extrapolation(closing, 1600) == "flips near n ≈ 4,525 (two points: no error estimate)"
    noisy = fit([200, 400, 800, 1600], [-0.30, -0.18, -0.22, -0.05])
    assert noisy.se is not None and noisy.se > 0 and noisy.slope > 0
    said = extrapolation(noisy, 1600)
    assert said.startswith("flips near n ≈ ") and "at ±1 s.e.: n ≈ " in said


def test_each_gap_has_a_turn_jackknife_error_and_the_slope_takes_the_larger_error():
    """The trend table's errors: a gap's standard error by leaving out one decoded turn at a time (the same turns for
    both methods: paired), none where a run kept no turns; the slope's error the larger of the residuals' and the one
    the points' errors propagate (two points on a line have no residual but still an error)."""
    from specbench.bench.report.scaling import Measured, fit, gap_with_error, trend_table

    def m(drafter, n, turns):
        return Measured(drafter, n, 0, "gsm8k", sum(t for _, t, _ in turns) / sum(s for _, _, s in turns), True,
                        tuple(turns))

    # tli1: 20 tokens in 15 steps; moa: 20 in 10. Without a: 1 - 2 = -1; without b: 2 - 2 = 0.
    runs = [m("moa_tli1", 200, [("a", 10, 5), ("b", 10, 10)]), m("moa", 200, [("a", 10, 5), ("b", 10, 5)])]
    gap, se = gap_with_error(runs, "moa_tli1", "moa", ["gsm8k"])
    assert math.isclose(gap, 20 / 15 - 2) and math.isclose(se, 0.5)  # sqrt(1/2 · (0.5² + 0.5²))
    assert gap_with_error([Measured("moa_tli1", 200, 0, "gsm8k", 1.5, True), runs[1]], "moa_tli1", "moa",
                          ["gsm8k"]) == (1.5 - 2, None)  # no turns kept: no error
    later = [m("moa_tli1", 400, [("a", 10, 5), ("b", 10, 5)]), m("moa", 400, [("a", 10, 5), ("b", 10, 5)])]
    row, = [ln for ln in trend_table(runs + later, [200, 400], ["gsm8k"]) if ln.startswith("| moa_tli1")]
    assert row.startswith("| moa_tli1 > moa | -0.67 ± 0.50 | +0.00 ± 0.00 | +0.667 ± 0.500 | ")
    two = fit([200, 400], [0.0, 0.1], [0.1, 0.1])  # Var = (0.25 · 0.01 + 0.25 · 0.01) / 0.5² = 0.02
    assert math.isclose(two.se, math.sqrt(0.02))
    straight = fit([200, 400, 800], [0.0, 0.1, 0.2], [0.1, 0.0, 0.1])  # on the line: the errors' alone, (0.01 + 0.01) / 2²
    assert math.isclose(straight.se, math.sqrt(0.005)) and fit([200, 400, 800], [0.0, 0.3, 0.2], [0.0] * 3).se > 0


def test_the_scaling_report_reads_each_ordering_as_a_gap_against_data(tmp_path):
    """The trend table: per ORDERINGS pair the gap in measured τ (the mean over the datasets) at each n both decoded,
    the slope per doubling and the extrapolation; a pair with one common n says so; a pair never decoded is left out."""
    from specbench.bench.report.scaling import Measured, trend_table

    def m(drafter, n, dataset, tau):
        return Measured(drafter, n, 0, dataset, tau, True)

    decoded = [m("eagle", 200, "gsm8k", 1.4), m("eagle", 200, "mtbench", 1.6), m("eagle", 1600, "gsm8k", 1.8),
               m("eagle", 1600, "mtbench", 2.0), m("moa", 200, "gsm8k", 1.3), m("moa", 200, "mtbench", 1.5),
               m("moa", 1600, "gsm8k", 1.5), m("moa", 1600, "mtbench", 1.5), m("moa_tli1", 1600, "gsm8k", 1.4),
               m("moa_tli1", 1600, "mtbench", 1.4), m("hass", 200, "gsm8k", 1.5)]  # hass: one dataset only
    lines = trend_table(decoded, [200, 1600], ["gsm8k", "mtbench"])
    rows = [ln for ln in lines if ln.startswith("| moa") or ln.startswith("| hass") or ln.startswith("| eagle3")]
    assert rows[0] == "| moa > eagle | -0.10 | -0.40 | -0.100 | no flip: the gap moves away from 0 (two points: no " \
                      "error estimate) |"
    assert rows[1] == "| moa_tli1 > moa | – | -0.10 | – | one point |"
    assert len(rows) == 2  # hass lacks MT-Bench, eagle3 was never decoded
