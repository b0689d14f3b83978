"""deploy=client_server through the whole run (python -m specbench.run): the client run spawns the server process
(python -m specbench.deploy.server) on a loopback port and stops it at the end; summary.json carries the split's
measurements; faults and bad input are one line (the server killed mid-answer, a refused drafter, a port in use, a
mismatched peer) and the finished answers stay on disk."""
from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from specbench.bench.run import Runner
from specbench.core.records import read_jsonl
from specbench.deploy.client import SplitClient
from specbench.deploy.errors import Refused
from specbench.deploy.link import LinkConfig
from specbench.deploy.split import DeployConfig
from specbench.deploy.server import SplitServer, serve
from specbench.deploy.tcp import listen
from specbench.errors import SpecbenchError
from tests.test_conformance import make_drafter, target_for

SPLIT = ["deploy=client_server", "decoding.max_new_tokens=20"]


def test_a_split_run_is_lossless_and_measured(make_cfg, one_thread):
    run = Runner(make_cfg("drafter=moa", "drafter.checkpoint=null", *SPLIT)).execute()
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["lossless"] == {"compared": 4, "matches": 4, "rate": 1.0}  # against the single-device baseline
    s = summary["split"]
    assert s["answers"] == 4 and s["calls_per_answer"]["mean"] == summary["steps"] / 4
    assert s["bytes_up_per_step"] > 8 and s["bytes_down_per_step"] > 14 and s["prefill_bytes_down_per_answer"]["mean"] > 0
    assert s["server_ms_per_step"] > 0 and s["link_ms_per_step"] >= 0 and s["draft_ms_per_step"] > 0
    assert "deploy" in json.loads(run.run_json.read_text())["config"]["drafter"]  # named apart from the local run
    # each record names what crossed (Table 7's formula in the report reads it): MoA at TLI 0, the LSA's two halves
    assert [[n for n, _ in r["split"]["needs"]] for r in read_jsonl(run.path / "records.jsonl")] == [["lsa0", "lsa1"]] * 4


def test_a_drafter_that_does_not_run_split_is_refused_before_decoding(make_cfg):
    runner = Runner(make_cfg("drafter=pld", *SPLIT))
    with pytest.raises(SpecbenchError, match="drafter 'pld' does not run split") as e:
        runner.execute()
    assert "\n" not in str(e.value) and not runner.exp_dir.exists()  # nothing decoded, not even the baseline


def test_batches_and_sampling_are_refused_in_one_line(make_cfg):
    with pytest.raises(SpecbenchError, match="deploy=client_server decodes one answer at a time, greedy"):
        Runner(make_cfg("drafter=sd", "decoding.temperature=0.7", *SPLIT))


def test_a_port_in_use_says_so(make_cfg):
    held = listen("127.0.0.1", 0)
    port = held.getsockname()[1]
    try:
        runner = Runner(make_cfg("drafter=sd", "drafter.checkpoint=null", "bench.baseline=false", *SPLIT,
                                 f"deploy.port={port}"))
        with pytest.raises(SpecbenchError, match=f"the server did not start: 127.0.0.1:{port} is in use"):
            runner.execute()
    finally:
        held.close()


def test_a_mismatched_peer_is_refused_before_decoding(one_thread):
    """The server holds another target (the same weights under another name), then another drafter: the handshake
    refuses each in one line, before any prompt is sent."""
    import torch

    from specbench.decode.target import TargetModel

    client_target = target_for()
    renamed = TargetModel(client_target.model, None, torch.device("cpu"), "tiny-other")
    for server_target, server_name, match in ((renamed, "sd", "target mismatch"),
                                              (client_target, "eagle2", "drafter mismatch")):
        listener = listen("127.0.0.1", 0)
        server = SplitServer(server_target, make_drafter(server_name, server_target), server_name)
        thread = threading.Thread(target=serve, args=(listener, server, LinkConfig(), 0, 10.0, 10.0, 1), daemon=True)
        thread.start()
        try:
            with pytest.raises(Refused, match=match) as e:
                SplitClient(client_target, make_drafter("sd", client_target), "sd", DeployConfig(name="client_server"),
                            LinkConfig(), 0, listener.getsockname()[1])
            assert "\n" not in str(e.value)
        finally:
            thread.join(timeout=15)
            listener.close()
        assert not thread.is_alive()


def test_a_server_killed_mid_answer_is_one_line_and_finished_answers_stay(make_cfg, one_thread, monkeypatch):
    """The spawned server is killed (by its pid) while the run's third answer decodes: the run stops with one line,
    and the answers it finished are on disk."""
    from specbench.deploy import client as client_mod

    procs = []
    spawn = client_mod.spawn_server

    def spawn_and_remember(*a, **kw):
        proc, port = spawn(*a, **kw)
        procs.append(proc)
        return proc, port

    monkeypatch.setattr(client_mod, "spawn_server", spawn_and_remember)
    verify = client_mod.RemoteVerifier.verify

    def verify_then_kill(self, *a, **kw):
        written = list(runner.exp_dir.glob("*/records.jsonl"))
        if procs and procs[0].poll() is None and written and written[0].read_text():  # a question is on disk
            os.kill(procs[0].pid, signal.SIGKILL)  # (the server this test's run started)
            procs[0].wait()
        return verify(self, *a, **kw)

    monkeypatch.setattr(client_mod.RemoteVerifier, "verify", verify_then_kill)
    runner = Runner(make_cfg("drafter=sd", "drafter.checkpoint=null", "bench.baseline=false", *SPLIT))
    with pytest.raises(SpecbenchError, match="the server is gone mid-answer") as e:
        runner.execute()
    assert "\n" not in str(e.value)
    (run,) = [p for p in runner.exp_dir.iterdir()]
    done = [json.loads(x) for x in (run / "records.jsonl").read_text().splitlines()]
    assert len(done) == 2 and all(r["split"]["calls"] > 0 for r in done)  # question 1's two turns
    assert procs[0].poll() is not None


def test_a_disconnection_run_records_the_cut_and_the_clients_own_tokens(make_cfg, one_thread):
    run = Runner(make_cfg("drafter=sd", "drafter.checkpoint=null", *SPLIT, "link.disconnect_after_tokens=5")).execute()
    summary = json.loads((run.path / "summary.json").read_text())
    recs = [json.loads(x) for x in (run.path / "records.jsonl").read_text().splitlines()]
    s = summary["split"]
    cut = [r for r in recs if r["split"]["disconnected_at"] is not None]
    assert s["disconnected"] == len(cut) >= 1 and s["alone_tokens"] == sum(r["split"]["alone_tokens"] for r in recs) > 0
    for r in cut:  # the server's part is the target's; a divergence after the cut is the client's own text
        d = r.get("divergence")
        assert d is None or (d["position"] >= r["split"]["disconnected_at"] and d["kind"] == "unclassified")


def test_a_server_elsewhere_needs_its_port(make_cfg):
    with pytest.raises(SpecbenchError, match="deploy.spawn=false connects to a server already listening"):
        Runner(make_cfg("drafter=sd", *SPLIT, "deploy.spawn=false"))


def test_a_server_started_by_hand_serves_a_run_and_stops_at_its_bye(make_cfg, tmp_path, one_thread):
    """python -m specbench.deploy.server --spec (as on another machine), then a run with deploy.spawn=false."""
    import subprocess
    import sys

    from omegaconf import OmegaConf

    from specbench.bench.run import inference_spec

    cfg = make_cfg("drafter=sd", "drafter.checkpoint=null", *SPLIT)
    spec = {"model": OmegaConf.to_container(cfg.model, resolve=True), "drafter": inference_spec(cfg.drafter),
            "name": "sd", "seed": cfg.seed, "deploy": OmegaConf.to_container(cfg.deploy, resolve=True),
            "link": OmegaConf.to_container(cfg.link, resolve=True)}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.Popen([sys.executable, "-m", "specbench.deploy.server", "--spec", str(tmp_path / "spec.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        port = int(proc.stdout.readline().split()[1])
        run = Runner(make_cfg("drafter=sd", "drafter.checkpoint=null", *SPLIT, "deploy.spawn=false",
                              f"deploy.port={port}")).execute()
        summary = json.loads((run.path / "summary.json").read_text())
        assert summary["lossless"]["rate"] == 1.0 and summary["split"]["answers"] == 4
        assert proc.wait(timeout=20) == 0  # the run's BYE stopped it
    finally:
        if proc.poll() is None:
            proc.kill()  # (the server this test started, by its pid)
            proc.wait()
