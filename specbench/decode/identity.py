"""Which target a drafter was trained for, whatever dtype either side loads it in.

A drafter checkpoint records the target it was trained against. An exact hash of the weights cannot be that record:
the same checkpoint loaded in fp32, bf16 or fp16 holds different numbers (and on CUDA `dtype: auto` is bf16, so an
exact hash refused every drafter trained on an fp32 target). Nor can a hash of the weights rounded to some coarser
grid: fp32 -> fp16 -> bf16 rounds twice, and a value near a grid midpoint lands on either side.

So the signature keeps the numbers: the exact names and shapes of every tensor (hashed), and SAMPLES values of each at
fixed strided positions, as float32. Two signatures match when the names and shapes are equal and every sampled value
agrees to within REL_TOL of its magnitude (+ ABS_TOL for values that fp16 flushes towards zero). bf16 keeps 8
significant bits, a relative error of at most 2^-9 per rounding; REL_TOL = 2^-6 leaves room for two roundings and is
still far below the difference between two trained models (independently trained or fine-tuned weights differ in
most sampled values by far more than 1.6%). It identifies the weights to bf16 precision: a target that differs from
the recorded one by less than bf16 rounding is the same target in any dtype it can be served in.
"""
from __future__ import annotations

import hashlib

import torch

SAMPLES = 8  # values per tensor: ~2.3k numbers for a 7B Llama, ~2.2k for SmolLM2 (a few tens of kB of JSON)
REL_TOL = 2.0**-6
ABS_TOL = 1e-6


def signature(model: torch.nn.Module) -> dict:
    """{"shapes": sha256 of every (name, shape), "values": {name: [SAMPLES floats]}} of a model's state dict."""
    shapes = hashlib.sha256()
    values: dict[str, list[float]] = {}
    for name, p in sorted(model.state_dict().items()):
        shapes.update(f"{name}:{tuple(p.shape)};".encode())
        flat = p.detach().reshape(-1)
        # evenly spread positions (not the first row: a norm's or a bias's first entries say little)
        idx = (torch.arange(SAMPLES, device=flat.device) * (flat.numel() - 1) // (SAMPLES - 1)).unique()
        values[name] = [float(x) for x in flat.index_select(0, idx).to(torch.float32).cpu()]
    return {"shapes": shapes.hexdigest()[:16], "values": values}


def mismatch(recorded: dict, loaded: dict) -> str | None:
    """Why two signatures are not the same weights (the first difference, in a few words), or None if they are."""
    if recorded.get("shapes") != loaded["shapes"]:
        return "its tensor names or shapes differ"
    for name, want in loaded["values"].items():
        have = recorded["values"].get(name)
        if have is None or len(have) != len(want):
            return f"{name} is not sampled alike"
        for a, b in zip(have, want):
            if abs(a - b) > REL_TOL * max(abs(a), abs(b)) + ABS_TOL:
                return f"{name} differs ({a:.6g} vs {b:.6g})"
    return None


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def fingerprint(model: torch.nn.Module) -> str:
    """A cheap, stable fingerprint of a model's weights: names, shapes and a strided sample of every tensor."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        h.update(f"{name}:{tuple(p.shape)}".encode())
        h.update(flat[::step].to(torch.float32).cpu().numpy().tobytes())
    return h.hexdigest()[:16]
