"""Shared fixtures: a tiny real checkpoint (random Llama + a byte-level BPE tokenizer with a ChatML template) that the
full Runner can load from disk like any HF model, and Hydra configs composed from conf/."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hypothesis import HealthCheck, settings
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specbench.core.config import register_schema
from tests.helpers import tiny_llama

# tests/cluster/ runs against a SLURM cluster, under `make cluster-test` (specbench/tools/cluster.py sets this)
collect_ignore = [] if os.environ.get("SPECBENCH_CLUSTER") else ["cluster"]

CONF = Path(__file__).resolve().parents[1] / "conf"

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` (pytest-xdist): the cores shared out among the workers, so that
    # N workers do not each run torch (and the processes a test starts) on every core
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)  # (macOS)
    _threads = max(1, _cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)

# property tests judged on their examples, not on how fast a loaded machine draws them: a CI host (or this one beside
# a training job) once took 1.26 s for one tree and failed hypothesis' too_slow health check; no per-example deadline
settings.register_profile("specbench", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("specbench")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in ("<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHATML
    return fast


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-ckpt")
    tok = byte_tokenizer()
    model = tiny_llama(vocab=len(tok), layers=6, hidden=32, seed=0, eos=tok.eos_token_id, scale=20.0)
    model.config.max_position_embeddings = 1024
    model.config.pad_token_id = tok.eos_token_id  # as SmolLM2 (a drafter building its own config must cope)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
def question_file(tmp_path) -> Path:
    path = tmp_path / "q.jsonl"
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Say hi twice.", "Now say it again, louder."]},
        {"question_id": 2, "category": "math", "turns": ["What is 2+2? 2+2 is"]},
        {"question_id": 3, "category": "math", "turns": ["Count: 1 2 3 4 5 6"]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def make_cfg(tiny_checkpoint, question_file, tmp_path):
    """Compose conf/config.yaml with overrides, pointing at the tiny checkpoint and a temporary results root."""
    register_schema()

    def _make(*overrides: str, tiny: bool = True):
        base = [f"out.root={tmp_path / 'results'}", "dataset=jsonl", f"dataset.path={question_file}",
                "decoding.max_new_tokens=24", "bench.warmup=0"]
        if tiny:
            base += [f"model.path={tiny_checkpoint}", "model.name=tiny"]
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose(config_name="config", overrides=base + list(overrides))

    return _make


@pytest.fixture
def one_thread():
    """Tiny models are overhead-bound: one thread is faster and keeps the suite short."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

