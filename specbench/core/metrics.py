"""The counters every method is measured by, defined once.

- tokens/s = new tokens / wall seconds of the turn (prefill included; the same counter for every method); at
  decoding.batch_size > 1, the batch's throughput: its rows' new tokens / its wall seconds;
- speedup = method tokens/s / baseline tokens/s, the baseline (drafter=none) run in the same job on the same device
  (at the same batch size); with bench.paired, the baseline's tokens/s from its decodes beside each of the run's
  turns instead (speedup_against: paired; the baseline run's ratio kept as speedup_vs_baseline_run);
- tau = new tokens per target verification step, the bonus/recovered token included (the prefill's first token is
  not a step); micro = over all steps of the run, macro = mean of per-turn tau;
- alpha[d-1] = accepted / tried at draft depth d (chain: EAGLE's (d-1)-alpha, acceptance at position d given 0..d-1
  accepted; tree: per depth);
- Leviathan et al. Thm 3.8: predicted improvement (1 - a^(g+1)) / ((1 - a)(g c + 1)) with a = mean alpha,
  g = chain length, c = draft time per drafted token / baseline target time per step; chains only.
"""
from __future__ import annotations

import math
import os
import resource
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch


class PeakMemory:
    """Peak memory of one turn. On CUDA: the allocator's peak on every device the target uses (summed, and per device
    where there are several: a device map), and NVML's device-wide `used` after the turn (not a peak: NVML keeps
    none; it includes other processes and the allocator's cache), looked up by the device's UUID, which names the
    same GPU whatever CUDA_VISIBLE_DEVICES renumbers. On the CPU: the process's peak RSS (VmHWM, reset per turn)."""

    def __init__(self, device: torch.device | tuple[torch.device, ...]):
        devices = device if isinstance(device, tuple) else (device,)
        self.cuda = [d for d in devices if d.type == "cuda"]
        self.device = devices[0]
        self._nvml: list = []
        if self.cuda:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = [nvml_handle(pynvml, d) for d in self.cuda]
            except Exception:  # noqa: BLE001 - NVML missing or unsupported: keep the allocator counter only
                self._nvml = []

    def reset(self) -> None:
        if self.cuda:
            for d in self.cuda:
                torch.cuda.reset_peak_memory_stats(d)
        else:
            try:  # "5" resets the peak resident set size of this process (Linux >= 4.0)
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                pass

    def read(self) -> dict[str, Any]:
        if self.cuda:
            peaks = [torch.cuda.max_memory_allocated(d) for d in self.cuda]
            out: dict[str, Any] = {"peak_mem_bytes": sum(peaks)}
            if len(peaks) > 1:
                out["peak_mem_bytes_per_device"] = peaks
            if self._nvml:
                import pynvml

                out["nvml_used_bytes_after"] = sum(int(pynvml.nvmlDeviceGetMemoryInfo(h).used) for h in self._nvml)
            return out
        return {"peak_mem_bytes": _peak_rss()}


def nvml_handle(pynvml, device: torch.device):
    """NVML's handle of a CUDA device by its UUID (torch numbers devices after CUDA_VISIBLE_DEVICES, NVML does not)."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")


def _peak_rss() -> int:
    try:
        for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def mean_std(xs: list[float]) -> dict[str, float | None]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def leviathan_improvement(alpha: float, gamma: float, c: float) -> float:
    """Expected walltime improvement factor of Algorithm 1 (Leviathan et al. 2023, Theorem 3.8)."""
    if alpha >= 1.0:
        return (gamma + 1) / (gamma * c + 1)
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def per_repeat_speed(records: list[dict]) -> dict[int, float]:
    """New tokens per second of decoding, per repeat. Rows decoded together (decoding.batch_size > 1, their record's
    `batch`) share one clock: their batch's wall time counts once, so this is the batch's throughput."""
    toks: dict[int, int] = defaultdict(int)
    wall: dict[int, float] = defaultdict(float)
    seen: set[str] = set()
    for r in records:
        toks[r["repeat"]] += r["new_tokens"]
        batch = r.get("batch")
        if batch is None:
            wall[r["repeat"]] += r["wall_s"]
        elif batch["id"] not in seen:
            seen.add(batch["id"])
            wall[r["repeat"]] += batch["wall_s"]
    return {k: toks[k] / wall[k] for k in toks if wall[k] > 0}


def paired_speed(records: list[dict]) -> dict[int, float] | None:
    """The baseline's new tokens per second per repeat from its decodes beside each turn (bench.paired: a record's
    `paired`, or its batch's, counted once per batch); None unless every decoded record has one."""
    toks: dict[int, int] = defaultdict(int)
    wall: dict[int, float] = defaultdict(float)
    seen: set[str] = set()
    for r in records:
        batch = r.get("batch")
        paired = batch.get("paired") if batch else r.get("paired")
        if paired is None:
            if r.get("steps"):  # a decoded turn without its pair: a run partly decoded before bench.paired
                return None
            continue
        if batch is not None:
            if batch["id"] in seen:
                continue
            seen.add(batch["id"])
        toks[r["repeat"]] += paired["new_tokens"]
        wall[r["repeat"]] += paired["wall_s"]
    return {k: toks[k] / wall[k] for k in toks if wall[k] > 0} or None


def _total_wall(records: list[dict]) -> float:
    """Seconds of decoding: a batch's wall time once for all its rows."""
    batches = {r["batch"]["id"]: r["batch"]["wall_s"] for r in records if r.get("batch")}
    return sum(r["wall_s"] for r in records if not r.get("batch")) + sum(batches.values())


def _shared_total(records: list[dict], key: str) -> float:
    """Seconds a batch's rows spent together (its prefill, its drafting and verification: every row of a step is
    drafted and verified in the same forwards) counted once per batch: the longest of its rows' (the row that stayed
    longest took part in every step); a row of its own counts as it is."""
    per_batch: dict[str, float] = {}
    alone = 0.0
    for r in records:
        if r.get("batch"):
            per_batch[r["batch"]["id"]] = max(per_batch.get(r["batch"]["id"], 0.0), r[key])
        else:
            alone += r[key]
    return alone + sum(per_batch.values())


def split_summary(records: list[dict]) -> dict[str, Any] | None:
    """deploy=client_server (specbench/deploy/client.py): calls to the server per answer (verification forwards, the
    prefill excluded), bytes up and down per step and per answer (the prompt's exchange apart), and each step's time
    split into client drafting, server verification and the link (the round trip less the server's own time)."""
    rows = [r for r in records if r.get("split")]
    if not rows:
        return None
    s = [r["split"] for r in rows]
    calls = sum(x["calls"] for x in s)
    # the time split over the answers the server finished (a cut one never reports the server's times)
    whole = [(r, x) for r, x in zip(rows, s) if x["disconnected_at"] is None]
    steps = sum(x["calls"] for _, x in whole)
    ms = lambda total: 1e3 * total / steps if steps else None  # noqa: E731
    return {
        "answers": len(s),
        "calls_per_answer": mean_std([x["calls"] for x in s]),
        "bytes_up_per_step": sum(x["bytes_up"] for x in s) / calls if calls else None,
        "bytes_down_per_step": sum(x["bytes_down"] for x in s) / calls if calls else None,
        "bytes_up_per_answer": mean_std([x["bytes_up"] for x in s]),
        "bytes_down_per_answer": mean_std([x["bytes_down"] for x in s]),
        "prompt_bytes_up_per_answer": mean_std([x["prompt_bytes_up"] for x in s]),
        "prefill_bytes_down_per_answer": mean_std([x["prefill_bytes_down"] for x in s]),
        # a step's time: the client's drafting, the server's verification, the link (round trip - server)
        "draft_ms_per_step": ms(sum(r["draft_s"] for r, _ in whole)),
        "server_ms_per_step": ms(sum(x["server_s"] for _, x in whole)),
        "link_ms_per_step": ms(sum(x["link_s"] for _, x in whole)),
        "round_trip_ms_per_step": ms(sum(x["round_trip_s"] for _, x in whole)),
        "disconnected": sum(x["disconnected_at"] is not None for x in s),
        "alone_tokens": sum(x["alone_tokens"] for x in s),
    }


def summarize(records: list[dict], baseline: list[dict] | None) -> dict[str, Any]:
    """Per-dataset means and std over repeats, and the SD metrics (see the module docstring)."""
    speed = per_repeat_speed(records)
    steps = sum(r["steps"] for r in records)
    step_tokens = sum(sum(r["tokens_per_step"]) for r in records)
    depth = max((len(r["depth_trials"]) for r in records), default=0)
    trials = [sum(r["depth_trials"][d] for r in records if d < len(r["depth_trials"])) for d in range(depth)]
    accepts = [sum(r["depth_accepts"][d] for r in records if d < len(r["depth_accepts"])) for d in range(depth)]
    drafted = sum(sum(r["tree_sizes"]) for r in records)
    out: dict[str, Any] = {
        "turns": len(records),
        "repeats": len(speed),
        "new_tokens": sum(r["new_tokens"] for r in records),
        "tokens_per_s": mean_std(list(speed.values())),
        "total_tokens_per_total_s": sum(r["new_tokens"] for r in records) / max(_total_wall(records), 1e-12),
        "wall_s_per_turn": mean_std([r["wall_s"] for r in records]),
        "steps": steps,
        "tau_micro": step_tokens / steps if steps else None,
        "tau_macro": mean_std([r["tau"] for r in records if r["steps"]])["mean"],
        "alpha": [a / t if t else None for a, t in zip(accepts, trials)],
        "alpha_trials": trials,
        "draft_s": _shared_total(records, "draft_s"),
        "verify_s": _shared_total(records, "verify_s"),
        "prefill_s": _shared_total(records, "prefill_s"),
        "wall_s": _total_wall(records),
        # (at batch B, per row-step: a step's drafting and its batched forward shared by the rows in it)
        "draft_ms_per_step": 1e3 * _shared_total(records, "draft_s") / steps if steps else None,
        "verify_ms_per_step": 1e3 * _shared_total(records, "verify_s") / steps if steps else None,
        "mean_tree_size": drafted / steps if steps else None,
        "peak_mem_bytes": max((r["peak_mem_bytes"] or 0 for r in records), default=None),
    }
    sizes = [r["batch"]["size"] for r in records if r.get("batch")]
    if sizes:  # decoding.batch_size > 1 (absent at batch 1: older summaries stay as they are)
        out["batch"] = {"batches": len({r["batch"]["id"] for r in records if r.get("batch")}),
                        "mean_size": statistics.fmean(sizes), "max_size": max(sizes)}
    cut = sum(r.get("stopped_by") == "context" for r in records)
    if cut:  # turns whose budget the target's context cut short (absent when none: older summaries stay as they are)
        out["stopped_by_context"] = cut
    split = split_summary(records)
    if split:  # deploy=client_server (absent otherwise: local summaries stay as they are)
        out["split"] = split
    compared = [r for r in records if r.get("matches_baseline") is not None]
    out["lossless"] = {
        "compared": len(compared),
        "matches": sum(bool(r["matches_baseline"]) for r in compared),
        "rate": sum(bool(r["matches_baseline"]) for r in compared) / len(compared) if compared else None,
    }
    after = sum(bool(r.get("after_divergence")) for r in records)
    if after:  # turns whose prompt already held a diverged earlier answer: not compared (absent when none)
        out["lossless"]["not_compared_after_divergence"] = after
    classified = [r["divergence"]["kind"] for r in compared if r.get("divergence")]
    if classified:  # specbench/bench/divergence.py: near-ties of the dtype's rounding vs mismatches
        out["lossless"]["divergences"] = {k: classified.count(k) for k in ("near_tie", "mismatch", "unclassified")
                                          if k != "unclassified" or k in classified}
    paired = paired_speed(records)
    if baseline:
        b_speed = per_repeat_speed(baseline)
        b_mean = statistics.fmean(b_speed.values())
        ratios = [speed[k] / b_speed[k] for k in speed if k in b_speed] or [s / b_mean for s in speed.values()]
        out["baseline_tokens_per_s"] = b_mean
        out["speedup"] = mean_std(ratios)
    if paired:  # bench.paired: against the baseline decoded beside each turn (seconds apart; absent otherwise, so that
        # older summaries stay as they are)
        if "speedup" in out:
            out["speedup_vs_baseline_run"] = out["speedup"]
        out["paired_baseline_tokens_per_s"] = statistics.fmean(paired.values())
        out["speedup"] = mean_std([speed[k] / paired[k] for k in speed if k in paired])
        out["speedup_against"] = "paired"
    if baseline:
        b_steps = sum(r["steps"] for r in baseline)
        target_step_s = sum(r["verify_s"] for r in baseline) / b_steps if b_steps else None
        chain = all(r.get("chain", False) for r in records)
        if chain and steps and drafted and target_step_s and trials and sum(trials) and not sizes:  # (batch 1 only)
            a = sum(accepts) / sum(trials)
            g = drafted / steps
            c = (out["draft_s"] / drafted) / target_step_s
            out["leviathan"] = {
                "alpha": a,
                "gamma": g,
                "c": c,
                "predicted_improvement": leviathan_improvement(a, g, c),
                "measured_speedup": out["speedup"]["mean"],
            }
    return out
