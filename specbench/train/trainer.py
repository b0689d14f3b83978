"""`python -m specbench.train drafter=<name> model=<target> train=<budget>`: one trainer for every drafter.

1. conversations (specbench/data/conversations.py), chat-formatted, loss on assistant tokens; with train.answers=target
   the replies are the target's own greedy answers to the first user turns (specbench/train/selfdistill.py);
2. offline target features (specbench/train/features.py), extracted once and reused by every drafter and epoch;
   validation data = held-out first user turns answered greedily by the target itself, so that a drafted token is
   "accepted" exactly when it equals the target's greedy token (EAGLE's n-alpha in chain mode);
3. AdamW (betas from the budget, fused on CUDA), linear warm-up, grad clipping (by value or norm), optional noise on target features,
   fp32/TF32 or bf16 autocast; DDP under torchrun (gloo on CPU, nccl on CUDA);
4. after every epoch: per-position acceptance with the drafter running on its own predictions, the simulated tau,
   training tokens/s and peak memory, logged to <out>/log.jsonl; a resumable `last` checkpoint; `final` at the end.
Each method supplies only its typed Options, build_module / training_loss / chain_predict (specbench/decode/drafter.py:
TrainableDrafter); it sees the plain module, never a DDP wrapper.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import MISSING, asdict, dataclass, fields
from datetime import timedelta
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from specbench.decode.drafter import KV, LAYERS, TrainableDrafter
from specbench.core import envinfo
from specbench.decode.checkpoints import load_checkpoint, read_meta, save_checkpoint, target_fingerprint, target_identity
from specbench.core.config import ModelConfig, TrainConfig, register_schema, to_dataclass
from specbench.data.conversations import Conversation, Encoded, encode, load_conversations
from specbench.decode.engine import Engine
from specbench.errors import SpecbenchError
from specbench.train.features import FeatureSet, extract, online_kv, online_layers, token_counts
from specbench.core.metrics import PeakMemory
from specbench.core.models import chat_prompt_ids, load_model
from specbench.core.cli import CONF_DIR, cli, fail
from specbench.train.selfdistill import read_done, seed_answers, ship_answers, target_answers
from specbench.decode.target import TargetModel, kv_per_token
from specbench.decode.drafter import NoDrafter
from specbench.decode.types import SamplingParams

log = logging.getLogger("specbench.train")
RESUME_FREE = {"resume", "answers_from", "max_steps", "epochs", "out_dir", "log_every", "features_dir", "save_dtype", "dist_timeout_min",
               "kv_features", "loader_workers", "features_shard", "save_every_min"}  # (kv_features: the same values, tested: test_online_kv_equals_stored)  # may change on resume
OPTIM_KEYS = {"lr", "lr_schedule", "lr_floor", "warmup_steps", "weight_decay", "grad_clip", "grad_clip_mode", "noise",
              "noise_scale"}
LR_SCHEDULES = ("constant", "cosine", "linear", "peak_constant")


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded with 0
    loss_mask: torch.Tensor  # [B, T] 1 on assistant tokens
    attn_mask: torch.Tensor  # [B, T] 1 on real tokens
    hidden: torch.Tensor  # [B, T, H] float32 target last hidden states, clean (regression / distillation targets)
    hidden_in: torch.Tensor | None = None  # [B, T, H] the same with the configured noise: what drafters read as input
    kv: torch.Tensor | None = None  # [B, T, L, 2 * kv_heads * head_dim] per token and layer: (K, V), drafters needing KV
    pre: torch.Tensor | None = None  # [B, T, P, H] residual inputs of target layers L-1 .. L-P (P = features.PRE_LAYERS)
    layers: torch.Tensor | None = None  # [B, T, k*H] inputs of the drafter's feature_layers (EAGLE-3), computed online

    @property
    def tokens(self) -> int:
        return int(self.attn_mask.sum())

    def pin_memory(self) -> "Batch":
        """Page-locked copies, for the DataLoader's pin_memory=True: it pins the tensors and collections it knows and
        calls this method on other objects (a dataclass it would hand back unpinned, making `to` synchronous)."""
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        hidden = pin(self.hidden)
        return Batch(pin(self.input_ids), pin(self.loss_mask), pin(self.attn_mask), hidden,
                     hidden if self.hidden_in is self.hidden else pin(self.hidden_in), pin(self.kv), pin(self.pre))

    def to(self, device: torch.device) -> "Batch":
        """On `device` (non-blocking from pinned memory); hidden_in stays the same tensor as hidden until noised."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        hidden = move(self.hidden)
        return Batch(move(self.input_ids), move(self.loss_mask), move(self.attn_mask), hidden, hidden,
                     move(self.kv), move(self.pre))


def collate(items: list[dict], device: torch.device | str = "cpu") -> Batch:
    t = max(len(x["input_ids"]) for x in items)
    b, h = len(items), items[0]["hidden"].shape[-1]
    ids = torch.zeros(b, t, dtype=torch.long)
    loss = torch.zeros(b, t, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.long)
    hid = torch.zeros(b, t, h)
    for i, x in enumerate(items):
        n = len(x["input_ids"])
        ids[i, :n], loss[i, :n], attn[i, :n], hid[i, :n] = x["input_ids"], x["loss_mask"], 1, x["hidden"].float()
    hid = hid.to(device)
    kv = pre = None
    if "kv" in items[0]:  # (K, V) [kv_heads, n, head_dim] per layer -> [n, L, 2 * kv_heads * head_dim]
        per_token = [torch.stack([kv_per_token(k, v) for k, v in x["kv"]], 1) for x in items]
        kv = torch.zeros(b, t, *per_token[0].shape[1:])
        pre = torch.zeros(b, t, len(items[0]["pre"]), h)
        for i, x in enumerate(items):
            n = len(x["input_ids"])
            kv[i, :n], pre[i, :n] = per_token[i].float(), torch.stack(x["pre"], 1).float()
        kv, pre = kv.to(device), pre.to(device)
    return Batch(ids.to(device), loss.to(device), attn.to(device), hid, hid, kv, pre)


NOISE_KINDS = ("none", "uniform", "uniform_by_length", "gaussian")
# the sequence length at which the authors' length-scaled noise equals U(-s, s): EAGLE's and HASS's `AddUniformNoise`
# draws (rand - 0.5) * 0.2 * 512 / T, i.e. U(-0.1, 0.1) scaled by 512 / T
NOISE_REFERENCE_LEN = 512


def check_noise(kind: str) -> None:
    if kind not in NOISE_KINDS:
        raise SpecbenchError(f"train.noise={kind!r} is not one of {', '.join(NOISE_KINDS)}")


def add_noise(batch: Batch, kind: str, scale: float, gen: torch.Generator) -> None:
    """On the target features only (pads stay clean). uniform: U(-s, s), the EAGLE paper's; uniform_by_length: the
    EAGLE / HASS authors' code, U(-s, s) x 512 / T with T each row's own length (wider on shorter sequences: 1.33x at
    the budget's 384 tokens); gaussian: N(0, s), Beagle's."""
    check_noise(kind)
    if kind == "none" or scale == 0:
        batch.hidden_in = batch.hidden
        return
    shape, dev = batch.hidden.shape, batch.hidden.device
    if kind == "gaussian":
        noise = torch.randn(shape, generator=gen) * scale
    else:
        noise = (torch.rand(shape, generator=gen) * 2 - 1) * scale
    noise = noise.to(dev) * batch.attn_mask[..., None]
    if kind == "uniform_by_length":  # on the device: no host read of the rows' lengths
        noise = noise * (NOISE_REFERENCE_LEN / batch.attn_mask.sum(1).clamp(min=1))[:, None, None]
    batch.hidden_in = batch.hidden + noise


def validation_data(target: TargetModel, cfg: TrainConfig, model_cfg: ModelConfig, val_convs) -> list[Encoded]:
    """Held-out first user turns answered greedily by the target (the loss mask marks the answer)."""
    eng = Engine(target, NoDrafter(), SamplingParams())
    out = []
    for conv in tqdm(val_convs, desc="validation answers", unit="conv", dynamic_ncols=True):
        prompt = chat_prompt_ids(target.tokenizer, [{"role": "user", "content": conv.messages[0][1]}],
                                 model_cfg.system_prompt)[-(cfg.max_len - cfg.val_new_tokens):]
        answer = eng.generate(prompt, cfg.val_new_tokens).new_tokens
        out.append(Encoded(conv.conv_id, prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return out


def features_root(target: TargetModel, cfg: TrainConfig, model_cfg: ModelConfig, kv: bool) -> Path:
    """The cache directory of a budget's answers and features on this target (named by the budget's data settings,
    the target's dtype and its exact fingerprint)."""
    key = {"data": cfg.data_path, "n": cfg.conversations, "val": cfg.val_conversations, "max_len": cfg.max_len,
           "dtype": cfg.features_dtype, "kv": kv, "val_new": cfg.val_new_tokens, "system": model_cfg.system_prompt}
    if cfg.answers not in ("dataset", "target"):
        raise SpecbenchError(f"train.answers={cfg.answers!r} is not one of dataset, target")
    if cfg.answers != "dataset":  # (added only when set, so features extracted before the option keep their tag)
        key |= {"answers": cfg.answers, "answer_tokens": cfg.answer_tokens}
    if cfg.features_shard != 64:  # (the same)
        key["shard"] = cfg.features_shard
    if cfg.subset is not None:  # (the same)
        key["subset"] = cfg.subset
    tag = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    # features are the target's outputs in its loaded dtype: the dtype names the cache, and the exact fingerprint
    dtype = str(target.dtype).removeprefix("torch.")
    return Path(os.path.expanduser(cfg.features_dir)) / f"{model_cfg.name}-{dtype}-{target_fingerprint(target)}" / tag


def answers_meta(target: TargetModel, cfg: TrainConfig, model_cfg: ModelConfig) -> dict:
    """What a budget's self-distilled answers depend on: the target's exact weights and the answer settings."""
    return {"target_fingerprint": target_fingerprint(target), "data": cfg.data_path, "conversations": cfg.conversations,
            "max_len": cfg.max_len, "answer_tokens": cfg.answer_tokens, "answer_batch_size": cfg.answer_batch_size,
            "system": model_cfg.system_prompt}


def check_subset(cfg: TrainConfig) -> int | None:
    if cfg.subset is not None and cfg.subset < 1:
        raise SpecbenchError(f"train.subset={cfg.subset} must be at least 1")
    return cfg.subset


def budget_conversations(cfg: TrainConfig) -> tuple[list[Conversation], list[Conversation]]:
    """A budget's training conversations and its held-out ones. With train.subset=n the first n training ones: below
    train.conversations a prefix; above it (the 2x point of the data-scaling experiment) the budget's own followed by
    the next ones after its held-out set, so that every point of the experiment validates on the same conversations
    and shares the budget's answers for its first ones."""
    path = Path(cfg.data_path).expanduser() if cfg.data_path else None
    n = check_subset(cfg) or cfg.conversations
    convs, _ = load_conversations(path, max(n, cfg.conversations) + cfg.val_conversations, 0)
    held = cfg.conversations + cfg.val_conversations
    return (convs[:cfg.conversations] + convs[held:])[:n], convs[cfg.conversations:held]


def training_conversations(target: TargetModel, cfg: TrainConfig, model_cfg: ModelConfig, root: Path, rank: int = 0,
                           world: int = 1, convs: tuple[list[Conversation], list[Conversation]] | None = None
                           ) -> tuple[list[Encoded], list]:
    """The budget's training conversations encoded (input ids, answer mask), and its held-out ones (not encoded).
    With train.answers=target the answers are the target's own, generated once into `root` (resumable; under
    torchrun rank r answers conversations i = r mod world). `convs`: budget_conversations(cfg) when the caller has
    read it already (the Trainer, before the target loads), so the conversation file is parsed once."""
    train_convs, val_convs = convs or budget_conversations(cfg)
    if cfg.answers != "target":
        return [e for c in train_convs if (e := encode(c, target.tokenizer, model_cfg.system_prompt, cfg.max_len))], \
            val_convs
    # shared out: rank r answers conversations i = r mod world into its own file (resumable); all read every file.
    # (On rank 0 alone the others waited at the barrier for hours and NCCL's watchdog ended the job.)
    answers = root / ("answers.jsonl" if world == 1 else f"answers.rank{rank}of{world}.jsonl")
    shipped = Path(cfg.answers_from).expanduser() if cfg.answers_from and world == 1 else None
    meta = answers_meta(target, cfg, model_cfg)
    if shipped is not None and (seeded := seed_answers(shipped, answers, meta, train_convs)):
        log.info("%d of %d answers from %s (the same target and budget)", seeded, len(train_convs), shipped)
    mine = [c if i % world == rank else None for i, c in enumerate(train_convs)]
    target_answers(target, mine, model_cfg.system_prompt, cfg.max_len, cfg.answer_tokens, cfg.answer_batch_size,
                   answers)
    if shipped is not None and ship_answers(answers, shipped, meta | {"git": envinfo.git_commit(),
                                                                      "date": envinfo.now_utc()}):
        log.info("wrote %s: this budget's answers, which the next machine's training starts from", shipped)
    if world > 1:
        dist.barrier()
    files = [answers] if world == 1 else [root / f"answers.rank{r}of{world}.jsonl" for r in range(world)]
    done = {i: e for f in files for i, e in read_done(f).items()}
    return [done[i] for i in range(len(train_convs)) if i in done], val_convs


def target_inputs(batch: Batch, target: TargetModel, kv: bool, layers: tuple[int, ...], dtype: str) -> None:
    """What a step reads from the frozen target, computed for `batch` in the loop (the trainer's and `make
    trainspeed`'s step alike): MoA's per-layer K/V (`kv`: train.kv_features=online) and EAGLE-3's low/middle/high
    features (`layers`: hidden_states indices, empty for every other method)."""
    if kv:
        batch.kv, batch.pre = online_kv(target, batch.input_ids, batch.attn_mask, dtype)
    if layers:
        batch.layers = online_layers(target, batch.input_ids, batch.attn_mask, layers, dtype)


def prepare_features(target: TargetModel, cfg: TrainConfig, model_cfg: ModelConfig, kv: bool, rank: int,
                     world: int = 1, convs: tuple[list[Conversation], list[Conversation]] | None = None):
    """Train and validation FeatureSets (resumable), shared by every drafter. Under torchrun each rank writes its
    share of the self-distilled answers (conversation i on rank i mod world), then every rank extracts its share of
    the training shards; rank 0 alone the small validation set. Stored K/V only with `kv` (train.kv_features=stored: MoA's otherwise come online)."""
    root = features_root(target, cfg, model_cfg, kv)
    try:  # complete already? (every rank reads the same directory)
        return FeatureSet.open(root / "train"), FeatureSet.open(root / "val")
    except SpecbenchError:
        pass
    # the answers do not depend on whether K/V are stored: one file for both (stored K/V regenerated them, ~15 min)
    enc, val_convs = training_conversations(target, cfg, model_cfg, features_root(target, cfg, model_cfg, kv=False),
                                            rank, world, convs)
    if rank == 0 and not (root / "train" / "manifest.json").is_file():
        check_free_space(root, enc, target, cfg, kv)
    train = extract(target, enc, root / "train", cfg.features_dtype, cfg.features_shard, kv=kv, desc="train features",
                    rank=rank, world=world)
    if rank == 0:
        extract(target, validation_data(target, cfg, model_cfg, val_convs), root / "val", cfg.features_dtype,
                cfg.features_shard, kv=kv, desc="val features")
    if world > 1:
        dist.barrier()
    return train, FeatureSet.open(root / "val")


def feature_bytes(tokens: int, target: TargetModel, features_dtype: str, kv: bool) -> int:
    """What extraction writes for `tokens` tokens: the last hidden state in features_dtype, ids (int32) and the loss mask
    (uint8) per token; with stored K/V (kv) also every layer's K and V and PRE_LAYERS residual inputs."""
    from specbench.decode.identity import DTYPES
    from specbench.train.features import PRE_LAYERS

    width = DTYPES[features_dtype].itemsize
    per_token = target.hidden_size * width + 4 + 1
    if kv:
        cfg = target.model.config
        kv_width = 2 * (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * (
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        per_token += (cfg.num_hidden_layers * kv_width + PRE_LAYERS * target.hidden_size) * width
    return tokens * per_token


def check_free_space(root: Path, enc: list, target: TargetModel, cfg: TrainConfig, kv: bool) -> None:
    """Refuse, in one line, a feature extraction the disk cannot hold (at the paper budget ~0.69 TB on Llama-2-7B, by
    default under ~/.cache), before hours of extraction end in a full disk."""
    need = feature_bytes(sum(len(e.input_ids) for e in enc), target, cfg.features_dtype, kv)
    probe = root
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise SpecbenchError(f"the training features need ~{need / 2**30:.1f} GiB and {probe} has {free / 2**30:.1f} "
                             "GiB free: point train.features_dir (or SPECBENCH_CACHE) at a larger disk")


class FeatureItems(torch.utils.data.Dataset):
    """One training conversation per index, read from its memory-mapped shard (what DataLoader workers prefetch)."""

    def __init__(self, features: FeatureSet, kv: bool):
        self.features, self.index, self.kv = features, features.index(), kv

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict:
        return self.features.load(*self.index[i], kv=self.kv)


@torch.no_grad()
def validate(cls: type[TrainableDrafter], module, val: list[dict], cfg: TrainConfig, target,
             layers: tuple[int, ...] = ()) -> dict:
    """Chain drafting on the drafter's own predictions from evenly spaced roots inside the target's own answers:
    alpha[n] = P(token n+1 accepted | tokens 1..n accepted); simulated tau = 1 + sum_n prod_{i<=n} alpha[i].
    With `layers` (EAGLE-3) the drafter reads those layers' inputs, computed from the target, for `hidden`."""
    module.eval()
    trials, accepts = [0] * cfg.val_depth, [0] * cfg.val_depth
    for x in val:
        ids, hidden, mask = x["input_ids"].to(target.device), x["hidden"].float().to(target.device), x["loss_mask"]
        if layers:
            hidden = online_layers(target, ids[None], torch.ones_like(ids)[None], layers, cfg.features_dtype)[0]
        start = int(mask.nonzero()[0])  # first answer token; roots are answer tokens with a full chain after them
        last = len(ids) - 1 - cfg.val_depth
        if last < start:
            continue
        positions = sorted({round(start + i * (last - start) / max(cfg.val_positions - 1, 1))
                            for i in range(cfg.val_positions)})
        preds = cls.chain_predict(module, ids, hidden, positions, cfg.val_depth, target).cpu()
        for p, row in zip(positions, preds):
            truth = ids[p + 1 : p + 1 + cfg.val_depth].cpu()
            for d in range(cfg.val_depth):
                trials[d] += 1
                if row[d] != truth[d]:
                    break
                accepts[d] += 1
    module.train()
    alpha = [a / t if t else 0.0 for a, t in zip(accepts, trials)]
    tau, run = 1.0, 1.0
    for a in alpha:
        run *= a
        tau += run
    return {"alpha": alpha, "alpha_trials": trials, "sim_tau": tau}


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warm-up to cfg.lr, then constant, a cosine decay or a linear decay to 0 at total_steps, or
    `peak_constant`: a linear decay to cfg.lr x cfg.lr_floor over one epoch's steps (total_steps / cfg.epochs) after
    the warm-up, constant after that.

    `linear` is the decay of EAGLE's and HASS's training code (transformers' get_linear_schedule_with_warmup);
    `peak_constant` is MoA's code's `zero_peak_constant_scheduler` (warm-up to 20x their lr, down to it over an epoch:
    lr = their peak, lr_floor = 1/20)."""
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise SpecbenchError(f"train.lr_schedule={cfg.lr_schedule!r} is not one of {', '.join(LR_SCHEDULES)}")
    if not 0.0 <= cfg.lr_floor <= 1.0:
        raise SpecbenchError(f"train.lr_floor={cfg.lr_floor} is a fraction of train.lr: between 0 and 1")
    if cfg.lr_schedule == "constant" or step < cfg.warmup_steps:
        return cfg.lr * min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
    if cfg.lr_schedule == "peak_constant":
        done = min(1.0, (step - cfg.warmup_steps) / max(total_steps / cfg.epochs, 1))
        return cfg.lr * (1.0 - (1.0 - cfg.lr_floor) * done)
    done = min(1.0, (step - cfg.warmup_steps) / max(total_steps - cfg.warmup_steps, 1))
    if cfg.lr_schedule == "linear":
        return cfg.lr * (1.0 - done)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * done))


def stage_starts(restarts, total_steps: int) -> list[tuple[int, float]]:
    """(first step, lr scale) of each stage: the first at step 0, then each Restart's (TrainableDrafter.restarts)."""
    out = [(0, 1.0)]
    for r in sorted(restarts, key=lambda r: r.at):
        if not 0.0 < r.at < 1.0:
            raise SpecbenchError(f"a restart at {r.at} of the budget is not inside it (0, 1)")
        # the first step whose progress (step / total_steps, what a method's training_steps sees) reaches r.at
        out.append((min(total_steps, max(1, math.ceil(r.at * total_steps - 1e-9))), r.lr_scale))
    return out


def scheduled_lr(step: int, cfg: TrainConfig, total_steps: int, stages: list[tuple[int, float]]) -> float:
    """The lr at `step`: each stage has the budget's warm-up and schedule over its own steps (lr_at), scaled."""
    i = max(k for k, (first, _) in enumerate(stages) if first <= step)
    first, scale = stages[i]
    end = stages[i + 1][0] if i + 1 < len(stages) else total_steps
    return scale * lr_at(step - first, cfg, end - first)


def shard(order: list[int], rank: int, world: int) -> list[int]:
    """This rank's share of an epoch's order, every rank the same length (a rank with fewer batches would wait forever
    in the others' gradient all-reduce): the order is wrapped around to a multiple of `world` first, as
    DistributedSampler pads, so a few conversations appear twice in an epoch when the count does not divide."""
    need = -(-len(order) // world) * world  # the next multiple of world
    return [order[i % len(order)] for i in range(need)][rank::world]


def autocast(tc: TrainConfig, device: torch.device):
    """The forward's precision context: bf16 autocast with train.precision=bf16, otherwise fp32 (TF32 on CUDA)."""
    if tc.precision not in ("fp32", "bf16"):
        raise SpecbenchError(f"train.precision={tc.precision!r} is not one of fp32, bf16")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=tc.precision == "bf16")


def broadcast_state(module: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Rank 0's parameters, buffers and optimiser moments on every rank (what DDP's constructor broadcasts, plus the
    optimiser state a resumed rank 0 loaded)."""
    for t in module.state_dict().values():
        dist.broadcast(t, 0)
    for state in opt.state.values():
        for t in state.values():
            if torch.is_tensor(t):
                dist.broadcast(t, 0)


def average_gradients(params: list[torch.nn.Parameter], world: int) -> None:
    """The mean gradient over ranks, in one flat all-reduce (DDP's result; no overlap with backward, which for a
    drafter's few layers costs little). A parameter no piece reached on a rank counts as a zero gradient there, so
    every rank reduces the same layout."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= world
    for p, g in zip(params, torch._utils._unflatten_dense_tensors(flat, grads)):
        p.grad = g


def rank_spread(module: torch.nn.Module) -> float:
    """The largest difference of any weight between ranks (0.0: every rank holds the same weights, as it must:
    identical starting weights, averaged gradients, the same optimiser)."""
    flat = torch.cat([p.detach().float().reshape(-1) for p in module.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return float((hi - lo).max())


def backward_pieces(pieces: Iterator[tuple[torch.Tensor, dict]], tc: TrainConfig, device: torch.device,
                    step: int | None = None) -> Iterator[tuple[float, dict]]:
    """A batch's independent graphs (TrainableDrafter.training_steps: Beagle's simulated steps, HASS's aligned ones),
    each built under the run's precision and backpropagated as soon as it is built, so that peak memory is one
    graph's; gradients accumulate. Yields each graph's (loss, named parts) after its backward."""
    while True:
        with autocast(tc, device):  # the forward under autocast, the backward outside it
            piece = next(pieces, None)
        if piece is None:
            return
        value = piece[0].item()
        if not math.isfinite(value):
            raise SpecbenchError(f"non-finite loss at step {step}: lower train.lr or check the features")
        piece[0].backward()
        yield value, piece[1]


class Trainer:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        # the code this process runs is the checkout's at start: a commit made while it trains must not be recorded
        self.git = envinfo.git_commit()
        # a method's own optimiser settings (the papers differ: EAGLE 3e-5, Medusa 1e-3) may come with its YAML;
        # the budget itself (conversations, epochs, length, batch) cannot: every drafter gets the same one
        optim = cfg.drafter.get("optim")
        optim = OmegaConf.to_container(optim, resolve=True) if optim is not None else {}
        unknown = set(optim) - OPTIM_KEYS
        if unknown:
            raise SpecbenchError(f"drafter.optim may set only {', '.join(sorted(OPTIM_KEYS))}; not {', '.join(sorted(unknown))}")
        self.tc: TrainConfig = to_dataclass(TrainConfig, OmegaConf.merge(OmegaConf.to_container(cfg.train, resolve=True),
                                                                      optim))
        lr_at(0, self.tc, 1)  # a bad lr_schedule fails here, before features or training
        check_noise(self.tc.noise)
        if self.tc.grad_clip_mode not in ("value", "norm"):
            raise SpecbenchError(f"train.grad_clip_mode={self.tc.grad_clip_mode!r} is not one of value, norm")
        # a bad train.subset, or too few conversations for it, fails here, before the target loads; kept for the
        # features (parsing ShareGPT's file takes seconds)
        self.convs = budget_conversations(self.tc)
        self.model_cfg: ModelConfig = to_dataclass(ModelConfig, cfg.model)
        self.cls = get_class(cfg.drafter._target_)
        if not (isinstance(self.cls, type) and issubclass(self.cls, TrainableDrafter)):
            raise SpecbenchError(f"drafter {cfg.drafter.name!r} has nothing to train")
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        own_gpu = self.world > 1 and torch.cuda.is_available() and self.model_cfg.device in ("auto", "cuda")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if own_gpu:  # before NCCL starts: its communicator binds to the current device (else every rank to GPU 0)
            torch.cuda.set_device(local)
            self.model_cfg.device = f"cuda:{local}"  # each rank loads the target straight onto its own GPU
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                    timeout=timedelta(minutes=self.tc.dist_timeout_min),
                                    **({"device_id": torch.device("cuda", local)} if own_gpu else {}))
        model, tok, device = load_model(self.model_cfg)
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.target = TargetModel(model, tok, device, self.model_cfg.name)
        self.out = Path(self.tc.out_dir) / self.model_cfg.name / cfg.drafter.name
        module = cfg.drafter.get("module")
        self.module_options = OmegaConf.to_container(module, resolve=True) if module is not None else {}
        self.opts = self.cls.options(self.module_options)  # typed; an unknown option fails before any work

    def meta(self, epoch: int, step: int, metrics: dict) -> dict:
        return {"drafter": self.cls.name, "module": self.module_options, "target": self.model_cfg.name,
                **target_identity(self.target), "train": asdict(self.tc), "epoch": epoch,
                "step": step, "metrics": metrics, "git": self.git, "date": envinfo.now_utc(),
                "command": " ".join(["specbench.train", *sys.argv[1:]]), "world_size": self.world,
                "env": envinfo.device_info(self.target.device), "versions": envinfo.versions()}

    def run(self) -> Path:
        """Features, then epochs of steps, validation and a `last/` checkpoint after each, then `final/`."""
        tc, dev = self.tc, self.target.device
        torch.manual_seed(tc.seed)
        if tc.kv_features not in ("online", "stored"):
            raise SpecbenchError(f"train.kv_features={tc.kv_features!r} is not one of online, stored")
        needs_kv = KV in getattr(self.cls, "needs", ())
        stored_kv = needs_kv and tc.kv_features == "stored"
        self.online_kv = needs_kv and not stored_kv
        train_set, val_set = prepare_features(self.target, tc, self.model_cfg, kv=stored_kv, rank=self.rank,
                                              world=self.world, convs=self.convs)
        counts = token_counts(train_set, self.target.vocab_size)  # answer tokens (EAGLE-3's vocabulary)
        sized = self.cls.fit_options(self.opts, counts)  # deterministic in the data: the same on resume
        if sized:
            log.info("%s: %s from the training answers", self.cls.name, sized)
            self.module_options = {**self.module_options, **sized}
            self.opts = self.cls.options(self.module_options)
        # fp32 masters whatever the target's dtype: a module built from a bf16 target's layers (sd copies them) would
        # take AdamW updates below half a bf16 ulp, lost (bf16 autocast, train.precision, computes in bf16 anyway)
        module = self.cls.build_module(self.target, self.opts).to(dev)
        shared = {id(p) for p in self.target.model.parameters()}
        for p in module.parameters():
            if p.requires_grad and id(p) not in shared and p.dtype != torch.float32:
                p.data = p.data.float()
        module.train()
        params = [p for p in module.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay,
                                fused=dev.type == "cuda")
        first_epoch, step, resumed = self._resume(module, opt)
        self.layers = tuple(self.cls.feature_layers(module)) if LAYERS in getattr(self.cls, "needs", ()) else ()
        if step == 0:  # a fresh start (a resumed module has it from its checkpoint): EAGLE-3's draft vocabulary
            self.cls.fit_data(module, counts, self.opts)
        if dist.is_initialized():  # every rank starts from rank 0's weights (and optimiser state, when resumed)
            broadcast_state(module, opt)
        items = FeatureItems(train_set, kv=stored_kv)
        val_items = [val_set.load(*ix) for ix in val_set.index()]  # small, read once, every epoch's validation
        total_steps = tc.epochs * math.ceil(len(shard(list(range(len(items))), self.rank, self.world)) / tc.batch_size)
        # the schedule (lr, HASS's restart) is planned over the budget; train.max_steps only stops a sitting early, so
        # a run stopped by it and resumed ends where one never stopped ends
        logf = self.out / "log.jsonl"
        if step == 0 and self.rank == 0:
            logf.unlink(missing_ok=True)  # a fresh start: the log describes this training's checkpoints only
        mem = PeakMemory(dev)
        noise_gen = torch.Generator()  # the feature noise's stream, seeded per step (_seed_step)
        metrics: dict = resumed.get("metrics", {})
        for epoch in range(first_epoch, tc.epochs):
            mem.reset()
            t0 = time.perf_counter()
            skip = resumed.get("batches", 0) if epoch == first_epoch else 0
            save = lambda e, s, b: self._save_inside(module, opt, e, s, b, metrics)  # noqa: E731
            step, tokens, stopped = self._epoch(module, params, opt, items, epoch, step, total_steps, logf, noise_gen,
                                                skip, save)
            epoch_s = time.perf_counter() - t0
            spread = rank_spread(module) if dist.is_initialized() else None
            if spread:  # a silent divergence would save one rank's weights as everyone's
                raise SpecbenchError(f"epoch {epoch + 1}: the ranks' weights differ by up to {spread:g}")
            if self.rank == 0:
                extra = {} if spread is None else {"rank_weight_spread": spread}
                metrics = self._validate(module, val_items, epoch, step, epoch_s, tokens, mem, logf, extra)
                if stopped is None:
                    save_checkpoint(self.out / "last", module, self.target, self.meta(epoch, step, metrics),
                                    extra={"optimizer": opt.state_dict()})
                else:  # train.max_steps stopped it inside the epoch: a larger max_steps resumes at that batch
                    self._save_inside(module, opt, epoch, step, stopped, metrics)
            if dist.is_initialized():
                dist.barrier()
            if stopped is not None or (tc.max_steps is not None and step >= tc.max_steps):
                break
        final = self.out / "final"
        if self.rank == 0:
            save_checkpoint(final, module, self.target, self.meta(tc.epochs - 1, step, metrics), dtype=tc.save_dtype)
        if dist.is_initialized():
            dist.barrier()
        return final

    def _save_inside(self, module, opt, epoch: int, step: int, batches: int, metrics: dict) -> None:
        """A `last/` checkpoint inside `epoch` after its first `batches` batches (rank 0; train.save_every_min, or
        train.max_steps): the weights, the optimiser and where the epoch stands (the random streams need no saving:
        each step seeds its own, _seed_step). Its meta `epoch` stays the last finished one (epoch - 1), so a reader
        that knows nothing of `inside` sees the last finished epoch's meta."""
        meta = self.meta(epoch - 1, step, metrics) | {"inside": {"epoch": epoch, "batches": batches}}
        save_checkpoint(self.out / "last", module, self.target, meta, extra={"optimizer": opt.state_dict()})
        log.info("saved %s inside epoch %d, after %d batches (step %d)", self.out / "last", epoch + 1, batches, step)

    def _resume(self, module, opt) -> tuple[int, int, dict]:
        """(first epoch, step, what else it restores): after the last finished epoch of `last/`, or inside an epoch
        where `last/` was saved there (batches: how many of that epoch's are done; the last
        validation's metrics); refused when made under another budget. The log loses the rows logged after it."""
        tc, last = self.tc, self.out / "last"
        old = last.with_name(f".{last.name}.old")  # a kill between save_checkpoint's two renames leaves only this
        if not (last / "config.json").is_file() and (old / "config.json").is_file():
            last = old
        if not (tc.resume and (last / "config.json").is_file()):
            return 0, 0, {}
        meta = load_checkpoint(last, module, self.target, self.cls.name)
        defaults = asdict(TrainConfig())  # a key the checkpoint predates was at its default then
        # a `last` from another budget would silently continue (or, finished, stand in for) a different training
        changed = sorted(k for k, v in asdict(tc).items()
                         if k not in RESUME_FREE and json.dumps(meta["train"].get(k, defaults.get(k))) != json.dumps(v))
        if changed:
            raise SpecbenchError(f"{last} was trained with another budget ({', '.join(changed)} differ): "
                                 "add train.resume=false to start over, or remove it")
        was = meta.get("module") or {}
        # an option the checkpoint predates (or the config leaves out) was at its default
        unset = {f.name: f.default for f in fields(self.cls.Options) if f.default is not MISSING}
        other = sorted(k for k in set(was) | set(self.module_options)
                       if json.dumps(was.get(k, unset.get(k)), sort_keys=True)
                       != json.dumps(self.module_options.get(k, unset.get(k)), sort_keys=True))
        if other:  # a method's own options (HASS's Top-K stage, Beagle's vloss) changed between sittings
            raise SpecbenchError(f"{last} was trained with other drafter options ({', '.join(other)} differ): "
                                 "add train.resume=false to start over, or remove it")
        state = torch.load(last / "trainer_state.pt", weights_only=True)
        opt.load_state_dict(state["optimizer"])
        self._trim_log(meta["step"])
        inside = meta.get("inside")
        if inside is None:
            log.info("resuming %s after epoch %d (step %d)", last, meta["epoch"], meta["step"])
            return meta["epoch"] + 1, meta["step"], {"metrics": meta.get("metrics", {})}
        log.info("resuming %s inside epoch %d after %d batches (step %d)", last, inside["epoch"] + 1,
                 inside["batches"], meta["step"])
        return inside["epoch"], meta["step"], {"metrics": meta.get("metrics", {}), "batches": inside["batches"]}

    def _trim_log(self, step: int) -> None:
        """Drop the log rows written after the checkpoint resumed from (steps that are run again)."""
        logf = self.out / "log.jsonl"
        if self.rank != 0 or not logf.is_file():
            return
        rows = logf.read_text(encoding="utf-8").splitlines()

        def before(line: str) -> bool:
            try:
                return json.loads(line)["step"] <= step
            except (json.JSONDecodeError, KeyError, TypeError):  # a line a crash cut off mid-write
                return False

        keep = [line for line in rows if before(line)]
        if len(keep) < len(rows):
            tmp = logf.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
            tmp.replace(logf)

    def _epoch(self, module, params, opt, items: FeatureItems, epoch: int, step: int, total_steps: int, logf: Path,
               noise_gen: torch.Generator, skip: int = 0, save=None) -> tuple[int, int, int | None]:
        """One epoch of this rank's shard -> (step, tokens trained on, None, or the batches done when max_steps
        stopped it inside the epoch). `skip`: its first batches are done (resumed inside it); `save(epoch, step,
        batches)` every train.save_every_min (rank 0)."""
        tc, dev = self.tc, self.target.device
        order = list(range(len(items)))
        random.Random(tc.seed + epoch).shuffle(order)
        order = shard(order, self.rank, self.world)
        batches = [order[i : i + tc.batch_size] for i in range(0, len(order), tc.batch_size)][skip:]
        workers = tc.loader_workers if tc.loader_workers is not None else (2 if dev.type == "cuda" else 0)
        # batches are read and collated by `workers` processes ahead of the step (none: in this process)
        # its own generator (for the workers' seeds): a loader drawing from torch's global stream would draw at another
        # point of it when an epoch is resumed midway, and the method's own draws (MoA's blocks) would shift
        loader = torch.utils.data.DataLoader(items, batch_sampler=batches, collate_fn=collate, num_workers=workers,
                                             prefetch_factor=2 if workers else None, pin_memory=dev.type == "cuda",
                                             generator=torch.Generator().manual_seed(tc.seed + epoch))
        t0, tokens = time.perf_counter(), 0
        saved = t0
        bar = tqdm(loader, desc=f"{self.cls.name} epoch {epoch + 1}/{tc.epochs}", unit="batch", initial=skip,
                   total=skip + len(batches), disable=self.rank != 0, dynamic_ncols=True)
        stages = stage_starts(self.cls.restarts(self.opts), total_steps)
        fresh = {first for first, _ in stages[1:]}
        for done_batches, batch in enumerate(bar, start=skip + 1):
            if step in fresh:  # a restart (HASS's second stage): the optimiser's moments and step counts from zero
                opt.state.clear()
                log.info("step %d: a new stage, with a fresh optimiser", step)
            batch = batch.to(dev)
            target_inputs(batch, self.target, self.online_kv, self.layers, tc.features_dtype)
            self._seed_step(step, noise_gen)
            add_noise(batch, tc.noise, tc.noise_scale, noise_gen)
            for g in opt.param_groups:
                g["lr"] = scheduled_lr(step, tc, total_steps, stages)
            loss, parts, gnorm = self._step(module, params, opt, batch, epoch, step, step / total_steps)
            step += 1
            tokens += batch.tokens
            bar.set_postfix(loss=f"{loss:.3f}")
            if self.rank == 0 and step % tc.log_every == 0:
                self._log(logf, {"kind": "train", "epoch": epoch, "step": step, "loss": loss, **parts,
                                 "grad_norm": float(gnorm), "lr": scheduled_lr(step - 1, tc, total_steps, stages),
                                 "tokens_per_s": tokens * self.world / (time.perf_counter() - t0)})
            last_batch = done_batches == skip + len(batches)
            if tc.max_steps is not None and step >= tc.max_steps:
                return step, tokens, None if last_batch else done_batches
            if (save is not None and self.rank == 0 and tc.save_every_min is not None and not last_batch
                    and time.perf_counter() - saved >= 60 * tc.save_every_min):
                save(epoch, step, done_batches)
                saved = time.perf_counter()
        return step, tokens, None

    def _seed_step(self, step: int, noise_gen: torch.Generator) -> None:
        """Every step's random draws (the feature noise, torch's streams on every device: MoA's blocks and staircase,
        Python's) are seeded by (seed, step, rank): a run resumed at any batch, on any device and under torchrun,
        draws what a run never stopped draws, with nothing to save."""
        seed = hash((self.tc.seed, step, self.rank)) & 0x7FFF_FFFF  # (ints hash to themselves: the same every run)
        noise_gen.manual_seed(seed)
        torch.manual_seed(seed)
        random.seed(seed)

    def _step(self, module, params, opt, batch, epoch: int, step: int,
              progress: float) -> tuple[float, dict, torch.Tensor]:
        """One optimiser step -> (loss, its named parts, the gradient norm before clipping). The method sees the plain
        module and its typed options; under torchrun the gradients of every piece are averaged across ranks once,
        after the last piece's backward (what DDP does under no_sync), so a method needs no DDP-aware code."""
        tc = self.tc
        opt.zero_grad(set_to_none=True)
        loss, parts = 0.0, {}
        pieces = self.cls.training_steps(module, batch, self.target, self.opts, epoch, progress)
        for value, part in backward_pieces(pieces, tc, self.target.device, step):
            loss, parts = loss + value, {**parts, **part}
        if dist.is_initialized():
            average_gradients(params, self.world)
        if tc.grad_clip_mode == "value":  # the norm is logged either way (inf: measure, do not rescale)
            gnorm = torch.nn.utils.clip_grad_norm_(params, float("inf"))
            torch.nn.utils.clip_grad_value_(params, tc.grad_clip)
        else:
            gnorm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        opt.step()
        return loss, parts, gnorm

    def _validate(self, module, val_items, epoch: int, step: int, epoch_s: float, tokens: int, mem: PeakMemory,
                  logf: Path, extra: dict) -> dict:
        """The epoch's validation (rank 0), logged -> the metrics its checkpoint records."""
        val = validate(self.cls, module, val_items, self.tc, self.target, self.layers)
        module.eval()
        val |= self.cls.validation_extras(module, val_items, self.target)
        module.train()
        metrics = {"kind": "val", "epoch": epoch, "step": step, **val, "epoch_s": epoch_s,
                   "train_tokens_per_s": tokens * self.world / epoch_s, **mem.read(), **extra}
        self._log(logf, metrics)
        log.info("epoch %d: sim tau %.3f, alpha %s", epoch + 1, val["sim_tau"], " ".join(f"{a:.2f}" for a in val["alpha"]))
        return metrics

    @staticmethod
    def _log(path: Path, row: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:  # append-only log: a crash loses at most the line being written
            f.write(json.dumps(row, sort_keys=True) + "\n")


register_schema()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    try:
        final = Trainer(cfg).run()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"trained: {final} ({json.dumps(read_meta(final)['metrics'].get('alpha'))})")
    except SpecbenchError as e:
        fail(e)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    cli(_main)


if __name__ == "__main__":
    main()
