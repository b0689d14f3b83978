"""Drafter checkpoints: `model.safetensors` (trainable weights only) + `config.json` (drafter, module options, the
target's name and weight signature, training config and metrics). Loading for another target is refused; the same
target loaded in another dtype is the same target (specbench/decode/identity.py)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specbench.errors import SpecbenchError
from specbench.decode.identity import DTYPES, fingerprint, mismatch, signature


def own_state(module: torch.nn.Module, target) -> dict[str, torch.Tensor]:
    """The drafter's own parameters: target weights the module shares by reference are not the drafter's to save."""
    shared = {id(p) for p in target.model.parameters()}
    return {k: p.detach() for k, p in module.named_parameters() if id(p) not in shared}


def save_checkpoint(path: Path, module: torch.nn.Module, target, meta: dict[str, Any], dtype: str = "float32",
                    extra: dict[str, Any] | None = None) -> None:
    """Atomic: written to a temp dir, then renamed over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        state = {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).contiguous().cpu()  # (ids stay ids)
                 for k, v in own_state(module, target).items()}
        save_file(state, str(tmp / "model.safetensors"))
        if extra:
            torch.save(extra, tmp / "trainer_state.pt")
        (tmp / "config.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


REPO = Path(__file__).resolve().parents[2]


def weights_root() -> Path:
    """Where drafter weights live: weights/ (relative: the working directory, then the repository), or
    $SPECBENCH_WEIGHTS (the drafter configs read it too; the day-one rehearsal points it at its replicas)."""
    return Path(os.environ.get("SPECBENCH_WEIGHTS", "weights"))


def resolve(path: str | Path) -> Path:
    """A relative checkpoint path is looked up from the working directory, then from the repository root."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.exists() else REPO / p


# a checkpoint's weight file: the project's (and the EAGLE authors' newer uploads) first, then the EAGLE authors' older
# one, then Medusa-1's
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "medusa_lm_head.pt")


def weight_file(path: str | Path) -> Path | None:
    """The weight file of a checkpoint directory, or None."""
    path = resolve(path)
    return next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)


def read_meta(path: Path) -> dict[str, Any]:
    path = resolve(path)
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise SpecbenchError(f"no drafter checkpoint at {path} (config.json missing): train it with `make train`")
    return json.loads(cfg.read_text())


def authors_config(path: Path) -> dict[str, Any] | None:
    """A checkpoint directory's config.json when it is not the project's (no `drafter` metadata) and sits beside a
    weight file: a layout of a drafter's authors (which drafter's, its reader tells from the fields); None otherwise."""
    cfg = path / "config.json"
    if not cfg.is_file() or weight_file(path) is None:
        return None
    meta = json.loads(cfg.read_text())
    return None if "drafter" in meta else meta


def rope_theta(config) -> float:
    """A model config's RoPE base: transformers' rope_parameters or the older rope_theta, else Llama's 10000."""
    return float((getattr(config, "rope_parameters", None) or {}).get("rope_theta")
                 or getattr(config, "rope_theta", None) or 10000.0)


def check_authors_config(path: Path, cfg: dict[str, Any], target, fields: tuple[str, ...], what: str) -> None:
    """A drafter published in its authors' layout against the target, one line per misfit: each of `fields` of its
    config.json (num_key_value_heads, absent in older configs, as many as the heads) and RoPE's base (EAGLE-1's
    configs carry none and their code uses Llama's 10000; the Llama-3 ones carry 500000: a drafter used under another
    base sees rotated keys it never learnt)."""
    base = target.model.config
    for key in fields:
        theirs, ours = cfg.get(key), getattr(base, key, None)
        if key == "num_key_value_heads":
            theirs, ours = theirs or cfg.get("num_attention_heads"), ours or base.num_attention_heads
        if theirs != ours:
            raise SpecbenchError(f"checkpoint {path} is {what} for {key}={theirs}; the target {target.name!r} has {ours}")
    theirs = float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0)
    ours = rope_theta(base)
    if theirs != ours:
        raise SpecbenchError(f"checkpoint {path} is {what} for rope_theta={theirs:g}; the target {target.name!r} "
                             f"has {ours:g}")


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint directory's weight file (safetensors, or a torch pickle read weights-only)."""
    file = weight_file(path)
    return (load_file(str(file)) if file.suffix == ".safetensors"
            else torch.load(file, map_location="cpu", weights_only=True))


def copy_state(path: Path, state: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter], what: str) -> None:
    """Load `state` into `params` (the same names; each tensor cast to its parameter's dtype), after one-line checks:
    the names (check_keys), then each shape."""
    check_keys(path, set(state), set(params), what)
    with torch.no_grad():
        for k, v in state.items():
            if v.shape != params[k].shape:
                raise SpecbenchError(f"checkpoint {path}: {k} is {tuple(v.shape)}, {what} needs {tuple(params[k].shape)}")
            params[k].copy_(v.to(params[k].dtype))


def check_keys(path: Path, have: set[str], want: set[str], what: str) -> None:
    """One line naming (up to three of) the missing and the unexpected tensors of a checkpoint that does not fit."""
    if have != want:
        raise SpecbenchError(f"checkpoint {path} does not fit {what}: missing {sorted(want - have)[:3]}, "
                             f"unexpected {sorted(have - want)[:3]}")


def target_fingerprint(target) -> str:
    """An exact hash of the weights as loaded (dtype included): a name for dtype-specific caches, not an identity."""
    return fingerprint(target.model)


def target_identity(target) -> dict[str, Any]:
    """What a checkpoint records of its target: the dtype-independent signature (checked on load) and, for the record,
    the exact fingerprint and the dtype it was trained against."""
    return {"target_signature": signature(target.model), "target_fingerprint": target_fingerprint(target),
            "target_dtype": str(target.dtype).removeprefix("torch.")}


def check_target(path: Path, meta: dict[str, Any], target) -> None:
    """Refuse a checkpoint trained for another target; any dtype of the same target passes."""
    recorded = meta.get("target_signature")
    if recorded is not None:
        why = mismatch(recorded, signature(target.model))
    else:  # written before signatures: only its exact fingerprint (fp32 loads of the same weights) can vouch for it
        why = None if meta.get("target_fingerprint") == target_fingerprint(target) else (
            "it records an exact fingerprint only (older checkpoint), which this dtype does not reproduce")
    if why:
        raise SpecbenchError(f"checkpoint {path} was trained for target {meta.get('target')!r}, not the loaded "
                             f"{target.name!r}: {why}")


def load_checkpoint(path: Path, module: torch.nn.Module, target, drafter: str) -> dict[str, Any]:
    """Load trained weights into `module` after checking the checkpoint belongs to this drafter and this target."""
    path = resolve(path)
    meta = read_meta(path)
    if meta.get("drafter") != drafter:
        raise SpecbenchError(f"checkpoint {path} is a {meta.get('drafter')!r} drafter, not {drafter!r}")
    check_target(path, meta, target)
    state = load_file(str(Path(path) / "model.safetensors"))
    check_keys(path, set(state), set(own_state(module, target)),
               f"the module (made by another version of it? retrain: python -m specbench.train drafter={drafter})")
    params = dict(module.named_parameters())
    with torch.no_grad():
        for k, v in state.items():
            params[k].copy_(v.to(params[k].dtype))
    return meta
