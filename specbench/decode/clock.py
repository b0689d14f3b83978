"""Per-phase times of the decode loop (draft, verify, each row's end) without a device drain per phase.

A step used to synchronise after the drafter proposed and again after verification, so that the host clock saw each
phase's device work: two queue drains per step on a GPU, each idling the device while the host launched the next
phase. The step's one host read (the trees and their outcomes, Engine.generate_batch) is the only wait now; the
phases are marked where they end and read once, when the generation ends:
  - one CUDA device: a timing event per mark on the current stream; a phase's seconds are the device time between
    its events (the device's timeline: what it spent on the phase, idle gaps between launches included);
  - a CPU (ops run as they are called): the host clock at each mark;
  - several devices (model.device_map): each mark drains every device, then reads the host clock (an event on one
    device's stream does not wait for another's), as before.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specbench.decode.roundtrips import count_sync

Mark = "float | torch.cuda.Event"


def sync(device: torch.device | tuple[torch.device, ...]) -> None:
    """Wait for queued device work, so that the clock measures it: on every device a target spread over several
    (model.device_map) computes on, not only the engine's. Counted by HostRoundTrips (a drain on a GPU, whatever the
    device here)."""
    count_sync()
    for d in device if isinstance(device, tuple) else (device,):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


@dataclass
class StepClock:
    """Marks taken in the loop, turned into seconds by `resolve` (one wait, at the generation's end). Start it after
    the prefill's synchronisation: `start` is the loop's zero, at `offset` seconds of the generation's clock."""

    devices: tuple[torch.device, ...]
    offset: float = 0.0  # the generation's seconds before the loop (its prefill)
    steps: list = field(default_factory=list)  # (draft start, draft end = verify start, verify end, the step's rows)
    ends: list = field(default_factory=list)  # (a finished row's Generation, the mark of its end)

    def __post_init__(self):
        cuda = [d for d in self.devices if d.type == "cuda"]
        self.events = len(cuda) == 1 and len(self.devices) == 1
        self.drain = bool(cuda) and not self.events
        self.start = self.mark()

    def mark(self) -> Mark:
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        if self.drain:
            sync(self.devices)
        return time.perf_counter()

    def seconds(self, a: Mark, b: Mark) -> float:
        return a.elapsed_time(b) / 1e3 if self.events else b - a

    def step(self, draft: Mark, verify: Mark, end: Mark, gens: list) -> None:
        """One step: every live row took part in its draft (draft -> verify) and its verification (verify -> end)."""
        self.steps.append((draft, verify, end, gens))

    def finish(self, gen, at: Mark) -> None:
        self.ends.append((gen, at))

    def resolve(self) -> None:
        """Wait once for the marks, then add each step's phases to its rows and set each finished row's wall_s."""
        if self.events:
            sync(self.devices)
        for draft, verify, end, gens in self.steps:
            d, v = self.seconds(draft, verify), self.seconds(verify, end)
            for gen in gens:
                gen.draft_s += d
                gen.verify_s += v
        for gen, at in self.ends:
            gen.wall_s = self.offset + self.seconds(self.start, at)
        self.steps, self.ends = [], []
