"""`make gpu-check` (`python -m specbench.gpu_check`): everything a lent GPU can tell about this engine, in one command.

A GPU reaches this project rarely and briefly (a bare machine: torch and transformers, no hub), so this needs nothing
downloaded: every target is built on the device from a Llama config with random weights.

  1. lossless: a tiny fp32 target; every drafter config (conf/drafter/*.yaml, untrained modules of the right shape)
     decodes the prompts eager and compiled (model.compile), one at a time and as one batch, tokens equal to the
     target's own greedy output; and one
     T > 0 case: the first drafted step's token law against the target's exact one (a chi-square test);
  2. per real shape (random bf16 Llama-2-7B and Llama-3-8B, GQA; `--shapes`), one prompt of `--prompt` tokens and
     `--new` new tokens:
     - ms per token: the HBM floor (the weight bytes at the bandwidth measured by a device copy), bare F.linear over
       every weight matrix, our baseline eager (dynamic and preallocated caches) and compiled, transformers' generate
       eager and with its static cache compiled;
     - verify ms against tree size (chains of 1..128 nodes), eager and compiled;
     - each drafter at its paper tree (an untrained head: the tree is grown in full whatever is accepted): draft /
       verify / other ms per step, eager and compiled, and the predicted speedup at the tau Spec-Bench publishes for
       the method (conf/experiment/specbench_board.yaml) beside its published speedup;
     - first pass against repeat: each eager drafter's steps timed on its first pass over the prompt and again after
       (the order-dependence of cuDNN's per-shape plans; the SDPA backends are fixed, `--sdpa`, and recorded);
     - the compiled baseline step's device time by kernel class (matmul, attention, norms and elementwise, copies)
       and the idle gap between kernels (torch.profiler);
     - the batch sweep (`--batch-drafters`, `--batch-sizes`, eager and compiled): draft ms per step and per
       row-step, verify ms per step, tokens/s, for B ragged prompts decoded together;
     - transformers' generate last (its static cache compiles for a minute).
  A deadline (`--deadline`, seconds) stops new parts from starting and records which were left out; the record is
  written after every part, so a call cut short keeps what it measured.
  Writes results/gpu_check/<device>/gpu_check.json (versions, device, commit) and gpu_check.md.

  python -m specbench.gpu_check                       # on a GPU: both shapes, every drafter, up to the deadline
  python -m specbench.gpu_check --cpu-form            # reduced shapes on the CPU (what `make test` runs)

On a machine with no registry, bring as wheels what it lacks of the pins (docs/gpu.md "On a box with no registry": on
the H200 box of 2026-11-27, transformers 5.23.0, hydra-core, omegaconf and antlr4-python3-runtime); torch is the
machine's.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

import torch
from omegaconf import OmegaConf

from specbench.core import envinfo
from specbench.core.cli import CONF_DIR
from specbench.core.models import SDPA_BACKENDS, sdpa_context
from specbench.core.records import atomic_write_json, atomic_write_text
from specbench.decode.compiled import compile_option
from specbench.decode.drafter import Drafter, NoDrafter
from specbench.decode.engine import Engine, Generation, sync
from specbench.decode.target import TargetModel
from specbench.decode.types import SamplingParams

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
KERNEL_CLASSES = (  # (class, substrings of a kernel's or op's name), the first that matches (attention first: its
    # CUTLASS kernels, fmha_cutlassF_*, name cutlass and the SM too)
    ("attention", ("attention", "attn", "fmha", "flash", "sdpa", "softmax")),
    ("matmul", ("gemm", "cutlass", "matmul", "aten::mm", "mm_", "addmm", "linear", "sm90", "sm80", "cublas", "nvjet")),
    ("copies", ("copy", "memcpy", "memset", "cat", "index", "gather", "scatter", "clone", "fill")),
    ("norms and elementwise", ("norm", "elementwise", "vectorized", "reduce", "triton", "mul", "add", "rsqrt", "silu",
                               "pow", "mean", "neg", "cos", "sin", "exp", "where", "unrolled")),
)


@dataclass
class Check:
    """What the run found, as data: the record and the markdown are written from it."""

    header: dict
    lossless: dict = field(default_factory=dict)  # "<drafter> eager|compiled" -> "ok" or what differed
    law: dict = field(default_factory=dict)  # the T > 0 test
    shapes: dict = field(default_factory=dict)  # per shape: its tables
    skipped: list = field(default_factory=list)  # the parts the deadline left out, in order


@dataclass
class Budget:
    """A lent GPU is held for minutes: the run checks its deadline before each part and leaves out (and records)
    what would start past it, so one call always returns a record; `save` writes the record after every part, so a
    call cut off by its limit still leaves what it measured."""

    check: Check
    deadline: float  # time.perf_counter() past which no part starts
    save: Callable[[Check], None] = lambda check: None

    def allows(self, part: str) -> bool:
        if time.perf_counter() < self.deadline:
            return True
        self.check.skipped.append(part)
        return False

    def done(self) -> None:
        self.save(self.check)


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
def check_lossless(device: torch.device, names: list[str], new: int, backend: bool | str = True) -> dict:
    model = random_llama(TINY, torch.float32, device, seed=1)
    with torch.no_grad():  # peaked logits (as the conformance tests' tiny target): few near-ties
        model.lm_head.weight.mul_(20.0)
    refs = [hf_greedy(model, p, new) for p in TINY_PROMPTS]
    found = {}
    for compiled in (False, True):
        target = TargetModel(model, None, device, "tiny", compile=backend if compiled else False)
        for name in names:
            engine = Engine(target, make_drafter(name, target), SamplingParams())
            bad = [i for i, (p, ref) in enumerate(zip(TINY_PROMPTS, refs)) if engine.generate(p, new).new_tokens != ref]
            found[f"{name} {'compiled' if compiled else 'eager'}"] = "ok" if not bad else f"prompts {bad} differ"
            # the prompts decoded together (ragged rows; compiled: the static cache of their batch bucket): each row
            # its greedy output
            rows = Engine(target, make_drafter(name, target), SamplingParams()).generate_batch(TINY_PROMPTS, new).rows
            bad = [i for i, (g, ref) in enumerate(zip(rows, refs)) if g.new_tokens != ref]
            found[f"{name} batch{' compiled' if compiled else ''}"] = "ok" if not bad else f"rows {bad} differ"
    return found


def check_law(device: torch.device, name: str, samples: int, temperature: float = 1.0) -> dict:
    """The token of the first verification step (the second new token) against its exact marginal law under the
    target, sum over t1 of p(t1) p(t2 | t1) (one batched forward over every t1): a Pearson chi-square over the
    tokens of expected count >= 5, the rest pooled in one cell."""
    model = random_llama(TINY, torch.float32, device, seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a peaked law: few tokens carry the mass, so the cells fill
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


def verify_ms(target: TargetModel, prompt: list[int], sizes, repeats: int) -> dict[int, float]:
    """One verification forward over a chain of n nodes after the prompt (ms, best of repeats; each repeat on a
    freshly prefilled cache, untimed)."""
    from specbench.decode.tree import ancestor_matrix

    dev = target.device
    ids = torch.tensor([prompt], device=dev)
    out = {}
    for n in sizes:
        anc = ancestor_matrix(torch.arange(-1, n - 1, device=dev))
        nodes = torch.randint(0, target.vocab_size, (1, n), device=dev)
        best = float("inf")
        for _ in range(repeats + 1):  # the first builds what a first forward of this size builds
            cache = target.new_cache(len(prompt) + n + 1)
            target.prefill(ids[:, :-1], cache)
            sync(target.devices)
            t0 = time.perf_counter()
            target.verify(ids[:, -1:], nodes, anc, cache, causal=True)
            sync(target.devices)
            best = min(best, time.perf_counter() - t0)
        out[n] = 1e3 * best
    return out


def kernel_classes(events, cuda: bool) -> dict[str, float]:
    """Microseconds per kernel class (KERNEL_CLASSES, then "other") of torch.profiler's averaged events. On CUDA the
    device's own events only (kernels, memcpy, memset): a CPU operator's self device time is its kernels' time again
    (torch.profiler gives an op the device time of the kernels it launched), so counting ops too counted every kernel
    twice (the H200 run at b6de4c9: 4.77 ms of "other" beside 4.62 of matmul, a busy time past the wall). On the CPU
    the aten operators' self time."""
    from torch.autograd import DeviceType

    classes = {c: 0.0 for c, _ in KERNEL_CLASSES} | {"other": 0.0}
    for evt in events:
        if cuda:
            us = evt.self_device_time_total if evt.device_type != DeviceType.CPU else 0.0
        else:
            us = evt.self_cpu_time_total if evt.key.startswith("aten::") else 0.0
        if us <= 0:
            continue
        name = evt.key.lower()
        classes[next((c for c, keys in KERNEL_CLASSES if any(k in name for k in keys)), "other")] += us
    return classes


def kernel_profile(engine: Engine, prompt: list[int], new: int) -> dict:
    """The compiled baseline's decode of `new` tokens under torch.profiler: device (CPU: operator self) time per kernel
    class, and the idle gap (wall minus busy) per token."""
    from torch.profiler import ProfilerActivity, profile

    dev = engine.target.device
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        gen = engine.generate(prompt, new)
    wall_us = 1e6 * (gen.wall_s - gen.prefill_s)
    classes = kernel_classes(prof.key_averages(), dev.type == "cuda")
    tokens = max(1, len(gen.new_tokens) - 1)
    busy = sum(classes.values())
    return {"ms_per_token": {k: v / 1e3 / tokens for k, v in classes.items()},
            "idle_ms_per_token": max(0.0, wall_us - busy) / 1e3 / tokens, "wall_ms_per_token": wall_us / 1e3 / tokens}


def published_board() -> dict[str, dict]:
    """Spec-Bench's published A100 tau and overall speedup per method of ours (conf/experiment/specbench_board.yaml)."""
    tables = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "experiment" / "specbench_board.yaml"))["report"]["tables"]
    spec = next(t for t in tables if t.get("kind") == "board")
    rows, ours = spec["published"]["rows"], spec["ours"]
    return {ours[k]: {"tau": float(v[-2]), "speedup": float(str(v[-1]).rstrip("x")), "source": spec["published"]["source"]}
            for k, v in rows.items() if k in ours}


def batch_costs(target: TargetModel, name: str, prompt: list[int], sizes, new: int) -> dict:
    """One drafter at each batch size (eager, or compiled on a static cache of the batch's bucket: the target's
    path): B ragged prompts (the prompt cut by 0..7 tokens) decoded together, after
    an untimed decode of the same batch; the step's draft and verify ms, the draft ms per row-step (the batch's draft
    time over the rows drafted for), and throughput."""
    out = {}
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
    return out


def check_shape(label: str, shape: dict, device: torch.device, dtype: torch.dtype, names: list[str],
                prompt_len: int, new: int, repeats: int, budget: Budget, tree_sizes=TREE_SIZES,
                batch_names: tuple[str, ...] = (), batch_sizes: tuple[int, ...] = (),
                batch_modes: tuple[str, ...] = ("eager", "compiled"), backend: bool | str = True) -> dict:
    """The tables of one real shape, filled part by part into budget.check.shapes[label] (saved after each part):
    the ms-per-token paths, verify against tree size, the compiled step's profile, the drafters eager and compiled,
    the batch sweep, transformers' generate."""
    row = budget.check.shapes.setdefault(label, {})
    model = random_llama(shape, dtype, device)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, shape["vocab_size"], (prompt_len,), generator=g).tolist()
    base = TargetModel(model, None, device, label)
    devs = base.devices
    from specbench.tools.limit import bare_ms, weight_matrices

    wbytes = sum(w.numel() * w.element_size() for w in weight_matrices(base))
    bw = bandwidth_gbs(device)
    row |= {"weight_bytes": wbytes, "bandwidth_gbs": bw, "ms_per_token": {"HBM floor": 1e3 * wbytes / (bw * 1e9),
                                                                           "bare F.linear": bare_ms(base, repeats)}}
    targets = {"eager, dynamic cache": base,
               "eager, preallocated cache": TargetModel(model, None, device, label, cache="preallocated"),
               "compiled": TargetModel(model, None, device, label, compile=backend)}
    for path, target in targets.items():
        engine = Engine(target, NoDrafter(), SamplingParams())
        engine.generate(prompt, new)  # warm: kernels, plans, graphs
        row["ms_per_token"][f"ours, {path}"] = min(per_token_ms(engine.generate(prompt, new)) for _ in range(repeats))
    budget.done()
    if budget.allows(f"{label} verify"):
        row["verify_ms"] = {k: verify_ms(targets[k], prompt, tree_sizes, repeats)
                            for k in ("eager, dynamic cache", "compiled")}
        budget.done()
    if budget.allows(f"{label} profile"):
        row["profile_compiled"] = kernel_profile(Engine(targets["compiled"], NoDrafter(), SamplingParams()), prompt,
                                                 min(new, 32))
        budget.done()
    board = published_board()
    base_ms = {"eager": row["ms_per_token"]["ours, eager, dynamic cache"], "compiled": row["ms_per_token"]["ours, compiled"]}
    drafters, first = row.setdefault("drafters", {}), row.setdefault("first_pass", {})
    for name in names:
        for mode, target in (("eager", targets["eager, dynamic cache"]), ("compiled", targets["compiled"])):
            if not budget.allows(f"{label} {name} {mode}"):
                continue
            engine = Engine(target, make_drafter(name, target), SamplingParams())
            engine.generate(prompt, 16)  # the drafter's first-call set-up
            cold = engine.generate(prompt, new)
            warm = min((engine.generate(prompt, new) for _ in range(repeats)), key=lambda g: g.wall_s)
            cost = step_ms(warm)
            pub = board.get(name)
            if pub:  # tau tokens a step, at this step's cost: against the same path's baseline
                cost["predicted_speedup"] = pub["tau"] * base_ms[mode] / (cost["draft"] + cost["verify"] + cost["other"])
                cost["published_tau"], cost["published_speedup"] = pub["tau"], pub["speedup"]
            drafters[f"{name} {mode}"] = cost
            if mode == "eager":
                c = step_ms(cold)
                first[name] = {"first": c, "repeat": cost, "ratio": (c["draft"] + c["verify"]) /
                               max(1e-9, cost["draft"] + cost["verify"])}
            budget.done()
    batch = row.setdefault("batch", {})
    for name in batch_names:
        for mode in batch_modes:
            target = targets["compiled" if mode == "compiled" else "eager, dynamic cache"]
            if budget.allows(f"{label} batch {name} {mode}"):
                batch[f"{name} {mode}"] = batch_costs(target, name, prompt, batch_sizes, new)
                budget.done()
    ids = torch.tensor([prompt], device=device)
    for static in (False, True):
        path = f"transformers generate, {'static cache compiled' if static else 'eager'}"
        if budget.allows(f"{label} {path}"):
            row["ms_per_token"][path] = hf_generate_ms(model, ids, new, static, devs, repeats, backend)
            budget.done()
    del targets, base, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


# ---- the record ----------------------------------------------------------------------------------------------------
def markdown(check: Check) -> str:
    h = check.header
    out = [f"# make gpu-check: {h['device_name']} ({h['dtype']}), commit {h['git'].get('commit', '?')[:7]}", "",
           f"torch {h['versions'].get('torch')}, transformers {h['versions'].get('transformers')}; SDPA backends "
           f"{h['sdpa']}; torch.compile backend {h.get('compile_backend', 'inductor')}; {h['command']}", "", "## Lossless (tiny fp32 target, greedy)", ""]
    bad = {k: v for k, v in check.lossless.items() if v != "ok"}
    out.append(f"{len(check.lossless) - len(bad)} of {len(check.lossless)} drafter x path runs equal the target's "
               "greedy output" + ("" if not bad else ": " + "; ".join(f"{k}: {v}" for k, v in sorted(bad.items()))))
    law = check.law
    if law:
        out += ["", f"T = {law['temperature']} law of the first drafted step's token ({law['drafter']}, {law['samples']} "
                    f"samples): chi2 {law['chi2']:.1f} on {law['df']} df, p = {law['p_value']:.3g} "
                    f"({'ok' if law['ok'] else 'REJECTED'})"]
    for label, row in check.shapes.items():
        if "ms_per_token" not in row:
            continue
        out += ["", f"## {label} (random weights, {row['weight_bytes'] / 1e9:.2f} GB of weight matrices, measured "
                    f"bandwidth {row['bandwidth_gbs']:.0f} GB/s)", "", "| path | ms per token |", "|---|---|"]
        out += [f"| {k} | {v:.2f} |" for k, v in row["ms_per_token"].items()]
        if row.get("verify_ms"):
            sizes = list(next(iter(row["verify_ms"].values())))
            out += ["", "| verify ms, chain of n | " + " | ".join(map(str, sizes)) + " |",
                    "|---|" + "---|" * len(sizes)]
            out += [f"| {k} | " + " | ".join(f"{v[n]:.2f}" for n in sizes) + " |" for k, v in row["verify_ms"].items()]
        if row.get("drafters"):
            out += ["", "| drafter, path | draft ms | verify ms | other ms | published τ | predicted | published |",
                    "|---|---|---|---|---|---|---|"]
            for k, c in row["drafters"].items():
                pred = f"{c['predicted_speedup']:.2f}x" if "predicted_speedup" in c else "–"
                out.append(f"| {k} | {c['draft']:.2f} | {c['verify']:.2f} | {c['other']:.2f} | "
                           f"{c.get('published_tau', '–')} | {pred} | "
                           f"{(str(c['published_speedup']) + 'x') if 'published_speedup' in c else '–'} |")
        if row.get("first_pass"):
            out += ["", "| drafter (eager) | first pass draft / verify ms | repeat | first / repeat |",
                    "|---|---|---|---|"]
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
    if check.skipped:
        out += ["", f"Left out at the deadline ({h.get('deadline_s')} s): " + ", ".join(check.skipped)]
    return "\n".join(out) + "\n"


def run(args, save=lambda check: None) -> Check:
    device = torch.device("cpu" if args.cpu_form else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu-check: no CUDA device here (--cpu-form runs the reduced check on the CPU)")
    dtype = torch.float32 if args.cpu_form else torch.bfloat16
    names = args.drafters.split(",") if args.drafters else drafter_names()
    timed_names = args.timed_drafters.split(",") if args.timed_drafters else names
    shapes = CPU_SHAPES if args.cpu_form else SHAPES
    backend = compile_option(args.compile_backend)  # True: inductor (CUDA graphs on CUDA), or the backend's name
    header = {"command": "python -m specbench.gpu_check " + " ".join(args.argv), "git": envinfo.git_commit(),
              "date": envinfo.now_utc(), "versions": envinfo.versions(), "device": envinfo.device_info(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else envinfo.cpu_name(),
              "dtype": str(dtype).removeprefix("torch."), "sdpa": args.sdpa, "drafters": names,
              "deadline_s": args.deadline, "compile_backend": args.compile_backend}
    check = Check(header)
    budget = Budget(check, time.perf_counter() + args.deadline, save)
    with sdpa_context(args.sdpa, device), torch.inference_mode():
        t0 = time.perf_counter()
        check.lossless = check_lossless(device, names, args.tiny_new, backend)
        check.law = check_law(device, args.law_drafter, args.law_samples)
        budget.done()
        print(f"lossless + law: {time.perf_counter() - t0:.0f} s", flush=True)
        for label in args.shapes.split(","):
            if not budget.allows(label):
                continue
            t0 = time.perf_counter()
            check_shape(label, shapes[label], device, dtype, timed_names, args.prompt, args.new, args.repeats, budget,
                        tuple(int(n) for n in args.tree_sizes.split(",")),
                        tuple(n for n in args.batch_drafters.split(",") if n),
                        tuple(int(n) for n in args.batch_sizes.split(",")),
                        tuple(m for m in args.batch_modes.split(",") if m), backend)
            print(f"{label}: {time.perf_counter() - t0:.0f} s", flush=True)
    return check


def write(check: Check, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "gpu_check.json", {"header": check.header, "lossless": check.lossless, "law": check.law,
                                               "shapes": check.shapes, "skipped": check.skipped})
    atomic_write_text(out / "gpu_check.md", markdown(check))
    return out


def parse(argv: list[str] | None = None):
    import sys

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m specbench.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--cpu-form", action="store_true", help="reduced shapes on the CPU (make test's form)")
    p.add_argument("--shapes", default="llama2-7b,llama3-8b")
    p.add_argument("--drafters", default="", help="comma-separated (default: every conf/drafter config)")
    p.add_argument("--timed-drafters", default="", help="the drafters timed on the real shapes (default: --drafters)")
    p.add_argument("--batch-drafters", default="none,pld,medusa,eagle2",
                   help="the drafters of the batch sweep on the real shapes (eager and compiled), comma-separated; "
                        "empty: none")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--batch-modes", default="eager,compiled", choices=["eager", "compiled", "eager,compiled"],
                   help="the batch sweep's paths")
    p.add_argument("--deadline", type=float, default=420.0,
                   help="seconds after which no part starts (the parts left out are recorded)")
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
    p.add_argument("--out", default=None, help="default: results/gpu_check/<device>")
    args = p.parse_args(argv)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse(argv)
    name = (torch.cuda.get_device_name() if not args.cpu_form and torch.cuda.is_available() else envinfo.cpu_name())
    out = Path(args.out) if args.out else envinfo.REPO / "results" / "gpu_check" / name.replace(" ", "_").replace("/", "_")
    check = run(args, save=lambda check: write(check, out))
    write(check, out)
    print(markdown(check))
    print(f"written: {out}")
    return out


if __name__ == "__main__":
    main()
