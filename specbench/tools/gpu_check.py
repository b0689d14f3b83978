"""`make gpu-check` (`python -m specbench.gpu_check`): everything a lent GPU can tell about this engine, in one command.

A GPU reaches this project rarely and briefly (a bare machine: torch and transformers, no hub), so this needs nothing
downloaded: every target is built on the device from a Llama config with random weights.

  1. lossless (two parts, eager and compiled): a tiny fp32 target; every drafter config (conf/drafter/*.yaml,
     untrained modules of the right shape) decodes the prompts eager or compiled (model.compile), one at a time and
     as one batch, tokens equal to the target's own greedy output; then the law part, one T > 0 case: the first
     drafted step's token law against the target's exact one (a chi-square test);
  2. per real shape (random bf16 Llama-2-7B and Llama-3-8B, GQA; `--shapes`), one prompt of `--prompt` tokens and
     `--new` new tokens, in these parts:
     - timings: ms per token: the HBM floor (the weight bytes at the bandwidth measured by a device copy), bare
       F.linear over every weight matrix, our baseline eager (on the preallocated cache every decode runs on; the
       records of before issue 77 also timed transformers' DynamicCache) and compiled;
     - verify: verify ms against tree size (chains of 1..128 nodes), eager and compiled (a chain whose rows pass the
       largest compiled bucket runs eagerly even on the compiled target: its compiled cell says so, untimed);
     - profile: the compiled baseline step's device time by kernel class (matmul, attention, norms and elementwise,
       copies), the idle gap between kernels, and the top kernels raw (torch.profiler);
     - drafters eager, drafters compiled: each drafter at its paper tree (an untrained head: the tree is grown in
       full whatever is accepted): draft / verify / other ms per step, and the predicted speedup at the tau Spec-Bench
       publishes for the method (conf/experiment/specbench_board.yaml) beside its published speedup; eager, each
       drafter's first pass against its repeat (the order-dependence of cuDNN's per-shape plans; the SDPA backends
       are fixed, `--sdpa`, and recorded);
     - batch eager, batch compiled (`--batch-drafters`, `--batch-sizes`, `--batch-modes`): draft ms per step and per
       row-step, verify ms per step, tokens/s, for B ragged prompts decoded together;
     - generate: transformers' generate eager and with its static cache compiled (that compiles for a minute).

A slot cannot be wasted by one part: each part runs in a process of its own (specbench/tools/isolated.py) under a
hard limit, min(`--part-limit` or its `--limit NAME=S`, the time left to `--deadline`); a part that raises, crashes
or overruns is killed and recorded ("failed" with its error's last line, "timeout" with its limit) with what it had
measured, and the next part runs; parts the deadline leaves no time for are recorded "skipped (deadline)". So a call
ends within its deadline (default 480 s) plus a few seconds. The record (gpu_check.json, gpu_check.md) is rewritten
after every part, into `--out`, else $OUT (a remote runner's returned folder), else results/gpu_check/<device>/. The
commit is $SPECBENCH_COMMIT, else $SPECBENCH_GIT_COMMIT, else git's HEAD, else "unknown".

  python -m specbench.gpu_check                       # on a GPU: both shapes, every drafter, up to the deadline
  python -m specbench.gpu_check --parts "llama3-8b timings,llama3-8b verify"   # what an earlier call left out
  python -m specbench.gpu_check --cpu-form            # reduced shapes on the CPU (what `make test` runs)

On a machine with no registry, bring as wheels what it lacks of the pins (docs/gpu.md "make gpu-check on a fresh GPU
machine": transformers, tokenizers, hydra-core, omegaconf, antlr4-python3-runtime); torch is the machine's.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from specbench.core import envinfo
from specbench.core.cli import CONF_DIR
from specbench.core.models import SDPA_BACKENDS, sdpa_context
from specbench.core.records import atomic_write_json, atomic_write_text
from specbench.decode.compiled import BUCKETS, compile_option
from specbench.decode.drafter import Drafter, NoDrafter
from specbench.decode.engine import Engine, Generation, sync
from specbench.decode.target import TargetModel
from specbench.decode.types import SamplingParams
from specbench.tools import isolated

# Llama configs of the real targets (their public config.json), and the reduced ones the CPU form runs
SHAPES = {
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, rope_theta=10000.0, max_position_embeddings=4096),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
}
CPU_SHAPES = {
    "llama2-7b": dict(SHAPES["llama2-7b"], hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=512),
    "llama3-8b": dict(SHAPES["llama3-8b"], hidden_size=128, intermediate_size=448, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, vocab_size=512),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, rope_theta=10000.0, max_position_embeddings=2048)
TINY_PROMPTS = [[5, 17, 33, 17, 33, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [60, 61, 60, 61, 60]]
TREE_SIZES = (1, 4, 8, 16, 32, 60, 64, 128)
DEADLINE_S = 480.0  # a call's bound, every part included: a ten-minute slot keeps two minutes for start and copy-back
PART_LIMIT_S = 150.0  # one part's, unless --limit NAME=S says otherwise: no part takes the whole slot
RUNNING = "running"  # a part's status while it runs; left in the record of a call stopped during it
MIN_START_S = 3.0  # a part with less time left than this is not started (a CUDA context alone takes about a second)
# what the parts' fork server imports once (seconds a part would spend on its own imports)
PRELOAD = ["specbench.tools.gpu_check", "transformers", "transformers.models.llama.modeling_llama", "hydra",
           "specbench.bench.run"]
TOP_KERNELS = 30  # the profile keeps this many kernels raw, beside the class sums, so the split can be redone

# Kernel classes. Inductor names a fused kernel after every op it fuses (triton_red_fused__to_copy_add_mean_mul_pow_
# rsqrt_0 is an RMSNorm, with a dtype cast in it), so a fused name is split into its ops and filed under the
# heaviest: a matmul template, else attention, else any arithmetic (norms and elementwise), else copies (a kernel
# that only moves data: cat, clone, _to_copy, index). Any other name (cuBLAS, CUTLASS, flash, aten's own kernels, the
# CPU's aten operators) is matched by substring in the order below: attention first (its CUTLASS kernels,
# fmha_cutlassF_*, name cutlass and the SM too), copies before elementwise (aten's direct_copy_kernel runs in an
# elementwise_kernel).
ATTENTION, MATMUL, NORMS, COPIES, OTHER = "attention", "matmul", "norms and elementwise", "copies", "other"
KERNEL_CLASSES = (  # (class, substrings of a kernel's or op's name), the first that matches
    (ATTENTION, ("attention", "attn", "fmha", "flash", "sdpa", "softmax")),
    (MATMUL, ("gemm", "cutlass", "matmul", "aten::mm", "aten::bmm", "mm_", "addmm", "linear", "sm90", "sm80",
              "cublas", "nvjet")),
    (COPIES, ("copy", "memcpy", "memset", "cat", "index", "gather", "scatter", "clone", "fill", "embedding")),
    (NORMS, ("norm", "elementwise", "vectorized", "reduce", "triton", "mul", "add", "rsqrt", "silu", "pow", "mean",
             "neg", "cos", "sin", "exp", "where", "unrolled")),
)
FUSED = re.compile(r"triton_(?P<kind>[a-z]+)_fused(?P<ops>_.*)?$")  # then the ops, then the kernel's number
FUSED_MATMUL = {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "gemm"}
FUSED_ATTENTION = {"attention", "attn", "sdpa", "softmax", "flash", "fmha", "flex"}
FUSED_MOVES = {"to", "copy", "cat", "clone", "index", "put", "select", "slice", "scatter", "gather", "embedding",
               "fill", "zeros", "ones", "full", "empty", "constant", "pad", "view", "permute", "transpose", "t",
               "expand", "stack", "unsqueeze", "squeeze", "split", "unbind", "unsafe", "as", "strided", "new",
               "zero", "lift", "fresh", "alias", "reshape", "narrow", "repeat", "interleave", "flip", "roll", "copy_",
               "arange", "iota"}


@dataclass
class Check:
    """What the run found, as data: the record and the markdown are written from it."""

    header: dict
    parts: dict = field(default_factory=dict)  # part name -> its status, seconds, limit (and error)
    lossless: dict = field(default_factory=dict)  # "<drafter> eager|compiled|batch|batch compiled" -> "ok" or what differed
    law: dict = field(default_factory=dict)  # the T > 0 test
    shapes: dict = field(default_factory=dict)  # per shape: its tables
    skipped: list = field(default_factory=list)  # the parts the deadline left out, in order


@dataclass(frozen=True)
class Part:
    """One part of the check: its own process, its own limit, its own line in the record."""

    name: str  # as recorded, and as --parts, --limit and the test hooks name it
    kind: str  # its measuring function, MEASURE's key
    label: str = ""  # the shape of a shape's part
    mode: str = ""  # eager or compiled, where the part has one


@dataclass
class Setup:
    """What a part's process rebuilds from the command line."""

    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    backend: bool | str  # True: inductor (CUDA graphs on CUDA), or another torch.compile backend's name
    names: list[str]  # the lossless part's drafters
    timed_names: list[str]  # the drafters timed on the real shapes
    shapes: dict


def random_llama(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A Llama of `shape` with random weights, built on `device` (seconds for a 7B on a GPU); no EOS, so every
    decode runs to its budget."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval().requires_grad_(False)


def drafter_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "drafter").glob("*.yaml") if p.stem != "none")


def make_drafter(name: str, target: TargetModel, *overrides: str) -> Drafter:
    """A drafter config as composed by Hydra (with `overrides`), untrained (the shape of its module, not the embedded
    target's weights), at its paper tree; a tree sized from trained heads' accuracies (Medusa's `auto`) is a fixed
    7-node one. The conformance tests build their drafters with it too."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from specbench.bench.run import inference_spec
    from specbench.core.config import register_schema

    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        node = compose(config_name="config", overrides=[f"drafter={name}", *overrides]).drafter
    spec = inference_spec(node)
    if "checkpoint" in spec:
        spec["checkpoint"] = None
    if spec.get("tree") == "auto":
        spec["tree"] = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]
    torch.manual_seed(0)
    return instantiate(spec, target=target, _convert_="object")


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


# ---- 1. lossless on the device -----------------------------------------------------------------------------------
def tiny_target_model(device: torch.device, scale: float):
    """The tiny fp32 target of the lossless and law parts; `scale` peaks its logits (few near-ties, or a law whose
    mass few tokens carry)."""
    model = random_llama(TINY, torch.float32, device, seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def check_lossless(device: torch.device, names: list[str], new: int, backend: bool | str = True,
                   compiled: bool = False, found: dict | None = None, save=lambda: None) -> dict:
    """Each drafter decodes the prompts one at a time and as one batch (eager, or compiled with `backend`): each row
    its greedy output. Into `found`, saved after each drafter (a part killed mid-way keeps the drafters it checked);
    a drafter that raises is recorded as such and the next one runs."""
    found = {} if found is None else found
    model = tiny_target_model(device, 20.0)  # peaked logits (as the conformance tests' tiny target)
    refs = [hf_greedy(model, p, new) for p in TINY_PROMPTS]
    target = TargetModel(model, None, device, "tiny", compile=backend if compiled else False)
    one, batch = f"{'compiled' if compiled else 'eager'}", f"batch{' compiled' if compiled else ''}"
    for name in names:
        try:
            engine = Engine(target, make_drafter(name, target), SamplingParams())
            bad = [i for i, (p, ref) in enumerate(zip(TINY_PROMPTS, refs)) if engine.generate(p, new).new_tokens != ref]
            found[f"{name} {one}"] = "ok" if not bad else f"prompts {bad} differ"
            # the prompts decoded together (ragged rows; compiled: the static cache of their batch bucket): each row
            # its greedy output
            rows = Engine(target, make_drafter(name, target), SamplingParams()).generate_batch(TINY_PROMPTS, new).rows
            bad = [i for i, (g, ref) in enumerate(zip(rows, refs)) if g.new_tokens != ref]
            found[f"{name} {batch}"] = "ok" if not bad else f"rows {bad} differ"
        except Exception as exc:  # one drafter's finding, not the part's end: the others are still checked
            found.setdefault(f"{name} {one}", f"raised {isolated.last_line(exc)}")
            found.setdefault(f"{name} {batch}", "not run (the one-prompt decode raised)")
        save()
    return found


def check_law(device: torch.device, name: str, samples: int, temperature: float = 1.0) -> dict:
    """The token of the first verification step (the second new token) against its exact marginal law under the
    target, sum over t1 of p(t1) p(t2 | t1) (one batched forward over every t1): a Pearson chi-square over the
    tokens of expected count >= 5, the rest pooled in one cell."""
    model = tiny_target_model(device, 8.0)  # a peaked law: few tokens carry the mass, so the cells fill
    target = TargetModel(model, None, device, "tiny")
    engine = Engine(target, make_drafter(name, target), SamplingParams(temperature=temperature))
    prompt = TINY_PROMPTS[1]
    with torch.no_grad():
        vocab = model.config.vocab_size
        p1 = torch.softmax(model(torch.tensor([prompt], device=device)).logits[0, -1].float() / temperature, -1)
        ids = torch.cat([torch.tensor([prompt], device=device).expand(vocab, -1),
                         torch.arange(vocab, device=device)[:, None]], 1)
        p2 = torch.softmax(model(ids).logits[:, -1].float() / temperature, -1)  # [t1, t2]
        exact = (p1[:, None] * p2).sum(0).cpu()
    gen = torch.Generator(device=device).manual_seed(0)
    seconds = [engine.generate(prompt, 2, generator=gen).new_tokens[1] for _ in range(samples)]
    counts = torch.bincount(torch.tensor(seconds), minlength=vocab).float()
    expected = exact * samples
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    p = float(torch.special.gammaincc(torch.tensor(max(df, 1) / 2.0), torch.tensor(chi2 / 2.0)))
    return {"drafter": name, "temperature": temperature, "samples": samples, "chi2": chi2, "df": df, "p_value": p,
            "ok": df > 0 and p > 1e-3}


# ---- 2. real shapes ------------------------------------------------------------------------------------------------
def timed(fn, devs, repeats: int) -> float:
    """Best wall seconds of `fn` over repeats, synchronised before and after."""
    best = float("inf")
    for _ in range(repeats):
        sync(devs)
        t0 = time.perf_counter()
        fn()
        sync(devs)
        best = min(best, time.perf_counter() - t0)
    return best


def bandwidth_gbs(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Device memory bandwidth from a copy of `nbytes` (read + write), best of 5."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    s = timed(lambda: b.copy_(a), (device,), 5)
    return 2 * nbytes / s / 1e9


def per_token_ms(gen: Generation) -> float:
    return 1e3 * (gen.wall_s - gen.prefill_s) / max(1, len(gen.new_tokens) - 1)


def step_ms(gen: Generation) -> dict:
    steps = max(1, gen.steps)
    other = gen.wall_s - gen.prefill_s - gen.draft_s - gen.verify_s
    return {"draft": 1e3 * gen.draft_s / steps, "verify": 1e3 * gen.verify_s / steps, "other": 1e3 * other / steps,
            "tau": gen.tau, "steps": gen.steps}


def hf_generate_ms(model, prompt: torch.Tensor, new: int, static: bool, devs, repeats: int,
                   backend: bool | str = True) -> float:
    """transformers' own generate, greedy: eager with its dynamic cache, or with its static cache, which its generate
    compiles itself (auto-compile on CUDA; forced on other devices); ms per token past the first."""
    from transformers import CompileConfig

    kw = dict(do_sample=False)
    if static:  # (a backend other than inductor takes no mode)
        config = CompileConfig() if backend is True else CompileConfig(backend=backend, mode="default")
        config._compile_all_devices = not prompt.is_cuda  # (on CUDA transformers compiles a static cache's forward)
        kw |= {"cache_implementation": "static", "compile_config": config}
    model.generate(prompt, max_new_tokens=new, min_new_tokens=new, **kw)  # warm-up (and the graphs)
    one = timed(lambda: model.generate(prompt, max_new_tokens=1, **kw), devs, repeats)
    whole = timed(lambda: model.generate(prompt, max_new_tokens=new, min_new_tokens=new, **kw), devs, repeats)
    return 1e3 * (whole - one) / (new - 1)


def compiled_covers(n: int) -> bool:
    """Whether a compiled target's verify of a chain of n nodes (n + 1 rows with the root) runs compiled: past the
    largest bucket (specbench/decode/compiled.py BUCKETS) the forward runs eagerly on the static cache."""
    return n + 1 <= max(BUCKETS)


def verify_ms(target: TargetModel, prompt: list[int], sizes, repeats: int) -> dict[int, float]:
    """One verification forward over a chain of n nodes after the prompt (ms, best of repeats; each repeat on a
    freshly prefilled cache, untimed): the cache the engine decodes on (eager: the preallocated one)."""
    from specbench.decode.tree import ancestor_matrix

    dev = target.device
    ids = torch.tensor([prompt], device=dev)
    out = {}
    for n in sizes:
        anc = ancestor_matrix(torch.arange(-1, n - 1, device=dev))
        nodes = torch.randint(0, target.vocab_size, (1, n), device=dev)
        best = float("inf")
        for _ in range(repeats + 1):  # the first builds what a first forward of this size builds
            cache = target.new_cache(len(prompt) + n + 1, ragged=True)
            target.prefill(ids[:, :-1], cache)
            sync(target.devices)
            t0 = time.perf_counter()
            target.verify(ids[:, -1:], nodes, anc, cache, causal=True)
            sync(target.devices)
            best = min(best, time.perf_counter() - t0)
        out[n] = 1e3 * best
    return out


def kernel_class(name: str) -> str:
    """A kernel's (or CPU operator's) class: KERNEL_CLASSES' comment says how."""
    low = name.lower()
    fused = FUSED.search(low)
    if fused:
        ops = {op for op in (fused["ops"] or "").split("_") if op and not op.isdigit()}
        if not ops:  # inductor's names without their ops (triton_poi_fused_0): nothing says what it does
            return OTHER
        if fused["kind"] == "tem" or ops & FUSED_MATMUL:  # a template kernel: a matmul (or flex attention's)
            return ATTENTION if ops & FUSED_ATTENTION else MATMUL
        if ops & FUSED_ATTENTION:
            return ATTENTION
        return NORMS if ops - FUSED_MOVES else COPIES
    return next((c for c, keys in KERNEL_CLASSES if any(k in low for k in keys)), OTHER)


def counted_events(events, cuda: bool) -> list[tuple[str, int, float]]:
    """(name, count, microseconds) of torch.profiler's averaged events that count. On CUDA the device's own events
    only (kernels, memcpy, memset): a CPU operator's self device time is its kernels' time again (torch.profiler gives
    an op the device time of the kernels it launched), so counting ops too counted every kernel twice (the H200 run
    at b6de4c9: 4.77 ms of "other" beside 4.62 of matmul, a busy time past the wall). On the CPU the aten operators'
    self time."""
    from torch.autograd import DeviceType

    out = []
    for evt in events:
        if cuda:
            us = evt.self_device_time_total if evt.device_type != DeviceType.CPU else 0.0
        else:
            us = evt.self_cpu_time_total if evt.key.startswith("aten::") else 0.0
        if us > 0:
            out.append((evt.key, int(getattr(evt, "count", 1)), float(us)))
    return out


def kernel_classes(events, cuda: bool) -> dict[str, float]:
    """Microseconds per kernel class (KERNEL_CLASSES' classes, then "other") of the events that count."""
    classes = {c: 0.0 for c, _ in KERNEL_CLASSES} | {OTHER: 0.0}
    for name, _, us in counted_events(events, cuda):
        classes[kernel_class(name)] += us
    return classes


def kernel_profile(engine: Engine, prompt: list[int], new: int) -> dict:
    """The compiled baseline's decode of `new` tokens under torch.profiler, after an untimed one (the graphs built
    outside the profile): device (CPU: operator self) time per kernel class, the idle gap (wall minus busy) per
    token, and the TOP_KERNELS heaviest kernels raw (name, calls, ms over the decode, class) to redo the split."""
    from torch.profiler import ProfilerActivity, profile

    dev = engine.target.device
    engine.generate(prompt, new)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        gen = engine.generate(prompt, new)
    wall_us = 1e6 * (gen.wall_s - gen.prefill_s)
    events = prof.key_averages()
    classes = kernel_classes(events, dev.type == "cuda")
    tokens = max(1, len(gen.new_tokens) - 1)
    busy = sum(classes.values())
    top = sorted(counted_events(events, dev.type == "cuda"), key=lambda e: -e[2])[:TOP_KERNELS]
    return {"ms_per_token": {k: v / 1e3 / tokens for k, v in classes.items()},
            "idle_ms_per_token": max(0.0, wall_us - busy) / 1e3 / tokens, "wall_ms_per_token": wall_us / 1e3 / tokens,
            "tokens": tokens, "timed": "device kernels" if dev.type == "cuda" else "aten operators' self CPU time",
            "top_kernels": [{"name": name[:300], "count": count, "device_ms": us / 1e3, "class": kernel_class(name)}
                            for name, count, us in top]}


def published_board() -> dict[str, dict]:
    """Spec-Bench's published A100 tau and overall speedup per method of ours (conf/experiment/specbench_board.yaml)."""
    tables = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "experiment" / "specbench_board.yaml"))["report"]["tables"]
    spec = next(t for t in tables if t.get("kind") == "board")
    rows, ours = spec["published"]["rows"], spec["ours"]
    return {ours[k]: {"tau": float(v[-2]), "speedup": float(str(v[-1]).rstrip("x")), "source": spec["published"]["source"]}
            for k, v in rows.items() if k in ours}


def batch_costs(target: TargetModel, name: str, prompt: list[int], sizes, new: int, out: dict | None = None,
                save=lambda: None) -> dict:
    """One drafter at each batch size (eager, or compiled on a static cache of the batch's bucket: the target's
    path): B ragged prompts (the prompt cut by 0..7 tokens) decoded together, after
    an untimed decode of the same batch; the step's draft and verify ms, the draft ms per row-step (the batch's draft
    time over the rows drafted for), and throughput. Into `out`, saved after each size."""
    out = {} if out is None else out
    for b in sizes:
        engine = Engine(target, make_drafter(name, target), SamplingParams())
        prompts = [prompt[: len(prompt) - (i % 8)] for i in range(b)]
        engine.generate_batch(prompts, 16)  # warm: this batch's kernels
        got = engine.generate_batch(prompts, new)
        draft, verify = got.draft_s, got.verify_s  # the batch's
        steps, row_steps = max(1, got.steps), max(1, sum(got.active))
        out[str(b)] = {"draft_ms_per_step": 1e3 * draft / steps, "verify_ms_per_step": 1e3 * verify / steps,
                       "draft_ms_per_row_step": 1e3 * draft / row_steps, "tokens_per_s": got.tokens_per_s,
                       "steps": got.steps, "tau": sum(g.tau for g in got.rows) / b}
        save()
    return out


# ---- the parts, each run in a process of its own ---------------------------------------------------------------------
@dataclass
class Shape:
    """A real shape's random model, prompt and targets, built in the part's process (a target when first asked)."""

    label: str
    model: object
    prompt: list[int]
    setup: Setup
    targets: dict = field(default_factory=dict)

    def target(self, path: str) -> TargetModel:
        if path not in self.targets:
            kw = {"eager": {}, "compiled": {"compile": self.setup.backend}}[path]
            self.targets[path] = TargetModel(self.model, None, self.setup.device, self.label, **kw)
        return self.targets[path]

    def warm(self, path: str) -> TargetModel:
        """The target after one untimed baseline decode (kernels, plans, its graphs): a part's first timing is not the
        process's first use of the device."""
        target = self.target(path)
        Engine(target, NoDrafter(), SamplingParams()).generate(self.prompt, self.setup.args.new)
        return target


def build_shape(setup: Setup, label: str) -> Shape:
    model = random_llama(setup.shapes[label], setup.dtype, setup.device)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, setup.shapes[label]["vocab_size"], (setup.args.prompt,), generator=g).tolist()
    return Shape(label, model, prompt, setup)


def measure_lossless(setup: Setup, part: Part, progress: isolated.Progress) -> None:
    check_lossless(setup.device, setup.names, setup.args.tiny_new, setup.backend, part.mode == "compiled",
                   progress.data, progress.save)


def measure_law(setup: Setup, part: Part, progress: isolated.Progress) -> None:
    progress.data.update(check_law(setup.device, setup.args.law_drafter, setup.args.law_samples))


def measure_timings(setup: Setup, part: Part, progress: isolated.Progress) -> None:
    """The ms-per-token paths: the HBM floor, bare F.linear, our baseline eager (its preallocated cache) and
    compiled."""
    from specbench.tools.limit import bare_ms, weight_matrices

    shape, args = build_shape(setup, part.label), setup.args
    base = shape.target("eager")
    wbytes = sum(w.numel() * w.element_size() for w in weight_matrices(base))
    bw = bandwidth_gbs(setup.device)
    row = progress.data
    row |= {"weight_bytes": wbytes, "bandwidth_gbs": bw, "ms_per_token": {"HBM floor": 1e3 * wbytes / (bw * 1e9),
                                                                           "bare F.linear": bare_ms(base, args.repeats)}}
    progress.save()
    for path in ("eager", "compiled"):
        engine = Engine(shape.warm(path), NoDrafter(), SamplingParams())
        row["ms_per_token"][f"ours, {path}"] = min(per_token_ms(engine.generate(shape.prompt, args.new))
                                                   for _ in range(args.repeats))
        progress.save()


def measure_verify(setup: Setup, part: Part, progress: isolated.Progress) -> None:
    """Verify ms against chain length, eager and compiled; a length the compiled buckets do not cover is not timed on
    the compiled row (it would run eagerly there) and is recorded as not compiled."""
    shape, args = build_shape(setup, part.label), setup.args
    sizes = tuple(int(n) for n in args.tree_sizes.split(","))
    covered = [n for n in sizes if compiled_covers(n)]
    rows = progress.data.setdefault("verify_ms", {})
    progress.data["verify_compiled"] = {str(n): compiled_covers(n) for n in sizes}
    for path, timed_sizes in (("eager", sizes), ("compiled", covered)):
        rows[path] = {str(n): ms for n, ms in verify_ms(shape.target(path), shape.prompt, timed_sizes,
                                                        args.repeats).items()}
        progress.save()


def measure_profile(setup: Setup, part: Part, progress: isolated.Progress) -> None:
    shape = build_shape(setup, part.label)
    engine = Engine(shape.target("compiled"), NoDrafter(), SamplingParams())
    progress.data["profile_compiled"] = kernel_profile(engine, shape.prompt, min(setup.args.new, 32))


def measure_drafters(setup: Setup, part: Part, progress: isolated.Progress) -> None:
    """Each timed drafter at its paper tree on one path (part.mode), after the baseline's warm decode; eager, its
    first pass against its repeat too. The predicted speedup needs the timings part's baseline: the parent adds it."""
    shape, args = build_shape(setup, part.label), setup.args
    target = shape.warm("compiled" if part.mode == "compiled" else "eager")
    board = published_board()
    drafters, first = progress.data.setdefault("drafters", {}), progress.data.setdefault("first_pass", {})
    for name in setup.timed_names:
        if target.compiled is not None:
            target.compiled.warned = False  # set again if this drafter's tree passes the largest bucket
        engine = Engine(target, make_drafter(name, target), SamplingParams())
        engine.generate(shape.prompt, 16)  # the drafter's first-call set-up
        cold = engine.generate(shape.prompt, args.new)
        warm = min((engine.generate(shape.prompt, args.new) for _ in range(args.repeats)), key=lambda g: g.wall_s)
        cost = step_ms(warm)
        if target.compiled is not None and target.compiled.warned:  # its verify ran eagerly: said beside the time
            cost["compiled"] = False
        pub = board.get(name)
        if pub:
            cost["published_tau"], cost["published_speedup"] = pub["tau"], pub["speedup"]
        drafters[f"{name} {part.mode}"] = cost
        if part.mode == "eager":
            c = step_ms(cold)
            first[name] = {"first": c, "repeat": cost, "ratio": (c["draft"] + c["verify"]) /
                           max(1e-9, cost["draft"] + cost["verify"])}
        progress.save()


def measure_batch(setup: Setup, part: Part, progress: isolated.Progress) -> None:
    shape, args = build_shape(setup, part.label), setup.args
    target = shape.target("compiled" if part.mode == "compiled" else "eager")
    sizes = tuple(int(n) for n in args.batch_sizes.split(","))
    batch = progress.data.setdefault("batch", {})
    for name in batch_drafters(args):
        batch_costs(target, name, shape.prompt, sizes, args.new, batch.setdefault(f"{name} {part.mode}", {}),
                    progress.save)


def measure_generate(setup: Setup, part: Part, progress: isolated.Progress) -> None:
    """transformers' generate, eager then with its static cache compiled (a minute's compile: last)."""
    shape, args = build_shape(setup, part.label), setup.args
    ids = torch.tensor([shape.prompt], device=setup.device)
    row = progress.data.setdefault("ms_per_token", {})
    for static in (False, True):
        path = f"transformers generate, {'static cache compiled' if static else 'eager'}"
        row[path] = hf_generate_ms(shape.model, ids, args.new, static, (setup.device,), args.repeats, setup.backend)
        progress.save()


MEASURE = {"lossless": measure_lossless, "law": measure_law, "timings": measure_timings, "verify": measure_verify,
           "profile": measure_profile, "drafters": measure_drafters, "batch": measure_batch,
           "generate": measure_generate}


def batch_drafters(args) -> list[str]:
    return [n for n in args.batch_drafters.split(",") if n]


def plan(args) -> list[Part]:
    """Every part of the call, in order (--parts keeps the named ones): the lossless parts first (they say whether the
    engine is right at all), then each shape's, generate last (its compile is long)."""
    parts = [Part("lossless eager", "lossless", mode="eager"), Part("lossless compiled", "lossless", mode="compiled"),
             Part("law", "law")]
    for label in (s for s in args.shapes.split(",") if s):
        parts += [Part(f"{label} {kind}", kind, label) for kind in ("timings", "verify", "profile")]
        parts += [Part(f"{label} drafters {mode}", "drafters", label, mode) for mode in ("eager", "compiled")]
        if batch_drafters(args):
            parts += [Part(f"{label} batch {mode}", "batch", label, mode) for mode in args.batch_modes.split(",") if mode]
        parts.append(Part(f"{label} generate", "generate", label))
    if not args.parts:
        return parts
    asked = [p.strip() for p in args.parts.split(",") if p.strip()]
    known(asked, parts, "--parts")
    return [p for p in parts if p.name in asked]


def known(names, parts: list[Part], flag: str) -> None:
    """A name that is no part's (a typo in --parts or --limit) stops the call before anything runs, in one line."""
    unknown = sorted(set(names) - {p.name for p in parts})
    if unknown:
        raise SystemExit(f"gpu-check: {flag}: no part named {', '.join(map(repr, unknown))} (the parts: "
                         f"{', '.join(p.name for p in parts)})")


def setup_of(args) -> Setup:
    names = args.drafters.split(",") if args.drafters else drafter_names()
    return Setup(args, torch.device("cpu" if args.cpu_form else "cuda"),
                 torch.float32 if args.cpu_form else torch.bfloat16, compile_option(args.compile_backend), names,
                 args.timed_drafters.split(",") if args.timed_drafters else names,
                 CPU_SHAPES if args.cpu_form else SHAPES)


def part_main(payload: tuple, progress: isolated.Progress) -> None:
    """A part's process: its setup rebuilt from the command line, then its measurement (the test hooks first)."""
    args, name, threads = payload
    torch.set_num_threads(threads)  # the caller's share of the cores (a test worker's), not the fork server's
    part = next(p for p in plan(args) if p.name == name)
    if name == args.fail_part:  # test hook: this part raises, so a test sees a failed part recorded and the rest run
        raise RuntimeError(f"forced failure of part {name!r} (--fail-part, a test hook)")
    if name == args.hang_part:  # test hook: this part never ends, so a test sees the limit kill it
        time.sleep(1e9)
    setup = setup_of(args)
    with sdpa_context(args.sdpa, setup.device), torch.inference_mode():
        MEASURE[part.kind](setup, part, progress)


# ---- the record ----------------------------------------------------------------------------------------------------
# (the records of before issue 77 name the eager one "ours, eager, dynamic cache")
BASELINE = {"eager": "ours, eager", "compiled": "ours, compiled"}


def merge(check: Check, part: Part, outcome: isolated.Outcome) -> None:
    """A part's outcome into the record: its status line, and whatever data it saved (a failed or killed part's
    too: what it measured before it stopped)."""
    check.parts[part.name] = outcome.record()
    if part.kind == "lossless":
        check.lossless.update(outcome.data)
    elif part.kind == "law":
        check.law = outcome.data or check.law
    else:
        row = check.shapes.setdefault(part.label, {})
        for key, value in outcome.data.items():
            if isinstance(value, dict) and isinstance(row.get(key), dict):
                row[key].update(value)  # e.g. ms_per_token: the timings part's paths, then generate's
            else:
                row[key] = value
        predict(row)


def predict(row: dict) -> None:
    """Each drafter's predicted speedup, tau tokens a step at its step's cost against the same path's baseline, where
    both the drafter's published tau and the timings part's baseline are in the record."""
    for key, cost in row.get("drafters", {}).items():
        base = row.get("ms_per_token", {}).get(BASELINE.get(key.rsplit(" ", 1)[-1], ""))
        if base and "published_tau" in cost:
            cost["predicted_speedup"] = cost["published_tau"] * base / (cost["draft"] + cost["verify"] + cost["other"])


def commit() -> dict:
    """The commit, where it came from and whether the tree was dirty: the environment (a copy of the tree on a GPU
    box, whose .git may be stale or absent), else git, else "unknown"; never None, so nothing downstream slices a
    None (a record without git once failed on None[:7] after minutes of work)."""
    for var in ("SPECBENCH_COMMIT", "SPECBENCH_GIT_COMMIT"):
        if os.environ.get(var):
            return {"commit": os.environ[var], "source": var, "dirty": None}
    git = envinfo.git_commit()
    if git.get("commit"):
        return {"commit": str(git["commit"]), "source": "git", "dirty": git.get("dirty")}
    return {"commit": "unknown", "source": "none", "dirty": None}


def fmt(value, spec: str = ".2f") -> str:
    """A number as `spec`, or a dash where the record has none (a part that failed or was left out)."""
    return format(value, spec) if isinstance(value, (int, float)) else "–"


def markdown(check: Check) -> str:
    h = check.header
    versions = h.get("versions", {})
    out = [f"# make gpu-check: {h.get('device_name', '?')} ({h.get('dtype', '?')}), commit "
           f"{str(h.get('commit') or 'unknown')[:12]}", "",
           f"torch {versions.get('torch')}, transformers {versions.get('transformers')}; SDPA backends "
           f"{h.get('sdpa')}; torch.compile backend {h.get('compile_backend', 'inductor')}; {h.get('command')}"]
    if check.parts:
        out += ["", f"## Parts (deadline {h.get('deadline_s')} s, each part at most {h.get('part_limit_s')} s unless "
                    f"named in --limit; {RUNNING}: the call was stopped during it)", "",
                "| part | status | s | limit s | error |", "|---|---|---|---|---|"]
        out += [f"| {name} | {p['status']} | {fmt(p.get('seconds'), '.0f')} | {fmt(p.get('limit_s'), '.0f')} | "
                f"{p.get('error', '').replace('|', '/')} |" for name, p in check.parts.items()]
    out += ["", "## Lossless (tiny fp32 target, greedy)", ""]
    bad = {k: v for k, v in check.lossless.items() if v != "ok"}
    out.append(f"{len(check.lossless) - len(bad)} of {len(check.lossless)} drafter x path runs equal the target's "
               "greedy output" + ("" if not bad else ": " + "; ".join(f"{k}: {v}" for k, v in sorted(bad.items()))))
    law = check.law
    if law:
        out += ["", f"T = {law['temperature']} law of the first drafted step's token ({law['drafter']}, {law['samples']} "
                    f"samples): chi2 {law['chi2']:.1f} on {law['df']} df, p = {law['p_value']:.3g} "
                    f"({'ok' if law['ok'] else 'REJECTED'})"]
    for label, row in check.shapes.items():
        out += shape_markdown(label, row)
    if check.skipped:
        out += ["", f"Left out at the deadline ({h.get('deadline_s')} s): " + ", ".join(check.skipped)]
    return "\n".join(out) + "\n"


def shape_markdown(label: str, row: dict) -> list[str]:
    """One shape's tables, each where its part left data (a failed part's table is absent or partial)."""
    weights = f"{row['weight_bytes'] / 1e9:.2f} GB of weight matrices" if "weight_bytes" in row else "weights unmeasured"
    out = ["", f"## {label} (random weights, {weights}, measured bandwidth {fmt(row.get('bandwidth_gbs'), '.0f')} GB/s)"]
    if row.get("ms_per_token"):
        out += ["", "| path | ms per token |", "|---|---|"]
        out += [f"| {k} | {fmt(v)} |" for k, v in row["ms_per_token"].items()]
    if row.get("verify_ms"):
        covers = row.get("verify_compiled", {})
        sizes = sorted({n for ms in row["verify_ms"].values() for n in ms} | set(covers), key=int)
        out += ["", "| verify ms, chain of n | " + " | ".join(map(str, sizes)) + " |", "|---|" + "---|" * len(sizes)]
        for path, ms in row["verify_ms"].items():
            cells = ["eager past the largest bucket, untimed" if path == "compiled" and covers.get(n) is False
                     else fmt(ms.get(n)) for n in sizes]
            out.append(f"| {path} | " + " | ".join(cells) + " |")
    if row.get("drafters"):
        out += ["", "| drafter, path | draft ms | verify ms | other ms | published τ | predicted | published |",
                "|---|---|---|---|---|---|---|"]
        for k, c in row["drafters"].items():
            label_k = k + (" (verify past the largest bucket: eager)" if c.get("compiled") is False else "")
            pred = f"{c['predicted_speedup']:.2f}x" if "predicted_speedup" in c else "–"
            out.append(f"| {label_k} | {fmt(c.get('draft'))} | {fmt(c.get('verify'))} | {fmt(c.get('other'))} | "
                       f"{c.get('published_tau', '–')} | {pred} | "
                       f"{(str(c['published_speedup']) + 'x') if 'published_speedup' in c else '–'} |")
    if row.get("first_pass"):
        out += ["", "| drafter (eager) | first pass draft / verify ms | repeat | first / repeat |", "|---|---|---|---|"]
        out += [f"| {k} | {v['first']['draft']:.2f} / {v['first']['verify']:.2f} | {v['repeat']['draft']:.2f} / "
                f"{v['repeat']['verify']:.2f} | {v['ratio']:.2f} |" for k, v in row["first_pass"].items()]
    if row.get("batch"):
        out += ["", "| drafter and path, B | draft ms / step | draft ms / row-step | verify ms / step | tokens/s | τ |",
                "|---|---|---|---|---|---|"]
        out += [f"| {name}, {b} | {c['draft_ms_per_step']:.2f} | {c['draft_ms_per_row_step']:.2f} | "
                f"{c['verify_ms_per_step']:.2f} | {c['tokens_per_s']:.1f} | {c['tau']:.2f} |"
                for name, per_b in row["batch"].items() for b, c in per_b.items()]
    prof = row.get("profile_compiled")
    if prof:
        out += ["", f"Compiled baseline step by kernel class (ms per token, wall {prof['wall_ms_per_token']:.2f}): "
                + ", ".join(f"{k} {v:.2f}" for k, v in prof["ms_per_token"].items())
                + f", idle {prof['idle_ms_per_token']:.2f}"]
        if prof.get("top_kernels"):
            out += ["", f"| top kernels ({prof.get('timed', 'device kernels')}) | calls | ms per token | class |",
                    "|---|---|---|---|"]
            out += [f"| `{k['name'][:100]}` | {k['count']} | {k['device_ms'] / prof.get('tokens', 1):.3f} | "
                    f"{k['class']} |" for k in prof["top_kernels"][:10]]
    return out


def write(check: Check, out: Path) -> Path:
    """The record and its markdown, each replaced whole (a reader, or a slot ending mid-write, never sees half)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "gpu_check.json", {"header": check.header, "parts": check.parts, "lossless": check.lossless,
                                               "law": check.law, "shapes": check.shapes, "skipped": check.skipped})
    atomic_write_text(out / "gpu_check.md", markdown(check))
    return out


def device_name(args) -> str:
    return torch.cuda.get_device_name() if not args.cpu_form and torch.cuda.is_available() else envinfo.cpu_name()


def out_dir(args) -> Path:
    """--out, else $OUT (a remote runner returns that folder only), else results/gpu_check/<device>/."""
    if args.out:
        return Path(args.out)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return envinfo.REPO / "results" / "gpu_check" / device_name(args).replace(" ", "_").replace("/", "_")


def header(args) -> dict:
    device = torch.device("cpu" if args.cpu_form else "cuda")
    found = commit()
    return {"command": "python -m specbench.gpu_check " + " ".join(args.argv), "commit": found["commit"],
            "commit_source": found["source"], "git": {"commit": found["commit"], "dirty": found["dirty"]},
            "date": envinfo.now_utc(), "versions": envinfo.versions(), "device": envinfo.device_info(device),
            "device_name": device_name(args), "dtype": "float32" if args.cpu_form else "bfloat16", "sdpa": args.sdpa,
            "drafters": args.drafters.split(",") if args.drafters else drafter_names(), "deadline_s": args.deadline,
            "part_limit_s": args.part_limit, "limits": dict(args.limit), "compile_backend": args.compile_backend}


def run(args, out: Path, started: float | None = None) -> Check:
    """Every part of plan(args) in turn, each in its own process under min(its limit, the time left); the record
    written after each. `started`: the perf_counter the deadline counts from (the call's start)."""
    if not args.cpu_form and not torch.cuda.is_available():
        raise SystemExit("gpu-check: no CUDA device here (--cpu-form runs the reduced check on the CPU)")
    started = time.perf_counter() if started is None else started
    parts = plan(args)
    check = Check(header(args))
    write(check, out)
    limits = dict(args.limit)
    ctx = isolated.context(PRELOAD)
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        for i, part in enumerate(parts):
            left = args.deadline - (time.perf_counter() - started)
            if left < MIN_START_S:
                check.parts[part.name] = {"status": isolated.SKIPPED}
                check.skipped.append(part.name)
                continue
            limit = min(limits.get(part.name, args.part_limit), left)
            # on disk before it starts: a call killed outright (the slot ended) still says which part it was in
            check.parts[part.name] = {"status": RUNNING, "limit_s": round(limit, 1)}
            write(check, out)
            outcome = isolated.run(ctx, part_main, (args, part.name, torch.get_num_threads()), limit,
                                   scratch / f"part{i}.json")
            merge(check, part, outcome)
            write(check, out)
            print(f"gpu-check: {part.name}: {outcome.status} in {outcome.seconds:.0f} s"
                  + (f" ({outcome.error})" if outcome.error else ""), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        write(check, out)
    return check


def limit_entry(text: str) -> tuple[str, float]:
    """--limit's NAME=SECONDS."""
    name, sep, seconds = text.rpartition("=")
    try:
        value = float(seconds)
    except ValueError:
        value = -1.0
    if not sep or not name.strip() or not value > 0:
        raise argparse.ArgumentTypeError(f"takes NAME=SECONDS (a part's name, seconds > 0), not {text!r}")
    return name.strip(), value


def parse(argv: list[str] | None = None):
    import sys

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m specbench.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--cpu-form", action="store_true", help="reduced shapes on the CPU (make test's form)")
    p.add_argument("--shapes", default="llama2-7b,llama3-8b")
    p.add_argument("--parts", default="", help="comma-separated part names to run (default: every part; a wrong name "
                                               "lists them)")
    p.add_argument("--drafters", default="", help="comma-separated (default: every conf/drafter config)")
    p.add_argument("--timed-drafters", default="", help="the drafters timed on the real shapes (default: --drafters)")
    p.add_argument("--batch-drafters", default="none,pld,medusa,eagle2",
                   help="the drafters of the batch sweep on the real shapes (eager and compiled), comma-separated; "
                        "empty: none")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--batch-modes", default="eager,compiled", choices=["eager", "compiled", "eager,compiled"],
                   help="the batch sweep's paths")
    p.add_argument("--deadline", type=float, default=DEADLINE_S,
                   help="seconds the whole call may take: a part gets at most what is left, and one with less than "
                        f"{MIN_START_S:.0f} s left is skipped (recorded)")
    p.add_argument("--part-limit", type=float, default=PART_LIMIT_S,
                   help="seconds one part may take before it is killed (recorded as timeout)")
    p.add_argument("--limit", type=limit_entry, action="append", default=[], metavar="NAME=SECONDS",
                   help="one part's own limit, e.g. --limit 'lossless compiled=240' (repeatable)")
    p.add_argument("--prompt", type=int, default=100, help="prompt tokens of the timed decodes")
    p.add_argument("--new", type=int, default=128, help="new tokens of the timed decodes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tree-sizes", default=",".join(map(str, TREE_SIZES)), help="verify timings: chain lengths")
    p.add_argument("--tiny-new", type=int, default=40, help="new tokens of the lossless decodes")
    p.add_argument("--law-drafter", default="eagle2")
    p.add_argument("--law-samples", type=int, default=2000)
    p.add_argument("--sdpa", choices=sorted(SDPA_BACKENDS), default="no-cudnn",
                   help="SDPA backends allowed (no-cudnn: cuDNN's per-shape plans make eager timings order-dependent)")
    p.add_argument("--compile-backend", default="inductor", choices=["inductor", "aot_eager"],
                   help="torch.compile's backend for every compiled path (inductor: what the engine compiles with, CUDA "
                        "graphs on CUDA; aot_eager: the same capture and guards without code generation, make test's "
                        "CPU form, whose inductor C++ builds took minutes of the suite)")
    p.add_argument("--out", default=None, help="default: $OUT if set, else results/gpu_check/<device>")
    # test hooks (tests/test_gpu_check.py), not for a measuring call: the named part raises, or never ends
    p.add_argument("--fail-part", default="", help=argparse.SUPPRESS)
    p.add_argument("--hang-part", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.part_limit > 0:
        p.error("--part-limit takes seconds > 0")
    args.argv = argv
    return args


def exit_on_signal(signum: int, frame) -> None:
    print(f"gpu-check: stopped by {signal.Signals(signum).name}; the record keeps what was measured", flush=True)
    raise SystemExit(128 + signum)


@contextmanager
def terminated_as_exit():
    """SIGTERM (a runner's timeout, `timeout`) raises SystemExit in the main thread, so the running part's process
    group is killed and the record written on the way out, not left holding the device."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, exit_on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> Path:
    started = time.perf_counter()
    args = parse(argv)
    known((name for name, _ in args.limit), plan(argparse.Namespace(**{**vars(args), "parts": ""})), "--limit")
    out = out_dir(args)
    with terminated_as_exit():
        check = run(args, out, started)
    print(markdown(check))
    print(f"written: {out}")
    return out


if __name__ == "__main__":
    main()
