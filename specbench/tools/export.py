"""A trained head written for a serving engine: `python -m specbench.export drafter=eagle3 model=<name>
export.format=sglang|speculators [export.out=DIR] [drafter.checkpoint=DIR]` loads the target and the drafter's
checkpoint (checked against each other, as a run does) and writes the drafter's serving layout (drafters/eagle3.py:
save_for_serving; SGLang / SpecForge, or vLLM's speculators format). A drafter without one is refused in one line."""
from __future__ import annotations

import logging
from pathlib import Path

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from specbench.core.cli import entry
from specbench.core.config import ModelConfig, to_dataclass
from specbench.errors import SpecbenchError
from specbench.core.models import load_model
from specbench.bench.run import inference_spec
from specbench.decode.target import TargetModel

log = logging.getLogger("specbench.export")


def export(cfg: DictConfig) -> Path:
    spec = inference_spec(cfg.drafter)
    cls = hydra.utils.get_class(spec["_target_"])
    if not hasattr(cls, "save_for_serving"):
        raise SpecbenchError(f"drafter {cfg.drafter.name!r} has no serving layout to export (eagle3 has)")
    if not spec.get("checkpoint"):
        raise SpecbenchError(f"drafter {cfg.drafter.name!r} has no checkpoint to export: set drafter.checkpoint")
    mc = to_dataclass(ModelConfig, cfg.model)
    model, tok, dev = load_model(mc)
    drafter = instantiate(spec, target=TargetModel(model, tok, dev, mc.name), _convert_="object")
    out = drafter.save_for_serving(Path(cfg.export.out), cfg.export.format, cfg.export.verifier or mc.hf_id)
    log.info("wrote %s (%s)", out, cfg.export.format)
    return out


main = entry(export)

if __name__ == "__main__":
    main()
