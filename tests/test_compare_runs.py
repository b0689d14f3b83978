"""scripts/compare_runs.py: a re-run read against its reference, run by run (issue 77's Table 1 re-run)."""
import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("compare_runs", Path(__file__).parents[1] / "scripts/compare_runs.py")
compare_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_runs)


def _run(root: Path, name: str, tau: float, tokens: list[list[int]]) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"drafter": "sd", "dataset": "mtbench", "tau_micro": tau,
                                                "lossless": {"compared": len(tokens), "matches": len(tokens)}}))
    (d / "records.jsonl").write_text("".join(json.dumps({"question_id": q, "turn": 0, "repeat": 0,
                                                         "new_token_ids": t}) + "\n" for q, t in enumerate(tokens)))


def test_equal_runs_pass_and_a_differing_turn_fails(tmp_path, capsys):
    _run(tmp_path / "ref", "m__sd__mtbench", 1.5, [[1, 2], [3]])
    _run(tmp_path / "same", "m__sd__mtbench", 1.5, [[1, 2], [3]])
    _run(tmp_path / "moved", "m__sd__mtbench", 1.53, [[1, 2], [4]])
    assert compare_runs.main([str(tmp_path / "same"), str(tmp_path / "ref")]) == 0
    assert "differing: 0" in capsys.readouterr().out
    assert compare_runs.main([str(tmp_path / "moved"), str(tmp_path / "ref")]) == 1
    out = capsys.readouterr().out
    assert "+2.0%" in out and "differing: 1" in out and "m__sd__mtbench (1, 0, 0)" in out
