"""Offline target features: run the frozen target once per conversation and store what drafters train on.

Per conversation: input_ids [T], loss_mask [T], hidden [T, H] (the target's last hidden state after the final norm,
the input of its LM head: what EAGLE / Medusa / Beagle read) and, on request, the per-layer keys/values MoA reads.
Stored as safetensors shards plus manifest.json (target name, weight fingerprint, dtype, counts, shards). Every shard
is written atomically with a small record beside it (`shard-NNNNN.safetensors.json`) as it completes, so an
interrupted extraction resumes; under torchrun every rank extracts its share of the shards (shard n on rank
n mod world) and rank 0 writes the manifest when all are done.

MoA's per-layer K/V need not be stored: `online_kv` computes the same tensors from the frozen target for a batch
(train.kv_features=online, the default), at the cost of one target forward per training batch instead of ~23 kB per
token on SmolLM2 and ~512 KiB on Llama-2-7B.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from specbench.data.conversations import Encoded
from specbench.errors import SpecbenchError
from specbench.core.records import atomic_write_json
from specbench.decode.identity import DTYPES, fingerprint
from specbench.decode.target import TargetModel, cache_kv, kv_per_token

PRE_LAYERS = 3  # with kv: also the residual inputs of the last 3 target layers (what MoA's TLI <= 3 regresses onto)


@dataclass
class FeatureSet:
    """A directory of feature shards; loads one conversation at a time (shards stay memory-mapped)."""

    path: Path
    manifest: dict

    @staticmethod
    def open(path: Path, target_fingerprint: str | None = None) -> "FeatureSet":
        mf = path / "manifest.json"
        if not mf.is_file():
            raise SpecbenchError(f"no feature manifest in {path}: train a drafter first (`python -m specbench.train`)")
        manifest = json.loads(mf.read_text())
        if not manifest.get("complete"):
            raise SpecbenchError(f"features in {path} are incomplete: re-run the extraction to resume it")
        if target_fingerprint and manifest["fingerprint"] != target_fingerprint:
            raise SpecbenchError(f"features in {path} were made with target {manifest['target']} "
                                 f"({manifest['fingerprint']}), not the loaded one ({target_fingerprint})")
        return FeatureSet(path, manifest)

    def __len__(self) -> int:
        return self.manifest["count"]

    def index(self) -> list[tuple[str, int]]:
        return [(s["file"], j) for s in self.manifest["shards"] for j in range(s["count"])]

    def load(self, file: str, j: int, kv: bool = False) -> dict[str, torch.Tensor]:
        with safe_open(str(self.path / file), framework="pt") as f:
            out = {k: f.get_tensor(f"{j}.{k}") for k in ("input_ids", "loss_mask", "hidden")}
            if kv:
                layers = self.manifest["num_layers"]
                out["kv"] = [(f.get_tensor(f"{j}.k{l}"), f.get_tensor(f"{j}.v{l}")) for l in range(layers)]
                out["pre"] = [f.get_tensor(f"{j}.pre{b}") for b in range(1, min(PRE_LAYERS, layers) + 1)]
        out["input_ids"] = out["input_ids"].long()
        return out


def _kv_tensors(cache, hidden_states, dtype: torch.dtype) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                                                   list[torch.Tensor]]:
    """What MoA reads, for a forward whose cache and hidden states are given: per layer (K, V) [B, nkv, T, dh] and the
    residual inputs of layers L-1 .. L-P [B, T, H] (TLI's regression targets), rounded to the features' dtype."""
    kv = [(k.to(dtype), v.to(dtype)) for k, v in cache_kv(cache)]
    layers = len(hidden_states) - 1
    pre = [hidden_states[layers - back].to(dtype) for back in range(1, min(PRE_LAYERS, layers) + 1)]
    return kv, pre


@torch.inference_mode()
def online_kv(target: TargetModel, input_ids: torch.Tensor, attn_mask: torch.Tensor, dtype: str = "bfloat16"):
    """The stored K/V features computed for one right-padded batch from the frozen target: input_ids, attn_mask
    [B, T] -> (kv [B, T, L, 2 nkv dh] as (K, V) per token and layer, pre [B, T, P, H]), float32 values rounded
    through `dtype` as storage rounds them. Right padding changes nothing for the real tokens (causal attention)."""
    cache = target.new_cache()
    res = target.decoder(input_ids=input_ids, attention_mask=attn_mask, past_key_values=cache, use_cache=True,
                         output_hidden_states=True)
    kv, pre = _kv_tensors(cache, res.hidden_states, DTYPES[dtype])
    return torch.stack([kv_per_token(k, v) for k, v in kv], 2).float(), torch.stack(pre, 2).float()


@torch.no_grad()  # (not inference_mode: the drafter's graph saves these inputs for its backward)
def online_layers(target: TargetModel, input_ids: torch.Tensor, attn_mask: torch.Tensor, layers: tuple[int, ...],
                  dtype: str = "bfloat16") -> torch.Tensor:
    """EAGLE-3's features for one right-padded batch, from the frozen target in the training loop (as its authors'
    trainer computes them): input_ids, attn_mask [B, T] -> the inputs of the target layers `layers` (hidden_states
    indices) concatenated, [B, T, k*H] float32, rounded through `dtype` as stored features are."""
    res = target.decoder(input_ids=input_ids, attention_mask=attn_mask, use_cache=False, output_hidden_states=True)
    return torch.cat([res.hidden_states[i].to(DTYPES[dtype]) for i in layers], -1).float()


def token_counts(features: FeatureSet, vocab: int) -> torch.Tensor:
    """How often each token id occurs at the loss positions (the answers) of a FeatureSet: [vocab] int64 (EAGLE-3's
    draft vocabulary is its most frequent N)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in features.manifest["shards"]:
        with safe_open(str(features.path / s["file"]), framework="pt") as f:
            for j in range(s["count"]):
                ids, mask = f.get_tensor(f"{j}.input_ids").long(), f.get_tensor(f"{j}.loss_mask").bool()
                counts += torch.bincount(ids[mask], minlength=vocab)[:vocab]
    return counts


def extract(target: TargetModel, convs: list[Encoded], out: Path, dtype: str = "bfloat16", shard_size: int = 64,
            kv: bool = False, desc: str = "features", rank: int = 0, world: int = 1) -> FeatureSet:
    """Write (or resume) the shards for `convs` under `out`: this rank's share (shard n where n mod world == rank).
    Returns the complete FeatureSet (every rank, after the others finished: a barrier when world > 1)."""
    if dtype not in DTYPES:
        raise SpecbenchError(f"feature dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    fp = fingerprint(target.model)
    mf = out / "manifest.json"
    manifest = json.loads(mf.read_text()) if mf.is_file() else None
    if manifest and manifest["fingerprint"] != fp:
        raise SpecbenchError(f"{out} holds features of another target ({manifest['target']}); remove it or pick another dir")
    if manifest is None:
        manifest = {"target": target.name, "fingerprint": fp, "dtype": dtype, "kv": kv,
                    "hidden_size": target.hidden_size, "num_layers": target.model.config.num_hidden_layers,
                    "count": 0, "tokens": 0, "shards": [], "complete": False}
    done = {s["file"] for s in manifest["shards"]}  # (extractions before the per-shard records listed them here)
    groups = [convs[i : i + shard_size] for i in range(0, len(convs), shard_size)]
    mine = [n for n in range(len(groups)) if n % world == rank]
    with tqdm(total=sum(len(groups[n]) for n in mine), desc=desc, unit="conv", dynamic_ncols=True,
              disable=rank != 0) as bar:
        for n in mine:
            group, file = groups[n], f"shard-{n:05d}.safetensors"
            if (out / file).is_file() and (file in done or (out / f"{file}.json").is_file()):  # its record is last
                bar.update(len(group))
                continue
            tensors: dict[str, torch.Tensor] = {}
            for j, enc in enumerate(group):
                ids = torch.tensor([enc.input_ids], device=target.device)
                cache = target.new_cache()
                with torch.inference_mode():
                    res = target.decoder(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=kv)
                tensors[f"{j}.input_ids"] = ids[0].to(torch.int32).cpu()
                tensors[f"{j}.loss_mask"] = torch.tensor(enc.loss_mask, dtype=torch.uint8)
                tensors[f"{j}.hidden"] = res.last_hidden_state[0].to(DTYPES[dtype]).cpu().contiguous()
                if kv:
                    per_layer, pre = _kv_tensors(cache, res.hidden_states, DTYPES[dtype])
                    for l, (k, v) in enumerate(per_layer):
                        tensors[f"{j}.k{l}"] = k[0].cpu().contiguous()
                        tensors[f"{j}.v{l}"] = v[0].cpu().contiguous()
                    for back, x in enumerate(pre, 1):  # residual input of layer L-back (MoA's TLI)
                        tensors[f"{j}.pre{back}"] = x[0].cpu().contiguous()
                bar.update(1)
            tmp = out / f".{file}.tmp"
            out.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(tmp), metadata={"target": target.name, "fingerprint": fp})
            tmp.rename(out / file)
            atomic_write_json(out / f"{file}.json", {"file": file, "count": len(group),
                                                     "tokens": sum(len(e.input_ids) for e in group),
                                                     "ids": [e.conv_id for e in group]})
    if world > 1:
        dist.barrier()  # every rank's shards are written
    if rank == 0:
        listed = {s["file"]: s for s in manifest["shards"]}
        for rec in sorted(out.glob("shard-*.safetensors.json")):
            row = json.loads(rec.read_text())
            listed.setdefault(row["file"], row)
        manifest["shards"] = [listed[f] for f in sorted(listed)]
        manifest["count"] = sum(s["count"] for s in manifest["shards"])
        manifest["tokens"] = sum(s["tokens"] for s in manifest["shards"])
        if manifest["count"] != len(convs):
            raise SpecbenchError(f"{out}: {manifest['count']} conversations in its shards, {len(convs)} expected")
        manifest["complete"] = True
        atomic_write_json(mf, manifest)
        size = sum((out / s["file"]).stat().st_size for s in manifest["shards"])
        print(f"{desc}: {manifest['count']} conversations, {manifest['tokens']} tokens, {size / 2**20:.1f} MiB "
              f"({size / max(manifest['tokens'], 1):.0f} bytes/token) in {out}")
    if world > 1:
        dist.barrier()  # the manifest is written
    return FeatureSet.open(out)
