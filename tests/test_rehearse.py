"""The day-one rehearsal, reduced (`make rehearse` runs it whole): Vicuna-7B v1.3's replica (.bin weights, a
SentencePiece tokenizer.model only, 2,048 positions) and its published drafters' replicas under their real hub ids,
then the runbook's (docs/gpu.md) `make download` and `make bench MODEL=vicuna-7b PRESET=paper` in bf16, offline. One published
drafter replica is altered to misfit the target: its job fails, the others finish losslessly, and the table names
the failure."""
import json

import pytest

from specbench.tools import rehearse

from specbench.tools import replicas

pytestmark = pytest.mark.slow


def test_day_one_on_vicuna_in_bf16_with_one_broken_download(tmp_path):
    root = tmp_path / "rehearsal"
    rehearse.write(root, ["vicuna-7b"])
    cache = replicas.HubCache(root / "hf")
    bad = replicas.medusa_heads({"vocab": 77, "target": replicas.TARGETS["vicuna-7b"]}, seed=1)  # another vocabulary
    cache.put("FasterDecoding/medusa-vicuna-7b-v1.3", bad)
    out = rehearse.rehearse(root, ["vicuna-7b"], ["bfloat16"], limit=1, max_new_tokens=24, replicas=False)
    rows = {(r["drafter"], r["dataset"]): r for r in out.rows}
    for drafter in ("none", "pld", "eagle", "eagle2", "sd"):
        for dataset in ("mtbench", "gsm8k", "cnndm"):
            r = rows[(drafter, dataset)]
            assert r["dtype"] == "bfloat16" and r["turns"] == (2 if dataset == "mtbench" else 1)
            if drafter != "none":
                assert r["lossless"] + r["near_tie"] == r["compared"] == r["turns"], r
    assert not any(d == "medusa" for d, _ in rows)
    assert [c for c, rc in out.steps if rc != 0] == [c for c, _ in out.steps if "bench" in c]  # the sweep exits 1
    failed = [p for p in out.problems if p.startswith("failed job medusa")]
    assert len(failed) == 3 and "holds Medusa heads for hidden size 64 and vocabulary 77" in failed[0]
    assert not any("named in no table" in p or "no table" in p for p in out.problems), out.problems
    table = (root / "results" / "beagle_table1" / "table1.vicuna-7b.md").read_text()
    assert "| medusa | failed |" in table and "Failed jobs: medusa on cnndm" in table
    head = json.loads(next((root / "results" / "beagle_table1").glob("vicuna-7b__eagle2__*/run.json")).read_text())
    assert head["model_identity"]["dtype"] == "bfloat16" and head["config"]["model"]["hf_id"] == "lmsys/vicuna-7b-v1.3"


def test_the_moa_replica_in_its_authors_layout_decodes_on_the_llama3_replica(tmp_path):
    """The rehearsal's Llama-3-8B-Instruct replica with huawei-noah/MOASpec-Llama-3-8B-Instruct beside it (listed under
    conf/model/llama3-8b.yaml `published`): the drafter loads from the hub cache's snapshot as `make download` leaves
    it and decodes losslessly in the replica's bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    from drafters.moa import MoADrafter
    from specbench.decode.engine import Engine
    from specbench.decode.target import TargetModel
    from specbench.decode.types import SamplingParams
    from tests.helpers import hf_greedy

    assert rehearse.published("llama3-8b")["moa"] == "huawei-noah/MOASpec-Llama-3-8B-Instruct"
    assert "moa" in rehearse.drafters_for("llama3-8b")
    root = tmp_path / "rehearsal"
    rehearse.write(root, ["llama3-8b"])
    snap = lambda repo: next((root / "hf" / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots").iterdir())  # noqa: E731
    model = AutoModelForCausalLM.from_pretrained(snap("meta-llama/Meta-Llama-3-8B-Instruct"), dtype=torch.bfloat16)
    target = TargetModel(model.eval().requires_grad_(False), None, torch.device("cpu"), "llama3-8b")
    drafter = MoADrafter(target, checkpoint=str(snap("huawei-noah/MOASpec-Llama-3-8B-Instruct")), module={"tli": 0},
                         tree={"kind": "dynamic", "depth": 3, "topk": 3, "total_tokens": 8})
    assert drafter.net.Ekv2E.weight.dtype == torch.bfloat16
    prompt = [5, 17, 33, 17, 33, 9, 2, 40]
    gen = Engine(target, drafter, SamplingParams()).generate(prompt, 24)
    assert gen.new_tokens == hf_greedy(target.model, prompt, 24)


@pytest.mark.parametrize("model", ["llama3.1-8b", "vicuna-13b"])
def test_the_eagle3_replicas_in_their_authors_layout_decode_on_their_targets(tmp_path, model):
    """yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (a quarter of the vocabulary drafted, d2t / t2d) on the Llama-3.1 replica
    (RoPE scaled "llama3"; the head's own RoPE is plain, base 10000) and yuhuili/EAGLE3-Vicuna1.3-13B (the whole
    vocabulary, no d2t / t2d) on Vicuna-13B's, as `make download` leaves them: lossless, Llama-3.1 in its bf16 and
    Vicuna in fp32 (in its fp16 this prompt's 15th token is an exact tie, two logits of 11.2578125, which a tree
    forward and a plain one may break apart: the near-tie the rehearsal's replay rule classifies)."""
    import torch
    from transformers import AutoModelForCausalLM

    from drafters.eagle3 import Eagle3Drafter
    from specbench.decode.engine import Engine
    from specbench.decode.target import TargetModel
    from specbench.decode.types import SamplingParams
    from tests.helpers import hf_greedy

    repo = rehearse.published(model)["eagle3"]
    assert "eagle3" in rehearse.drafters_for(model)
    root = tmp_path / "rehearsal"
    rehearse.write(root, [model])
    snap = lambda r: next((root / "hf" / "hub" / f"models--{r.replace('/', '--')}" / "snapshots").iterdir())  # noqa: E731
    model_dir = snap(replicas.TARGETS[model].repo)
    dtype = torch.bfloat16 if model == "llama3.1-8b" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    target = TargetModel(hf.eval().requires_grad_(False), None, torch.device("cpu"), model)
    drafter = Eagle3Drafter(target, checkpoint=str(snap(repo)),
                            tree={"kind": "dynamic", "depth": 4, "topk": 3, "total_tokens": 10})
    assert drafter.head.fc.weight.dtype == dtype and drafter.hidden_layers == (2, 4, 5)
    assert drafter.head.midlayer.rope_theta == 10000.0
    quarter = model == "llama3.1-8b"
    assert (drafter.head.d2t.shape[0] < target.vocab_size) == quarter
    prompt = [5, 17, 33, 17, 33, 9, 2, 40]
    gen = Engine(target, drafter, SamplingParams()).generate(prompt, 24)
    assert gen.new_tokens == hf_greedy(target.model, prompt, 24)
