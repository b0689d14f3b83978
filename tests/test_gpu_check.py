"""`make gpu-check` in its CPU form (reduced shapes): every part runs and the record says what it found, so the GPU
command cannot rot between GPU loans."""
import json

import pytest

from specbench.tools.gpu_check import SHAPES, main, published_board


def test_the_published_taus_are_spec_benchs_board():
    board = published_board()
    assert board["eagle2"]["tau"] == 4.34 and board["eagle2"]["speedup"] == 2.36
    assert board["medusa"]["tau"] == 2.31 and board["pld"]["tau"] == 1.75 and "hass" not in board
    assert SHAPES["llama3-8b"]["num_key_value_heads"] == 8 and SHAPES["llama2-7b"]["intermediate_size"] == 11008


@pytest.mark.slow
def test_the_cpu_form_runs_every_part_and_writes_its_record(tmp_path):
    out = main(["--cpu-form", "--shapes", "llama3-8b", "--drafters", "pld,eagle2", "--prompt", "12", "--new", "8",
                "--repeats", "1", "--tree-sizes", "1,4", "--tiny-new", "12", "--law-samples", "150",
                "--batch-drafters", "pld,eagle2", "--batch-sizes", "1,3", "--batch-modes", "eager",
                "--out", str(tmp_path)])
    rec = json.loads((out / "gpu_check.json").read_text())
    assert rec["lossless"] == {f"{d} {p}": "ok" for d in ("pld", "eagle2")
                               for p in ("eager", "compiled", "batch", "batch compiled")}
    assert rec["law"]["ok"] and rec["law"]["df"] >= 3 and rec["law"]["drafter"] == "eagle2"
    row = rec["shapes"]["llama3-8b"]
    assert set(row["ms_per_token"]) == {"HBM floor", "bare F.linear", "ours, eager, dynamic cache",
                                        "ours, eager, preallocated cache", "ours, compiled",
                                        "transformers generate, eager", "transformers generate, static cache compiled"}
    assert all(v > 0 for v in row["ms_per_token"].values())
    assert set(row["verify_ms"]["compiled"]) == {"1", "4"}
    assert set(row["drafters"]) == {f"{d} {p}" for d in ("pld", "eagle2") for p in ("eager", "compiled")}
    e2 = row["drafters"]["eagle2 compiled"]
    assert e2["published_tau"] == 4.34 and e2["predicted_speedup"] > 0 and e2["steps"] >= 1
    assert set(row["first_pass"]) == {"pld", "eagle2"} and row["first_pass"]["eagle2"]["ratio"] > 0
    for name in ("pld", "eagle2"):
        b1, b3 = row["batch"][f"{name} eager"]["1"], row["batch"][f"{name} eager"]["3"]
        assert b1["steps"] >= 1 and b3["steps"] >= 1 and b3["tokens_per_s"] > 0
        # B rows drafted for in one step: the step's draft time over at least B row-steps at its first step
        assert b3["draft_ms_per_row_step"] < b3["draft_ms_per_step"]
    assert rec["skipped"] == []
    prof = row["profile_compiled"]
    assert prof["ms_per_token"]["matmul"] > 0 and prof["wall_ms_per_token"] > 0
    assert rec["header"]["sdpa"] == "no-cudnn" and rec["header"]["git"]
    md = (out / "gpu_check.md").read_text()
    assert "## llama3-8b" in md and "8 of 8 drafter x path runs equal" in md and "| eagle2 compiled |" in md
    assert "| eagle2 eager, 3 |" in md


def test_a_part_past_the_deadline_is_left_out_recorded_and_the_record_saved_after_each_part():
    import time

    from specbench.tools.gpu_check import Budget, Check

    saved = []
    budget = Budget(Check({}), time.perf_counter() + 3600, lambda check: saved.append(list(check.skipped)))
    assert budget.allows("a")
    budget.done()
    budget.deadline = time.perf_counter() - 1
    assert not budget.allows("b") and not budget.allows("c")
    budget.done()
    assert budget.check.skipped == ["b", "c"] and saved == [[], ["b", "c"]]
