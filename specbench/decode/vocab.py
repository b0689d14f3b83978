"""Draft vocabularies: the N most frequent answer tokens of a target (EAGLE-3's d2t / t2d, the EAGLE family's pruned
LM head at decoding time, `+drafter.module.draft_vocab=N`), from the token counts `python -m specbench.vocab` writes
(specbench/tools/vocab.py) beside the weights."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specbench.decode.checkpoints import target_fingerprint
from specbench.errors import SpecbenchError
from specbench.decode.target import TargetModel

COUNTS_FILE = "token_counts.safetensors"


def frequent_ids(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The n most frequent ids [n], most frequent first; ties and unseen ids by id (as SpecForge pads its vocabulary)."""
    return torch.argsort(-counts, stable=True)[:n]


def covering_size(counts: torch.Tensor, coverage: float, multiple: int = 1) -> int:
    """The smallest N whose N most frequent ids cover `coverage` of the counted tokens, rounded up to a multiple of
    `multiple` and capped at the vocabulary (EAGLE-3's draft vocabulary sized to the data). counts [V]."""
    if not 0.0 < coverage <= 1.0 or multiple < 1:
        raise ValueError(f"coverage={coverage} must be in (0, 1] and multiple={multiple} >= 1")
    total = float(counts.sum())
    if total <= 0:
        raise ValueError("no counted tokens to size a vocabulary from")
    share = counts.double().sort(descending=True).values.cumsum(0) / total
    n = int(torch.searchsorted(share, torch.tensor([coverage - 1e-12], dtype=share.dtype))[0]) + 1
    return min(counts.shape[0], multiple * -(-n // multiple))


class PrunedLMHead:
    """The target's frozen LM head restricted to a draft vocabulary of N ids (a copy of their N rows): scores only
    those, and scatters them back into the target's vocabulary with -inf elsewhere, so the tree holds target ids and
    ranks nothing outside the vocabulary (as EAGLE-3's d2t and vLLM's compute_logits). Lossless whatever N: the
    target verifies every drafted token. The saving is the (V - N) rows not applied to each drafted row."""

    def __init__(self, lm_head: torch.nn.Linear, ids: torch.Tensor):
        self.ids = ids.sort().values.to(lm_head.weight.device)  # [N] target ids
        self.weight = lm_head.weight.detach()[self.ids].contiguous()  # [N, H]
        self.bias = None if lm_head.bias is None else lm_head.bias.detach()[self.ids].contiguous()  # [N]
        self.vocab = lm_head.weight.shape[0]
        for t in (self.ids, self.weight, self.bias):  # constants a compiled draft tree reads (no copy per CUDA graph
            if t is not None:  # replay)
                torch._dynamo.mark_static_address(t)

    def __call__(self, f: torch.Tensor) -> torch.Tensor:
        """Features [.., H] -> logits [.., V]: the draft vocabulary's scores, -inf elsewhere."""
        sub = torch.nn.functional.linear(f.to(self.weight.dtype), self.weight, self.bias)  # [.., N]
        full = sub.new_full((*sub.shape[:-1], self.vocab), float("-inf"))
        return full.index_copy_(-1, self.ids, sub)


def pruned_lm_head(target: TargetModel, n: int | None, counts_path: Path | None) -> PrunedLMHead | None:
    """The target's LM head pruned to its n most frequent answer tokens (counts from `counts_path`), or None for the
    whole vocabulary (n None, or n >= V)."""
    if n is None:
        return None
    if n < 1:
        raise SpecbenchError(f"module.draft_vocab={n}: a draft vocabulary needs at least one token")
    if n >= target.vocab_size:
        return None
    if counts_path is None:
        raise SpecbenchError("module.draft_vocab needs token counts: set module.vocab_counts (this drafter has no "
                             "checkpoint directory beside which to look)")
    return PrunedLMHead(target.lm_head, frequent_ids(load_counts(counts_path, target), n))


def save_counts(path: Path, counts: torch.Tensor, target: TargetModel, source: str) -> Path:
    """Write counts [V] with the target they belong to (its fingerprint) and where they came from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({"counts": counts.long().contiguous()}, str(tmp),
              metadata={"target": target.name, "fingerprint": target_fingerprint(target), "source": source,
                        "tokens": str(int(counts.sum()))})
    tmp.chmod(0o644)  # (safetensors writes its file private)
    tmp.rename(path)  # nothing half-written where a run looks
    return path


def load_counts(path: Path, target: TargetModel) -> torch.Tensor:
    """Counts [V] for `target`; a missing file, another vocabulary or another target's file is one line."""
    if not path.is_file():
        raise SpecbenchError(f"a draft vocabulary needs token counts, and {path} does not exist: write it with "
                             f"`python -m specbench.vocab model={target.name}`, or point module.vocab_counts at one")
    with safe_open(str(path), framework="pt") as f:
        meta, counts = f.metadata() or {}, f.get_tensor("counts")
    if counts.shape != (target.vocab_size,):
        raise SpecbenchError(f"{path} counts {tuple(counts.shape)} tokens; the target's vocabulary has "
                             f"{target.vocab_size} (another target's file)")
    if meta.get("fingerprint") not in (None, target_fingerprint(target)):
        raise SpecbenchError(f"{path} was counted for another target ({meta.get('target')}), not {target.name}")
    return counts
