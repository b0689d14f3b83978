"""Token frequencies of a target's training answers (what the draft vocabularies of specbench/decode/vocab.py rank by).

    python -m specbench.vocab model=smollm2-135m          # -> weights/smollm2-135m/token_counts.safetensors

EAGLE-3 builds its draft vocabulary (d2t / t2d) from these counts when it trains; the rest of the EAGLE family
(eagle, eagle2, hass, coral) prunes its LM head to the N most frequent tokens at decoding time
(`+drafter.module.draft_vocab=N`), reading the file this writes beside their weights. The counts are taken at the
loss positions (the answers) of the training budget's conversations: with `train=embedded` the target's own answers
(generated once, the cache every drafter trains from), with `train=paper` ShareGPT's. No target forward is needed
beyond those answers, so a user's GPU box writes it in seconds once the answers exist.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from specbench.core.cli import entry
from specbench.core.config import ModelConfig, TrainConfig, to_dataclass
from specbench.core.models import load_model
from specbench.data.conversations import Encoded
from specbench.decode.target import TargetModel
from specbench.decode.vocab import save_counts
from specbench.train.trainer import features_root, training_conversations

log = logging.getLogger("specbench.vocab")


def answer_counts(convs: list[Encoded], vocab: int) -> torch.Tensor:
    """How often each token id occurs at the loss positions (the answers): [vocab] int64."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for enc in convs:
        ids, mask = torch.tensor(enc.input_ids), torch.tensor(enc.loss_mask, dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab)[:vocab]
    return counts


def write_counts(cfg: DictConfig) -> Path:
    mc, tc = to_dataclass(ModelConfig, cfg.model), to_dataclass(TrainConfig, cfg.train)
    model, tok, dev = load_model(mc)
    target = TargetModel(model, tok, dev, mc.name)
    enc, _ = training_conversations(target, tc, mc, features_root(target, tc, mc, kv=False))
    counts = answer_counts(enc, target.vocab_size)
    out = save_counts(Path(cfg.vocab.out), counts, target,
                      f"answers of {len(enc)} training conversations (train.answers={tc.answers})")
    log.info("wrote %s: %d answer tokens, %d distinct", out, int(counts.sum()), int((counts > 0).sum()))
    return out


main = entry(write_counts)

if __name__ == "__main__":
    main()
