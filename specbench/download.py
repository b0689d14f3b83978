"""`make download MODEL=<name>` (`python -m specbench.download model=<name>`): the authors' published drafter weights
listed in conf/model/<name>.yaml (`published`), fetched from the hub into weights/<name>/<drafter>/, where the drafter
configs look for them (eagle2 decodes eagle's). Needs hub access (and a login for gated repositories); re-running
skips what is there. The loaders read the authors' layouts as they are (drafters/eagle.py, drafters/medusa.py)."""
from __future__ import annotations

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig

from specbench.checkpoints import REPO, weight_file
from specbench.config import ModelConfig, register_schema, to_dataclass
from specbench.errors import SpecbenchError
from specbench.cli import cli, fail

log = logging.getLogger("specbench.download")


def download(model: ModelConfig, root: Path = REPO / "weights") -> list[Path]:
    if not model.published:
        raise SpecbenchError(f"model {model.name!r} lists no published drafter weights (conf/model/{model.name}.yaml: "
                             "published); train its drafters with `make train`")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    out = []
    for drafter, repo in sorted(model.published.items()):
        dest = root / model.name / drafter
        if weight_file(dest) is not None:
            log.info("%s: already in %s", repo, dest)
        else:
            try:
                snapshot_download(repo, local_dir=dest, allow_patterns=["*.json", "*.bin", "*.safetensors", "*.pt", "tokenizer.model"])
            except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
                raise SpecbenchError(f"{repo} could not be downloaded into {dest} (hub access and, for gated "
                                     f"repositories, `hf auth login`): {str(e).splitlines()[0]}") from None
        out.append(dest)
        print(f"{drafter}: {repo} -> {dest}")
    return out


register_schema()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    try:
        download(to_dataclass(ModelConfig, cfg.model))
    except SpecbenchError as e:
        fail(e)


def main() -> None:
    cli(_main)


if __name__ == "__main__":
    main()
