"""The Hydra run on a tiny checkpoint: records, resume, no mixing of configs, lossless check, and bad input."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specbench.errors import SpecbenchError
from specbench.core.records import read_jsonl
from specbench.bench.run import Runner

REPO = Path(__file__).resolve().parents[1]
RECORD_FIELDS = {"question_id", "turn", "repeat", "prompt_tokens", "new_tokens", "new_token_ids", "wall_s",
                 "tokens_per_s", "peak_mem_bytes", "steps", "tau", "tokens_per_step", "depth_trials",
                 "depth_accepts", "draft_s", "verify_s", "matches_baseline", "first_divergence"}


def test_baseline_run_writes_the_three_files(make_cfg):
    run = Runner(make_cfg("drafter=none")).execute()
    meta = json.loads((run.path / "run.json").read_text())
    assert {"config", "git", "date", "env", "versions", "command"} <= set(meta)
    assert meta["config"]["decoding"]["max_new_tokens"] == 24 and meta["env"]["cpu"]
    assert {"torch", "transformers"} <= set(meta["versions"])
    recs = read_jsonl(run.path / "records.jsonl")
    assert len(recs) == 4  # 2 + 1 + 1 turns
    assert RECORD_FIELDS <= set(recs[0])
    assert all(r["tau"] == 1.0 for r in recs if r["steps"])
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["turns"] == 4 and summary["tokens_per_s"]["mean"] > 0 and summary["tau_micro"] == 1.0


@pytest.mark.parametrize("drafter", ["pld", "sd"])
def test_drafter_run_is_lossless_against_the_baseline_of_the_same_job(make_cfg, drafter):
    extra = ["drafter.module.init_layers=[0,1,2]", "drafter.checkpoint=null"] if drafter == "sd" else []
    run = Runner(make_cfg(f"drafter={drafter}", *extra)).execute()
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["baseline_run"] and "__none__" in summary["baseline_run"]
    assert summary["lossless"] == {"compared": 4, "matches": 4, "rate": 1.0}
    assert summary["speedup"]["mean"] > 0
    assert summary["tau_micro"] > 1.0
    if drafter == "sd":  # chain drafts: Leviathan's prediction is reported next to the measured speedup
        assert summary["leviathan"]["predicted_improvement"] > 0


def test_a_baseline_timed_in_another_sitting_is_named_and_recorded(make_cfg, caplog):
    """A drafter run whose baseline was timed earlier (a committed one, skipped): the speedup mixes two sittings of a
    host whose speed drifts (this CPU ran one baseline at 20 and 10 tok/s on two days). The run says so in one warning
    and records the baseline's date and commit in its run.json; a baseline timed in the same job is recorded too."""
    fresh = Runner(make_cfg("drafter=pld")).execute()
    head = json.loads((fresh.path / "run.json").read_text())
    base = fresh.path.parent / head["baseline"]["run"]
    assert head["baseline"]["commit"] == json.loads((base / "run.json").read_text())["git"]["commit"]
    assert "timed" not in caplog.text
    meta = json.loads((base / "run.json").read_text())
    (base / "run.json").write_text(json.dumps({**meta, "date": "2026-01-01T00:00:00+00:00"}))
    shutil.rmtree(fresh.path)  # the drafter's run again, its baseline kept (as a committed one is)
    later = Runner(make_cfg("drafter=pld")).execute()
    assert json.loads((later.path / "run.json").read_text())["baseline"]["date"] == "2026-01-01T00:00:00+00:00"
    assert "against a baseline timed" in caplog.text and "delete" in caplog.text


def test_resume_after_interruption_redoes_nothing_and_duplicates_nothing(make_cfg):
    cfg = make_cfg("drafter=none", "bench.repeats=2")
    run = Runner(cfg).execute()
    full = read_jsonl(run.records_path)
    # simulate a crash after the first question of repeat 0: keep its lines, lose the summary
    kept = [r for r in full if r["repeat"] == 0 and r["question_id"] == "1"]
    run.records_path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
    run.summary_path.unlink()
    Runner(cfg).execute()
    again = read_jsonl(run.records_path)
    keys = [(r["repeat"], r["question_id"], r["turn"]) for r in again]
    assert len(keys) == len(set(keys)) == len(full)
    assert again[: len(kept)] == kept  # finished turns were not redone
    assert run.summary_path.is_file()


def test_a_different_config_writes_a_different_run(make_cfg):
    a = Runner(make_cfg("drafter=none")).execute()
    b = Runner(make_cfg("drafter=none", "decoding.max_new_tokens=8")).execute()
    assert a.path != b.path and a.path.parent == b.path.parent


@pytest.mark.parametrize("override", ["model.dtype=bfloat16", "model.system_prompt=Be brief.",
                                      "model.attn_implementation=eager"])
def test_the_resolved_target_names_the_run(make_cfg, override):
    """Measured before the fix: `model.dtype=bfloat16 drafter=none` landed in the fp32 run's directory and "resumed"
    it. Every resolved field of the target that changes the records now changes the run's name."""
    fp32 = Runner(make_cfg("drafter=none")).run_dir_for(make_cfg("drafter=none").drafter)[0]
    cfg = make_cfg("drafter=none", override)
    other = Runner(cfg).run_dir_for(cfg.drafter)[0]
    assert other.path != fp32.path and other.path.parent == fp32.path.parent


def test_the_run_key_holds_the_resolved_dtype_device_and_placement(make_cfg):
    import torch

    from specbench.bench.run import model_identity

    runner = Runner(make_cfg("drafter=none"))
    ident = model_identity(runner.model_cfg, torch.device("cuda", 1), torch.bfloat16)
    assert (ident["dtype"], ident["device"]) == ("bfloat16", "cuda")  # `auto` as resolved, the kind of device
    assert {"chat_template", "system_prompt", "attn_implementation", "device_map", "path", "revision"} <= set(ident)


def test_model_compile_names_its_backend_and_refuses_an_unknown_one(make_cfg):
    """model.compile=true is inductor's and keys runs as before ({"compile": True}: committed run names unchanged);
    another backend's name keys its runs apart; a name torch.compile does not know is refused before the model loads."""
    import torch

    from specbench.bench.run import model_identity

    ident = lambda *o: model_identity(Runner(make_cfg("drafter=none", *o)).model_cfg, torch.device("cpu"),  # noqa: E731
                                      torch.float32)
    assert "compile" not in ident() and ident("model.compile=true")["compile"] is True
    assert ident("model.compile=inductor")["compile"] is True and ident("model.compile=aot_eager")["compile"] == "aot_eager"
    with pytest.raises(SpecbenchError, match=r"model.compile=nosuch: true, false or a torch.compile backend"):
        Runner(make_cfg("drafter=none", "model.compile=nosuch"))


def test_a_run_directory_of_another_config_is_not_resumed(make_cfg):
    """A resume is refused when the run.json in the directory describes another run (hand-edited, or a collision)."""
    cfg = make_cfg("drafter=none", "dataset.limit=1")
    run = Runner(cfg).execute()
    head = json.loads(run.run_json.read_text())
    assert head["model_identity"]["dtype"] == "float32" and head["model_identity"]["device"] == "cpu"
    head["model_identity"]["dtype"] = "bfloat16"
    run.run_json.write_text(json.dumps(head))
    with pytest.raises(SpecbenchError, match=r"holds a run of another config \(differs in model.dtype\)"):
        Runner(cfg).execute()


def test_sampling_run_records_no_token_match(make_cfg):
    run = Runner(make_cfg("drafter=pld", "decoding.temperature=1.0")).execute()
    recs = read_jsonl(run.records_path)
    assert all(r["matches_baseline"] is None for r in recs)


def test_over_long_prompt_fails_before_writing(make_cfg, tmp_path):
    long_q = tmp_path / "long.jsonl"
    long_q.write_text(json.dumps({"question_id": 1, "turns": ["word " * 2000]}) + "\n")
    with pytest.raises(SpecbenchError, match="exceeds the context"):
        Runner(make_cfg(f"dataset.path={long_q}"))
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize(("content", "message"), [
    ("", "no questions"),
    ("{not json}\n", r"q.jsonl:1: not a JSON object"),
    ('{"question_id": 1, "turns": "hi"}\n', r"q.jsonl:1: 'turns' must be a non-empty list"),
    ('{"question_id": 1, "turns": ["  "]}\n', "empty prompt"),
])
def test_bad_question_files(make_cfg, tmp_path, content, message):
    bad = tmp_path / "q.jsonl"
    bad.write_text(content)
    with pytest.raises(SpecbenchError, match=message):
        Runner(make_cfg(f"dataset.path={bad}"))


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specbench.run", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


@pytest.mark.parametrize("arg", ["drafter=nope", "dataset=nope", "model=nope", "-m drafter=none,nope"])
def test_unknown_names_answer_with_one_line_listing_valid_names(arg):
    res = cli(*arg.split())
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown") and "valid: " in lines[0]


@pytest.mark.parametrize("arg,name", [("decoding.ragged=true", "decoding.ragged"), ("+model.cache=dynamic", "model.cache")])
def test_a_removed_option_answers_with_one_line_naming_its_removal(arg, name):
    res = cli(arg)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {name} was removed (issue 77)")


def test_missing_hub_model_is_one_clear_line(tmp_path):
    res = cli("model=llama2-7b", "dataset.limit=1", f"out.root={tmp_path}",
              env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "meta-llama/Llama-2-7b-chat-hf" in lines[0] and "`hf download meta-llama/Llama-2-7b-chat-hf --include" in lines[0]
    assert not any(tmp_path.glob("*/*/records.jsonl"))


def test_help_works():
    res = cli("--help")
    assert res.returncode == 0 and "drafter: " in res.stdout and "dataset: " in res.stdout


def test_missing_package_names_the_pip_install():
    from specbench.core.models import package_file

    with pytest.raises(SpecbenchError, match="pip install --no-deps not-a-real-pkg"):
        package_file("not_a_real_pkg", "x.json")


def test_dirty_flag_ignores_regenerated_results(tmp_path, monkeypatch):
    """A run header's `dirty` is about the code: a tracked table under results/ rewritten by `make figures` does not
    set it, a tracked source file edited does."""
    import subprocess

    from specbench.core import envinfo

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "t.md").write_text("a\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    monkeypatch.setattr(envinfo, "REPO", tmp_path)
    assert envinfo.git_commit()["dirty"] is False
    (tmp_path / "results" / "t.md").write_text("b\n")
    assert envinfo.git_commit()["dirty"] is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert envinfo.git_commit()["dirty"] is True


def sweep_cli(tmp_path, tiny_checkpoint, question_file, *args):
    """A sweep on the tiny target run from tmp_path, so that drafter checkpoints (weights/tiny/...) resolve there."""
    cmd = [sys.executable, "-m", "specbench.run", "-m", f"model.path={tiny_checkpoint}", "model.name=tiny",
           "dataset=jsonl", f"dataset.path={question_file}", "decoding.max_new_tokens=8", "bench.warmup=0",
           f"out.root={tmp_path / 'results'}", *args]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_strict_sweep_preflight_lists_every_missing_drafter_before_decoding(tmp_path, tiny_checkpoint, question_file):
    """Strict mode (make bench STRICT=1): any drafter without weights refuses the whole sweep, before decoding."""
    res = sweep_cli(tmp_path, tiny_checkpoint, question_file, "drafter=none,pld,eagle2,medusa",
                    "hydra.callbacks.checks.strict=true")
    assert res.returncode == 2, res.stderr[-2000:]
    err = res.stderr
    assert "pre-flight: 2 missing piece(s)" in err and "nothing was decoded" in err
    assert "drafter=eagle2 on model=tiny: no weights at weights/tiny/eagle" in err
    assert "make train MODEL=tiny TRAIN_DRAFTERS=eagle" in err and "TRAIN_DRAFTERS=medusa" in err
    assert "or decode only the drafters that can run: drafter=none,pld (make bench ARGS='drafter=none,pld')" in err
    assert not (tmp_path / "results").exists()


def test_a_sweep_skips_the_drafters_without_weights_and_runs_the_others(tmp_path, tiny_checkpoint, question_file):
    """Issue 81: no weights for eagle2 and medusa on this target. Their jobs are skipped, each with the command that
    makes its weights; none and pld decode; the end names what finished and what was skipped; exit 0. A skipped job
    leaves nothing in results/: no run directory, no failure record."""
    res = sweep_cli(tmp_path, tiny_checkpoint, question_file, "drafter=none,pld,eagle2,medusa")
    assert res.returncode == 0, res.stderr[-3000:]
    err = res.stderr
    assert "pre-flight: 2 job(s) skipped" in err and "nothing was decoded" not in err
    assert ("skip #2 drafter=eagle2: drafter=eagle2 on model=tiny: no weights at weights/tiny/eagle — train them with "
            "`make train MODEL=tiny TRAIN_DRAFTERS=eagle`") in err
    assert "skip #3 drafter=medusa: drafter=medusa on model=tiny" in err and "TRAIN_DRAFTERS=medusa" in err
    assert "sweep: 2 of 4 job(s) finished: #0 drafter=none, #1 drafter=pld" in err
    assert "sweep: 2 job(s) skipped for want of drafter weights" in err
    exp = tmp_path / "results" / "adhoc"
    assert sorted(p.parent.name.split("__")[1] for p in exp.glob("*/summary.json")) == ["none", "pld"]
    runs = sorted(p.name.split("__")[1] for p in exp.iterdir() if "__" in p.name)  # (besides .locks)
    assert runs == ["none", "pld"] and not (exp / "failed").exists()
    assert "Traceback" not in err


def test_a_sweep_whose_every_drafted_job_lacks_weights_decodes_nothing(tmp_path, tiny_checkpoint, question_file):
    """Only the baseline could run: nothing to compare it with, so the sweep refuses before decoding, non-zero."""
    res = sweep_cli(tmp_path, tiny_checkpoint, question_file, "drafter=none,eagle2")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "pre-flight: no drafted job of this sweep has its drafter's weights; nothing was decoded" in res.stderr
    assert "make train MODEL=tiny TRAIN_DRAFTERS=eagle" in res.stderr and "decode only" not in res.stderr
    assert not (tmp_path / "results").exists()


def test_a_failed_job_does_not_end_the_sweep(tmp_path, tiny_checkpoint, question_file):
    """eagle2 finds a checkpoint that belongs to another drafter: that job fails with that one line and leaves no run
    directory; the next job (pld) still runs; the sweep exits non-zero at the end naming the failed job."""
    wrong = tmp_path / "weights" / "tiny" / "eagle"
    wrong.mkdir(parents=True)
    (wrong / "config.json").write_text(json.dumps({"drafter": "moa", "module": {"block_max": 8}}))
    (wrong / "model.safetensors").write_bytes(b"")
    res = sweep_cli(tmp_path, tiny_checkpoint, question_file, "drafter=eagle2,pld")
    assert res.returncode == 1, res.stderr[-2000:]
    assert "1 job(s) of the sweep failed" in res.stderr
    assert "drafter=eagle2" in res.stderr and "is a 'moa' drafter, not 'eagle'" in res.stderr
    finished = sorted(p.parent.name.split("__")[1] for p in (tmp_path / "results" / "adhoc").glob("*/summary.json"))
    assert finished == ["none", "pld"]
    assert not list((tmp_path / "results" / "adhoc").glob("*__eagle2__*"))
    assert "Traceback" not in res.stderr  # a SpecbenchError is its one line, also inside a sweep
    (failed,) = (tmp_path / "results" / "adhoc" / "failed").glob("*.json")  # kept for the tables (make figures)
    record = json.loads(failed.read_text())
    assert record["config"]["drafter"]["name"] == "eagle2" and "is a 'moa' drafter" in record["error"]


def test_two_parallel_jobs_compute_their_shared_baseline_once(tmp_path, tiny_checkpoint, question_file):
    """Hydra's submitit launcher (its local flavour here, SLURM on a cluster) starts both jobs at once and each runs the
    baseline first: one computes it under the run's lock, the other waits and finds it finished. One complete
    baseline, no record twice, and both speedups divide by it."""
    res = sweep_cli(tmp_path, tiny_checkpoint, question_file, "drafter=pld", "drafter.num_pred_tokens=4,6",
                    "decoding.max_new_tokens=48", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert res.returncode == 0, res.stderr[-3000:]
    exp = tmp_path / "results" / "adhoc"
    (base,) = exp.glob("tiny__none__*")
    keys = [(r["repeat"], r["question_id"], r["turn"]) for r in read_jsonl(base / "records.jsonl")]
    assert len(keys) == len(set(keys)) == 4  # 3 questions, the first with 2 turns
    runs = sorted(exp.glob("tiny__pld__*/summary.json"))
    assert len(runs) == 2
    for run in runs:
        s = json.loads(run.read_text())
        assert s["baseline_run"] == base.name and s["speedup"]["mean"] > 0
    assert (exp / ".locks" / base.name).is_file()


def test_sweep_preflight_names_a_target_that_is_not_there(tmp_path, tiny_checkpoint, question_file):
    res = sweep_cli(tmp_path, tmp_path / "nothing", question_file, "drafter=none,pld")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "pre-flight: 1 missing piece(s)" in res.stderr
    assert f"model 'tiny': no checkpoint at model.path={tmp_path / 'nothing'}" in res.stderr
    assert not (tmp_path / "results").exists()


def test_an_hf_draft_runs_without_a_specbench_checkpoint(make_cfg, tmp_path, tiny_checkpoint):
    """`drafter=sd drafter.model_path=<HF model>` runs as it is (the YAML's checkpoint path, with no weights there, is
    not demanded), and a published HF draft downloaded into the checkpoint's directory (Spec-Bench's vicuna-68m for
    vicuna-7b, `make download`) is read as the draft model."""
    import shutil

    from tests.conftest import byte_tokenizer
    from tests.helpers import tiny_llama

    draft = tmp_path / "draft"
    tiny_llama(vocab=len(byte_tokenizer()), layers=1, hidden=32, seed=3).save_pretrained(draft)
    byte_tokenizer().save_pretrained(draft)
    run = Runner(make_cfg("drafter=sd", f"drafter.model_path={draft}", "dataset.limit=1")).execute()
    summary = json.loads(run.summary_path.read_text())
    assert summary["lossless"]["rate"] == 1.0
    head = json.loads(run.run_json.read_text())["config"]["drafter"]
    assert head["checkpoint"] is None and len(head["model_sha256"]) == 16
    published = tmp_path / "weights" / "tiny" / "sd"
    shutil.copytree(draft, published)
    run = Runner(make_cfg("drafter=sd", f"drafter.checkpoint={published}", "dataset.limit=1")).execute()
    assert json.loads(run.summary_path.read_text())["lossless"]["rate"] == 1.0


@pytest.mark.parametrize(("override", "message"), [
    ("decoding.temperature=-1", "decoding.temperature=-1 must be >= 0"),
    ("decoding.top_p=0", "decoding.top_p=0 must be in"),
    ("decoding.top_k=-2", "decoding.top_k=-2 >= 0"),
    ("decoding.batch_size=0", "decoding.batch_size=0 must be >= 1"),
    # a batch of 4 over 2 questions decodes 2 rows: the batch table would label it B=4
    ("decoding.batch_size=4 dataset.limit=2", "decoding.batch_size=4 needs at least that many questions"),
])
def test_bad_decoding_parameters_are_refused_before_anything_runs(make_cfg, tmp_path, override, message):
    """temperature=-1 ran as greedy without a word."""
    with pytest.raises(SpecbenchError, match=message):
        Runner(make_cfg("drafter=pld", *override.split())).execute()
    assert not (tmp_path / "results").exists()


def test_a_bad_tree_is_refused_before_the_baseline_runs(make_cfg, tmp_path):
    """tree.depth=0 was refused only after the baseline had decoded every question."""
    with pytest.raises(SpecbenchError, match="dynamic tree needs depth, topk >= 1 and total_tokens >= 2"):
        Runner(make_cfg("drafter=eagle2", "drafter.checkpoint=null", "tree.depth=0")).execute()
    assert not list((tmp_path / "results").glob("*/*/records.jsonl"))


@pytest.mark.parametrize("drafter", ["pld", "eagle2"])
def test_the_context_cuts_a_turn_and_every_method_stops_at_the_same_token(make_cfg, tmp_path, drafter):
    """Vicuna-7B v1.3 has 2,048 positions: with 1,024 new tokens whole CNN-DM jobs were refused and MT-Bench's second
    turn failed mid-run. Here (1,024 positions): turn 1 is cut by the context, turn 2's prompt fills it; both are
    recorded as stopped by the context, counted in the summary, and the drafter equals the baseline token for token
    (its trees near the end are not verified: they would reach past the last position)."""
    q = tmp_path / "long.jsonl"
    q.write_text(json.dumps({"question_id": 1, "turns": ["word " * 180, "and again " * 20]}) + "\n")
    extra = ["drafter.checkpoint=null"] if drafter == "eagle2" else []
    run = Runner(make_cfg(f"drafter={drafter}", f"dataset.path={q}", "decoding.max_new_tokens=200", *extra)).execute()
    recs = sorted(read_jsonl(run.records_path), key=lambda r: r["turn"])
    assert [r["stopped_by"] for r in recs] == ["context", "context"]
    assert recs[0]["prompt_tokens"] + recs[0]["new_tokens"] == 1024 and 0 < recs[0]["new_tokens"] < 200
    assert recs[1]["new_tokens"] == 0 and recs[1]["tokens_per_s"] is None
    summary = json.loads(run.summary_path.read_text())
    assert summary["stopped_by_context"] == 2 and summary["lossless"]["rate"] == 1.0
    base = json.loads((run.path.parent / summary["baseline_run"] / "summary.json").read_text())
    assert base["stopped_by_context"] == 2


def test_a_checkpoint_path_of_ones_own_that_is_empty_is_named_as_such(make_cfg, tmp_path):
    """A typo'd drafter.checkpoint suggested `make train ... TRAIN_DRAFTERS=<the path's last part>`."""
    from specbench.bench.sweep import missing_weights

    line = missing_weights(make_cfg("drafter=eagle2", f"drafter.checkpoint={tmp_path / 'my-eagel'}"))
    assert line.endswith("no checkpoint is at that path (check drafter.checkpoint)") and "make train" not in line
    assert "make train MODEL=tiny TRAIN_DRAFTERS=eagle" in missing_weights(make_cfg("drafter=eagle2"))


def test_training_settings_do_not_name_a_run_but_the_weights_do(make_cfg):
    """A drafter YAML's `optim` (weight decay, clipping) made the weights; the weights' digest names the run, so a
    changed training setting alone does not orphan the runs of unchanged weights."""
    cfg = make_cfg("drafter=eagle2", "drafter.checkpoint=null")
    base = Runner(cfg).run_dir_for(cfg.drafter)[0]
    cfg2 = make_cfg("drafter=eagle2", "drafter.checkpoint=null", "drafter.optim.weight_decay=0.5")
    assert Runner(cfg2).run_dir_for(cfg2.drafter)[0].path == base.path
    cfg3 = make_cfg("drafter=eagle2", "drafter.checkpoint=null", "tree.topk=3")
    assert Runner(cfg3).run_dir_for(cfg3.drafter)[0].path != base.path
    # nor do a method's training-only module options (its decoding_options drop them)
    cfg4 = make_cfg("drafter=hass", "drafter.checkpoint=null")
    cfg5 = make_cfg("drafter=hass", "drafter.checkpoint=null", "drafter.module.topk_stage=0.5")
    assert Runner(cfg4).run_dir_for(cfg4.drafter)[0].path == Runner(cfg5).run_dir_for(cfg5.drafter)[0].path


@pytest.mark.parametrize("size", [1, 2])
def test_a_paired_run_times_the_baseline_beside_each_turn(make_cfg, size):
    """bench.paired: the baseline decodes each turn's prompts again beside the drafter (the same members, budgets and
    seeds; first at every other turn), and the speedup is against those times; the baseline run's ratio is kept. A
    run resumed across the option (a decoded turn without its pair) falls back to the baseline run. The warm-up (both
    engines, every row) writes no record and counts no pair."""
    from specbench.bench.report.cells import provenance
    from specbench.core.metrics import paired_speed, per_repeat_speed, summarize

    runner = Runner(make_cfg("drafter=pld", "bench.paired=true", f"decoding.batch_size={size}", "bench.warmup=1"))
    run = runner.execute()
    recs = read_jsonl(run.records_path)
    summary = json.loads(run.summary_path.read_text())
    assert summary["lossless"]["matches"] == 4 and summary["speedup_against"] == "paired"
    pairs = list({r["batch"]["id"]: r["batch"]["paired"] for r in recs}.values()) if size > 1 else [r["paired"] for r in recs]
    assert len(pairs) == (3 if size > 1 else 4) and runner._pairs == len(pairs)  # one pair per decode, none twice
    assert sum(p["new_tokens"] for p in pairs) == sum(r["new_tokens"] for r in recs)  # T=0: the same tokens
    assert all(p["wall_s"] > 0 for p in pairs)
    paired = sum(p["new_tokens"] for p in pairs) / sum(p["wall_s"] for p in pairs)
    assert summary["paired_baseline_tokens_per_s"] == pytest.approx(paired)
    assert summary["speedup"]["mean"] == pytest.approx(per_repeat_speed(recs)[0] / paired)
    base = read_jsonl(run.path.parent / summary["baseline_run"] / "records.jsonl")
    assert summary["speedup_vs_baseline_run"]["mean"] == pytest.approx(per_repeat_speed(recs)[0] / per_repeat_speed(base)[0])
    assert not any("paired" in r or "paired" in (r.get("batch") or {}) for r in base)  # the baseline is not paired
    mixed = [{k: v for k, v in r.items() if k != "paired"} if i == 0 else r for i, r in enumerate(recs)]
    if size == 1:
        assert paired_speed(mixed) is None and "speedup_against" not in summarize(mixed, base)
    heads = [{**summary, "_head": json.loads(run.run_json.read_text())}]
    assert provenance(heads).endswith("(bench.paired) in 1 of 1 drafted runs")
    assert "bench.paired" not in provenance([{**h, "speedup_against": None} for h in heads])


@pytest.mark.parametrize("drafter", ["sd", "eagle2"])
def test_a_batched_run_is_lossless_per_row_against_its_batched_baseline(make_cfg, drafter):
    """decoding.batch_size=2: the 3 questions in batches of 2 then 1, turn by turn (question 1's second turn alone);
    each row equals the baseline at the same batch size, which equals the batch-1 baseline here (fp32, tiny); the
    speed is the batch's throughput, and batch 1 keeps the names runs had before the option."""
    extra = ["drafter.checkpoint=null"] + (["drafter.module.init_layers=[0,1,2]"] if drafter == "sd" else [])
    run = Runner(make_cfg(f"drafter={drafter}", "decoding.batch_size=2", *extra)).execute()
    summary = json.loads(run.summary_path.read_text())
    assert summary["lossless"] == {"compared": 4, "matches": 4, "rate": 1.0}
    assert summary["batch"] == {"batches": 3, "mean_size": 1.5, "max_size": 2} and summary["speedup"]["mean"] > 0
    recs = read_jsonl(run.records_path)
    assert {r["batch"]["size"] for r in recs} == {1, 2}
    pair = [r for r in recs if r["turn"] == 0 and r["question_id"] in ("1", "2")]
    assert pair[0]["batch"] == pair[1]["batch"]  # decoded together, one clock
    clocks = {r["batch"]["id"]: r["batch"]["wall_s"] for r in recs}
    assert summary["wall_s"] == pytest.approx(sum(clocks.values()))  # each batch's time once, not once per row
    base_b = read_jsonl(run.path.parent / summary["baseline_run"] / "records.jsonl")
    base_1 = read_jsonl(Runner(make_cfg("drafter=none")).execute().records_path)
    one = {(r["question_id"], r["turn"]): r["new_token_ids"] for r in base_1}
    assert all(one[(r["question_id"], r["turn"])] == r["new_token_ids"] for r in base_b)
    assert len(list(run.path.parent.glob("*__none__*"))) == 2  # batch 1 and batch 2: two baselines



def test_batches_depend_only_on_the_repeat_and_the_question():
    """Question i is in batch i // B of its repeat, whatever a resume left to do: 5 questions at B = 2 make batches
    {0, 1}, {2, 3}, {4} in every repeat, and a resume that finished question 0 and 3 keeps 1 and 2 apart."""
    from specbench.data.data import Question
    from specbench.bench.run import batches

    qs = [Question(question_id=str(i), category="c", turns=["t"]) for i in range(5)]
    todo = [(r, q) for r in range(2) for q in qs]
    ids = [[(r, q.question_id) for r, q in g] for g in batches(todo, qs, 2)]
    assert ids[:3] == [[(0, "0"), (0, "1")], [(0, "2"), (0, "3")], [(0, "4")]] and len(ids) == 6
    left = [(r, q) for r, q in todo if not (r == 0 and q.question_id in ("0", "3"))]
    assert [[q.question_id for _, q in g] for g in batches(left, qs, 2)][:3] == [["1"], ["2"], ["4"]]
    assert [len(g) for g in batches(todo, qs, 1)] == [1] * 10  # batch 1: one question at a time, in order


def test_the_batch_path_at_batch_1_names_its_runs_and_the_default_keeps_the_old_names():
    """decoding.ragged (gone with issue 77: every B decodes one path) is in the names of the runs of then that set it
    true; false, as a record of then says, is not, so a run of today keeps the name of those."""
    from specbench.bench.run import run_key, run_name

    base = {"model": {"name": "m"}, "drafter": {"name": "none"}, "dataset": {"name": "d"}, "repeats": 1, "seed": 0}
    plain = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
    name = lambda decoding: run_name(run_key(base["model"], base["drafter"], base["dataset"], decoding, 1, 0))  # noqa: E731
    assert name(plain) == name({**plain, "batch_size": 1, "ragged": False})
    assert name({**plain, "ragged": True}) != name(plain)


def test_coral_routers_default_routing_keeps_its_runs_names():
    """drafter.module.routing=grouped (the default, what every committed coral_router run decoded with) is not in
    the run name; masked is."""
    from specbench.bench.run import run_key, run_name

    drafter = {"_target_": "drafters.coral.CoralRouterDrafter", "name": "coral_router",
               "module": {"base": "w/coral", "groups": 16, "active": 2}}
    decoding = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
    name = lambda module: run_name(run_key({"name": "m"}, {**drafter, "module": module}, {"name": "d"},  # noqa: E731
                                           decoding, 1, 0))
    assert name({**drafter["module"], "routing": "grouped"}) == name(drafter["module"])
    assert name({**drafter["module"], "routing": "masked"}) != name(drafter["module"])
