"""CORAL App. A's rule for the CSRA weight on this target: w_csra such that w_csra * L_csra ~ w_reg * L_reg (w_reg 0.5),
measured on 8 training batches with an untrained head and with the trained EAGLE head (the same module).
    python scripts/csra_weight.py          (needs the training features; `make train` builds them)"""
from pathlib import Path

import torch, random
from hydra import compose, initialize_config_dir
from specbench.core.config import register_schema
from specbench.train.trainer import Trainer, prepare_features, collate, add_noise
from drafters.coral import CoralDrafter
from specbench.decode.checkpoints import load_checkpoint
register_schema()
with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
    cfg = compose(config_name="config", overrides=["drafter=coral"])
tr = Trainer(cfg)
train_set, _ = prepare_features(tr.target, tr.tc, tr.model_cfg, kv=False, rank=0)
idx = train_set.index()
for label, ckpt in [("untrained", None), ("eagle-trained", "weights/smollm2-135m/eagle")]:
    torch.manual_seed(0)
    opts = CoralDrafter.options(steps=3, csra_weight=0.0)
    head = CoralDrafter.build_module(tr.target, opts)
    if ckpt:
        load_checkpoint(ckpt, head, tr.target, "eagle")
    regs, cs = [], []
    with torch.no_grad():
        for i in range(0, 16, 2):
            b = collate([train_set.load(*idx[j]) for j in (i, i + 1)], tr.target.device)
            add_noise(b, "uniform", 0.1, torch.Generator().manual_seed(i))
            parts = {k: v for _, part in CoralDrafter.training_steps(head, b, tr.target, opts, epoch=0) for k, v in part.items()}
            regs.append(sum(parts[f"reg{j}"] for j in (1, 2, 3)) / 3)  # per step, as Eq. 3 weighs them
            cs.append(sum(parts[f"csra{j}"] for j in (1, 2, 3)) / 3)
    r, c = sum(regs) / len(regs), sum(cs) / len(cs)
    print(f"{label}: L_reg {r:.4f}  L_csra {c:.4f}  w_csra for 0.5*L_reg = {0.5 * r / c:.4f}")
