"""Every named question set loads in the one shape, with the counts of its source."""
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from specbench.core.config import DatasetConfig, to_dataclass
from specbench.data.data import load_questions

CONF = Path(__file__).resolve().parents[1] / "conf" / "dataset"
EXPECTED = {"mtbench": (80, 2), "humaneval": (80, 1), "humaneval_full": (164, 1), "gsm8k": (80, 1),
            "gsm8k_full": (1319, 1), "cnndm": (80, 1), "alpaca": (80, 1), "qa": (80, 1), "translation": (80, 1),
            "rag": (80, 1), "specbench": (480, None), "specbench_mt": (80, 2), "specbench_math": (80, 1)}


def dataset(name: str, **over) -> DatasetConfig:
    return to_dataclass(DatasetConfig, OmegaConf.merge(OmegaConf.load(CONF / f"{name}.yaml"), over))


def test_every_named_set_is_tested():
    assert set(EXPECTED) | {"jsonl"} == {p.stem for p in CONF.glob("*.yaml")}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_named_sets_load(name):
    count, turns = EXPECTED[name]
    qs = load_questions(dataset(name))
    assert len(qs) == count
    assert len({q.question_id for q in qs}) == count
    if turns:
        assert all(len(q.turns) == turns for q in qs)
    assert all(t.strip() for q in qs for t in q.turns)


def test_limit_takes_the_first_n():
    full = load_questions(dataset("gsm8k"))
    assert load_questions(dataset("gsm8k", limit=5)) == full[:5]


def test_cnndm_is_the_summarization_category():
    assert {q.category for q in load_questions(dataset("cnndm"))} == {"summarization"}
