"""`make trainmem` (`python -m specbench.trainmem`): peak training memory and step time versus simulated steps.

Beagle's claim (papers/000 Sec. 4.2, Fig. 10): its late-stage simulation needs constant memory in the number of
simulated steps s, while self-attention multi-step training (HASS, "training-time test") grows with s. For each method
in `trainmem.methods` and each s in `trainmem.steps`, one fresh process (so that peak RSS on the CPU is its own)
trains the method's module on the same batch (the first `train.batch_size` training conversations that fill
`train.max_len` tokens) with the shared trainer's optimiser: `bench.warmup` steps, then `bench.repeats` timed steps.
Recorded per point:
  peak_bytes       peak during the timed steps: CUDA allocator peak / peak RSS (VmHWM, reset) on the CPU;
  base_bytes       the same counter just before them (target, features, module, optimiser state);
  graph_bytes      bytes autograd saved for backward in the largest graph that was alive at once (exact,
                   device-independent: saved_tensors_hooks);
  step_s           seconds per optimiser step (synchronised), mean and std over the timed steps.
With `trainmem.steps: null` each method is measured once at its configured options (any trainable method, not only
the simulated-steps ones), and `trainmem.precisions` repeats every point under each `train.precision` (fp32, bf16
autocast): `make trainspeed` measures every method's training tokens/s both ways (tokens / step_s).
Writes results/<out.experiment>/<model>__trainmem__<hash>/trainmem.json with the run header.
"""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from pathlib import Path

import hydra
import torch
from hydra import compose
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from specbench.core import envinfo
from specbench.core.config import ModelConfig, TrainConfig, register_schema, to_dataclass
from specbench.decode.engine import sync
from specbench.errors import SpecbenchError
from specbench.core.metrics import PeakMemory, _peak_rss
from specbench.core.models import load_model, pick_device
from specbench.core.records import atomic_write_json
from specbench.core.cli import CONF_DIR, cli, config_hash, fail
from specbench.decode.target import TargetModel

STEP_OPTION = {"hass": "steps", "coral": "steps", "beagle": "sim_steps"}  # the module option that sets s


def fixed_batch(train_set, tc: TrainConfig, device, kv: bool = False):
    from specbench.train.trainer import collate

    full = [key for key in train_set.index() if len(train_set.load(*key)["input_ids"]) >= tc.max_len]
    if len(full) < tc.batch_size:
        raise SpecbenchError(f"fewer than {tc.batch_size} training conversations reach train.max_len={tc.max_len}")
    return collate([train_set.load(*key, kv=kv) for key in full[: tc.batch_size]], device)


def measure(job: dict) -> dict:
    """One (method, s) point, in its own process."""
    from specbench.decode.drafter import KV, LAYERS
    from specbench.train.features import token_counts
    from specbench.train.trainer import add_noise, backward_pieces, prepare_features, target_inputs

    torch.manual_seed(0)
    model_cfg, tc = to_dataclass(ModelConfig, job["model"]), to_dataclass(TrainConfig, job["train"])
    model, tok, device = load_model(model_cfg)
    target = TargetModel(model, tok, device, model_cfg.name)
    cls = get_class(job["target_cls"])
    stored = KV in cls.needs and tc.kv_features == "stored"
    train_set, _ = prepare_features(target, tc, model_cfg, kv=stored, rank=0)
    batch = fixed_batch(train_set, tc, device, kv=stored)
    add_noise(batch, tc.noise, tc.noise_scale, torch.Generator().manual_seed(0))
    # as the trainer builds it: options sized from the answers (EAGLE-3's draft vocabulary), then its data-fitted state
    counts = token_counts(train_set, target.vocab_size)
    opts = cls.options({**job["module"], **cls.fit_options(cls.options(job["module"]), counts)})
    module = cls.build_module(target, opts).to(device).train()
    cls.fit_data(module, counts, opts)
    layers = tuple(cls.feature_layers(module)) if LAYERS in cls.needs else ()
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, betas=tuple(tc.betas), fused=device.type == "cuda")
    epoch = job["epoch"]
    graph = {"now": 0, "max": 0}
    weights = {p.data_ptr() for p in [*module.parameters(), *target.model.parameters()]}

    def pack(t: torch.Tensor):
        if t.data_ptr() not in weights:  # weights saved for backward are not extra memory
            graph["now"] += t.numel() * t.element_size()
        graph["max"] = max(graph["max"], graph["now"])
        return t

    def step() -> None:
        # the trainer's online K/V and EAGLE-3's online features: part of what a step costs
        target_inputs(batch, target, KV in cls.needs and not stored, layers, tc.features_dtype)
        opt.zero_grad(set_to_none=True)
        for _ in backward_pieces(cls.training_steps(module, batch, target, opts, epoch), tc, device):
            graph["now"] = 0  # that graph is freed; the next piece starts from nothing
        opt.step()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()  # also the first warm-up step
    for _ in range(max(job["warmup"] - 1, 0)):
        step()
    mem = PeakMemory(device)
    sync(device)
    mem.reset()
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else _peak_rss()
    times = []
    for _ in range(job["repeats"]):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return {"method": job["method"], "steps": job["s"], "precision": tc.precision, "peak_bytes": mem.read()["peak_mem_bytes"], "base_bytes": base,
            "graph_bytes": graph["max"], "step_s": statistics.fmean(times),
            "step_s_std": statistics.pstdev(times), "tokens": batch.tokens,
            "tokens_per_s": batch.tokens / statistics.fmean(times), "device": str(device)}


def jobs(cfg: DictConfig) -> list[dict]:
    out = []
    for method in cfg.trainmem.methods:
        node = compose(config_name="config", overrides=[f"drafter={method}"]).drafter  # model: the parent's
        if cfg.trainmem.steps is not None and method not in STEP_OPTION:
            raise SpecbenchError(f"trainmem.methods: {method!r} has no simulated-steps option ({', '.join(STEP_OPTION)})")
        module, optim = (OmegaConf.to_container(node[k], resolve=True) if node.get(k) is not None else {}
                         for k in ("module", "optim"))
        train = {**OmegaConf.to_container(cfg.train, resolve=True), **optim}
        late = int(module.get("late_from_epoch", 0))  # Beagle: measure its late stage (the simulated one)
        points = [(None, module)] if cfg.trainmem.steps is None else \
            [(int(s), {**module, STEP_OPTION[method]: int(s)}) for s in cfg.trainmem.steps]
        for precision in cfg.trainmem.precisions:
            for s, options in points:
                out.append({"method": method, "s": s, "target_cls": node._target_, "module": options, "epoch": late,
                            "model": OmegaConf.to_container(cfg.model, resolve=True),
                            "train": {**train, "precision": precision},
                            "warmup": cfg.bench.warmup, "repeats": cfg.bench.repeats})
    return out


def print_table(rows: list[dict]) -> None:
    print(f"{'method':12} {'s':>4} {'prec':>4} {'peak MiB':>9} {'over base':>10} {'graph MiB':>10} {'step s':>8} "
          f"{'tokens/s':>9}")
    for r in rows:
        print(f"{r['method']:12} {str(r['steps']):>4} {r['precision']:>4} {r['peak_bytes'] / 2**20:9.0f} "
              f"{(r['peak_bytes'] - r['base_bytes']) / 2**20:10.0f} {r['graph_bytes'] / 2**20:10.1f} "
              f"{r['step_s']:8.2f} {r['tokens_per_s']:9.0f}")


register_schema()


@hydra.main(config_path=str(CONF_DIR), config_name="trainmem", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    try:
        todo = jobs(cfg)
        ctx = mp.get_context("spawn")
        rows = []
        for job in todo:
            with ctx.Pool(1) as pool:  # a fresh process per point: its peak memory is its own
                rows.append(pool.apply(measure, (job,)))
            print(f"{job['method']} s={job['s']} {job['train']['precision']}: peak "
                  f"{rows[-1]['peak_bytes'] / 2**20:.0f} MiB, {rows[-1]['step_s']:.2f} s/step", flush=True)
    except SpecbenchError as e:
        fail(e)
    print_table(rows)
    conf = OmegaConf.to_container(cfg, resolve=True)
    out = Path(cfg.out.root) / cfg.out.experiment / f"{cfg.model.name}__trainmem__{config_hash(conf)}" / "trainmem.json"
    atomic_write_json(out, {"rows": rows, "config": conf,
                            **envinfo.header("specbench.trainmem", pick_device(cfg.model.device))})
    print(f"written: {out}")


def main() -> None:
    cli(_main)


if __name__ == "__main__":
    main()
