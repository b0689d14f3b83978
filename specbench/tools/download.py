"""`make download MODEL=<name>` (`python -m specbench.download model=<name>`): the authors' published drafter weights
listed in conf/model/<name>.yaml (`published`), fetched through the hub cache into weights/<name>/<drafter>/, where the
drafter configs look for them (eagle2 decodes eagle's). Needs hub access (and `hf auth login` for gated repositories),
or the files already in the hub cache with HF_HUB_OFFLINE=1; re-running skips what is there. The loaders read the authors' layouts as they are (drafters/eagle.py, drafters/medusa.py)."""
from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path


from specbench.decode.checkpoints import resolve, weight_file, weights_root
from specbench.core.config import ModelConfig, to_dataclass
from specbench.errors import SpecbenchError
from specbench.core.cli import entry

log = logging.getLogger("specbench.download")


PATTERNS = ["*.json", "*.bin", "*.safetensors", "*.pt", "tokenizer.model"]  # weights, configs, a draft's tokenizer


def download(model: ModelConfig, root: Path | None = None) -> list[Path]:
    """Each published drafter of `model` into root/<model>/<drafter>/. The files go through the hub cache
    (snapshot_download without local_dir), then are copied out: the same call works online and offline
    (HF_HUB_OFFLINE=1 with the files in the cache: a cluster node without internet, the day-one rehearsal), where a
    local_dir download refuses to read the cache."""
    root = root or resolve(weights_root())
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
                snapshot = Path(snapshot_download(repo, allow_patterns=PATTERNS))
            except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
                raise SpecbenchError(f"{repo} could not be downloaded into {dest} (hub access and, for gated "
                                     f"repositories, `hf auth login`): {str(e).splitlines()[0]}") from None
            copy_snapshot(snapshot, dest)
        out.append(dest)
        print(f"{drafter}: {repo} -> {dest}")
    return out


def copy_snapshot(snapshot: Path, dest: Path) -> None:
    """The snapshot's files (the cache's symlinks followed) into dest, atomically: a temp dir renamed into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    try:
        for f in sorted(snapshot.rglob("*")):
            if f.is_file() and not any(part.startswith(".") for part in f.relative_to(snapshot).parts):
                target = tmp / f.relative_to(snapshot)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, target)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


main = entry(lambda cfg: download(to_dataclass(ModelConfig, cfg.model)))

if __name__ == "__main__":
    main()
