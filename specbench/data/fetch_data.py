"""`make data` (`python -m specbench.fetch_data`): every benchmark question file no package ships, from its public
origin, pinned to a commit and checked against its sha256, into the data directory the question sets read.

Where question files are looked up (specbench/data/data.py `find_data`), first hit wins:
  1. $SPECBENCH_DATA, else ${SPECBENCH_CACHE:-~/.cache/specbench}/data   (what `make data` fills)
  2. ../shared/data beside the repository                                   (this project's offline copies)
A file already present and verified in either place is not fetched again; one present with other bytes is refused
(a truncated download, or another version of the set). On a machine without internet the files come from
`--from DIR` (a directory in the same layout), or from ../shared/data where it exists.

    python -m specbench.fetch_data [--from DIR] [--base-url URL]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from specbench.errors import SpecbenchError

RAW = "https://raw.githubusercontent.com"


@dataclass(frozen=True)
class Origin:
    repo: str  # owner/name on GitHub
    commit: str  # pinned: the bytes below are the file at this commit
    path: str  # inside the repository
    sha256: str

    def url(self, base: str = RAW) -> str:
        return f"{base}/{self.repo}/{self.commit}/{self.path}"


EAGLE = ("SafeAILab/EAGLE", "cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b")  # eagle/data/<set>/question.jsonl
SPEC_BENCH = ("hemingkx/Spec-Bench", "fd2c1cd7d2201ef71db4c5f4e455008f017967bf")
GSM8K = ("openai/grade-school-math", "3101c7d5072418e28b9008a6636bde82a006892c")

# data-dir relative path -> origin (the layout of ../shared/data; checksums of the files at the pinned commits)
FILES: dict[str, Origin] = {
    "eagle/alpaca/question.jsonl": Origin(*EAGLE, "eagle/data/alpaca/question.jsonl",
                                          "8ad3e5a7fc61b88d8e25edb81a52a2ce00a04494d5694c122cb11a5cc26a00df"),
    "eagle/gsm8k/question.jsonl": Origin(*EAGLE, "eagle/data/gsm8k/question.jsonl",
                                         "a55920b2f2aac724241124c59e5b8e8168dbbeb2ab0fdbee17d5b0ab6db5ff27"),
    "eagle/humaneval/question.jsonl": Origin(*EAGLE, "eagle/data/humaneval/question.jsonl",
                                             "ce0244e2b228339e9a11afc63a151719beede1e389fdaec7cd9751d33902180e"),
    "eagle/mt_bench/question.jsonl": Origin(*EAGLE, "eagle/data/mt_bench/question.jsonl",
                                            "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"),
    "eagle/qa/question.jsonl": Origin(*EAGLE, "eagle/data/qa/question.jsonl",
                                      "04252e41ab00bcc03b11940b4a3766cf40ae0b76a09c4f56968ba952f0b029f3"),
    "eagle/sum/question.jsonl": Origin(*EAGLE, "eagle/data/sum/question.jsonl",
                                       "916876f0c42f938a944de96eed16e51425f29f27438cca5c9ef4737c0fedf771"),
    "spec_bench/question.jsonl": Origin(*SPEC_BENCH, "data/spec_bench/question.jsonl",
                                        "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"),
    "gsm8k/test.jsonl": Origin(*GSM8K, "grade_school_math/data/test.jsonl",
                               "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"),
}


def data_dir() -> Path:
    """Where `make data` writes: $SPECBENCH_DATA, else ${SPECBENCH_CACHE:-~/.cache/specbench}/data."""
    env = os.environ.get("SPECBENCH_DATA")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("SPECBENCH_CACHE", "~/.cache/specbench")).expanduser() / "data"


def shared_dir() -> Path:
    """The project's offline copies, ../shared/data beside the repository (absent in a user's clone;
    $SPECBENCH_SHARED_DATA points elsewhere)."""
    env = os.environ.get("SPECBENCH_SHARED_DATA")
    return Path(env).expanduser() if env else Path(__file__).resolve().parents[2].parent / "shared" / "data"


def search_dirs() -> list[Path]:
    return [data_dir(), shared_dir()]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def find_data(rel: str) -> Path | None:
    """The first copy of a question file in the search dirs, or None."""
    return next((d / rel for d in search_dirs() if (d / rel).is_file()), None)


def missing_hint(rel: str) -> str:
    return (f"question file {rel} is in none of {', '.join(str(d) for d in search_dirs())}: run `make data` "
            f"(python -m specbench.fetch_data) to fetch it from its origin")


def _verified(path: Path, origin: Origin) -> bool:
    if not path.is_file():
        return False
    got = sha256(path)
    if got != origin.sha256:
        raise SpecbenchError(f"{path} is not {origin.repo}@{origin.commit[:7]}:{origin.path} (sha256 {got[:12]}, "
                             f"expected {origin.sha256[:12]}): remove it and run `make data` again")
    return True


def _install(src_bytes_path: Path, dest: Path, origin: Origin) -> None:
    """Verify a candidate file, then move it into place atomically."""
    got = sha256(src_bytes_path)
    if got != origin.sha256:
        raise SpecbenchError(f"{origin.url()}: sha256 {got[:12]}, expected {origin.sha256[:12]} (a changed or "
                             "truncated file); nothing was written")
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(src_bytes_path, dest)


def fetch(dest: Path | None = None, offline: Path | None = None, base_url: str = RAW, timeout: float = 60.0) -> dict:
    """Make every file of FILES available: {relative path: 'present' | 'copied' | 'downloaded'}."""
    dest = dest or data_dir()
    done: dict[str, str] = {}
    for rel, origin in FILES.items():
        if any(_verified(d / rel, origin) for d in (dest, shared_dir()) if (d / rel).is_file()):
            done[rel] = "present"
            continue
        dest.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest, prefix=".fetch.")
        os.close(fd)
        tmp_path = Path(tmp)
        try:
            if offline is not None and (offline / rel).is_file():
                shutil.copyfile(offline / rel, tmp_path)
                how = "copied"
            else:
                try:
                    with urllib.request.urlopen(origin.url(base_url), timeout=timeout) as r, tmp_path.open("wb") as f:
                        shutil.copyfileobj(r, f)
                except (urllib.error.URLError, OSError) as e:
                    raise SpecbenchError(f"{origin.url(base_url)} could not be fetched ({e}); without internet, "
                                         f"copy the files here with `--from DIR`") from None
                how = "downloaded"
            _install(tmp_path, dest / rel, origin)
            done[rel] = how
        finally:
            tmp_path.unlink(missing_ok=True)
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="offline", type=Path, help="a directory in the same layout to copy from")
    ap.add_argument("--base-url", default=RAW, help="where the repositories' raw files are served")
    args = ap.parse_args()
    try:
        done = fetch(offline=args.offline, base_url=args.base_url)
    except SpecbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for rel, how in done.items():
        print(f"{how:10} {rel}")
    print(f"{len(done)} question files ready (read from {', '.join(str(d) for d in search_dirs())})")


if __name__ == "__main__":
    main()
