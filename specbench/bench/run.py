"""`python -m specbench.run drafter=<name> dataset=<name> [overrides]`: one run (or a `-m` sweep) of a drafter over a
question set through the shared engine, written to results/<experiment>/<run>/."""
from __future__ import annotations

import hashlib
import json
import logging
import sys
import zlib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from specbench.decode.drafter import Drafter, NoDrafter, check_batched
from specbench.bench import divergence
from specbench.core import envinfo
from specbench.bench import failures
from specbench.core.cli import CONF_DIR, cli, config_hash, fail
from specbench.decode.compiled import compile_option, compiled_graphs
from specbench.bench.divergence import first_divergence
from specbench.core.config import BenchConfig, DatasetConfig, DecodingConfig, ModelConfig, register_schema, to_dataclass
from specbench.data.data import Question, load_questions
from specbench.decode.engine import TREE_ROOM, BatchGeneration, Engine, Generation
from specbench.errors import SpecbenchError
from specbench.core.metrics import PeakMemory, summarize
from specbench.core.models import chat_prompt_ids, load_model, pick_dtype, sdpa_context
from specbench.core.records import RunDir, atomic_write_json, exclusive
from specbench.bench.sweep import missing_weights, record_failure, skip_reason
from specbench.decode.target import TargetModel
from specbench.deploy.split import DeployConfig
from specbench.deploy.link import LinkConfig

log = logging.getLogger("specbench")
def model_identity(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> dict:
    """The target as the run decodes with it, resolved: which weights (name, hub id, local path, revision, GGUF file),
    in which dtype (after `auto`), on which kind of device, behind which prompt (template, system prompt), through
    which attention and placement. Each of these changes the records; where the cache lives or which drafters have
    published weights does not."""
    return {"name": cfg.name, "hf_id": cfg.hf_id, "path": cfg.path, "revision": cfg.revision, "gguf_file": cfg.gguf_file,
            "dtype": str(dtype).removeprefix("torch."), "device": device.type, "chat_template": cfg.chat_template,
            "system_prompt": cfg.system_prompt, "attn_implementation": cfg.attn_implementation,
            "device_map": cfg.device_map,
            # only when set: runs made before the option keep their names (the fast tokenizer was the only one)
            **({} if cfg.use_fast_tokenizer else {"use_fast_tokenizer": False}),
            # (compiled kernels may round differently from eager ones: a compiled run is a run of its own; True is
            # inductor's, a run through another backend names it)
            **({"compile": compile_option(cfg.compile)} if cfg.compile else {})}


def run_key(model: dict, drafter: dict, dataset: dict, decoding: dict, repeats: int, seed: int) -> dict:
    """Everything that changes the records: runs of different keys never share a directory. A drafter's training
    settings (`optim`, and the module options its `decoding_options` drops) are not among them: the weights they made
    are, by their digest (checkpoint_sha256)."""
    drafter = {k: v for k, v in drafter.items() if k != "optim"}
    cls = get_class(drafter["_target_"]) if drafter.get("_target_") else None
    if isinstance(drafter.get("module"), dict) and hasattr(cls, "decoding_options"):
        drafter["module"] = cls.decoding_options(dict(drafter["module"]))  # its training-only options do not count
    if decoding.get("batch_size", 1) == 1:  # batch 1 is how every run was decoded before the option: same names
        decoding = {k: v for k, v in decoding.items() if k != "batch_size"}
    if not decoding.get("ragged", False):  # (decoding.ragged, gone with issue 77: records of then that set it false)
        decoding = {k: v for k, v in decoding.items() if k != "ragged"}
    return {"model": model, "drafter": drafter, "dataset": dataset, "decoding": decoding, "repeats": repeats,
            "seed": seed}


def run_name(key: dict) -> str:
    return (f"{key['model']['name']}__{key['drafter']['name']}__{key['dataset']['name']}__"
            f"T{key['decoding']['temperature']:g}__{config_hash(key)}")


def recorded_key(head: dict) -> dict:
    """The key of an existing run, from its run.json. Runs written before run.json carried `model_identity` are
    resolved the way the loader resolves them (specbench.models.pick_dtype: `auto` is bf16 on CUDA, else fp32)."""
    cfg = head["config"]
    identity = head.get("model_identity")
    if identity is None:
        m, device = dict(cfg["model"]), torch.device(head["env"]["device"])
        # model.cache, gone since every decode runs on the preallocated cache (issue 77): a run of before named it
        # when it was not the default dynamic
        cache = m.pop("cache", "dynamic")
        identity = model_identity(to_dataclass(ModelConfig, m), device, pick_dtype(m.get("dtype", "float32"), device))
        identity |= {} if cache == "dynamic" else {"cache": cache}
    return run_key(identity, cfg["drafter"], cfg["dataset"], cfg["decoding"], cfg["bench"]["repeats"], cfg["seed"])


def differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """The dotted keys where two nested dicts differ."""
    out = []
    for k in sorted(set(a) | set(b), key=str):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += differences(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k}")
    return out


def turn_seed(seed: int, repeat: int, qid: str, turn: int) -> int:
    return zlib.crc32(f"{seed}/{repeat}/{qid}/{turn}".encode())


TRAINING_ONLY = ("name", "optim")  # drafter YAML keys that are not constructor arguments


def inference_spec(node: DictConfig | dict) -> dict:
    """A drafter node as `instantiate` takes it for decoding: without its name and training-only settings."""
    spec = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    for key in TRAINING_ONLY:
        spec.pop(key, None)
    return spec


def with_paper_tree(spec: dict, paper_tree: dict | None) -> dict:
    """tree=paper (conf/tree/paper.yaml): the drafter's `tree` becomes the tree its YAML picks (`paper_tree`), so the
    run is named and built exactly as one naming that tree."""
    tree = spec.get("tree")
    if isinstance(tree, dict) and tree.get("kind") == "paper":
        if paper_tree is None:
            raise SpecbenchError("tree=paper: no paper_tree in the config")
        return {**spec, "tree": paper_tree}
    return spec


def is_auto(tree) -> bool:
    return isinstance(tree, dict) and tree.get("kind") == "auto"


def own_tree(spec: dict):
    """The drafter class's own tunable drafts (Drafter.own_tree), for tree=auto on a drafter without ${tree}."""
    cls = get_class(spec["_target_"]) if spec.get("_target_") else None
    return cls.own_tree(spec) if cls is not None and hasattr(cls, "own_tree") else None


def weights_digest(checkpoint: str) -> str:
    from specbench.decode.checkpoints import weight_file

    path = weight_file(checkpoint)
    if path is None:
        raise SpecbenchError(f"no drafter checkpoint at {checkpoint} (no model.safetensors or pytorch_model.bin): "
                             "run `make train`")
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def model_digest(model_path: str) -> str:
    """An HF draft model's identity: the digest of its config and weight files (a hub id as given: its files are in
    the hub cache, by revision)."""
    path = Path(model_path).expanduser()
    if not path.is_dir():
        return hashlib.sha256(model_path.encode()).hexdigest()[:16]
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.suffix in (".json", ".safetensors", ".bin") and f.is_file():
            h.update(f.name.encode())
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


BASELINE_STALE_HOURS = 6.0  # a baseline timed longer before its drafter's run than this is named (the host drifts)


def baseline_timing(baseline: RunDir) -> dict | None:
    """When and at which commit a baseline run was timed, and how many hours before now (None: no run.json yet)."""
    if not baseline.run_json.is_file():
        return None
    head = json.loads(baseline.run_json.read_text())
    then = datetime.fromisoformat(head["date"])
    return {"run": baseline.path.name, "date": head["date"], "commit": (head.get("git") or {}).get("commit") or "",
            "hours_before": (datetime.now(timezone.utc) - then).total_seconds() / 3600}


class Runner:
    """Holds the loaded target for one job; runs the baseline and the drafter over one question set."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.model_cfg: ModelConfig = to_dataclass(ModelConfig, cfg.model)
        self.dataset_cfg: DatasetConfig = to_dataclass(DatasetConfig, cfg.dataset)
        self.decoding: DecodingConfig = to_dataclass(DecodingConfig, cfg.decoding)
        self.bench: BenchConfig = to_dataclass(BenchConfig, cfg.bench)
        if self.decoding.max_new_tokens < 1:
            raise SpecbenchError("decoding.max_new_tokens must be >= 1")
        if self.decoding.temperature < 0:  # would silently run as greedy
            raise SpecbenchError(f"decoding.temperature={self.decoding.temperature:g} must be >= 0 (0 = greedy)")
        if not 0 < self.decoding.top_p <= 1 or self.decoding.top_k < 0:
            raise SpecbenchError(f"decoding.top_p={self.decoding.top_p:g} must be in (0, 1] and decoding.top_k="
                                 f"{self.decoding.top_k} >= 0 (0 = off)")
        if self.decoding.batch_size < 1:
            raise SpecbenchError(f"decoding.batch_size={self.decoding.batch_size} must be >= 1")
        if self.bench.repeats < 1 or self.bench.warmup < 0:
            raise SpecbenchError("bench.repeats must be >= 1 and bench.warmup >= 0")
        self.questions = load_questions(self.dataset_cfg)
        if self.decoding.batch_size > len(self.questions):  # the table would show B while fewer rows were decoded
            raise SpecbenchError(f"decoding.batch_size={self.decoding.batch_size} needs at least that many questions: "
                                 f"{self.dataset_cfg.name} has {len(self.questions)} here (dataset.limit="
                                 f"{self.dataset_cfg.limit}); give dataset.limit={self.decoding.batch_size} or more")
        compile = compile_option(self.model_cfg.compile)  # (refused before loading)
        model, tok, device = load_model(self.model_cfg)
        self.target = TargetModel(model, tok, device, self.model_cfg.name, compile=compile)
        self.identity = model_identity(self.model_cfg, device, self.target.dtype)
        self.exp_dir = Path(cfg.out.root) / cfg.out.experiment
        self.tree_auto: dict | None = None  # tree=auto: the chosen tree and its prediction (run.json)
        self._pairs = 0  # bench.paired: turn pairs decoded so far (the odd ones run the baseline first)
        self.paper_tree = OmegaConf.to_container(cfg.paper_tree, resolve=True) if cfg.get("paper_tree") else None
        tree = OmegaConf.to_container(cfg.tree, resolve=True) if cfg.get("tree") is not None else None
        self.global_auto = tree if is_auto(tree) else None  # tree=auto: also tunes drafters without ${tree}
        self.deploy: DeployConfig = to_dataclass(DeployConfig, cfg.deploy) if cfg.get("deploy") else DeployConfig()
        self.link: LinkConfig = to_dataclass(LinkConfig, cfg.link) if cfg.get("link") else LinkConfig()
        self.deploy.check()
        self.link.check()
        if self.deploy.name == "client_server":  # before anything is loaded or decoded: one line each
            if self.decoding.batch_size != 1 or self.decoding.temperature != 0:
                raise SpecbenchError(f"deploy=client_server decodes one answer at a time, greedy (no draft "
                                     f"probabilities cross): decoding.batch_size={self.decoding.batch_size} and "
                                     f"decoding.temperature={self.decoding.temperature:g} must be 1 and 0")
        self._check_prompts()

    def prompt_ids(self, q: Question, turn: int, answers: list[str]) -> list[int]:
        messages: list[dict[str, str]] = []
        for i in range(turn):
            messages += [{"role": "user", "content": q.turns[i]}, {"role": "assistant", "content": answers[i]}]
        messages.append({"role": "user", "content": q.turns[turn]})
        return chat_prompt_ids(self.target.tokenizer, messages, self.model_cfg.system_prompt)

    def budget(self, prompt_tokens: int) -> int:
        """New tokens this turn may have: max_new_tokens, or fewer where the context ends first (Vicuna-7B v1.3 has
        2,048 positions; the authors' scripts stop there too). The same for the baseline and every drafter (the engine
        does not verify a tree that would reach past the context), so their outputs stay comparable token for token."""
        limit = self.target.max_positions
        room = limit - prompt_tokens if limit else self.decoding.max_new_tokens
        return max(0, min(self.decoding.max_new_tokens, room))

    def _check_prompts(self) -> None:
        """Fail before anything is written when a first turn leaves no room for one new token (later turns that do
        not fit are recorded as stopped by the context)."""
        for q in self.questions:
            ids = self.prompt_ids(q, 0, [])
            if self.budget(len(ids)) < 1:
                raise SpecbenchError(f"question {q.question_id} turn 1: prompt of {len(ids)} tokens exceeds the "
                                     f"context of {self.model_cfg.name} ({self.target.max_positions} tokens)")

    def run_dir_for(self, drafter_node: DictConfig) -> tuple[RunDir, dict, dict]:
        drafter = with_paper_tree(OmegaConf.to_container(drafter_node, resolve=True), self.paper_tree)
        if self.global_auto is not None and not is_auto(drafter.get("tree")) and own_tree(drafter) is not None:
            drafter["tree"] = self.global_auto  # pld / sd / medusa tuned by tree=auto: a run of its own
        if drafter.get("model_path"):  # an HF draft model (sd): its weights identify the run, a checkpoint does not
            drafter["checkpoint"] = None
            drafter["model_sha256"] = model_digest(drafter["model_path"])
        elif drafter.get("checkpoint"):  # the weights, not just their path, identify a run
            drafter["checkpoint_sha256"] = weights_digest(drafter["checkpoint"])
        if self.split_run(drafter_node):  # a split run is named apart from the local one (which keeps its name)
            drafter["deploy"] = {"name": self.deploy.name, "link": OmegaConf.to_container(self.cfg.link, resolve=True)}
        dataset = OmegaConf.to_container(self.cfg.dataset, resolve=True)
        decoding = OmegaConf.to_container(self.cfg.decoding, resolve=True)
        key = run_key(self.identity, drafter, dataset, decoding, self.bench.repeats, self.cfg.seed)
        return RunDir(self.exp_dir / run_name(key)), drafter, key

    def make_drafter(self, node: DictConfig) -> Drafter:
        spec = with_paper_tree(inference_spec(node), self.paper_tree)
        tree = spec.get("tree")
        if is_auto(tree):  # conf/tree/auto.yaml: the drafter's tree policy sized for this device
            spec["tree"], self.tree_auto = self._auto_tree(spec, tree)
        elif self.global_auto is not None and (own := own_tree(spec)) is not None:  # its own chain / sparse tree
            cut, self.tree_auto = self._auto_tree(spec, self.global_auto, own)
            spec = own.apply(spec, cut)
        return self._instantiate(spec, node.get("name"))

    def _auto_tree(self, spec: dict, tree: dict, own=None) -> tuple[dict, dict]:
        """The tuned cut of the drafter's tree (a conf/tree dict) and its record. `own` (Drafter.own_tree): a drafter
        without a conf/tree policy, whose base and constructor arguments it gives."""
        from specbench.bench import costmodel

        auto = to_dataclass(costmodel.AutoConfig, {k: v for k, v in tree.items() if k != "kind"})
        if own is not None:
            auto.base = own.base
        build = (lambda t: {**spec, "tree": t}) if own is None else (lambda t: own.apply(spec, t))
        cal = to_dataclass(DatasetConfig, OmegaConf.load(CONF_DIR / "dataset" / f"{auto.dataset}.yaml"))
        cal.limit = auto.questions
        prompts = [self.prompt_ids(q, 0, []) for q in load_questions(cal)]
        key = {k: v for k, v in spec.items() if k != "tree"}
        if spec.get("checkpoint"):
            key["checkpoint_sha256"] = weights_digest(spec["checkpoint"])
        run_prompts = [self.prompt_ids(q, 0, []) for q in self.questions]
        return costmodel.choose_tree(self.target, auto,
                                     lambda t: self._instantiate(build(t), self.cfg.drafter.name),
                                     {"name": self.cfg.drafter.name, **key}, prompts, run_prompts,
                                     self.decoding.max_new_tokens, self.model_cfg.cache_dir, self.model_cfg.name,
                                     batch=self.decoding.batch_size)

    def _instantiate(self, spec: dict, name: str | None) -> Drafter:
        try:
            drafter = instantiate(spec, target=self.target, _convert_="object")
        except Exception as e:  # noqa: BLE001 - Hydra wraps constructor errors; report them in one line
            cause = e.__cause__ or e
            if isinstance(cause, SpecbenchError):
                raise cause from None
            raise SpecbenchError(f"drafter {name!r} could not be built: {cause}") from None
        check_batched(drafter, self.decoding.batch_size)  # a one-row drafter at B > 1: one line, before decoding
        return drafter

    def execute(self) -> RunDir:
        problem = missing_weights(self.cfg)
        if problem:  # before the baseline: a job that cannot run its drafter decodes nothing
            raise SpecbenchError(problem)
        baseline_node = OmegaConf.load(CONF_DIR / "drafter" / "none.yaml")
        baseline_dir, _, _ = self.run_dir_for(baseline_node)
        is_baseline = self.cfg.drafter.name == "none"
        run_dir, _, _ = self.run_dir_for(self.cfg.drafter)
        drafter = None
        if not is_baseline and self.todo(run_dir):  # built (its weights and tree checked) before the baseline runs
            torch.manual_seed(self.cfg.seed)  # untrained modules (a test's) are built from the run's seed
            drafter = self.make_drafter(self.cfg.drafter)
            if self.split_run(self.cfg.drafter):  # a drafter that cannot run split: one line, before the baseline
                from specbench.deploy.split import crossing_of

                crossing_of(drafter, self.cfg.drafter.name)
        if not is_baseline and self.bench.baseline:
            with exclusive(baseline_dir.path):  # parallel jobs sharing the baseline compute it once
                self.run_one(baseline_node, None)
        if is_baseline:  # a sweep's own baseline job: the same lock as the drafter jobs' baseline-first
            with exclusive(run_dir.path):
                self.run_one(self.cfg.drafter, None)
        else:
            self.run_one(self.cfg.drafter, baseline_dir if baseline_dir.exists() else None, drafter)
        return run_dir

    def split_run(self, node) -> bool:
        """deploy=client_server applies to the drafter's run; the baseline beside it is the single-device one."""
        return self.deploy.name == "client_server" and node.name != "none"

    def _split(self, node, drafter: Drafter, run_dir: RunDir):
        """The client of deploy=client_server: its server started (unless spawn=false) and the handshake done; a
        drafter that cannot run split is refused here, before the server starts."""
        from specbench.deploy.client import SplitClient, spawn_server
        from specbench.deploy.split import crossing_of

        crossing_of(drafter, node.name)
        server, port = None, self.deploy.port
        if self.deploy.spawn:
            spec = {"model": OmegaConf.to_container(self.cfg.model, resolve=True),
                    "drafter": with_paper_tree(inference_spec(node), self.paper_tree), "name": node.name,
                    "seed": self.cfg.seed, "deploy": OmegaConf.to_container(self.cfg.deploy, resolve=True),
                    "link": OmegaConf.to_container(self.cfg.link, resolve=True)}
            server, port = spawn_server(spec, self.deploy, run_dir.path)  # its spec and log beside the run's records
        try:
            return SplitClient(self.target, drafter, node.name, self.deploy, self.link, self.cfg.seed, port, server)
        except BaseException:
            if server is not None:
                server.kill()  # (its pid: the server this run started)
                server.wait()
            raise

    def todo(self, run_dir: RunDir) -> list[tuple[int, Question]]:
        """The (repeat, question) pairs a run has not recorded yet."""
        done = run_dir.done_keys()
        return [(r, q) for r in range(self.bench.repeats) for q in self.questions if (r, q.question_id) not in done]

    def run_one(self, node: DictConfig, baseline: RunDir | None, drafter: Drafter | None = None) -> RunDir:
        """Run (or resume) one run; `drafter`: the drafter already built for it (None: built here if needed)."""
        run_dir, drafter_spec, key = self.run_dir_for(node)
        if run_dir.exists():  # a resume: only of the very same run (a hash collision or a hand-edited run.json is not)
            diff = differences(recorded_key(json.loads(run_dir.run_json.read_text())), key)
            if diff:
                raise SpecbenchError(f"{run_dir.path} holds a run of another config (differs in {', '.join(diff[:4])}): "
                                     "refusing to resume it; move it away or pick another out.experiment")
        todo = self.todo(run_dir)
        # the drafter is built (its weights loaded and checked) before anything is written: a drafter that cannot
        # load leaves no run directory behind
        if todo and drafter is None:
            torch.manual_seed(self.cfg.seed)  # untrained modules (a test's) are built from the run's seed
            drafter = self.make_drafter(node)
        drafter = drafter if todo else None
        timed = baseline_timing(baseline) if todo and baseline is not None else None
        if timed is not None and timed["hours_before"] > BASELINE_STALE_HOURS:
            log.warning("%s: its speedup is against a baseline timed %.0f h ago (%s, %s); the host's speed drifts "
                        "between sittings: delete %s to time it again in this one", run_dir.path.name,
                        timed["hours_before"], timed["date"], timed["commit"][:7], baseline.path)
        if not run_dir.exists():
            atomic_write_json(run_dir.run_json, {
                "run": run_dir.path.name,
                "experiment": self.cfg.out.experiment,
                "config": OmegaConf.to_container(self.cfg, resolve=True) | {"drafter": drafter_spec},
                "model_identity": self.identity,
                "git": envinfo.git_commit(),
                "date": envinfo.now_utc(),
                "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                "env": envinfo.device_info(self.target.device),
                "versions": envinfo.versions(),
                **({"tree_auto": self.tree_auto} if self.tree_auto and drafter is not None else {}),
                # a tree the drafter resolved itself (Medusa's `auto`: its accuracies' tree, or mc_sim_7b_63 for
                # published heads), for the captions
                **({"tree_used": drafter.tree_used} if getattr(drafter, "tree_used", None) else {}),
                # the baseline its speedup is against: when and at which commit that one was timed
                **({"baseline": {k: timed[k] for k in ("run", "date", "commit")}} if timed is not None else {}),
            })
        if todo:
            split = self._split(node, drafter, run_dir) if self.split_run(node) else None
            engine = Engine(self.target, drafter, self.decoding.sampling(),
                            verifier=None if split is None else split.verifier_for)
            try:
                with sdpa_context(self.bench.sdpa, self.target.device):
                    self._decode(run_dir, engine, todo, baseline, node.name)
            finally:
                if split is not None:  # BYE, then the spawned server is waited for or ended by its pid
                    split.close()
        base_records = baseline.records() if baseline else None
        summary = {"run": run_dir.path.name, "drafter": node.name, "dataset": self.dataset_cfg.name,
                   "model": self.model_cfg.name, "temperature": self.decoding.temperature,
                   "baseline_run": baseline.path.name if baseline else None,
                   **summarize(run_dir.records(), base_records)}
        atomic_write_json(run_dir.summary_path, summary)
        log.info("%s: %s", run_dir.path, _headline(summary))
        return run_dir

    def _decode(self, run_dir: RunDir, engine: Engine, todo: list, baseline: RunDir | None, label: str) -> None:
        reference = {}
        if baseline is not None and self.decoding.temperature == 0:
            reference = {(r["question_id"], r["turn"]): r["new_token_ids"] for r in baseline.records() if r["repeat"] == 0}
        mem = PeakMemory(self.target.devices)
        context = self.target.max_positions
        size = self.decoding.batch_size
        compiled = self.target.compiled
        if compiled is not None:  # the static caches at the largest size any turn can need, before any graph is built on
            # them: the batch's and, for a last group of one prompt, one row's (the engine gives a batch's cache a
            # tree's room past the context)
            most = self._largest_need(todo, context) + (TREE_ROOM if context else 0)
            self.target.new_cache(most, ragged=True)
            if size > 1:
                self.target.new_cache(most, batch=size, ragged=True)
        # bench.paired: the baseline decoded beside each timed turn (same prompts, budgets and seeds), so that the
        # speedup is a ratio of times taken seconds apart, whatever the host's speed does over the sitting
        pair = (Engine(self.target, NoDrafter(self.target), self.decoding.sampling())
                if self.bench.paired and not isinstance(engine.drafter, NoDrafter) else None)
        for _ in range(self.bench.warmup):  # untimed: kernels, allocator, caches; the first prompt in every row
            ids = self.prompt_ids(todo[0][1], 0, [])
            for e in (engine, pair) if pair is not None else (engine,):
                self._decode_turn(e, [ids] * size, [min(self.budget(len(ids)), 32)] * size, [self.cfg.seed] * size,
                                  list(range(size)), context)
        groups = batches(todo, self.questions, size)
        total = sum(len(q.turns) for _, q in todo)
        warm_pass = (self.bench.warm_pass if self.bench.warm_pass is not None
                     else compiled is not None or self.target.device.type == "cuda")
        if warm_pass:
            # model.compile builds a graph per (tree bucket, context block): decoding the set once, untimed, builds
            # every one the timed pass will use (at T=0 one repeat: the others decode the same tokens); a second pass
            # only if a turn still outgrew the static cache (graphs are built anew on a new one)
            first = todo[0][0]
            warm = groups if self.decoding.temperature > 0 else [g for g in groups if g[0][0] == first]
            for _ in range(2):
                held = compiled.capacity if compiled is not None else None
                with tqdm(total=sum(len(q.turns) for g in warm for _, q in g), desc=f"{label} warm pass", unit="turn",
                          dynamic_ncols=True) as bar:
                    for group in warm:
                        for turn in self._turns(engine, group, context, pair=pair):
                            bar.update(len(turn.members))
                if compiled is None or compiled.capacity == held:
                    break
        timed_built = 0
        with tqdm(total=total, desc=f"{label} {self.dataset_cfg.name}", unit="turn", dynamic_ncols=True) as bar:
            for group in groups:
                rows: dict[str, list[dict]] = {q.question_id: [] for _, q in group}
                graphs = compiled_graphs()
                for turn in self._turns(engine, group, context, mem, pair):
                    built = compiled_graphs() - graphs  # graphs compiled inside this timed turn (model.compile)
                    timed_built += built
                    for i, (repeat, q) in enumerate(turn.members):
                        # the conversation so far fills the context: nothing to decode
                        g = turn.gens.get(i) or Generation(new_tokens=[], prompt_tokens=len(turn.prompts[i]),
                                                           wall_s=0.0, prefill_s=0.0)
                        qrows = rows[q.question_id]
                        row = self._turn_record(q, turn, i, g, reference, engine, context,
                                                diverged=any(r["first_divergence"] is not None for r in qrows))
                        if turn.batch is not None and i in turn.gens:
                            row["batch"] = turn.batch
                        elif turn.paired is not None and i in turn.gens:
                            row["paired"] = turn.paired
                        if self.target.compiled is not None:
                            row["graphs_compiled"] = built
                        qrows.append(row)
                        bar.update(1)
                        bar.set_postfix(tok_s=f"{row['tokens_per_s'] or 0:.1f}", tau=f"{g.tau:.2f}")
                    graphs = compiled_graphs()  # (after the records: a divergence replay's graphs are not a turn's)
                # all turns of a question at once: resume never sees half a conversation
                run_dir.append([row for _, q in group for row in rows[q.question_id]])
        if timed_built:
            log.warning("%s: %d graphs were compiled inside timed turns (their compile time is in the run's speed; "
                        "their records say which: graphs_compiled; bench.warm_pass=true builds them untimed first)",
                        run_dir.path, timed_built)

    def _largest_need(self, todo: list, context: int | None) -> int:
        """An upper bound on the positions any turn of `todo` needs (Engine.generate: prompt + budget + one tree): the
        last turn's prompt with empty answers, each earlier answer counted at the budget and 32 tokens of slack."""
        most = 0
        for _, q in todo:
            n = len(q.turns)
            prompt = len(self.prompt_ids(q, n - 1, [""] * (n - 1)))
            most = max(most, prompt + n * (self.decoding.max_new_tokens + 32) + TREE_ROOM)
        return min(most, context) if context else most

    def _turns(self, engine: Engine, group: list, context: int | None, mem: PeakMemory | None = None,
               pair: Engine | None = None):
        """Decode one batch group's conversations turn by turn (a later turn's prompt holds the question's earlier
        answers); yields each turn's DecodedTurn. `mem`: peak memory measured per turn (over the drafted decode only).
        `pair` (bench.paired): the baseline engine, run on the same prompts, budgets and seeds beside each turn,
        before it at every other turn (a drift of the host's speed within a turn pair then favours neither)."""
        size = self.decoding.batch_size
        answers: dict[str, list[str]] = {q.question_id: [] for _, q in group}
        for turn in range(max(len(q.turns) for _, q in group)):
            members = [(r, q) for r, q in group if turn < len(q.turns)]
            prompts = [self.prompt_ids(q, turn, answers[q.question_id]) for _, q in members]
            budgets = [self.budget(len(ids)) for ids in prompts]
            seeds = [turn_seed(self.cfg.seed, r, q.question_id, turn) for r, q in members]
            live = [i for i, b in enumerate(budgets) if b > 0]
            paired = None
            baseline_first = pair is not None and live and self._pairs % 2 == 1
            if baseline_first:
                paired = self._paired(pair, prompts, budgets, seeds, live, context)
            if mem is not None:
                mem.reset()
            gens, out = self._decode_turn(engine, prompts, budgets, seeds, live, context)
            peak = mem.read() if mem is not None else {}
            if pair is not None and live and not baseline_first:
                paired = self._paired(pair, prompts, budgets, seeds, live, context)
            if pair is not None and live:
                self._pairs += 1
            batch = None
            if out is not None:  # decoding.batch_size > 1
                batch = {"id": f"{members[0][0]}/{members[0][1].question_id}/{turn}", "size": len(live),
                         "wall_s": out.wall_s, "steps": out.steps, **({"paired": paired} if paired else {})}
            yield DecodedTurn(turn, members, prompts, budgets, gens, batch, peak, paired)
            for i, (_, q) in enumerate(members):
                g = gens.get(i)
                answers[q.question_id].append(self._answer(g.new_tokens if g else []))

    def _decode_turn(self, engine: Engine, prompts: list, budgets: list, seeds: list, live: list,
                     context: int | None) -> tuple[dict[int, Generation], BatchGeneration | None]:
        """One turn's live members through `engine`: their generations by member index, and the batch's output
        (None at batch size 1). Each engine draws from fresh generators of the same seeds."""
        dev = self.target.device
        rngs = [torch.Generator(dev).manual_seed(seeds[i]) for i in range(len(prompts))]
        if not live:
            return {}, None
        if self.decoding.batch_size == 1:
            return {0: engine.generate(prompts[0], budgets[0], rngs[0], context)}, None
        out = engine.generate_batch([prompts[i] for i in live], [budgets[i] for i in live], [rngs[i] for i in live],
                                    context)
        return dict(zip(live, out.rows)), out

    def _paired(self, pair: Engine, prompts: list, budgets: list, seeds: list, live: list,
                context: int | None) -> dict:
        """The baseline's time and new tokens for one turn's live members (bench.paired): wall seconds (a batch's
        once) and tokens summed over the members."""
        gens, out = self._decode_turn(pair, prompts, budgets, seeds, live, context)
        wall = out.wall_s if out is not None else sum(g.wall_s for g in gens.values())
        return {"wall_s": wall, "new_tokens": sum(len(g.new_tokens) for g in gens.values())}

    def _answer(self, ids: list[int]) -> str:
        """A turn's answer as the next turn's prompt holds it."""
        return self.target.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def _turn_record(self, q: Question, turn: DecodedTurn, member: int, g: Generation, reference: dict, engine: Engine,
                     context: int | None, diverged: bool) -> dict:
        """Member `member`'s record of a decoded turn: compared with the baseline's output unless an earlier turn of
        the question left it (this turn's prompt then holds other words); a divergence classified as a near-tie or a
        mismatch by replays (specbench/bench/divergence.py): at batch 1, or of each path's own batch when the turn was
        decoded in one."""
        ids, budget = turn.prompts[member], turn.budgets[member]
        if budget < self.decoding.max_new_tokens and g.stopped_by == "max_new_tokens":
            g.stopped_by = "context"
        ref = None if diverged else reference.get((q.question_id, turn.turn))
        row = self._record(q, turn.turn, turn.members[member][0], g, turn.peak, ref)
        if diverged:
            row["after_divergence"] = True
        j = row["first_divergence"]
        if j is None or j >= min(len(ref), len(g.new_tokens)):  # equal, or one output a prefix of the other
            return row
        if g.split is not None:  # deploy=client_server: the replays capture logits, which do not cross
            why = ("the client finished alone after its link dropped" if g.alone_tokens else
                   "a split run's logits stay on the server (replay it with deploy=local)")
            row["divergence"] = {"position": j, "kind": "unclassified", "why": why}
            return row
        replay = Engine(self.target, NoDrafter(self.target), self.decoding.sampling())
        if self.decoding.batch_size == 1:
            kind = divergence.classify(replay, engine, ids, j, g.new_tokens[j], ref[j], context, self.target.dtype)
        else:
            theirs = self._reference_prompts(turn, reference)
            if theirs is None:
                kind = {"kind": "unclassified", "why": "the baseline's records lack an earlier turn of this batch"}
            else:
                kind = divergence.classify_batch(replay, self._decoded_rows(theirs, member), engine,
                                                 self._decoded_rows(turn.prompts, member), j, g.new_tokens[j], ref[j],
                                                 context, self.target.dtype)
        row["divergence"] = {"position": j, **kind}
        return row

    def _reference_prompts(self, turn: DecodedTurn, reference: dict) -> list[list[int]] | None:
        """The prompts of the baseline's own batch at this turn: each member's holds the baseline's earlier answers
        (after a divergence in an earlier turn they are not this run's); None if its records lack one."""
        prompts = []
        for _, q in turn.members:
            earlier = [reference.get((q.question_id, k)) for k in range(turn.turn)]
            if any(e is None for e in earlier):
                return None
            prompts.append(self.prompt_ids(q, turn.turn, [self._answer(e) for e in earlier]))
        return prompts

    def _decoded_rows(self, prompts: list[list[int]], member: int) -> tuple[list, list, int]:
        """A turn's batch as Runner._turns decodes it -> (prompts, budgets, row of `member`): the members with a
        budget."""
        budgets = [self.budget(len(p)) for p in prompts]
        live = [k for k, b in enumerate(budgets) if b > 0]
        return [prompts[k] for k in live], [budgets[k] for k in live], live.index(member)

    @staticmethod
    def _record(q: Question, turn: int, repeat: int, g: Generation, mem: dict, ref: list[int] | None) -> dict:
        return {
            "question_id": q.question_id, "category": q.category, "turn": turn, "repeat": repeat,
            "prompt_tokens": g.prompt_tokens, "new_tokens": len(g.new_tokens), "new_token_ids": g.new_tokens,
            "wall_s": g.wall_s, "prefill_s": g.prefill_s,
            "tokens_per_s": len(g.new_tokens) / g.wall_s if g.wall_s > 0 else None,
            "steps": g.steps, "tau": g.tau if g.steps else None, "tokens_per_step": g.tokens_per_step,
            "tree_sizes": g.tree_sizes, "depth_trials": g.depth_trials, "depth_accepts": g.depth_accepts,
            "recovered": g.recovered, "chain": g.chain, "draft_s": g.draft_s, "verify_s": g.verify_s,
            "stopped_by": g.stopped_by, **mem,
            **({"split": g.split} if g.split is not None else {}),  # deploy=client_server (specbench/deploy/client.py)
            "matches_baseline": None if ref is None else ref == g.new_tokens,
            "first_divergence": None if ref is None else first_divergence(g.new_tokens, ref),
        }


@dataclass
class DecodedTurn:
    """One turn of a batch group's conversations, decoded (Runner._turns)."""

    turn: int
    members: list  # (repeat, Question) decoded at this turn
    prompts: list[list[int]]  # each member's prompt ids
    budgets: list[int]  # each member's new-token budget (0: the context is full, nothing decoded)
    gens: dict[int, Generation]  # member index -> its generation (members with a budget)
    batch: dict | None  # the batch's id, size, wall and steps (decoding.batch_size > 1)
    peak: dict  # peak memory over the turn (the timed pass)
    paired: dict | None = None  # bench.paired: the baseline's wall_s and new_tokens for the same members, beside it


def batches(todo: list[tuple[int, Question]], questions: list[Question], size: int) -> list[list[tuple[int, Question]]]:
    """The (repeat, question) pairs still to decode, grouped into batches decoded together, turn by turn (a later
    turn's prompt holds that question's earlier answer): question i of the set is in batch i // size of its repeat,
    whatever is left to do, so a resumed run and its baseline batch the same questions together in every repeat."""
    index = {q.question_id: i for i, q in enumerate(questions)}
    groups: dict[tuple[int, int], list[tuple[int, Question]]] = {}
    for repeat, q in todo:
        groups.setdefault((repeat, index[q.question_id] // size), []).append((repeat, q))
    return [groups[k] for k in sorted(groups)]


def _headline(s: dict) -> str:
    parts = [f"{s['tokens_per_s']['mean']:.2f} tok/s"]
    if s.get("speedup"):
        parts.append(f"speedup {s['speedup']['mean']:.2f}x" + (
            f" (paired; against the baseline run {s['speedup_vs_baseline_run']['mean']:.2f}x)"
            if s.get("speedup_vs_baseline_run") else " (paired)" if s.get("speedup_against") == "paired" else ""))
    if s.get("tau_micro"):
        parts.append(f"tau {s['tau_micro']:.2f}")
    if s["lossless"]["compared"]:
        parts.append(f"lossless {s['lossless']['matches']}/{s['lossless']['compared']}")
    return ", ".join(parts)


register_schema()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    skipped = skip_reason(hc.sweep.dir, list(hc.overrides.task)) if hc.mode == RunMode.MULTIRUN else None
    if skipped:  # the pre-flight found no weights for its drafter: nothing decoded, written or recorded as failed
        log.warning("job #%s skipped: %s", hc.job.num, skipped)
        return
    try:
        Runner(cfg).execute()
    except Exception as e:  # noqa: BLE001 - in a sweep, any failed job is recorded and the sweep goes on
        if hc.mode != RunMode.MULTIRUN:
            if isinstance(e, SpecbenchError):
                fail(e)
            raise
        # a SpecbenchError is the one line that says what to do; anything else is a bug and keeps its traceback
        (log.error if isinstance(e, SpecbenchError) else log.exception)(
            "job #%s failed (the sweep goes on; it will exit non-zero): %s", hc.job.num, e)
        record_failure(hc.sweep.dir, hc.job.num, list(hc.overrides.task), e)
        failures.record(cfg, e, list(hc.overrides.task))  # for the tables: results/<experiment>/failed/
    else:
        failures.clear(cfg)


def main() -> None:
    cli(_hydra_main)


if __name__ == "__main__":
    main()
