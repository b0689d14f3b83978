"""HumanEval pass@1 by execution (specbench/bench/humaneval_exec.py, issue 78): canonical solutions pass, wrong ones
fail, an endless loop times out; answers as the chat models write them (fenced whole definitions) are extracted as
declared; the question sets map to their problems."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from specbench.bench.humaneval_exec import (ExecResult, check, check_answers, completion_from_answer, load_problems,
                                            pass_at_1, problem_for)
from specbench.core.config import DatasetConfig, to_dataclass
from specbench.data.data import load_questions
from specbench.errors import SpecbenchError

CONF = Path(__file__).resolve().parents[1] / "conf" / "dataset"


@pytest.fixture(scope="module")
def problems():
    return load_problems()


def test_the_problems_carry_tests_and_entry_points(problems):
    assert len(problems) == 164
    p = problems["HumanEval/52"]
    assert p.entry_point == "below_threshold" and "def check(candidate)" in p.test


@pytest.mark.parametrize("name, count", [("humaneval", 80), ("humaneval_full", 164)])
def test_every_question_maps_to_one_problem(problems, name, count):
    """EAGLE's subset has no task ids or tests: its prompts are found inside the questions (and its reference is the
    problem's canonical solution); the full set is keyed by task id."""
    qs = load_questions(to_dataclass(DatasetConfig, OmegaConf.load(CONF / f"{name}.yaml")))
    found = {problem_for(q.question_id, q.turns[0], problems).task_id for q in qs}
    assert len(qs) == len(found) == count
    by_text = {problem_for("?", q.turns[0], problems).task_id for q in qs}  # the text alone is unambiguous too
    assert by_text == found


def test_the_subsets_reference_is_the_canonical_solution(problems):
    import json

    from specbench.data.data import data_file

    for line in data_file("eagle/humaneval/question.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert problem_for(str(rec["question_id"]), rec["turns"][0], problems).canonical_solution == rec["reference"][0]


def test_an_unknown_question_is_refused_in_one_line(problems):
    with pytest.raises(SpecbenchError, match="question 'q1': its text contains no HumanEval problem's prompt"):
        problem_for("q1", "Write a poem about the sea.", problems)


@pytest.mark.parametrize("task", ["HumanEval/0", "HumanEval/10", "HumanEval/52"])
def test_canonical_solutions_pass(problems, task):
    p = problems[task]
    assert check(p, p.canonical_solution) == ExecResult(task, True, "passed")


def test_canonical_solutions_across_the_set_pass(problems):
    """Every 8th problem (21; all 164 take ~15 s under pytest, each child forked from a process holding torch, and all
    passed at this commit): no problem's tests depend on something this machine lacks."""
    results = check_answers((p, p.canonical_solution) for p in list(problems.values())[::8])
    assert pass_at_1(results) == 1.0, [r for r in results if not r.passed][:3]


def test_a_wrong_solution_fails_and_an_endless_loop_times_out(problems):
    p = problems["HumanEval/52"]
    wrong = check(p, "    return True\n")
    assert not wrong.passed and wrong.result.startswith("failed")
    t0 = time.monotonic()
    loop = check(p, "    while True:\n        pass\n", timeout_s=0.5)
    assert loop == ExecResult("HumanEval/52", False, "timed out")
    assert time.monotonic() - t0 < 5
    with pytest.raises(SpecbenchError, match="a time limit must be positive"):
        check(p, p.canonical_solution, timeout_s=0)


# two answers SmolLM2-135M-Instruct gave (results/coral_table2/smollm2-135m__coral__humaneval__T0__a8346a88, the
# first two records, decoded): the first is right, the second is not
BELOW = ("```python\ndef below_threshold(l: list, t: int) -> bool:\n    return all(num < t for num in l)\n```\n\nThis "
         "function uses the `all` function to check if all elements in the list l are below the specified threshold t. "
         "The `isinstance` function")
LAST_CHAR = ("```python\ndef check_if_last_char_is_a_letter(txt):\n    return 'word' in str(txt)\n```\n\nThis function uses "
             "the `str()` function to convert the input string to a string, which allows it to compare the input with a "
             "regular expression. The")


def test_answers_as_the_models_write_them(problems):
    below, last = problems["HumanEval/52"], problems["HumanEval/134"]
    assert completion_from_answer(below, BELOW) == "\ndef below_threshold(l: list, t: int) -> bool:\n    return all(num < t for num in l)\n"
    results = check_answers([(below, BELOW), (last, LAST_CHAR)])
    assert [r.passed for r in results] == [True, False] and pass_at_1(results) == 0.5
    # an answer cut inside its fence (the budget, a disconnection): the code runs to the end
    assert check_answers([(below, BELOW.split("```\n")[0])])[0].passed
    cut = "```python\ndef below_threshold(l: list, t: int) -> bool:\n    return all(num < t for"
    assert check_answers([(below, cut)])[0].result.startswith("failed")
    # a bare body continues the prompt, as the harness's own completions do
    assert completion_from_answer(below, below.canonical_solution) == below.canonical_solution
    # a helper the prompt defines stays in scope for a whole redefinition (HumanEval/10 calls is_palindrome)
    pal = problems["HumanEval/10"]
    redefined = f"Sure:\n```py\ndef make_palindrome(string: str) -> str:\n{pal.canonical_solution}```"
    assert check_answers([(pal, redefined)])[0].passed
    with pytest.raises(SpecbenchError, match="pass@1 of no results"):
        pass_at_1([])
