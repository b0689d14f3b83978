"""`make peer`: our `eagle` against the authors' own EAGLE (PyPI eagle-llm==1.2.1, `EaModel`), one head in both.

The trained head (drafter=eagle: weights/<model>/eagle) is written in the authors' layout (the drafter's
`save_authors_layout`, drafters/eagle.py) and
both implementations load that one directory: ours through `drafter.checkpoint` (load_authors_head), theirs through
`EaModel.from_pretrained` (in .peer-venv, peer/eagle_llm_side.py, a subprocess answering JSON lines). Both decode the
same chat-templated prompts at T=0 with EAGLE-1's tree (`mc_sim_7b_63`) in fp32 on the same threads; the two
alternate prompt by prompt so that drift hits both alike. Reported per target variant, in results/peer/:
- whether each output equals the target's greedy output (ours, no drafter) and each other's, token for token, with
  the first divergence of each classified (specbench/bench/divergence.py);
- the mean acceptance length of each, one definition for both: tokens after the prefill's first one, per
  tree-verification step, counting the steps needed to produce the compared tokens (N, or up to an EOS);
- tokens/s of each (and of each side's one-token greedy decoding), ours / theirs from the same run.

Target variants (`peer.rope_thetas`): eagle-llm 1.2.1 hard-codes the RoPE base 10000 in its target
(modeling_llama_kv.py) and its head (cnets.py), and reads no `rope_theta`; SmolLM2 uses 100000. So `null` (the
target as shipped) shows what their code does to such a target, and 10000 (the same weights with rope_theta 10000,
which both implementations then compute alike) is the like-for-like check.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from specbench.core.config import ModelConfig, register_schema
from specbench.bench.divergence import classify_by_forward, first_divergence
from specbench.decode.drafter import NoDrafter
from specbench.decode.compiled import compile_option
from specbench.decode.engine import Engine
from specbench.errors import SpecbenchError
from specbench.core.models import load_model, resolve_checkpoint
from specbench.core.cli import CONF_DIR, cli, measure_and_save
from specbench.bench.run import Runner, inference_spec
from specbench.decode.target import TargetModel

log = logging.getLogger("specbench.peer")

SIDE = Path(__file__).resolve().parents[2] / "peer" / "eagle_llm_side.py"


# ---- one definition of the compared output and its acceptance length, for both sides --------------------------------
def compared(tokens: list[int], max_new: int, eos: int) -> list[int]:
    """The first max_new tokens, cut after the first EOS (both sides stop there)."""
    out = tokens[:max_new]
    return out[: out.index(eos) + 1] if eos in out else out


def steps_to(known: list[int], need: int) -> int:
    """Verification steps until `need` tokens were known (known[k]: tokens known after step k+1, the prefill's
    first token included)."""
    for k, n in enumerate(known):
        if n >= need:
            return k + 1
    raise SpecbenchError(f"the authors' generator stopped at {known[-1] if known else 0} tokens, {need} were needed")


# ---- the two targets: as shipped, or with another RoPE base ---------------------------------------------------------
def export_target(src: Path, out: Path, rope_theta: float | None) -> Path:
    """The target's checkpoint in a form transformers 4.36 (the authors' pin) reads: a config with a plain
    `rope_theta` (transformers 5 writes `rope_parameters`), a tokenizer config naming PreTrainedTokenizerFast, BPE
    merges as strings (the tokenizers release it pins), the weights linked, not copied."""
    cfg = json.loads((src / "config.json").read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = float(rope_theta if rope_theta is not None else cfg.get("rope_theta", rope.get("rope_theta")))
    cfg["torch_dtype"] = cfg.pop("dtype", cfg.get("torch_dtype", "float32"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok = json.loads((src / "tokenizer_config.json").read_text())
    tok = {k: tok[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if tok.get(k)}
    (out / "tokenizer_config.json").write_text(json.dumps({**tok, "tokenizer_class": "PreTrainedTokenizerFast"}))
    spec = json.loads((src / "tokenizer.json").read_text())
    merges = spec.get("model", {}).get("merges")
    if merges and isinstance(merges[0], list):  # tokenizers < 0.19 (transformers 4.36's) reads "a b", not ["a", "b"]
        spec["model"]["merges"] = [" ".join(m) for m in merges]
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    for name in ("model.safetensors", "generation_config.json", "chat_template.jinja"):
        if (src / name).exists() and not (out / name).exists():
            os.symlink((src / name).resolve(), out / name)
    return out


class AuthorsSide:
    """The authors' EaModel in its own environment, driven over JSON lines."""

    def __init__(self, python: str, target_dir: Path, head_dir: Path, threads: int, log_path: Path):
        if not Path(python).is_file():
            raise SpecbenchError(f"peer.python={python} does not exist: run `make peer` (it builds .peer-venv)")
        self.stderr = log_path.open("w")
        self.proc = subprocess.Popen([python, str(SIDE), str(target_dir), str(head_dir), str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        hello = self._read()
        self.eos, self.tree = hello["eos"], hello["tree"]

    def _read(self) -> dict:
        for line in self.proc.stdout:  # the authors' code may print; our answers are the JSON objects
            if line.startswith("{"):
                return json.loads(line)
        raise SpecbenchError(f"the authors' side exited ({self.proc.wait()}): see {self.stderr.name}")

    def __call__(self, method: str, ids: list[int], max_new: int) -> dict:
        self.proc.stdin.write(json.dumps({"method": method, "ids": ids, "max_new": max_new}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.stderr.close()


@dataclass
class Side:
    """One method's results over the prompts: outputs (repeat 0), steps and tokens for tau, seconds per repeat."""
    outputs: list[list[int]]
    steps: int
    tokens: int  # compared tokens after each prompt's first one
    walls: list[float]  # per repeat
    counts: list[int]  # compared tokens per repeat

    @classmethod
    def empty(cls) -> "Side":
        return cls([], 0, 0, [], [])

    def add(self, rep: int, out: list[int], steps: int, wall: float) -> None:
        if rep == 0:
            self.outputs.append(out)
            self.steps += steps
            self.tokens += len(out) - 1
        if len(self.walls) <= rep:
            self.walls.append(0.0)
            self.counts.append(0)
        self.walls[rep] += wall
        self.counts[rep] += len(out)

    def summary(self) -> dict:
        speeds = [c / w for c, w in zip(self.counts, self.walls)]
        return {"tau": self.tokens / self.steps if self.steps else None, "steps": self.steps,
                "tokens_per_s": {"mean": statistics.fmean(speeds), "std": statistics.pstdev(speeds),
                                 "repeats": speeds}}


def compare_variant(runner: Runner, cfg: DictConfig, rope_theta: float | None, work: Path, trained) -> dict:
    src = Path(resolve_checkpoint(runner.model_cfg))
    label = "as shipped" if rope_theta is None else f"rope_theta={rope_theta:g}"
    tdir = export_target(src, work / f"target-{'shipped' if rope_theta is None else f'rope{rope_theta:g}'}",
                         rope_theta)
    if rope_theta is None:
        target = runner.target
    else:
        mc = ModelConfig(**{**OmegaConf.to_container(cfg.model, resolve=True), "path": str(tdir),
                            "gguf_package": None, "name": f"{runner.model_cfg.name}@{label}"})
        model, tok, device = load_model(mc)
        target = TargetModel(model, tok, device, mc.name, compile=compile_option(mc.compile))  # as the run's target
    # the one trained head, written for this variant's target: the same weights, its config naming the target's RoPE
    # base (the check on loading refuses a head recorded for another base; the authors' code reads none)
    head_dir = work / f"eagle-authors-layout-{tdir.name}"
    if head_dir.exists():
        shutil.rmtree(head_dir)
    trained.save_authors_layout(head_dir, target)
    params = runner.decoding.sampling()
    tree = OmegaConf.to_container(cfg.tree, resolve=True)
    eagle = instantiate({**inference_spec(cfg.drafter), "checkpoint": str(head_dir)}, target=target, _convert_="object")
    ours = {"greedy": Engine(target, NoDrafter(), params), "eagle": Engine(target, eagle, params)}
    theirs = AuthorsSide(cfg.peer.python, tdir, head_dir, torch.get_num_threads(), work / f"authors-{tdir.name}.log")
    eos, max_new = theirs.eos, runner.decoding.max_new_tokens
    if eos not in target.eos_token_ids:
        raise SpecbenchError(f"the authors' tokenizer stops at {eos}, ours at {sorted(target.eos_token_ids)}")
    if theirs.tree != tree["paths"]:
        raise SpecbenchError(f"tree={tree['name']} is not the authors' mc_sim_7b_63: use tree=static")
    prompts = [runner.prompt_ids(q, 0, []) for q in runner.questions]
    sides = {k: Side.empty() for k in ("ours-greedy", "ours-eagle", "theirs-greedy", "theirs-eagle")}

    def once(method: str, ids: list[int]) -> tuple[list[int], int, float]:
        who, how = method.split("-")
        if who == "ours":
            g = ours[how].generate(ids, max_new)
            return compared(g.new_tokens, max_new, eos), g.steps, g.wall_s
        r = theirs(how, ids, max_new)
        out = compared(r["tokens"], max_new, eos)
        k = steps_to(r["known"], len(out))
        # greedy: one target forward per token, the prefill's included; eagle: verification steps
        return out, (k if how == "eagle" else len(out) - 1), r["times"][k - 1]

    try:
        for m in sides:  # warm-up
            for _ in range(runner.bench.warmup):
                once(m, prompts[0])
        for rep in range(runner.bench.repeats):
            for i, ids in enumerate(prompts):
                for m in sides:
                    out, steps, wall = once(m, ids)
                    sides[m].add(rep, out, steps, wall)
                log.info("%s: repeat %d prompt %d/%d", label, rep + 1, i + 1, len(prompts))
    finally:
        theirs.close()

    ref = sides["ours-greedy"].outputs  # the target's greedy output (the engine with no drafter = transformers')

    def against(name: str, other: list[list[int]]) -> dict:
        mine = sides[name].outputs
        first = []
        for p, (a, b) in enumerate(zip(mine, other)):
            at = first_divergence(a, b)
            if at is not None and at < min(len(a), len(b)):
                first.append({"prompt": p, "at": at, **classify_by_forward(target, prompts[p], a[:at], a[at], b[at])})
            elif at is not None:
                first.append({"prompt": p, "at": at, "kind": "length"})
        return {"identical": sum(a == b for a, b in zip(mine, other)), "of": len(mine), "divergences": first}

    s = {k: v.summary() for k, v in sides.items()}
    return {
        "target": label, "rope_theta": rope_theta,
        "identical_to_greedy": {k: against(k, ref) for k in ("ours-eagle", "theirs-greedy", "theirs-eagle")},
        "ours_eagle_vs_theirs_eagle": against("ours-eagle", sides["theirs-eagle"].outputs),
        "tau": {"ours": s["ours-eagle"]["tau"], "theirs": s["theirs-eagle"]["tau"]},
        "tokens_per_s": {k: v["tokens_per_s"] for k, v in s.items()},
        "ours_over_theirs": {how: s[f"ours-{how}"]["tokens_per_s"]["mean"] / s[f"theirs-{how}"]["tokens_per_s"]["mean"]
                             for how in ("eagle", "greedy")},
        "eagle_over_greedy": {who: s[f"{who}-eagle"]["tokens_per_s"]["mean"] / s[f"{who}-greedy"]["tokens_per_s"]["mean"]
                              for who in ("ours", "theirs")},
    }


def run_peer(cfg: DictConfig) -> dict:
    if cfg.model.dtype != "float32" or cfg.decoding.temperature != 0:
        raise SpecbenchError("make peer compares fp32 greedy decoding (model.dtype=float32, decoding.temperature=0)")
    runner = Runner(cfg)
    work = Path(os.path.expanduser(cfg.model.cache_dir)) / "peer" / runner.model_cfg.name
    trained = runner.make_drafter(cfg.drafter)  # our eagle with its trained head (drafter.checkpoint)
    if not hasattr(trained, "save_authors_layout"):
        raise SpecbenchError(f"make peer compares EAGLE heads: drafter={cfg.drafter.name} has no authors' layout")
    variants = [compare_variant(runner, cfg, t, work, trained) for t in cfg.peer.rope_thetas]
    return {"model": runner.model_cfg.name, "checkpoint": cfg.drafter.checkpoint, "tree": cfg.tree.name,
            "prompts": len(runner.questions), "max_new_tokens": runner.decoding.max_new_tokens,
            "repeats": runner.bench.repeats, "threads": torch.get_num_threads(),
            "authors": "eagle-llm==1.2.1 (EaModel.ea_generate / naive_generate), transformers==4.36.2",
            "variants": variants}


def print_report(r: dict) -> None:
    print(f"\nmake peer: {r['model']}, head {r['checkpoint']}, tree {r['tree']}, {r['prompts']} prompts x "
          f"{r['max_new_tokens']} tokens, {r['repeats']} repeats, {r['threads']} threads; theirs: {r['authors']}")
    for v in r["variants"]:
        print(f"\n target {v['target']}")
        for k, d in {**v["identical_to_greedy"], "ours-eagle vs theirs-eagle": v["ours_eagle_vs_theirs_eagle"]}.items():
            kinds = ", ".join(f"p{x['prompt']}@{x['at']}:{x['kind']}" for x in d["divergences"])
            print(f"  {k:28} identical {d['identical']}/{d['of']}" + (f"  ({kinds})" if kinds else ""))
        print(f"  tau ours {v['tau']['ours']:.3f}  theirs {v['tau']['theirs']:.3f}")
        for k, t in v["tokens_per_s"].items():
            print(f"  {k:14} {t['mean']:7.2f} ±{t['std']:5.2f} tok/s")
        print("  ours/theirs: " + ", ".join(f"{k} {x:.2f}x" for k, x in v["ours_over_theirs"].items()))


register_schema()


@hydra.main(config_path=str(CONF_DIR), config_name="peer", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    measure_and_save(cfg, run_peer, print_report, "eagle", "specbench.peer")


def main() -> None:
    cli(_main)


if __name__ == "__main__":
    main()
