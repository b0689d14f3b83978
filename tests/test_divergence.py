"""A greedy output that leaves the baseline's is classified at its first divergence: a near-tie of the target's two
best tokens (bf16's rounding can pick either) or a mismatch (specbench/bench/divergence.py)."""
import json
from types import SimpleNamespace

import torch

from specbench.bench import divergence
from specbench.core.records import read_jsonl
from specbench.bench.run import Runner


class Replay:
    """An engine stand-in whose replay captures a given logits row (what each path computed at the divergence)."""

    def __init__(self, row):
        self.row = torch.tensor(row)

    def generate(self, prompt, max_new, generator=None, context=None, capture_at=None):
        assert max_new == capture_at + 1
        return SimpleNamespace(captured=self.row)


def test_a_near_tie_needs_each_path_to_reproduce_its_own_token():
    theirs, ours, bf16 = 1, 2, torch.bfloat16  # the baseline emitted 1, the drafter 2, at the same position
    base_row = [0.0, 5.0, 4.999, -3.0]  # one-token decoding: 1 just ahead of 2
    tree_row = [0.0, 4.999, 5.0, -3.0]  # the tree row, rounded otherwise: 2 just ahead of 1
    tie = divergence.classify(Replay(base_row), Replay(tree_row), [7], 3, ours, theirs, dtype=bf16)
    assert tie["kind"] == "near_tie" and tie["baseline"]["token"] == 1 and tie["drafter"]["token"] == 2
    assert abs(tie["swing"] - 0.002) < 1e-6 and abs(tie["drafter"]["margin"] - 0.001) < 1e-6
    # the same swing is far beyond fp32's rounding: two fp32 paths that disagree by that much compute another function
    assert divergence.classify(Replay(base_row), Replay(tree_row), [7], 3, ours, theirs)["kind"] == "mismatch"
    # a verification that emits its own row's runner-up (a swap): the tree row replays to the baseline's token,
    # however small the margin -- the old 8·|l1|·eps rule called this a near-tie
    swap = divergence.classify(Replay(base_row), Replay(base_row), [7], 3, ours, theirs, dtype=bf16)
    assert swap["kind"] == "mismatch" and not swap["drafter"]["reproduces"]
    # fp16 rounds two logits to exactly the same value: the engine's argmax takes the lower id (topk may not)
    exact = divergence.classify(Replay([0.0, 4.999, 5.0, -3.0]), Replay([0.0, 5.0, 5.0, -3.0]), [7], 3, 1, 2,
                                dtype=torch.float16)
    assert exact["kind"] == "near_tie" and exact["drafter"]["token"] == 1 and exact["drafter"]["margin"] == 0.0
    # three tokens level in bf16 (found by the rehearsal: each row's runner-up is not the other run's token)
    three = divergence.classify(Replay([9.9375, 10.0, 10.0]), Replay([10.0, 10.0, 9.9375]), [7], 3, 0, 1, dtype=bf16)
    assert three["kind"] == "near_tie" and three["baseline"]["top2"] == [1, 2] and three["drafter"]["top2"] == [0, 1]
    far = divergence.classify(Replay(base_row), Replay([0.0, 4.0, 1.0, 5.0]), [7], 3, 3, theirs, dtype=bf16)
    assert far["kind"] == "mismatch"  # both reproduce, but the rows disagree by far more than bf16's rounding


def test_a_swapped_acceptance_in_a_real_run_is_a_mismatch(make_cfg, monkeypatch):
    """A verification bug injected in the engine (the test's only): at one step the bonus token is the argmax's
    neighbour. The drafter's output leaves the baseline's there, and the replay of its tree row does not reproduce
    the token it emitted: a mismatch, not a near-tie."""
    from specbench.decode import verifier as verifier_mod  # (the target's half of the loop: its acceptance)

    Runner(make_cfg("drafter=none", "dataset.limit=1")).execute()
    real, calls = verifier_mod.greedy_accept_rows, {"n": 0}

    def buggy(tokens, parents, anc, target_argmax, valid=None):
        acc = real(tokens, parents, anc, target_argmax, valid)
        calls["n"] += 1
        if calls["n"] == 3:  # in the run only (the replay re-runs from the prompt, with calls > 3: correct again)
            return acc.__class__(acc.path, acc.length, (acc.next_token + 1) % 50, acc.recovered)
        return acc

    monkeypatch.setattr(verifier_mod, "greedy_accept_rows", buggy)
    run = Runner(make_cfg("drafter=pld", "dataset.limit=1")).execute()
    first = read_jsonl(run.records_path)[0]
    assert first["matches_baseline"] is False
    d = first["divergence"]
    assert d["kind"] == "mismatch" and d["baseline"]["reproduces"] and not d["drafter"]["reproduces"]


def test_a_replay_that_stops_early_is_a_mismatch():
    """A replay that ends (EOS) before the diverging token does not reproduce its run: a mismatch, not a crash."""
    class Short:
        def generate(self, prompt, max_new, generator=None, context=None, capture_at=None):
            return SimpleNamespace(captured=None)

    d = divergence.classify(Replay([0.0, 5.0, 4.0]), Short(), [7], 3, 2, 1)
    assert d["kind"] == "mismatch" and "drafter replay stopped before token 3" in d["why"]


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
    # the question's second turn carries the first turn's (other) answer in its prompt: not compared with the baseline
    second = [r for r in read_jsonl(run.records_path) if r["question_id"] == first["question_id"] and r["turn"] == 1]
    assert second and second[0]["after_divergence"] and second[0]["matches_baseline"] is None
    assert summary["lossless"]["not_compared_after_divergence"] == 1


def test_a_batched_divergence_is_classified_on_replays_of_each_runs_own_batch(make_cfg, monkeypatch):
    """decoding.batch_size=2 (the 3 questions in batches of 2 then 1). A verification bug injected in the engine (the
    test's only) at one row's step of a batch: that row leaves its batched baseline, and the replays of both runs'
    batches capture the diverging row at the diverging position (each gives the target's token there, as the
    baseline emitted it): a mismatch, since the drafter's replayed row does not reproduce its run's token."""
    from specbench.decode import verifier as verifier_mod  # (the target's half of the loop: its acceptance)

    batch = ("decoding.batch_size=2",)
    base = Runner(make_cfg("drafter=none", *batch)).execute()
    real, calls = verifier_mod.greedy_accept_rows, {"n": 0}

    def buggy(tokens, parents, anc, target_argmax, valid=None):
        acc = real(tokens, parents, anc, target_argmax, valid)
        calls["n"] += 1
        if calls["n"] == 2:  # step 2 of the first batch, its second row (the replays run later: correct again)
            wrong = acc.next_token.clone()
            wrong[1] = (wrong[1] + 1) % 50
            return acc.__class__(acc.path, acc.length, wrong, acc.recovered)
        return acc

    monkeypatch.setattr(verifier_mod, "greedy_accept_rows", buggy)
    run = Runner(make_cfg("drafter=pld", *batch)).execute()
    recs = read_jsonl(run.records_path)
    off = [r for r in recs if r["matches_baseline"] is False]
    assert len(off) == 1 and off[0]["batch"]["size"] == 2 and off[0]["question_id"] == "2"  # the batch's row 1
    d, j = off[0]["divergence"], off[0]["first_divergence"]
    ref = {(r["question_id"], r["turn"]): r["new_token_ids"] for r in read_jsonl(base.records_path)}
    theirs = ref[(off[0]["question_id"], off[0]["turn"])][j]
    assert d["kind"] == "mismatch" and d["replayed"] == "batches of 2 (baseline) and 2 (drafter)" and d["position"] == j
    assert d["baseline"]["reproduces"] and not d["drafter"]["reproduces"]
    assert d["baseline"]["token"] == d["drafter"]["token"] == theirs != off[0]["new_token_ids"][j]
    # an altered baseline record (as another dtype's rounding might leave it) at a batched turn: the baseline's own
    # replay does not reproduce it
    monkeypatch.setattr(verifier_mod, "greedy_accept_rows", real)
    rows = read_jsonl(base.records_path)
    rows[0]["new_token_ids"][3] = (rows[0]["new_token_ids"][3] + 1) % 50
    base.records_path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    again = Runner(make_cfg("drafter=eagle2", "drafter.checkpoint=null", "bench.baseline=false", *batch)).execute()
    first = next(r for r in read_jsonl(again.records_path)
                 if (r["question_id"], r["turn"]) == (rows[0]["question_id"], rows[0]["turn"]))
    d = first["divergence"]
    assert first["first_divergence"] == 3 and d["kind"] == "mismatch" and d["drafter"]["reproduces"]
    assert not d["baseline"]["reproduces"]


def test_a_verification_that_emits_its_rows_runner_up_is_a_mismatch(make_cfg, monkeypatch):
    """A verification bug injected in the test only: at the first step whose root row has its two best tokens within
    the old rule's margin (8·|l1|·eps(bf16)), the row's top two logits are swapped, so the step emits the runner-up of
    the row that chose its first token. The old rule (one fresh forward; the pair is its top two within that margin)
    filed this swap as a near-tie; the replay of the drafter's own tree row gives the baseline's token there (the
    row's argmax), not the token the run emitted: a mismatch, with both paths' top two and margins."""
    import dataclasses

    bf16 = ("dataset.limit=1", "model.dtype=bfloat16")
    Runner(make_cfg("drafter=none", *bf16)).execute()
    runner = Runner(make_cfg("drafter=pld", *bf16))
    real, state = runner.target.forward, {"swapped": None}

    def swapped(*args, **kwargs):
        fwd = real(*args, **kwargs)
        if "logits_rows" in kwargs:  # the prefill's forward, not a tree's
            return fwd
        row = fwd.logits[0, 0].float()
        (l1, l2), top2 = row.topk(2).values.tolist(), row.topk(2).indices
        if state["swapped"] is not None or l1 - l2 > 8 * abs(l1) * torch.finfo(torch.bfloat16).eps:
            return fwd  # (once: the replays verify correctly)
        state["swapped"] = top2.tolist()
        logits = fwd.logits.clone()
        logits[0, 0, top2] = logits[0, 0, top2.flip(0)]
        return dataclasses.replace(fwd, logits=logits)

    monkeypatch.setattr(runner.target, "forward", swapped)
    run = runner.execute()
    assert state["swapped"] is not None  # the bug fired, at a close pair
    first = read_jsonl(run.records_path)[0]
    assert first["matches_baseline"] is False
    d, j = first["divergence"], first["first_divergence"]
    theirs, ours = state["swapped"]
    assert d["position"] == j and first["new_token_ids"][j] == ours
    assert d["kind"] == "mismatch"
    assert d["baseline"]["reproduces"] and not d["drafter"]["reproduces"]
    # the emitted token is the runner-up of the drafter's own (correctly replayed) tree row, as of the baseline's row
    assert d["drafter"]["top2"] == [theirs, ours] and d["baseline"]["top2"] == [theirs, ours]
    assert 0 < d["drafter"]["margin"] <= 8 * abs(d["drafter"]["top_logit"]) * torch.finfo(torch.bfloat16).eps


def test_a_divergence_from_a_path_not_replayable_here_is_classified_by_one_forward():
    """make peer's divergences (the authors' code cannot be replayed through our engine; make peer called the replay
    rule with the old arguments and crashed on SmolLM2 as shipped): one forward over prompt + shared tokens, a near-tie
    only when its row gives one of the two tokens within NEAR_TIE_ULPS ulps of the other."""
    logits = torch.full((1, 1, 10), -5.0)
    logits[0, 0, 3], logits[0, 0, 5], logits[0, 0, 7] = 10.0, 10.0 - 1e-6, 2.0  # 1e-6 < 4 ulps of 10 in fp32
    calls = []

    def forward(ids, cache, logits_rows):
        calls.append(ids.tolist())
        return SimpleNamespace(logits=logits)

    target = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, new_cache=lambda n: None, forward=forward)
    kinds = {pair: divergence.classify_by_forward(target, [1, 2], [4], *pair)["kind"]
             for pair in [(3, 5), (5, 3), (3, 7), (8, 9)]}
    assert kinds == {(3, 5): "near_tie", (5, 3): "near_tie", (3, 7): "mismatch", (8, 9): "mismatch"}
    assert calls[0] == [[1, 2, 4]]  # the prompt and the shared tokens
