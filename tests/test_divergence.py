"""A greedy output that leaves the baseline's is classified at its first divergence: a near-tie of the target's two
best tokens (bf16's rounding can pick either) or a mismatch (specbench/divergence.py)."""
import json

import torch

from specbench import divergence
from specbench.records import read_jsonl
from specbench.run import Runner
from tests.helpers import tiny_target


def test_a_tie_of_the_two_best_tokens_is_a_near_tie_and_anything_else_a_mismatch():
    target = tiny_target(scale=5.0)
    prompt = [5, 17, 33, 9]
    best = int(target.model(torch.tensor([prompt])).logits[0, -1].argmax())
    other = (best + 1) % target.vocab_size
    with torch.no_grad():  # token `other` gets the same LM-head row: an exact tie with the best token
        target.lm_head.weight[other] = target.lm_head.weight[best]
    tie = divergence.classify(target, prompt, [], best, other)
    assert tie["kind"] == "near_tie" and tie["margin"] == 0.0 and set(tie["top2"]) == {best, other}
    third = (best + 2) % target.vocab_size
    assert divergence.classify(target, prompt, [], best, third)["kind"] == "mismatch"  # not among the top two
    target.lm_head.weight[other] -= 1.0  # a clear margin
    assert divergence.classify(target, prompt, [], best, other)["kind"] == "mismatch"


def test_a_run_that_diverges_from_its_baseline_records_the_kind(make_cfg):
    """The baseline's record is altered at one position (as another dtype's rounding might leave it): the drafter's
    turn is no longer lossless, its record says where and which kind, and the summary counts the kinds."""
    base = Runner(make_cfg("drafter=none")).execute()
    recs = read_jsonl(base.records_path)
    recs[0]["new_token_ids"][3] = (recs[0]["new_token_ids"][3] + 1) % 50  # not what the target chose there
    base.records_path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in recs))
    run = Runner(make_cfg("drafter=pld", "bench.baseline=false")).execute()
    first = read_jsonl(run.records_path)[0]
    assert first["matches_baseline"] is False and first["divergence"]["position"] == 3
    assert first["divergence"]["kind"] == "mismatch"
    summary = json.loads(run.summary_path.read_text())
    assert summary["lossless"]["divergences"] == {"near_tie": 0, "mismatch": 1}
