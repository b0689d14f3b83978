"""`make peer` (specbench/tools/peer.py): the head written in the authors' layout is the head that was trained, the target
exported for transformers 4.36 is the same model, and one definition of the compared output and its acceptance length
serves both sides. The authors' side itself (eagle-llm in .peer-venv) runs in the last test where that environment
exists (`make peer` builds it)."""
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from drafters.eagle import EagleDrafter, save_authors_head
from specbench.decode.engine import Engine
from specbench.errors import SpecbenchError
from specbench.tools.peer import AuthorsSide, compared, export_target, first_divergence, steps_to
from specbench.decode.types import SamplingParams
from tests.helpers import hf_greedy
from tests.test_published_layouts import DIMS, target_of, write_authors_head

MC_SIM_7B_63 = {"kind": "static", "name": "mc_sim_7b_63",
                "paths": [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
                          [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
                          [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]}


def trained_like_head(target, seed=4):
    head = EagleDrafter.build_module(target, EagleDrafter.options())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if "layernorm" in name else 0.0))
    return head


def test_a_head_written_in_the_authors_layout_is_the_same_head(tmp_path):
    target = target_of(DIMS["tiny"])
    head = trained_like_head(target)
    save_authors_head(head, target, tmp_path / "head")
    state = torch.load(tmp_path / "head" / "pytorch_model.bin", weights_only=True)
    # the key names an independent writer of the authors' layout uses (tests/test_published_layouts.py)
    assert set(state) == set(write_authors_head(tmp_path / "other", DIMS["tiny"]))
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["bias"] is True and cfg["rms_norm_eps"] == 1e-5
    assert cfg["num_key_value_heads"] == 2 and cfg["vocab_size"] == 128
    drafter = EagleDrafter(target, checkpoint=str(tmp_path / "head"), tree=MC_SIM_7B_63)
    for (k, a), (_, b) in zip(head.state_dict().items(), drafter.head.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    prompt = [5, 17, 33, 17, 33, 9, 2, 40]
    assert Engine(target, drafter, SamplingParams()).generate(prompt, 24).new_tokens == hf_greedy(target.model, prompt, 24)


def test_a_head_with_an_input_norm_has_no_authors_layout(tmp_path):
    target = target_of(DIMS["tiny"])
    with pytest.raises(SpecbenchError, match="input RMSNorm in layer 0"):
        save_authors_head(EagleDrafter.build_module(target, EagleDrafter.options(input_norm=True)), target, tmp_path / "head")


def test_the_exported_target_is_the_same_model_for_transformers_4_36(tmp_path, tiny_checkpoint):
    src = tmp_path / "src"
    src.mkdir()
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    cfg.pop("rope_theta", None)
    cfg["rope_parameters"] = {"rope_theta": 100000.0, "rope_type": "default"}  # as transformers 5 writes it
    (src / "config.json").write_text(json.dumps(cfg))
    spec = json.loads((tiny_checkpoint / "tokenizer.json").read_text())
    spec["model"]["merges"] = [["Ġ", "t"], ["h", "e"]]  # tokenizers >= 0.19 writes pairs
    (src / "tokenizer.json").write_text(json.dumps(spec))
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "tokenizer_class": "TokenizersBackend"}))
    (src / "model.safetensors").write_bytes((tiny_checkpoint / "model.safetensors").read_bytes())
    shipped = export_target(src, tmp_path / "shipped", None)
    other = export_target(src, tmp_path / "rope", 10000.0)
    assert json.loads((shipped / "config.json").read_text())["rope_theta"] == 100000.0
    assert "rope_parameters" not in json.loads((other / "config.json").read_text())
    assert AutoConfig.from_pretrained(other).rope_parameters["rope_theta"] == 10000.0  # our side reads it back
    assert json.loads((shipped / "tokenizer.json").read_text())["model"]["merges"] == ["Ġ t", "h e"]
    assert json.loads((shipped / "tokenizer_config.json").read_text()) == {
        "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    assert (shipped / "model.safetensors").resolve() == (src / "model.safetensors").resolve()


def test_one_definition_of_the_compared_tokens_and_the_steps():
    assert compared([4, 5, 2, 7], 10, eos=2) == [4, 5, 2]
    assert compared([4, 5, 6, 7], 3, eos=2) == [4, 5, 6]
    # known after each step, the prefill's first token included: 1 + (accepted + 1) per step
    assert steps_to([3, 4, 7, 9], 7) == 3 and steps_to([3, 4, 7, 9], 8) == 4 and steps_to([3], 1) == 1
    with pytest.raises(SpecbenchError, match="stopped at 9 tokens, 10 were needed"):
        steps_to([3, 4, 7, 9], 10)
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


PEER_PYTHON = Path(__file__).resolve().parents[1] / ".peer-venv" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not PEER_PYTHON.is_file(), reason="the authors' environment is made by `make test` and `make peer`")
def test_the_authors_eagle_and_ours_emit_the_same_tokens_and_steps(tmp_path, tiny_checkpoint):
    """On the tiny target (RoPE base 10000, which eagle-llm hard-codes), one random head in both: the same tokens,
    each the target's greedy output, in the same number of tree-verification steps."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from specbench.decode.target import TargetModel

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    target = TargetModel(LlamaForCausalLM.from_pretrained(tiny_checkpoint).eval(), tok, torch.device("cpu"), "t")
    save_authors_head(trained_like_head(target), target, tmp_path / "head")
    export = export_target(tiny_checkpoint, tmp_path / "target", None)
    drafter = EagleDrafter(target, checkpoint=str(tmp_path / "head"), tree=MC_SIM_7B_63)
    theirs = AuthorsSide(str(PEER_PYTHON), export, tmp_path / "head", 1, tmp_path / "authors.log")
    try:
        for prompt in ([5, 17, 33, 17, 33, 9, 2, 40], [7, 7, 7, 7, 7, 7]):
            ours = Engine(target, drafter, SamplingParams()).generate(prompt, 32)
            r = theirs("eagle", prompt, 32)
            out = compared(r["tokens"], 32, theirs.eos)
            assert out == compared(ours.new_tokens, 32, theirs.eos) == compared(hf_greedy(target.model, prompt, 32), 32, theirs.eos)
            assert steps_to(r["known"], len(out)) == ours.steps
    finally:
        theirs.close()


@pytest.mark.skipif(not PEER_PYTHON.is_file(), reason="the authors' environment is made by `make test` and `make peer`")
def test_make_peer_runs_both_targets_end_to_end(tmp_path, tiny_checkpoint, question_file):
    """run_peer as `make peer` runs it, on the tiny target as shipped and with another RoPE base (5000, where the
    authors' hard-coded 10000 makes their side decode another model): the head written for each variant's target
    loads (one head for both was refused on the variant: its config named the other base), every divergence is
    classified (the replay rule was called with the old arguments and crashed), ours equals the greedy output on both."""
    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer, LlamaForCausalLM

    from specbench.decode.checkpoints import save_checkpoint, target_identity
    from specbench.core.config import register_schema
    from specbench.tools.peer import run_peer
    from specbench.decode.target import TargetModel
    from tests.test_conformance import CONF

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    target = TargetModel(LlamaForCausalLM.from_pretrained(tiny_checkpoint).eval(), tok, torch.device("cpu"), "tiny")
    save_checkpoint(tmp_path / "eagle", trained_like_head(target), target, {"drafter": "eagle", **target_identity(target)})
    register_schema()
    with initialize_config_dir(config_dir=str(CONF.parent), version_base="1.3"):
        cfg = compose(config_name="peer", overrides=[
            f"model.path={tiny_checkpoint}", "model.name=tiny", f"model.cache_dir={tmp_path / 'cache'}", "dataset=jsonl",
            f"dataset.path={question_file}", "dataset.limit=2", "decoding.max_new_tokens=16", "bench.repeats=1",
            "bench.warmup=0", f"drafter.checkpoint={tmp_path / 'eagle'}", f"peer.python={PEER_PYTHON}",
            "peer.rope_thetas=[null,5000]", f"out.root={tmp_path / 'results'}"])
    r = run_peer(cfg)
    assert [v["rope_theta"] for v in r["variants"]] == [None, 5000.0]
    for v in r["variants"]:
        ours = v["identical_to_greedy"]["ours-eagle"]
        assert ours["identical"] == ours["of"] == 2
        for d in [*v["identical_to_greedy"].values(), v["ours_eagle_vs_theirs_eagle"]]:
            assert all(x["kind"] in ("near_tie", "mismatch", "length") for x in d["divergences"])
