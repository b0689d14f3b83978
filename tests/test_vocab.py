"""Draft vocabularies (specbench/decode/vocab.py): token counts of the training answers, written by `python -m specbench.vocab`
and read back for their target only; the EAGLE family's decode-time pruning (`module.draft_vocab`) scores only the N
most frequent tokens, drafts nothing else and stays lossless."""
from pathlib import Path

import pytest
import torch

from drafters.coral import CoralRouterDrafter
from drafters.eagle import EagleDrafter
from specbench.data.conversations import Encoded, encode, load_conversations
from specbench.errors import SpecbenchError
from specbench.bench.run import run_key, run_name
from specbench.decode.target import TargetModel
from specbench.decode.vocab import PrunedLMHead, frequent_ids, load_counts, save_counts
from specbench.tools.vocab import answer_counts, write_counts
from tests.helpers import engine_greedy, hf_greedy, tiny_llama
from tests.test_conformance import PROMPTS, make_drafter, target_for
from tests.test_train import sharegpt_file, tiny_target, train_overrides  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[1]
V = 128  # tiny_llama's vocabulary


def counts_file(tmp_path, target: TargetModel):
    """Counts that rank ids 7, 5, 3, ... (odd ids, descending) first: a vocabulary the tiny target's greedy text does
    not keep to, so pruning must change what is drafted and not what is output."""
    counts = torch.zeros(V, dtype=torch.long)
    counts[1::2] = torch.arange(1, V, 2)
    return save_counts(tmp_path / "token_counts.safetensors", counts, target, "test")


def test_counts_are_the_answers_tokens_and_rank_by_frequency_then_id():
    convs = [Encoded("a", [1, 2, 2, 3, 3], [0, 1, 1, 0, 1]), Encoded("b", [3, 4, 4], [0, 0, 1])]
    counts = answer_counts(convs, 6)
    assert counts.tolist() == [0, 0, 2, 1, 1, 0]  # the prompt's tokens (mask 0) are not counted
    assert frequent_ids(counts, 4).tolist() == [2, 3, 4, 0]  # ties (3, 4) and unseen ids (0) by id


def test_counts_load_for_their_target_only(tmp_path):
    target = target_for()
    path = counts_file(tmp_path, target)
    assert load_counts(path, target)[7] == 7
    with pytest.raises(SpecbenchError, match="another target"):
        load_counts(path, target_for(seed=1))
    with pytest.raises(SpecbenchError, match="vocabulary has 64"):
        load_counts(path, TargetModel(tiny_llama(vocab=64), None, torch.device("cpu"), "small"))
    with pytest.raises(SpecbenchError, match="python -m specbench.vocab model=tiny"):
        load_counts(tmp_path / "none.safetensors", target)


def test_pruned_head_scores_its_rows_and_nothing_else():
    target = target_for()
    ids = torch.tensor([9, 3, 120])
    head = PrunedLMHead(target.lm_head, ids)
    f = torch.randn(2, 5, target.hidden_size)
    out, full = head(f), target.lm_head(f)  # [2, 5, V]
    torch.testing.assert_close(out[..., [3, 9, 120]], full[..., [3, 9, 120]])
    assert torch.isneginf(out).sum() == 2 * 5 * (V - 3)


@pytest.mark.parametrize("name", ["eagle", "eagle2", "hass", "coral"])
def test_pruned_drafters_draft_inside_their_vocabulary_and_stay_lossless(name, tmp_path):
    target = target_for()
    path = counts_file(tmp_path, target)
    pruned = make_drafter(name, target, "+drafter.module.draft_vocab=8", f"+drafter.module.vocab_counts={path}")
    allowed = set(range(V - 15, V, 2))  # the 8 most frequent: 127, 125, ..., 113
    drafted: set[int] = set()
    propose = pruned.propose_rows  # (the engine drives every drafter through the rows protocol)

    def spy(state):
        tree = propose(state)
        drafted.update(tree.tokens[0, 1:].tolist())  # node 0 is the root (a verified token)
        return tree

    pruned.propose_rows = spy
    for prompt in PROMPTS:
        assert engine_greedy(target, pruned, prompt, 40) == hf_greedy(target.model, prompt, 40)
    assert drafted and drafted <= allowed


def test_the_whole_vocabulary_or_none_is_no_pruning_and_bad_values_are_one_line(tmp_path):
    target = target_for()
    assert EagleDrafter(target, module={"draft_vocab": V}).vocab is None  # N >= V: nothing to prune, no file needed
    with pytest.raises(SpecbenchError, match="at least one token"):
        EagleDrafter(target, module={"draft_vocab": 0})
    with pytest.raises(SpecbenchError, match="set module.vocab_counts"):
        EagleDrafter(target, module={"draft_vocab": 8})  # no checkpoint beside which to look
    with pytest.raises(SpecbenchError, match="does not exist"):
        EagleDrafter(target, checkpoint=None, module={"draft_vocab": 8, "vocab_counts": str(tmp_path / "x")})
    router = CoralRouterDrafter(target, module={"groups": 4, "active": 1})
    with pytest.raises(SpecbenchError, match="module.draft_vocab does not apply"):
        router.pruned_head(target, None, {"draft_vocab": 8})


def test_draft_vocab_names_its_runs(make_cfg):
    from omegaconf import OmegaConf

    def name(*over):
        cfg = OmegaConf.to_container(make_cfg("drafter=hass", *over), resolve=True)
        return run_name(run_key(cfg["model"], cfg["drafter"], cfg["dataset"], cfg["decoding"], 1, 0))

    assert name() != name("+drafter.module.draft_vocab=4096") != name("+drafter.module.draft_vocab=1024")


def test_the_vocab_cli_counts_the_budgets_answers(make_cfg, tmp_path, sharegpt_file, tiny_target):
    cfg = make_cfg(*train_overrides(tmp_path, sharegpt_file), f"vocab.out={tmp_path / 'w' / 'counts.safetensors'}")
    out = write_counts(cfg)
    counts = load_counts(out, tiny_target)
    convs, _ = load_conversations(sharegpt_file, 10, 3)
    enc = [e for c in convs if (e := encode(c, tiny_target.tokenizer, None, 96))]
    assert torch.equal(counts, answer_counts(enc, tiny_target.vocab_size)) and counts.sum() > 0


def test_the_draft_vocab_experiment_sweeps_n_and_reports_the_saving(tmp_path, tiny_checkpoint, question_file,
                                                                     tiny_target):
    """conf/experiment/draft_vocab.yaml on the tiny target (N narrowed to null and 16: its 8192 etc. exceed the tiny
    vocabulary), then its table: each N's row beside the whole vocabulary's, with the draft-time change and tau cost."""
    import os
    import subprocess
    import sys

    from specbench.bench.report.main import report

    counts = torch.arange(tiny_target.vocab_size, dtype=torch.long)
    path = save_counts(tmp_path / "counts.safetensors", counts, tiny_target, "test")
    args = [sys.executable, "-m", "specbench.run", "-m", "+experiment=draft_vocab", "+preset=cpu",
            f"model.path={tiny_checkpoint}", "model.name=tiny", "dataset=jsonl", f"dataset.path={question_file}",
            "drafter=eagle2", "drafter.checkpoint=null", f"+drafter.module.vocab_counts={path}",
            "+drafter.module.draft_vocab=null,16", "tree=paper", "decoding.max_new_tokens=12", "bench.warmup=0",
            f"out.root={tmp_path / 'results'}"]
    res = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    report(tmp_path / "results")
    rows = [line for line in (tmp_path / "results" / "draft_vocab" / "draft_vocab.tiny.md").read_text().splitlines()
            if line.startswith("| eagle2")]
    assert [r.split(" | ")[3] for r in rows] == ["whole", "16"]
    assert rows[0].endswith("| – | – |") and "%" in rows[1].split(" | ")[8]
