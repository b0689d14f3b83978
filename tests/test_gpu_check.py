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
    # every drafter's losslessness on these four paths is test_compile's; here one drafter shows the part runs. The
    # deadline is the lent GPU's (420 s by default): a slow CI host must not leave a part out of this test. aot_eager:
    # every compiled path captured and guarded as under inductor, without its C++ builds (minutes of a cold CI host;
    # test_compile's test_inductor_compiles_the_baseline keeps inductor itself in the suite)
    out = main(["--cpu-form", "--compile-backend", "aot_eager", "--shapes", "llama3-8b", "--drafters", "pld", "--timed-drafters", "pld,eagle2",
                "--prompt", "12", "--new", "8", "--repeats", "1", "--tree-sizes", "1,4", "--tiny-new", "12",
                "--law-samples", "150", "--batch-drafters", "pld,eagle2", "--batch-sizes", "1,3",
                "--batch-modes", "eager", "--deadline", "7200", "--out", str(tmp_path)])
    rec = json.loads((out / "gpu_check.json").read_text())
    assert rec["lossless"] == {f"pld {p}": "ok" for p in ("eager", "compiled", "batch", "batch compiled")}
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
    assert rec["header"]["sdpa"] == "no-cudnn" and rec["header"]["git"] and rec["header"]["compile_backend"] == "aot_eager"
    md = (out / "gpu_check.md").read_text()
    assert "## llama3-8b" in md and "4 of 4 drafter x path runs equal" in md and "| eagle2 compiled |" in md
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


def test_a_kernel_is_counted_once_not_again_under_the_op_that_launched_it():
    """torch.profiler gives a CPU op the device time of the kernels it launched: on CUDA only the device's events
    count (the H200 record of b6de4c9 counted both: "other" 4.77 ms beside matmul 4.62, a busy time past the wall)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from specbench.tools.gpu_check import kernel_classes

    def evt(key, device, self_device=0.0, self_cpu=0.0):
        return SimpleNamespace(key=key, device_type=device, self_device_time_total=self_device,
                               self_cpu_time_total=self_cpu)

    events = [evt("aten::mm", DeviceType.CPU, self_device=100.0, self_cpu=30.0),
              evt("sm90_xmma_gemm_bf16bf16_bf16f32", DeviceType.CUDA, self_device=100.0),
              evt("aten::_efficient_attention_forward", DeviceType.CPU, self_device=20.0, self_cpu=5.0),
              evt("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", DeviceType.CUDA, self_device=20.0),
              evt("Memcpy DtoD (Device -> Device)", DeviceType.CUDA, self_device=3.0),
              evt("cudaLaunchKernel", DeviceType.CPU, self_cpu=50.0)]
    cuda = kernel_classes(events, cuda=True)
    assert cuda["matmul"] == 100.0 and cuda["copies"] == 3.0 and sum(cuda.values()) == 123.0
    cpu = kernel_classes(events, cuda=False)
    assert cpu["matmul"] == 30.0 and cpu["attention"] == 5.0 and sum(cpu.values()) == 35.0
