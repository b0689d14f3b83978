"""EAGLE-3 (drafters/eagle3.py): the training-time test computes what drafting computes, the draft vocabulary from
token counts, its loss over the draft vocabulary, and a head written in the authors' layout (by hand, not by the
project's code) loading and decoding losslessly, each misfit one line."""
import json

import pytest
import torch
from transformers.cache_utils import DynamicLayer
from safetensors.torch import save_file

from drafters.eagle3 import Eagle3Drafter, Eagle3Options, default_layers
from specbench.errors import SpecbenchError
from specbench.train.features import online_layers
from tests.helpers import engine_greedy, hf_greedy, tiny_target


def _jitter(module, scale=0.5, seed=1):
    """Untrained norms are all ones and the head near zero: random weights everywhere, so that a wrong mask or position
    changes the numbers."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g) * scale)


def test_training_time_test_equals_drafting_a_chain():
    """Step i of the TTT at position t == the i-th node of a chain drafted below root t (same tokens forced): the
    context, the drafted ancestors, the RoPE positions and the fed-back outputs all agree."""
    target = tiny_target(seed=0)
    head = Eagle3Drafter.build_module(target, Eagle3Options(draft_vocab=64)).float()
    _jitter(head)
    ids = torch.randint(0, target.vocab_size, (1, 14), generator=torch.Generator().manual_seed(0))
    feats = online_layers(target, ids, torch.ones_like(ids), head.layers, "float32")
    n, steps = ids.shape[1] - 1, 5
    outs = list(head.ttt(target.decoder.embed_tokens, ids, feats[:, :n], torch.ones(1, n, dtype=torch.bool), steps))
    embed = target.decoder.embed_tokens
    for t in (0, 3, 7):
        causal = torch.ones(1, 1, t + 1, t + 1, dtype=torch.bool).tril()
        past = DynamicLayer()
        h = head.step(embed(ids[:, 1 : t + 2]), head.fc(feats[:, : t + 1]), torch.arange(t + 1)[None], past, causal)
        torch.testing.assert_close(h[:, -1], outs[0][:, t], rtol=1e-4, atol=1e-4)
        f = h[:, -1:]
        for i in range(1, steps):
            if t + 1 + i >= ids.shape[1]:
                break
            allowed = torch.ones(1, 1, 1, past.get_seq_length() + 1, dtype=torch.bool)
            f = head.step(embed(ids[:, t + 1 + i : t + 2 + i]), f, torch.tensor([[t + i]]), past, allowed)
            torch.testing.assert_close(f[:, 0], outs[i][:, t], rtol=1e-4, atol=1e-4)


def test_draft_vocabulary_is_the_most_frequent_ids_and_maps_back():
    target = tiny_target(seed=0)
    head = Eagle3Drafter.build_module(target, Eagle3Options(draft_vocab=5))
    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    counts[[40, 7, 99, 3]] = torch.tensor([9, 5, 5, 1])
    Eagle3Drafter.fit_data(head, counts, None)
    assert head.draft_ids.tolist() == [0, 3, 7, 40, 99]  # 4 seen, then the lowest unseen id; sorted by id
    assert head.d2t.tolist() == [0, 2, 5, 37, 95]  # offsets: target id = i + d2t[i] (the authors' layout)
    assert head.t2d.sum() == 5 and head.t2d[[0, 3, 7, 40, 99]].all()
    logits = head.target_logits(torch.randn(2, target.hidden_size))
    assert torch.isinf(logits).sum(-1).tolist() == [target.vocab_size - 5] * 2
    assert set(logits.argmax(-1).tolist()) <= {0, 3, 7, 40, 99}


def test_a_resumed_head_marks_its_own_draft_vocabulary(tmp_path):
    """A trainer's resume loads d2t into a head built with the identity vocabulary (fit_data runs at step 0 only): t2d,
    which the loss's position mask reads, must follow the loaded d2t (a stored copy of it once stayed the identity)."""
    from specbench.decode.checkpoints import load_checkpoint, save_checkpoint, target_identity

    target = tiny_target(seed=0)
    trained = Eagle3Drafter.build_module(target, Eagle3Options(draft_vocab=5))
    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    counts[[40, 7, 99, 3, 60]] = 1
    Eagle3Drafter.fit_data(trained, counts, None)
    save_checkpoint(tmp_path / "last", trained, target, {"drafter": "eagle3", **target_identity(target)})
    fresh = Eagle3Drafter.build_module(target, Eagle3Options(draft_vocab=5))
    load_checkpoint(tmp_path / "last", fresh, target, "eagle3")
    assert fresh.t2d.nonzero()[:, 0].tolist() == [3, 7, 40, 60, 99]


def test_the_loss_is_over_the_draft_vocabulary_and_skips_undraftable_targets():
    """A position whose target top-1 is outside the draft vocabulary adds nothing (the authors' position_mask)."""
    from specbench.train.trainer import Batch

    target = tiny_target(seed=0, scale=20.0)
    opts = Eagle3Options(draft_vocab=8, steps=2)
    head = Eagle3Drafter.build_module(target, opts).float()
    ids = torch.randint(0, target.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3))
    hidden = target.decoder(input_ids=ids).last_hidden_state
    top1 = target.lm_head(hidden).argmax(-1)[0]
    batch = Batch(ids, torch.ones_like(ids), torch.ones_like(ids), hidden, hidden,
                  layers=online_layers(target, ids, torch.ones_like(ids), head.layers, "float32"))
    head.set_vocab(torch.arange(8) + 100)  # none of the target's choices, unless by chance
    drafted = set(range(100, 108))
    loss, parts = Eagle3Drafter.training_loss(head, batch, target, opts)
    if not drafted & set(top1.tolist()):
        assert loss.item() == 0.0
    chosen = list(dict.fromkeys(top1[2:].tolist()))[:8]  # the target's choices at the predicted positions
    chosen += [i for i in range(target.vocab_size) if i not in chosen][: 8 - len(chosen)]
    head.set_vocab(torch.tensor(chosen))
    loss, parts = Eagle3Drafter.training_loss(head, batch, target, opts)
    assert loss.item() > 0 and {"ce0", "ce1", "top0", "top1"} <= set(parts)
    loss.backward()
    assert head.fc.weight.grad is not None and head.d2t.grad is None
    # loss_norm: the authors' mean over the padded batch weighs the same sum by real / all positions
    attn = torch.ones_like(ids)
    attn[0, 7:] = 0
    padded = Batch(ids, attn, attn, hidden, hidden, layers=batch.layers)
    real = Eagle3Drafter.training_loss(head, padded, target, opts)[0]
    theirs = Eagle3Drafter.training_loss(head, padded, target, Eagle3Options(draft_vocab=8, steps=2, loss_norm="padded"))[0]
    torch.testing.assert_close(theirs, real * 7 / 9)  # 7 real of the 9 positions that predict
    with pytest.raises(SpecbenchError, match="loss_norm='mean' is not one of real, padded"):
        Eagle3Options(loss_norm="mean")


def write_authors_head(path, target, draft_ids, seed=0, **config):
    """An EAGLE-3 head as the authors save it (SafeAILab/EAGLE traineagle3: fc, midlayer.*, norm, lm_head over the
    draft vocabulary, d2t offsets, t2d mask; no embed_tokens), written from the layout alone."""
    g = torch.Generator().manual_seed(seed)
    cfg = target.model.config
    h, i = cfg.hidden_size, cfg.intermediate_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    dh, n = h // nh, len(draft_ids)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    state = {"fc.weight": r(h, 3 * h), "norm.weight": 1 + r(h), "lm_head.weight": r(n, h),
             "midlayer.self_attn.q_proj.weight": r(nh * dh, 2 * h), "midlayer.self_attn.k_proj.weight": r(nkv * dh, 2 * h),
             "midlayer.self_attn.v_proj.weight": r(nkv * dh, 2 * h), "midlayer.self_attn.o_proj.weight": r(h, nh * dh),
             "midlayer.mlp.gate_proj.weight": r(i, h), "midlayer.mlp.up_proj.weight": r(i, h),
             "midlayer.mlp.down_proj.weight": r(h, i), "midlayer.hidden_norm.weight": 1 + r(h),
             "midlayer.input_layernorm.weight": 1 + r(h), "midlayer.post_attention_layernorm.weight": 1 + r(h)}
    ids = torch.tensor(sorted(draft_ids))
    state["d2t"] = ids - torch.arange(n)
    state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    state["t2d"][ids] = True
    meta = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": i,
            "num_attention_heads": nh, "num_key_value_heads": nkv, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
            "vocab_size": cfg.vocab_size, "draft_vocab_size": n, "torch_dtype": "float16", **config}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(meta))
    torch.save(state, path / "pytorch_model.bin")
    return state


def test_a_head_in_the_authors_layout_loads_and_decodes_losslessly(tmp_path):
    target = tiny_target(seed=0, scale=20.0)
    state = write_authors_head(tmp_path / "head", target, draft_ids=range(0, 128, 2))
    drafter = Eagle3Drafter(target, checkpoint=str(tmp_path / "head"),
                            tree={"kind": "dynamic", "depth": 4, "topk": 4, "total_tokens": 12})
    assert drafter.hidden_layers == default_layers(target.model.config.num_hidden_layers)
    assert torch.equal(drafter.head.lm_head.weight, state["lm_head.weight"])
    assert drafter.head.draft_ids.tolist() == list(range(0, 128, 2))
    for prompt in ([5, 17, 33, 17, 33, 9, 2], [1, 2, 3, 4, 5, 6]):
        assert engine_greedy(target, drafter, prompt, 40) == hf_greedy(target.model, prompt, 40)
    # the SGLang copy of the same weights (architecture LlamaForCausalLMEagle3) loads the same way
    write_authors_head(tmp_path / "sgl", target, draft_ids=range(64), architectures=["LlamaForCausalLMEagle3"])
    assert Eagle3Drafter(target, checkpoint=str(tmp_path / "sgl")).head.draft_ids.tolist() == list(range(64))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda s, c: c.update(hidden_size=64), "EAGLE-3 head of width 64"),
    (lambda s, c: c.update(vocab_size=256), "vocabulary of 256"),
    (lambda s, c: s.pop("midlayer.hidden_norm.weight"), "missing \\['midlayer.hidden_norm.weight'\\]"),
    (lambda s, c: s.update({"lm_head.weight": torch.zeros(3, 32)}), "lm_head.weight is \\(3, 32\\)"),
    (lambda s, c: s["t2d"].__setitem__(1, True), "t2d does not mark"),
    (lambda s, c: s.pop("d2t"), "needs d2t"),
    (lambda s, c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "RoPE is scaled"),
    (lambda s, c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "RoPE is scaled"),
    (lambda s, c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 6]), "layer ids \\[1, 3, 6\\]"),
    (lambda s, c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [-2, 2, 4]}), "outside the target"),
    (lambda s, c: c.update(target_hidden_size=64), "target states of width 64"),
    (lambda s, c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 3]},
                           eagle_aux_hidden_state_layer_ids=[1, 3, 5]), "name different layers"),
])
def test_a_misfit_authors_head_is_one_line(tmp_path, edit, message):
    target = tiny_target(seed=0)
    state = write_authors_head(tmp_path, target, draft_ids=range(0, 128, 2))
    cfg = json.loads((tmp_path / "config.json").read_text())
    edit(state, cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(SpecbenchError, match=message) as err:
        Eagle3Drafter(target, checkpoint=str(tmp_path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("field", [{"rope_scaling": {"rope_type": "default"}}, {"rope_scaling": {"type": "default"}},
                                   {"rope_scaling": None}, {"rope_parameters": {"rope_type": "default",
                                                                                 "rope_theta": 10000.0}}])
def test_an_unscaled_head_that_names_its_default_rope_loads(tmp_path, field):
    # a config that spells out the default RoPE (transformers writes {"rope_type": "default"}) is not a scaled head
    target = tiny_target(seed=0)
    write_authors_head(tmp_path, target, draft_ids=range(32))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **field}))
    assert Eagle3Drafter(target, checkpoint=str(tmp_path)).head.draft_ids.tolist() == list(range(32))


def test_layers_outside_the_target_are_refused():
    with pytest.raises(SpecbenchError, match="hidden_states indices must be in 0 .. 5"):
        Eagle3Drafter.build_module(tiny_target(seed=0), Eagle3Options(layers=[2, 3, 6]))


def test_a_safetensors_head_loads_too(tmp_path):
    target = tiny_target(seed=0)
    state = write_authors_head(tmp_path, target, draft_ids=range(32))
    (tmp_path / "pytorch_model.bin").unlink()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    assert Eagle3Drafter(target, checkpoint=str(tmp_path)).head.draft_ids.tolist() == list(range(32))


# what the serving engines read (SGLang llama_eagle3.py / SpecForge to_sglang.py; vLLM llama_eagle3.py and its
# speculators config checks, configs/speculators/base.py), as keys and config fields
SGLANG_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
               "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
               "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
               "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
               "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight"}
LLAMA_FIELDS = {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_theta", "tie_word_embeddings"}


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_a_head_saved_for_serving_has_the_engines_keys_and_fields(tmp_path, fmt):
    from safetensors.torch import load_file

    target = tiny_target(seed=0, scale=20.0)
    d = Eagle3Drafter(target, module={"draft_vocab": 40}, tree={"kind": "dynamic", "depth": 4, "topk": 4,
                                                               "total_tokens": 12})
    d.head.set_vocab(torch.arange(0, 120, 3))
    out = d.save_for_serving(tmp_path / fmt, fmt, "org/tiny")
    state, cfg = load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert state["t2d"].shape == (target.vocab_size,) and int(state["t2d"].sum()) == 40  # speculators' checks
    assert torch.equal(state["t2d"].nonzero()[:, 0], state["d2t"] + torch.arange(40))  # SpecForge's invariant
    assert not any("embed" in k for k in state)  # the target's table is shared, never exported
    if fmt == "sglang":
        assert set(state) == SGLANG_KEYS and cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert LLAMA_FIELDS <= set(cfg) and cfg["draft_vocab_size"] == 40 and cfg["num_hidden_layers"] == 1
        assert "eagle_config" not in cfg  # the default layers: every engine's default
        again = Eagle3Drafter(target, checkpoint=str(out), tree={"kind": "dynamic", "depth": 4, "topk": 4,
                                                                  "total_tokens": 12})  # the authors' layout, read back
        for k, v in d.head.state_dict().items():
            assert torch.equal(again.head.state_dict()[k], v), k
        prompt = [5, 17, 33, 17, 33, 9, 2]
        assert engine_greedy(target, again, prompt, 30) == engine_greedy(target, d, prompt, 30)
    else:
        assert set(state) == {k.replace("midlayer.", "layers.0.") for k in SGLANG_KEYS}
        assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
        assert cfg["norm_before_residual"] is False and cfg["draft_vocab_size"] == 40
        assert cfg["eagle_aux_hidden_state_layer_ids"] == list(default_layers(6))
        sc = cfg["speculators_config"]
        assert sc["proposal_methods"][0]["speculative_tokens"] == 4 and sc["verifier"]["name_or_path"] == "org/tiny"
        assert LLAMA_FIELDS <= set(cfg["transformer_layer_config"])


def test_a_head_on_other_layers_exported_for_sglang_reads_back_on_the_same_layers(tmp_path):
    # SGLang's eagle_config counts layer outputs (it captures layer i + 1's input): export writes index - 1, the
    # loader must add the 1 back, or the head fuses the wrong features
    target = tiny_target(seed=0, scale=20.0)
    tree = {"kind": "dynamic", "depth": 4, "topk": 4, "total_tokens": 12}
    d = Eagle3Drafter(target, module={"layers": [1, 3, 5]}, tree=tree)
    _jitter(d.head)
    out = d.save_for_serving(tmp_path / "sgl", "sglang", "org/tiny")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    # vLLM's model runner reads a top-level list first (the input of layer i: our index) and ignores eagle_config's
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    again = Eagle3Drafter(target, checkpoint=str(out), tree=tree)
    assert again.hidden_layers == (1, 3, 5)
    prompt = [5, 17, 33, 17, 33, 9, 2]
    assert engine_greedy(target, again, prompt, 30) == hf_greedy(target.model, prompt, 30)


def test_an_unknown_serving_format_is_one_line(tmp_path):
    d = Eagle3Drafter(tiny_target(seed=0))
    with pytest.raises(SpecbenchError, match="export.format='vllm' is not one of sglang, speculators"):
        d.save_for_serving(tmp_path, "vllm", "org/tiny")


def test_the_draft_vocabulary_is_sized_by_the_coverage_rule():
    from specbench.decode.vocab import covering_size

    counts = torch.zeros(100)
    counts[:10] = torch.tensor([50.0, 20, 10, 8, 5, 3, 2, 1, 0.5, 0.5])  # 100 tokens over 10 ids
    assert covering_size(counts, 0.5) == 1 and covering_size(counts, 0.8) == 3 and covering_size(counts, 0.99) == 8
    assert covering_size(counts, 0.99, multiple=16) == 16 and covering_size(counts, 1.0, multiple=64) == 64
    assert covering_size(counts, 1.0, multiple=1024) == 100  # capped at the vocabulary
    with pytest.raises(ValueError):
        covering_size(counts, 0.0)
    # the drafter sizes N only where the YAML leaves it open, and records it (decoding rebuilds the same shape)
    assert Eagle3Drafter.fit_options(Eagle3Options(draft_vocab_coverage=0.99, draft_vocab_multiple=4), counts) == \
        {"draft_vocab": 8}
    assert Eagle3Drafter.fit_options(Eagle3Options(draft_vocab=40), counts) == {}
