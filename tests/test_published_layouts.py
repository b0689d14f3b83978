"""Heads published in their authors' layout (SafeAILab/EAGLE `cnets.py`: yuhuili/EAGLE-*, HArmonizedSS/HASS-*) load
through `drafter.checkpoint=<dir>`, the layout detected from the files. The checkpoints here are written by this test
in exactly that layout (random weights, the real key names and config fields), not by the project's own saving code,
for a tiny Llama and for SmolLM2's dimensions."""
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from drafters.eagle import EagleDrafter
from drafters.hass import HassDrafter
from specbench.decode.engine import Engine
from specbench.errors import SpecbenchError
from specbench.decode.target import TargetModel
from specbench.decode.types import SamplingParams
from tests.helpers import hf_greedy

DIMS = {  # (vocab, hidden, heads, kv heads, intermediate)
    "tiny": (128, 32, 4, 2, 64),
    "smollm2-135m": (49152, 576, 9, 3, 1536),  # SmolLM2-135M's config, 2 layers
}


def target_of(dims, layers=2, seed=0):
    vocab, hidden, heads, kv, inter = dims
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=512,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.generation_config.pad_token_id = 0
    return TargetModel(model, None, torch.device("cpu"), "t")


def write_authors_head(path, dims, fmt="bin", bias=True, drop=(), extra=None, config=None):
    """An EAGLE head as the authors save it: their config.json and state-dict keys."""
    vocab, hidden, heads, kv, inter = dims
    dh = hidden // heads
    g = torch.Generator().manual_seed(1)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.05  # noqa: E731
    state = {"fc.weight": r(hidden, 2 * hidden),
             "layers.0.self_attn.q_proj.weight": r(heads * dh, hidden),
             "layers.0.self_attn.k_proj.weight": r(kv * dh, hidden),
             "layers.0.self_attn.v_proj.weight": r(kv * dh, hidden),
             "layers.0.self_attn.o_proj.weight": r(hidden, heads * dh),
             "layers.0.mlp.gate_proj.weight": r(inter, hidden), "layers.0.mlp.up_proj.weight": r(inter, hidden),
             "layers.0.mlp.down_proj.weight": r(hidden, inter),
             "layers.0.post_attention_layernorm.weight": 1 + r(hidden),
             "embed_tokens.weight": r(vocab, hidden)}
    if bias:
        state["fc.bias"] = r(hidden)
    state.update(extra or {})
    for k in drop:
        state.pop(k)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": vocab, "hidden_act": "silu",
           "max_position_embeddings": 2048, "torch_dtype": "float16", **({} if bias else {"bias": False}),
           **(config or {})}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    half = {k: v.half() for k, v in state.items()}  # the published heads are fp16
    if fmt == "bin":
        torch.save(half, path / "pytorch_model.bin")
    else:
        save_file(half, str(path / "model.safetensors"))
    return state


@pytest.mark.parametrize("name", sorted(DIMS))
@pytest.mark.parametrize(("fmt", "bias", "cls"), [("bin", True, EagleDrafter), ("safetensors", False, HassDrafter)])
def test_an_authors_head_loads_and_decodes_losslessly(tmp_path, name, fmt, bias, cls):
    target = target_of(DIMS[name])
    state = write_authors_head(tmp_path / "head", DIMS[name], fmt, bias)
    drafter = cls(target, checkpoint=str(tmp_path / "head"),
                  tree={"kind": "dynamic", "depth": 3, "topk": 3, "total_tokens": 8})
    head = drafter.head
    assert isinstance(head.body.layers[0].input_layernorm, torch.nn.Identity)  # their layer 0: no input norm
    assert (head.fc.bias is not None) == bias and head.body.config.rms_norm_eps == 1e-6
    torch.testing.assert_close(head.body.layers[0].mlp.down_proj.weight,
                               state["layers.0.mlp.down_proj.weight"].half().float())
    torch.testing.assert_close(head.fc.weight, state["fc.weight"].half().float())
    prompt = [5, 17, 33, 17, 33, 9, 2, 40]
    gen = Engine(target, drafter, SamplingParams()).generate(prompt, 24)
    assert gen.new_tokens == hf_greedy(target.model, prompt, 24)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"drop": ("layers.0.mlp.down_proj.weight",)}, "missing ['layers.0.mlp.down_proj.weight']"),
    ({"extra": {"layers.0.self_attn.rotary.weight": torch.zeros(2)}}, "unexpected ['layers.0.self_attn.rotary"),
    ({"config": {"hidden_size": 64}}, "EAGLE head for hidden_size=64; the target 't' has 32"),
    ({"extra": {"embed_tokens.weight": torch.zeros(99, 32)}}, "embed_tokens (99, 32) does not match"),
    ({"config": {"rope_theta": 500000.0}}, "EAGLE head for rope_theta=500000; the target 't' has 10000"),
])
def test_a_head_that_does_not_fit_gets_one_line(tmp_path, kwargs, message):
    target = target_of(DIMS["tiny"])
    write_authors_head(tmp_path / "head", DIMS["tiny"], **kwargs)
    with pytest.raises(SpecbenchError) as e:
        EagleDrafter(target, checkpoint=str(tmp_path / "head"))
    assert message in str(e.value) and "\n" not in str(e.value)


# ---- vanilla SD with any HF causal LM as the draft (drafter.model_path)
def test_an_hf_draft_with_the_targets_tokenizer_and_a_padded_vocabulary(tmp_path, tiny_checkpoint):
    """As Qwen2.5-0.5B drafting for Qwen2.5-7B: the same tokenizer, embedding tables padded to other sizes. The draft
    works on the rows both have; greedy and sampled chains and a tree decode losslessly."""
    from transformers import AutoTokenizer

    from drafters.sd import IndependentDrafter
    from tests.conftest import byte_tokenizer
    from tests.helpers import tiny_llama

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    target = TargetModel(LlamaForCausalLM.from_pretrained(tiny_checkpoint).eval(), tok, torch.device("cpu"), "t")
    draft = tiny_llama(vocab=len(byte_tokenizer()) + 16, layers=1, hidden=32, seed=3)  # 16 padding rows more
    draft.save_pretrained(tmp_path / "draft")
    byte_tokenizer().save_pretrained(tmp_path / "draft")
    prompt = [5, 17, 33, 17, 33, 9, 2, 40]
    ref = hf_greedy(target.model, prompt, 20)
    for tree in (None, {"kind": "dynamic", "depth": 3, "topk": 2, "total_tokens": 6}):
        drafter = IndependentDrafter(target, gamma=3, model_path=str(tmp_path / "draft"), tree=tree)
        assert Engine(target, drafter, SamplingParams()).generate(prompt, 20).new_tokens == ref
    drafter = IndependentDrafter(target, gamma=3, model_path=str(tmp_path / "draft"))
    g = Engine(target, drafter, SamplingParams(temperature=1.0)).generate(prompt, 20, torch.Generator().manual_seed(0))
    assert len(g.new_tokens) == 20 and max(g.new_tokens) < target.vocab_size


def test_an_hf_draft_with_another_tokenizer_is_refused(tmp_path, tiny_checkpoint):
    from transformers import AutoTokenizer

    from drafters.sd import IndependentDrafter
    from tests.conftest import byte_tokenizer
    from tests.helpers import tiny_llama

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    target = TargetModel(LlamaForCausalLM.from_pretrained(tiny_checkpoint).eval(), tok, torch.device("cpu"), "t")
    other = byte_tokenizer()
    vocab = other.backend_tokenizer.get_vocab()
    a, b = vocab["!"], vocab['"']
    swapped = {**vocab, "!": b, '"': a}  # the same size, two tokens at each other's ids
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(vocab=swapped, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(tmp_path / "draft")
    tiny_llama(vocab=len(tok), layers=1, hidden=32).save_pretrained(tmp_path / "draft")
    with pytest.raises(SpecbenchError) as e:
        IndependentDrafter(target, model_path=str(tmp_path / "draft"))
    assert "tokenizes differently from the target: '!' is id" in str(e.value) and "\n" not in str(e.value)


# ---- Medusa-1 as FasterDecoding/Medusa publishes it
def write_authors_medusa(path, hidden, vocab, heads=5, drop=(), config_heads=2):
    g = torch.Generator().manual_seed(2)
    state = {}
    for i in range(heads):
        state[f"{i}.0.linear.weight"] = torch.randn(hidden, hidden, generator=g) * 0.05
        state[f"{i}.0.linear.bias"] = torch.randn(hidden, generator=g) * 0.05
        state[f"{i}.1.weight"] = torch.randn(vocab, hidden, generator=g)
    for k in drop:
        state.pop(k)
    path.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.half() for k, v in state.items()}, path / "medusa_lm_head.pt")
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": config_heads, "medusa_num_layers": 1,
                                                  "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}))
    return state


def test_published_medusa_heads_load_with_their_own_lm_heads_and_decode_losslessly(tmp_path):
    from drafters.medusa import MedusaDrafter

    target = target_of(DIMS["tiny"])
    state = write_authors_medusa(tmp_path / "medusa", 32, 128)
    tree = [[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]
    drafter = MedusaDrafter(target, checkpoint=str(tmp_path / "medusa"), tree=tree)
    assert len(drafter.heads.w1) == 5  # counted from the tensors, not the config's 2
    torch.testing.assert_close(drafter.heads.w2[3].weight, state["3.1.weight"].half().float())
    prompt = [5, 17, 33, 17, 33, 9, 2, 40]
    assert Engine(target, drafter, SamplingParams()).generate(prompt, 24).new_tokens == hf_greedy(target.model, prompt, 24)
    # no measured accuracies in a published checkpoint: `tree: auto` decodes with the authors' own mc_sim_7b_63
    from drafters.medusa import MEDUSA_MC_SIM_7B_63

    drafter = MedusaDrafter(target, checkpoint=str(tmp_path / "medusa"), tree="auto")
    assert len(MEDUSA_MC_SIM_7B_63) == 63 and sorted(map(tuple, drafter.paths)) == sorted(map(tuple, MEDUSA_MC_SIM_7B_63))
    # ... and says so to run.json, whose caption then names it (not "from the heads' accuracies")
    from specbench.bench.report.cells import tree_of

    assert drafter.tree_used["name"] == "mc_sim_7b_63"
    assert tree_of({"name": "medusa", "tree": "auto", "tree_nodes": 19}, drafter.tree_used).startswith(
        "static Medusa mc_sim_7b_63 (63 nodes")
    assert Engine(target, drafter, SamplingParams()).generate(prompt, 24).new_tokens == hf_greedy(target.model, prompt, 24)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"hidden": 64}, "for hidden size 64 and vocabulary 128; the target 't' has 32 and 128"),
    ({"drop": ("2.1.weight",)}, "missing ['2.1.weight']"),
])
def test_a_medusa_checkpoint_that_does_not_fit_gets_one_line(tmp_path, kwargs, message):
    from drafters.medusa import MedusaDrafter

    target = target_of(DIMS["tiny"])
    write_authors_medusa(tmp_path / "medusa", kwargs.pop("hidden", 32), 128, **kwargs)
    with pytest.raises(SpecbenchError) as e:
        MedusaDrafter(target, checkpoint=str(tmp_path / "medusa"), tree=[[0], [0, 0]])
    assert message in str(e.value) and "\n" not in str(e.value)


def write_authors_moa(path, target, drop=(), extra=None, config=None, layout="training"):
    """MoA's drafter as its authors' save_pretrained writes it (layout `training`: the target's config.json) or as
    their vllm/convert_checkpoint.py rewrites that (`vllm`: model_type moa_spec, the widths recorded), the drafter's
    tensors in model.safetensors (bf16), from specbench.replicas.moa_state (their rule, not drafters/moa.py)."""
    from specbench.tools.replicas import moa_state, moa_vllm_config

    cfg = target.model.config
    state = moa_state(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, seed=4)
    state.update(extra or {})
    for k in drop:
        state.pop(k)
    path.mkdir(parents=True, exist_ok=True)
    written = {**cfg.to_dict(), "architectures": ["MOASpecLlamaForCausalLM"]}
    if layout == "vllm":
        written = moa_vllm_config(written, state)
    (path / "config.json").write_text(json.dumps({**written, **(config or {})}))
    save_file({k: v.bfloat16() for k, v in state.items()}, str(path / "model.safetensors"))
    return state


LLAMA3_LIKE = (128, 64, 8, 2, 128)  # Llama-3-8B's 4:1 grouped-query structure, scaled down


@pytest.mark.parametrize(("tli", "layout"), [(0, "training"), (1, "training"), (0, "vllm"), (1, "vllm")])
def test_the_published_moa_layout_loads_and_decodes_losslessly(tmp_path, tli, layout):
    """huawei-noah/MOASpec-Llama-3-8B-Instruct's layouts (their training's and their vLLM port's): widths and head
    counts read from the tensors, every tensor in place, and the drafter lossless through the engine (TLI from the
    YAML: their checkpoint does not record it)."""
    from drafters.moa import MoADrafter

    target = target_of(LLAMA3_LIKE, layers=3)
    state = write_authors_moa(tmp_path / "moa", target, layout=layout)
    drafter = MoADrafter(target, checkpoint=str(tmp_path / "moa"), module={"tli": tli},
                         tree={"kind": "dynamic", "depth": 3, "topk": 3, "total_tokens": 8})
    net = drafter.net
    assert net.tli == tli and net.layer_self_attention.self_attn.head_dim == 4  # 2 E_kv = 32 over the 8 target heads
    assert net.self_attention.self_attn.num_key_value_groups == 8 and net.cross_attention.nkv == 1
    own = dict(net.named_parameters())
    assert set(own) == set(state)
    for k, v in state.items():
        torch.testing.assert_close(own[k], v.bfloat16().float())
    prompt = [5, 17, 33, 17, 33, 9, 2, 40]
    gen = Engine(target, drafter, SamplingParams()).generate(prompt, 24)
    assert gen.new_tokens == hf_greedy(target.model, prompt, 24)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"drop": ("cross_attention.mlp.up_proj.weight",)}, "missing ['cross_attention.mlp.up_proj.weight']"),
    ({"extra": {"lm_head.weight": torch.zeros(128, 64)}}, "unexpected ['lm_head.weight']"),
    ({"config": {"hidden_size": 128}}, "MoA drafter for hidden_size=128; the target 't' has 64"),
    ({"config": {"num_hidden_layers": 32}}, "MoA drafter for num_hidden_layers=32; the target 't' has 3"),
    ({"config": {"rope_theta": 500000.0}}, "MoA drafter for rope_theta=500000; the target 't' has 10000"),
    ({"extra": {"Ekv2E.weight": torch.zeros(64, 16)}}, "Ekv2E.weight is (64, 16), the target 't' needs (64, 32)"),
    ({"drop": ("Ekv2E.weight", "Ekv2E.bias")}, "is not a MoA drafter in its authors' layout (no Ekv2E.weight)"),
    ({"layout": "vllm", "config": {"hidden_size": 128}}, "MoA drafter for hidden_size=128; the target 't' has 64"),
    ({"layout": "vllm", "config": {"disable_LSA": True}}, "without its Layer Self-Attention (disable_LSA)"),
    ({"layout": "vllm", "config": {"self_attention_intermediate_size": 512}},
     "config.json records self_attention_intermediate_size=512, its tensors 96"),
    ({"layout": "vllm", "config": {"layer_self_attention_num_key_value_heads": 4}},
     "config.json records layer_self_attention_num_key_value_heads=4, its tensors 2"),
])
def test_a_moa_checkpoint_that_does_not_fit_gets_one_line(tmp_path, kwargs, message):
    from drafters.moa import MoADrafter

    target = target_of(LLAMA3_LIKE, layers=3)
    write_authors_moa(tmp_path / "moa", target, **kwargs)
    with pytest.raises(SpecbenchError) as e:
        MoADrafter(target, checkpoint=str(tmp_path / "moa"))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_published_heads_decode_next_to_a_half_precision_target(tmp_path, dtype):
    """The published Medusa-1 heads (fp16 on the hub) and an EAGLE head are cast to the target's dtype, as their
    authors cast them; Medusa's stayed fp32 and crashed on a bf16/fp16 target."""
    from drafters.eagle import EagleDrafter
    from drafters.medusa import MedusaDrafter

    target = target_of(DIMS["tiny"])
    target.model.to(dtype)
    write_authors_medusa(tmp_path / "medusa", 32, 128)
    write_authors_head(tmp_path / "eagle", DIMS["tiny"], "bin", True)
    from specbench.decode.drafter import NoDrafter
    prompt = [5, 17, 33, 17, 33, 9, 2, 40]
    base = Engine(target, NoDrafter(target), SamplingParams()).generate(prompt, 24).new_tokens
    for drafter in (MedusaDrafter(target, checkpoint=str(tmp_path / "medusa"), tree="auto"),
                    EagleDrafter(target, checkpoint=str(tmp_path / "eagle"),
                                 tree={"kind": "dynamic", "depth": 3, "topk": 3, "total_tokens": 8})):
        module = drafter.heads if isinstance(drafter, MedusaDrafter) else drafter.head
        assert {p.dtype for p in module.parameters()} == {dtype}
        assert Engine(target, drafter, SamplingParams()).generate(prompt, 24).new_tokens == base
