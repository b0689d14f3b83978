"""The harness on a real SLURM cluster (`make cluster-test`: specbench/tools/cluster.py starts one on this machine and
runs this file against it, SLURM_CONF set): a Hydra sweep as SLURM jobs writes what a local sweep writes; a job
cancelled and submitted again, or requeued by SLURM, resumes from the turns on disk; drafter training across two
node ranks (scripts/slurm/train.sbatch, torchrun's c10d rendezvous, gloo) trains what one node's two processes
train, and a job killed after a checkpoint resumes to the weights of a run never stopped."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specbench.core.records import read_jsonl
from specbench.decode.checkpoints import read_meta
from specbench.tools.cluster import free_port
from specbench.train.trainer import Trainer
from tests.test_train import sharegpt_file, train_overrides  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
if "SLURM_CONF" not in os.environ:
    raise pytest.UsageError("tests/cluster runs against a SLURM cluster: make cluster-test")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def slurm(*cmd: str) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=ENV)
    assert res.returncode == 0, f"{' '.join(cmd)}: {res.stderr[-1000:]}"
    return res.stdout


def job_ids() -> list[str]:
    return slurm("squeue", "-h", "-o", "%i").split()


def states(job: str) -> list[str]:
    """Every state a job went through (sacct -D: a requeued job's earlier runs too)."""
    return slurm("sacct", "-D", "-X", "-n", "-P", "-o", "State", "-j", job).splitlines()


def wait_for(predicate, timeout: float, what: str, every: float = 0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def questions(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"question_id": i, "category": "count",
                                        "turns": [f"Count from {i} to {i + 40}, one number a line."]}) + "\n"
                            for i in range(n)))
    return path


def sweep_cmd(tmp_path: Path, tiny_checkpoint: Path, root: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "specbench.run", "-m", f"model.path={tiny_checkpoint}", "model.name=tiny",
            "bench.warmup=0", f"out.root={tmp_path / root}", *args]


def on_slurm(tmp_path: Path, name: str) -> list[str]:
    return ["hydra/launcher=submitit_slurm", "hydra.launcher.partition=debug", "hydra.launcher.timeout_min=20",
            "hydra.launcher.cpus_per_task=1", f"hydra.sweep.dir={tmp_path / name}"]


def run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=ENV)


def records(run_dir: Path) -> dict[tuple, dict]:
    rows = read_jsonl(run_dir / "records.jsonl")
    keys = [(r["repeat"], str(r["question_id"]), r["turn"]) for r in rows]
    assert len(keys) == len(set(keys)), "a turn recorded twice"
    return dict(zip(keys, rows))


@pytest.fixture
def medusa_weights(tmp_path, sharegpt_file, tiny_checkpoint):  # noqa: F811
    """A medusa head trained for one epoch on the tiny target, where a sweep run from tmp_path looks for it."""
    from hydra import compose, initialize_config_dir

    from specbench.core.config import register_schema

    register_schema()
    over = [f"model.path={tiny_checkpoint}", "model.name=tiny", "drafter=medusa",
            *train_overrides(tmp_path, sharegpt_file, **{"train.epochs": 1})]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        final = Trainer(compose(config_name="config", overrides=over)).run()
    dest = tmp_path / "weights" / "tiny" / "medusa"
    shutil.copytree(final, dest)
    return dest


def test_a_sweep_through_slurm_writes_what_a_local_sweep_writes(tmp_path, tiny_checkpoint, medusa_weights):
    """drafter=pld,medusa on MT-Bench's first questions, once as SLURM jobs (Hydra's submitit_slurm launcher) and once
    in this process's own launcher: the same runs, T = 0 outputs token for token, the same tau; the jobs are SLURM's
    (sacct: COMPLETED), and Beagle's Table 1 renders from the cluster's records with the local records' tau."""
    args = ["drafter=pld,medusa", "dataset=mtbench", "dataset.limit=3", "decoding.max_new_tokens=16",
            "out.experiment=beagle_table1"]
    local = run(sweep_cmd(tmp_path, tiny_checkpoint, "local", *args), tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    res = run(sweep_cmd(tmp_path, tiny_checkpoint, "cluster", *args, *on_slurm(tmp_path, "sweep")), tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    # the sweep's job array: one task per job (submitit's folders <array>_<task>)
    tasks = sorted(p.name for p in (tmp_path / "sweep" / ".submitit").iterdir()
                   if p.name[0].isdigit() and "_" in p.name)
    assert len(tasks) == 2
    # (submitit returns on the result file, written before the task ends: accounting follows within seconds)
    wait_for(lambda: all(states(t) == ["COMPLETED"] for t in tasks), 60, "both tasks COMPLETED in sacct", every=0.5)
    exp = "beagle_table1"
    runs = sorted(p.name for p in (tmp_path / "local" / exp).glob("tiny__*"))
    assert sorted(p.name for p in (tmp_path / "cluster" / exp).glob("tiny__*")) == runs
    assert {r.split("__")[1] for r in runs} == {"none", "pld", "medusa"}
    for name in runs:
        a, b = records(tmp_path / "local" / exp / name), records(tmp_path / "cluster" / exp / name)
        assert a.keys() == b.keys() and len(a) == 6  # 3 questions of 2 turns
        for k in a:
            assert a[k]["new_token_ids"] == b[k]["new_token_ids"] and a[k]["tau"] == b[k]["tau"], (name, k)
        if "__none__" not in name:  # (the baseline is what the others are checked against)
            s = json.loads((tmp_path / "cluster" / exp / name / "summary.json").read_text())
            assert s["lossless"]["rate"] == 1.0
    taus = {}
    for root in ("local", "cluster"):
        report = run([sys.executable, "-m", "specbench.report", "--results", str(tmp_path / root)], tmp_path)
        assert report.returncode == 0, report.stderr[-2000:]
        taus[root] = table_tau(tmp_path / root / exp / "table1.tiny.md", "mtbench")
    assert taus["cluster"] == taus["local"] and set(taus["cluster"]) == {"none", "pld", "medusa"}


def table_tau(path: Path, dataset: str) -> dict[str, str]:
    """The tau cells of a rendered markdown table's column `<dataset> τ` that hold a number, by method."""
    lines = [line for line in path.read_text().splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    col = head.index(f"{dataset} τ")
    cells = {}
    for line in lines[2:]:
        row = [c.strip() for c in line.strip("|").split("|")]
        if row[col] not in ("–", ""):
            cells[row[0]] = row[col]
    return cells


def started_run(tmp_path: Path, root: str, at_least: int, total: int):
    """The one job of the sweep running, with at least `at_least` of its `total` questions on disk: it is suspended
    there (SIGSTOP through slurmd) so that what is on disk stays put; returns (job id, run dir, records)."""
    run_dir = wait_for(lambda: next(iter((tmp_path / root / "adhoc").glob("tiny__pld__*")), None), 180,
                       "the run's directory")
    wait_for(lambda: (run_dir / "records.jsonl").is_file() and len(records(run_dir)) >= at_least, 180,
             f"{at_least} recorded turns")
    (job,) = job_ids()
    slurm("scontrol", "suspend", job)
    done = records(run_dir)
    assert at_least <= len(done) < total, f"the job finished before it could be stopped ({len(done)} of {total})"
    return job, run_dir, done


@pytest.mark.parametrize("stop", ["scancel", "requeue"])
def test_a_job_stopped_half_way_resumes_from_the_turns_on_disk(tmp_path, tiny_checkpoint, stop):
    """A sweep job stopped after some of its questions: cancelled (scancel; the sweep says so and exits non-zero, and
    the same sweep submitted again resumes) or requeued by SLURM (scontrol requeue, what preemption does; the job
    starts again by itself and the sweep that submitted it finishes). Either way each turn is on disk once, the turns
    recorded before the stop are kept as they were, and every output is the target's greedy one (lossless)."""
    total = 120  # (submitit's job runs on through scancel's SIGTERM until SIGKILL, KillWait = 2 s later: ~30 turns)
    qfile = questions(tmp_path / "q.jsonl", total)
    cmd = sweep_cmd(tmp_path, tiny_checkpoint, "results", "dataset=jsonl", f"dataset.path={qfile}", "drafter=pld",
                    "decoding.max_new_tokens=64", *on_slurm(tmp_path, "sweep"))  # the baseline, then pld (stopped)
    driver = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        job, run_dir, before = started_run(tmp_path, "results", 2, total)
        if stop == "scancel":
            slurm("scancel", job)
            out, _ = driver.communicate(timeout=300)
            assert "CANCELLED" in states(job)[-1]
            assert len(records(run_dir)) < total
            assert driver.returncode != 0, out[-2000:]
            res = run(cmd, tmp_path)  # submitted again
            assert res.returncode == 0, res.stderr[-3000:]
        else:
            slurm("scontrol", "resume", job)  # (SLURM holds a job requeued while suspended: JobHeldAdmin)
            slurm("scontrol", "requeue", job)
            out, _ = driver.communicate(timeout=600)
            assert driver.returncode == 0, out[-3000:]
            # (the submitter can read the results before slurmdbd records the job's end: wait for it, briefly)
            wait_for(lambda: states(job)[-1] != "RUNNING", 30, f"job {job}'s accounting to record its end", every=1.0)
            assert states(job)[0] == "REQUEUED" and states(job)[-1] == "COMPLETED"
    finally:
        if driver.poll() is None:
            driver.kill()
    after = records(run_dir)
    assert len(after) == total  # nothing lost, nothing twice (records() refuses a turn twice)
    for k, row in before.items():
        assert after[k] == row  # the turns on disk before the stop, untouched
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["turns"] == total and summary["lossless"]["rate"] == 1.0


# ---- training across nodes -------------------------------------------------------------------------------------
def submit_training(tmp_path: Path, tiny_checkpoint: Path, sharegpt: Path, out: str, nodes: int, nproc: int,  # noqa: F811
                    *extra: str) -> str:
    """scripts/slurm/train.sbatch in its CPU form: `nodes` torchrun agents (node ranks, one srun task each) of
    `nproc` processes on this machine's one SLURM node, meeting at a c10d rendezvous on 127.0.0.1."""
    over = train_overrides(tmp_path, sharegpt, **{"train.conversations": 12, "train.val_conversations": 1,
                                                  "train.batch_size": 1, "train.epochs": 2,
                                                  "train.out_dir": tmp_path / out})
    env = f"ALL,NNODES={nodes},NPROC={nproc},RDZV_HOST=127.0.0.1,RDZV_PORT={free_port()},PYTHON={sys.executable}"
    cmd = ["sbatch", "--parsable", "--nodes=1", f"--ntasks={nodes}", f"--ntasks-per-node={nodes}", "--cpus-per-task=1",
           f"--export={env}",
           f"--output={tmp_path / out}-%j.log", f"--chdir={REPO}", str(SBATCH), "drafter=eagle",
           f"model.path={tiny_checkpoint}", "model.name=tiny", *over, *extra]
    return slurm(*cmd).strip().split(";")[0]


def wait_job(job: str, timeout: float = 400) -> str:
    wait_for(lambda: job not in job_ids(), timeout, f"job {job}", every=0.5)
    return wait_for(lambda: (s := states(job)) and s[-1] not in ("RUNNING", "PENDING", "COMPLETING") and s[-1],
                    30, f"job {job}'s final state", every=0.5)


def weights(root: Path, which: str = "final") -> dict[str, torch.Tensor]:
    return load_file(str(root / "tiny" / "eagle" / which / "model.safetensors"))


def train_losses(root: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_jsonl(root / "tiny" / "eagle" / "log.jsonl") if r["kind"] == "train"]


def test_two_node_training_trains_what_one_node_trains_and_resumes_after_a_kill(tmp_path, tiny_checkpoint,
                                                                               sharegpt_file):  # noqa: F811
    """The sbatch script with 2 node ranks x 1 process against 1 node x 2 processes: the same per-step losses and
    the same final weights (within float tolerance: a gloo all-reduce over the same two ranks), the checkpoint
    written once (rank 0), each step logged once. A 2-node job killed after a checkpoint (saves after every batch)
    and submitted again resumes to the weights of the 2-node run never stopped, exactly."""
    one = submit_training(tmp_path, tiny_checkpoint, sharegpt_file, "one", 1, 2)
    assert wait_job(one) == "COMPLETED", (tmp_path / f"one-{one}.log").read_text()[-3000:]
    two = submit_training(tmp_path, tiny_checkpoint, sharegpt_file, "two", 2, 1)
    assert wait_job(two) == "COMPLETED", (tmp_path / f"two-{two}.log").read_text()[-3000:]
    log = (tmp_path / f"two-{two}.log").read_text()
    assert "torchrun agent 0 of 2 nodes" in log and "torchrun agent 1 of 2 nodes" in log, log[-2000:]
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=1e-3, atol=1e-4)
    la, lb = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert [s for s, _ in lb] == list(range(1, len(lb) + 1)) and len(lb) == 12  # 12 conversations / 2 ranks x 2 epochs
    assert [s for s, _ in la] == [s for s, _ in lb]
    assert all(abs(x - y) <= 1e-4 * max(1.0, abs(x)) for (_, x), (_, y) in zip(la, lb)), (la, lb)
    meta = read_meta(tmp_path / "two" / "tiny" / "eagle" / "final")
    assert meta["world_size"] == 2 and meta["metrics"]["rank_weight_spread"] == 0.0
    assert sorted(p.name for p in (tmp_path / "two" / "tiny" / "eagle").iterdir() if p.is_dir()) == ["final", "last"]

    # killed after a checkpoint, submitted again
    cut = tmp_path / "cut" / "tiny" / "eagle"
    job = submit_training(tmp_path, tiny_checkpoint, sharegpt_file, "cut", 2, 1, "train.save_every_min=0")

    def saved() -> bool:
        try:
            return json.loads((cut / "last" / "config.json").read_text()).get("step", 0) >= 3
        except (OSError, ValueError):
            return False

    wait_for(saved, 300, "a checkpoint after step 3", every=0.01)
    slurm("scontrol", "suspend", job)
    assert not (cut / "final").exists(), "the training finished before it could be killed"
    step = json.loads((cut / "last" / "config.json").read_text())["step"]
    slurm("scancel", job)
    assert "CANCELLED" in wait_job(job)
    again = submit_training(tmp_path, tiny_checkpoint, sharegpt_file, "cut", 2, 1, "train.save_every_min=0")
    assert wait_job(again) == "COMPLETED", (tmp_path / f"cut-{again}.log").read_text()[-3000:]
    resumed, whole = weights(tmp_path / "cut"), b
    assert all(torch.equal(resumed[k], whole[k]) for k in whole), f"killed after step {step}"
    steps = [s for s, _ in train_losses(tmp_path / "cut")]
    assert steps == list(range(1, 13))
