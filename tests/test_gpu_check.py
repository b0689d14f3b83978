"""`make gpu-check` in its CPU form (reduced shapes): every part runs in its own process and the record says what it
found, so the GPU command cannot rot between GPU loans; a part that fails or overruns is recorded as such and the
others still run, so one part cannot waste a short GPU slot."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from specbench.core import envinfo
from specbench.tools import gpu_check, isolated
from specbench.tools.gpu_check import SHAPES, main, published_board

# the CPU form's reduced call: one drafter's losslessness (every drafter's on these four paths is test_compile's), two
# timed. aot_eager: every compiled path captured and guarded as under inductor, without its C++ builds (minutes of a
# cold CI host; test_compile's test_inductor_compiles_the_baseline keeps inductor itself in the suite). The deadline
# and part limit are long: a slow CI host must not leave a part out
CPU_FORM = ["--cpu-form", "--compile-backend", "aot_eager", "--shapes", "llama3-8b", "--drafters", "pld",
            "--timed-drafters", "pld,eagle2", "--prompt", "12", "--new", "8", "--repeats", "1", "--tree-sizes", "1,4,128",
            "--tiny-new", "12", "--law-samples", "150", "--batch-drafters", "pld,eagle2", "--batch-sizes", "1,3",
            "--batch-modes", "eager", "--deadline", "3600", "--part-limit", "1200"]


def test_the_published_taus_are_spec_benchs_board():
    board = published_board()
    assert board["eagle2"]["tau"] == 4.34 and board["eagle2"]["speedup"] == 2.36
    assert board["medusa"]["tau"] == 2.31 and board["pld"]["tau"] == 1.75 and "hass" not in board
    assert SHAPES["llama3-8b"]["num_key_value_heads"] == 8 and SHAPES["llama2-7b"]["intermediate_size"] == 11008


@pytest.mark.slow
def test_the_cpu_form_records_a_failed_and_an_overrun_part_and_runs_every_other(tmp_path, monkeypatch):
    """One part forced to raise (profile) and one to hang past its own limit (law): both recorded, every other part
    ran and recorded ok, into $OUT, with the commit "unknown" where neither the environment nor git names one."""
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.delenv("SPECBENCH_COMMIT", raising=False)
    monkeypatch.delenv("SPECBENCH_GIT_COMMIT", raising=False)
    monkeypatch.setattr(envinfo, "REPO", tmp_path)  # git run where no repository is: as on a copy without .git
    out = main([*CPU_FORM, "--fail-part", "llama3-8b profile", "--hang-part", "law", "--limit", "law=2"])
    assert out == tmp_path / "out"
    rec = json.loads((out / "gpu_check.json").read_text())
    parts = rec["parts"]
    assert set(parts) == {p.name for p in gpu_check.plan(gpu_check.parse(CPU_FORM))}
    assert parts["llama3-8b profile"]["status"] == "failed"
    assert parts["llama3-8b profile"]["error"] == ("RuntimeError: forced failure of part 'llama3-8b profile' "
                                                   "(--fail-part, a test hook)")
    assert parts["law"]["status"] == "timeout" and parts["law"]["limit_s"] == 2.0 and parts["law"]["seconds"] < 30
    assert {k for k, v in parts.items() if v["status"] == "ok"} == set(parts) - {"llama3-8b profile", "law"}
    assert rec["header"]["commit"] == "unknown" and rec["header"]["commit_source"] == "none"

    assert rec["lossless"] == {f"pld {p}": "ok" for p in ("eager", "compiled", "batch", "batch compiled")}
    assert rec["law"] == {}
    row = rec["shapes"]["llama3-8b"]
    assert "profile_compiled" not in row
    assert set(row["ms_per_token"]) == {"HBM floor", "bare F.linear", "ours, eager", "ours, compiled",
                                        "transformers generate, eager", "transformers generate, static cache compiled"}
    assert all(v > 0 for v in row["ms_per_token"].values())
    # 128 nodes and the root pass the largest compiled bucket: that forward would run eagerly, so it is not timed
    # under the compiled label, and the record says so
    assert set(row["verify_ms"]["eager"]) == {"1", "4", "128"}
    assert set(row["verify_ms"]["compiled"]) == {"1", "4"}
    assert row["verify_compiled"] == {"1": True, "4": True, "128": False}
    assert set(row["drafters"]) == {f"{d} {p}" for d in ("pld", "eagle2") for p in ("eager", "compiled")}
    e2 = row["drafters"]["eagle2 compiled"]
    assert e2["published_tau"] == 4.34 and e2["predicted_speedup"] > 0 and e2["steps"] >= 1
    assert "compiled" not in e2  # its paper tree (60 nodes) fits a bucket
    assert set(row["first_pass"]) == {"pld", "eagle2"} and row["first_pass"]["eagle2"]["ratio"] > 0
    for name in ("pld", "eagle2"):
        b1, b3 = row["batch"][f"{name} eager"]["1"], row["batch"][f"{name} eager"]["3"]
        assert b1["steps"] >= 1 and b3["steps"] >= 1 and b3["tokens_per_s"] > 0
        # B rows drafted for in one step: the step's draft time over at least B row-steps at its first step
        assert b3["draft_ms_per_row_step"] < b3["draft_ms_per_step"]
    assert rec["skipped"] == []
    assert rec["header"]["sdpa"] == "no-cudnn" and rec["header"]["compile_backend"] == "aot_eager"

    md = (out / "gpu_check.md").read_text()
    assert "commit unknown" in md and "## llama3-8b" in md and "4 of 4 drafter x path runs equal" in md
    assert "| eagle2 compiled |" in md and "| eagle2 eager, 3 |" in md
    assert "| llama3-8b profile | failed |" in md and "| law | timeout |" in md
    assert "| compiled | " in md and "eager past the largest bucket, untimed" in md


@pytest.mark.slow
def test_the_law_and_profile_parts_alone_and_the_top_kernels_kept_raw(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBENCH_COMMIT", "0123456789abcdef")
    out = main([*CPU_FORM, "--parts", "law,llama3-8b profile", "--out", str(tmp_path)])
    rec = json.loads((out / "gpu_check.json").read_text())
    assert {k: v["status"] for k, v in rec["parts"].items()} == {"law": "ok", "llama3-8b profile": "ok"}
    assert rec["law"]["ok"] and rec["law"]["df"] >= 3 and rec["law"]["drafter"] == "eagle2"
    prof = rec["shapes"]["llama3-8b"]["profile_compiled"]
    assert prof["ms_per_token"]["matmul"] > 0 and prof["wall_ms_per_token"] > 0
    top = prof["top_kernels"]
    assert 0 < len(top) <= gpu_check.TOP_KERNELS and all(k["count"] >= 1 and k["device_ms"] > 0 for k in top)
    assert [k["device_ms"] for k in top] == sorted((k["device_ms"] for k in top), reverse=True)
    assert any(k["class"] == "matmul" for k in top) and all(k["class"] == gpu_check.kernel_class(k["name"]) for k in top)
    assert rec["header"]["commit"] == "0123456789abcdef" and rec["header"]["commit_source"] == "SPECBENCH_COMMIT"
    assert "commit 0123456789ab" in (out / "gpu_check.md").read_text()


@pytest.mark.slow
def test_the_deadline_bounds_a_part_and_skips_the_rest(tmp_path):
    """The lossless and law parts too: a part gets at most what is left of the deadline, and a part with no time left
    is not started but recorded."""
    t0 = time.perf_counter()
    out = main([*CPU_FORM, "--parts", "law,llama3-8b timings", "--hang-part", "law", "--deadline", "6",
                "--out", str(tmp_path)])
    assert time.perf_counter() - t0 < 20
    rec = json.loads((out / "gpu_check.json").read_text())
    assert rec["parts"]["law"]["status"] == "timeout" and rec["parts"]["law"]["limit_s"] <= 6
    assert rec["parts"]["llama3-8b timings"] == {"status": "skipped (deadline)"}
    assert rec["skipped"] == ["llama3-8b timings"]
    assert "Left out at the deadline (6.0 s): llama3-8b timings" in (out / "gpu_check.md").read_text()


def hang_with_a_grandchild(payload, progress: isolated.Progress) -> None:
    """A part that starts a process of its own (as inductor's compile workers) and never ends."""
    sleeper = subprocess.Popen(["sleep", "600"])
    progress.data["grandchild"] = sleeper.pid
    progress.save()
    time.sleep(600)


def crash(payload, progress: isolated.Progress) -> None:
    progress.data["before"] = 1
    progress.save()
    os.kill(os.getpid(), signal.SIGSEGV)


def gone(pid: int) -> bool:
    """No such process, or a zombie (killed, not yet reaped by whatever adopted it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_an_overrunning_part_is_killed_with_its_process_group_and_a_crash_recorded(tmp_path):
    ctx = isolated.context(gpu_check.PRELOAD)
    got = isolated.run(ctx, hang_with_a_grandchild, None, 3.0, tmp_path / "hang.json")
    assert got.status == "timeout" and got.limit_s == 3.0 and 3.0 <= got.seconds < 15
    assert got.record() == {"status": "timeout", "seconds": round(got.seconds, 1), "limit_s": 3.0,
                            "error": "over its limit of 3 s, killed"}
    deadline = time.monotonic() + 10
    while not gone(got.data["grandchild"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(got.data["grandchild"])
    got = isolated.run(ctx, crash, None, 60.0, tmp_path / "crash.json")
    assert (got.status, got.error, got.data) == ("failed", "killed by SIGSEGV", {"before": 1})


def test_the_commit_comes_from_the_environment_else_git_else_unknown(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECBENCH_COMMIT", "abc")
    assert gpu_check.commit() == {"commit": "abc", "source": "SPECBENCH_COMMIT", "dirty": None}
    monkeypatch.delenv("SPECBENCH_COMMIT")
    monkeypatch.delenv("SPECBENCH_GIT_COMMIT", raising=False)
    monkeypatch.setattr(envinfo, "REPO", tmp_path)
    assert gpu_check.commit() == {"commit": "unknown", "source": "none", "dirty": None}


def test_the_markdown_renders_a_record_cut_short():
    """A header without a commit or versions, a shape with only generate's rows and a drafter past the largest
    bucket: every table that has data, no KeyError or None slice."""
    check = gpu_check.Check({"git": {"commit": None}}, parts={"lossless eager": {"status": "skipped (deadline)"}},
                            shapes={"llama2-7b": {"ms_per_token": {"transformers generate, eager": 24.2},
                                                  "verify_ms": {"compiled": {"1": 7.0}},
                                                  "verify_compiled": {"1": True, "128": False},
                                                  "drafters": {"sd_tree compiled": {"draft": 1.0, "verify": 2.0,
                                                                                    "other": 0.1, "compiled": False}}}})
    md = gpu_check.markdown(check)
    assert "commit unknown" in md and "| lossless eager | skipped (deadline) | – | – |  |" in md
    assert "weights unmeasured" in md and "| transformers generate, eager | 24.20 |" in md
    assert "| compiled | 7.00 | eager past the largest bucket, untimed |" in md
    assert "| sd_tree compiled (verify past the largest bucket: eager) | 1.00 | 2.00 | 0.10 | – | – | – |" in md


def test_a_wrong_part_name_stops_the_call_in_one_line():
    with pytest.raises(SystemExit, match="--parts: no part named 'llama3-8b verfy'"):
        gpu_check.plan(gpu_check.parse([*CPU_FORM, "--parts", "law,llama3-8b verfy"]))
    with pytest.raises(SystemExit, match="--limit: no part named 'lossles eager'"):
        main([*CPU_FORM, "--limit", "lossles eager=30", "--deadline", "0"])
    with pytest.raises(SystemExit):  # argparse's own one line: NAME=SECONDS
        gpu_check.parse(["--limit", "law"])


def test_the_output_folder_is_out_then_the_env_then_results(monkeypatch, tmp_path):
    args = gpu_check.parse(["--cpu-form", "--out", str(tmp_path / "a")])
    monkeypatch.setenv("OUT", str(tmp_path / "b"))
    assert gpu_check.out_dir(args) == tmp_path / "a"
    args.out = None
    assert gpu_check.out_dir(args) == tmp_path / "b"
    monkeypatch.delenv("OUT")
    assert gpu_check.out_dir(args).parent == envinfo.REPO / "results" / "gpu_check"


# inductor's fused kernels are named after every op they fuse: each lands where its heaviest op is (a norm with a
# cast in it is a norm, not a copy); the rest by substring
KERNEL_NAMES = {
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norms and elementwise",  # RMSNorm (a bf16 cast inside)
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_4": "norms and elementwise",
    "triton_poi_fused_add_cat_mul_neg_slice_unsqueeze_2": "norms and elementwise",  # RoPE
    "triton_poi_fused_mul_silu_3": "norms and elementwise",  # SwiGLU
    "triton_poi_fused__to_copy_add_7": "norms and elementwise",  # a residual add
    "triton_poi_fused_cat_1": "copies",
    "triton_poi_fused_clone_5": "copies",
    "triton_poi_fused__to_copy_0": "copies",
    "triton_poi_fused_index_put_6": "copies",
    "triton_poi_fused_embedding_0": "copies",
    "triton_tem_fused_mm_8": "matmul",
    "triton_tem_fused_addmm_9": "matmul",
    "triton_tem_fused__to_copy_mm_t_10": "matmul",
    "triton_tem_fused_flex_attention_0": "attention",
    "triton_per_fused__softmax_3": "attention",
    "triton_poi_fused_2": "other",  # no ops in the name: nothing says what it does
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas": "matmul",
    "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTT": "matmul",
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn": "matmul",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>": "matmul",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>": "attention",
    "void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>": "copies",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy_contig<float, unsigned int, 4, 128, 1>": "copies",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1>>": "copies",
    "void at::native::index_elementwise_kernel<128, 4>": "copies",
    "Memcpy DtoD (Device -> Device)": "copies",
    "Memset (Device)": "copies",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "norms and elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>": "norms and elementwise",
    "aten::mm": "matmul", "aten::addmm": "matmul", "aten::_to_copy": "copies", "aten::cat": "copies",
    "aten::embedding": "copies", "aten::mul": "norms and elementwise", "aten::rsqrt": "norms and elementwise",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
}


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_a_kernel_is_classed_by_its_dominant_op(name):
    assert gpu_check.kernel_class(name) == KERNEL_NAMES[name]


def test_a_kernel_is_counted_once_not_again_under_the_op_that_launched_it():
    """torch.profiler gives a CPU op the device time of the kernels it launched: on CUDA only the device's events
    count (the H200 record of b6de4c9 counted both: "other" 4.77 ms beside matmul 4.62, a busy time past the wall)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from specbench.tools.gpu_check import kernel_classes

    def evt(key, device, self_device=0.0, self_cpu=0.0):
        return SimpleNamespace(key=key, device_type=device, self_device_time_total=self_device,
                               self_cpu_time_total=self_cpu, count=1)

    events = [evt("aten::mm", DeviceType.CPU, self_device=100.0, self_cpu=30.0),
              evt("sm90_xmma_gemm_bf16bf16_bf16f32", DeviceType.CUDA, self_device=100.0),
              evt("aten::_efficient_attention_forward", DeviceType.CPU, self_device=20.0, self_cpu=5.0),
              evt("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", DeviceType.CUDA, self_device=20.0),
              evt("Memcpy DtoD (Device -> Device)", DeviceType.CUDA, self_device=3.0),
              evt("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", DeviceType.CUDA, self_device=7.0),
              evt("cudaLaunchKernel", DeviceType.CPU, self_cpu=50.0)]
    cuda = kernel_classes(events, cuda=True)
    assert cuda["matmul"] == 100.0 and cuda["copies"] == 3.0 and cuda["norms and elementwise"] == 7.0
    assert sum(cuda.values()) == 130.0
    cpu = kernel_classes(events, cuda=False)
    assert cpu["matmul"] == 30.0 and cpu["attention"] == 5.0 and sum(cpu.values()) == 35.0
