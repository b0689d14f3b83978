"""`make data`: the question files no package ships, fetched from their pinned origins and checked by sha256; read
without ../shared/data (a user's clone); the pre-flight names a missing set."""
import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from specbench.data import fetch_data
from specbench.core.config import DatasetConfig
from specbench.data.data import load_questions
from specbench.errors import SpecbenchError

REPO = Path(__file__).resolve().parents[1]
SHARED = fetch_data.shared_dir()


@pytest.fixture
def no_shared(tmp_path, monkeypatch):
    """A user's clone: no ../shared/data, an empty data directory."""
    monkeypatch.setattr(fetch_data, "shared_dir", lambda: tmp_path / "no-shared")
    monkeypatch.setenv("SPECBENCH_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


@pytest.fixture
def origin_server(tmp_path):
    """The origins' raw files served from 127.0.0.1, laid out as <repo>/<commit>/<path> (from the offline copies)."""
    root = tmp_path / "www"
    for rel, o in fetch_data.FILES.items():
        dest = root / o.repo / o.commit / o.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SHARED / rel, dest)
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(root), **k)  # noqa: E731
    http.server.SimpleHTTPRequestHandler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", root
    server.shutdown()
    thread.join(timeout=10)


def test_the_pinned_checksums_are_the_offline_copies():
    for rel, origin in fetch_data.FILES.items():
        assert fetch_data.sha256(SHARED / rel) == origin.sha256, rel


def test_a_clone_without_shared_data_reads_nothing_until_make_data(no_shared, origin_server):
    """Before: gsm8k, cnndm, humaneval, alpaca and the Spec-Bench categories read only ../shared/data."""
    gsm8k = DatasetConfig(name="gsm8k", source="shared:eagle/gsm8k/question.jsonl")
    with pytest.raises(SpecbenchError, match="run `make data`"):
        load_questions(gsm8k)
    base, _ = origin_server
    done = fetch_data.fetch(base_url=base, timeout=10)
    assert set(done.values()) == {"downloaded"} and len(done) == len(fetch_data.FILES)
    assert len(load_questions(gsm8k)) == 80
    cnndm = DatasetConfig(name="cnndm", source="shared:spec_bench/question.jsonl", categories=["summarization"])
    assert len(load_questions(cnndm)) == 80
    assert set(fetch_data.fetch(base_url=base).values()) == {"present"}  # verified, not fetched again


def test_a_file_with_other_bytes_is_refused_and_nothing_is_written(no_shared, origin_server):
    base, root = origin_server
    o = fetch_data.FILES["eagle/alpaca/question.jsonl"]
    (root / o.repo / o.commit / o.path).write_text('{"question_id": 1, "turns": ["changed"]}\n')
    with pytest.raises(SpecbenchError, match="sha256 .* expected 8ad3e5a7fc61"):
        fetch_data.fetch(base_url=base, timeout=10)
    assert not (no_shared / "eagle" / "alpaca" / "question.jsonl").exists()
    assert not list(no_shared.rglob(".fetch.*"))


def test_offline_copies_from_a_directory(no_shared):
    done = fetch_data.fetch(offline=SHARED, base_url="http://127.0.0.1:9")
    assert set(done.values()) == {"copied"} and (no_shared / "gsm8k" / "test.jsonl").is_file()


def test_the_preflight_names_a_missing_question_set(tmp_path, tiny_checkpoint):
    res = subprocess.run([sys.executable, "-m", "specbench.run", "-m", f"model.path={tiny_checkpoint}",
                          "model.name=tiny", "drafter=none", "dataset=gsm8k", f"out.root={tmp_path / 'results'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "SPECBENCH_DATA": str(tmp_path / "empty"),
                              "SPECBENCH_SHARED_DATA": str(tmp_path / "none")})
    assert res.returncode == 2, res.stderr[-2000:]
    assert "dataset=gsm8k: question file eagle/gsm8k/question.jsonl is in none of" in res.stderr
    assert "run `make data`" in res.stderr and not (tmp_path / "results").exists()
