"""The drafters `make train` trains, read from their own YAMLs (one place): those whose checkpoint is
<weights root>/${model.name}/<their own name>, the root `weights` or ${oc.env:SPECBENCH_WEIGHTS,weights} (eagle2 and
sd_tree decode eagle's and sd's weights), each after the drafters
whose weights it starts from (`module.base`: coral_router's stage 2 starts from coral).
    python -m specbench.trainable      -> the names, in training order, on one line
"""
from __future__ import annotations

from omegaconf import OmegaConf

from specbench.core.cli import CONF_DIR

WEIGHT_ROOTS = ("weights", "${oc.env:SPECBENCH_WEIGHTS,weights}")  # how a drafter YAML names the committed weights


def trainable_drafters() -> list[str]:
    own: dict[str, str | None] = {}  # name -> the drafter whose weights it starts from
    for path in sorted((CONF_DIR / "drafter").glob("*.yaml")):
        node = OmegaConf.to_container(OmegaConf.load(path))
        node = node.get("drafter", node)  # `# @package _global_` drafters nest under `drafter:`
        name, ckpt = node.get("name"), str(node.get("checkpoint") or "")
        if name and any(ckpt == f"{root}/${{model.name}}/{name}" for root in WEIGHT_ROOTS):
            base = str((node.get("module") or {}).get("base") or "")
            own[name] = base.rsplit("/", 1)[-1] if base else None
    order: list[str] = []

    def visit(name: str) -> None:
        if name not in order:
            if own.get(name):
                visit(own[name])
            order.append(name)

    for name in own:
        visit(name)
    return order


if __name__ == "__main__":
    print(" ".join(trainable_drafters()))
