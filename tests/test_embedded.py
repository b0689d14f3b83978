"""The embedded SmolLM2-135M target (slow: converts the packaged GGUF once, ~20 s, then loads in seconds)."""
import json

import pytest
import torch

from specbench.core.records import read_jsonl
from specbench.bench.run import Runner

pytestmark = pytest.mark.slow


def test_baseline_and_pld_equal_hf_greedy_generation(make_cfg):
    cfg = make_cfg("drafter=pld", "dataset.limit=2", "decoding.max_new_tokens=32", tiny=False)
    runner = Runner(cfg)
    assert runner.target.vocab_size == 49152 and runner.target.model.config.num_hidden_layers == 30
    pld_run = runner.execute()
    summary = json.loads((pld_run.path / "summary.json").read_text())
    assert summary["lossless"]["rate"] == 1.0 and summary["lossless"]["compared"] == 3
    base = read_jsonl(pld_run.path.parent / summary["baseline_run"] / "records.jsonl")
    answers = {}
    for rec in base:  # rebuild each turn's prompt and let transformers decode it greedily
        q = next(q for q in runner.questions if q.question_id == rec["question_id"])
        ids = runner.prompt_ids(q, rec["turn"], answers.get(q.question_id, []))
        assert len(ids) == rec["prompt_tokens"]
        ref = runner.target.model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):]
        assert rec["new_token_ids"] == ref.tolist()
        text = runner.target.tokenizer.decode(rec["new_token_ids"], skip_special_tokens=True).strip()
        answers.setdefault(q.question_id, []).append(text)
