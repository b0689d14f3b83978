"""What both sides of a client-server split agree on (issue 78): the deploy config, which drafters can run split and
what crosses for them (Drafter.crossing, specbench/decode/verifier.py's Crossing), and each side's identity for the
handshake.

A drafter runs split when it declares `crossing()` (sd: nothing; the EAGLE family: the last hidden state; MoA: its
Layer Self-Attention's output and the TLI layers' K/V, drafters/moa.py) and `continue_alone()` (the disconnection);
any other is refused in one line before anything is decoded.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from specbench.decode.drafter import LAYERS
from specbench.decode.verifier import Crossing
from specbench.deploy.protocol import ActivationSpec, Hello
from specbench.errors import SpecbenchError

DEPLOYS = ("local", "client_server")


@dataclass
class DeployConfig:
    """conf/deploy/*.yaml."""

    name: str = "local"  # local: the target in this process; client_server: in a server process (docs/deploy.md)
    host: str = "127.0.0.1"  # the server's address (loopback by default; another machine's to split across hosts)
    port: int = 0  # 0: a free port the spawned server picks and reports
    client_threads: int = 1  # torch threads of each side (a 2-core machine: one each)
    server_threads: int = 1
    spawn: bool = True  # the client run starts the server itself (false: one already listens at host:port)
    accept_timeout_s: float = 120.0  # how long the server waits for its next client before it stops
    startup_timeout_s: float = 300.0  # how long the client waits for a spawned server to listen (loading the target)
    timeout_s: float = 120.0  # a read that waits longer is a server gone

    def check(self) -> None:
        if self.name not in DEPLOYS:
            raise SpecbenchError(f"deploy.name={self.name!r} is not one of {', '.join(DEPLOYS)}")
        if self.name == "client_server" and not self.spawn and self.port == 0:
            raise SpecbenchError("deploy.spawn=false connects to a server already listening: give its deploy.port "
                                 "(and deploy.host)")
        if not 0 <= self.port < 65536 or self.client_threads < 1 or self.server_threads < 1:
            raise SpecbenchError(f"deploy: port={self.port} must be in 0..65535 and client_threads="
                                 f"{self.client_threads}, server_threads={self.server_threads} at least 1")


def crossing_of(drafter, name: str) -> Crossing:
    """The drafter's declared crossing, or one line saying why it cannot run split."""
    if not callable(getattr(drafter, "crossing", None)) or not callable(getattr(drafter, "continue_alone", None)):
        raise SpecbenchError(f"drafter {name!r} does not run split (deploy=client_server): it declares no crossing "
                             f"(what the server sends it per token) or no continue_alone; the split runs sd, "
                             f"eagle2, moa, moa_tli1 (docs/deploy.md), or use deploy=local")
    if LAYERS in drafter.needs:
        raise SpecbenchError(f"drafter {name!r} reads the target's middle layers (EAGLE-3's features), which no "
                             f"crossing declares: it does not run split; use deploy=local")
    return drafter.crossing()


def needs_of(crossing: Crossing) -> tuple[ActivationSpec, ...]:
    return tuple(ActivationSpec(n, w) for n, w in crossing.specs)


def digest(module: torch.nn.Module | None, *extra: str) -> str:
    """A short digest of a module's parameters (and `extra` strings): both sides must hold the same weights."""
    h = hashlib.sha256("|".join(extra).encode())
    if module is not None:
        for name, p in sorted(module.state_dict().items()):
            h.update(name.encode())
            h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def drafter_module(drafter) -> torch.nn.Module | None:
    """The drafter's own weights (what the digest covers): its net, head or model, whichever it holds."""
    for attr in ("net", "head", "model"):
        m = getattr(drafter, attr, None)
        if isinstance(m, torch.nn.Module):
            return m
    return None


def identity(drafter, name: str, target, crossing: Crossing) -> Hello:
    """A side's HELLO: the drafter's name and weights, the target's name and weights, what crosses."""
    return Hello(drafter=f"{name}@{digest(drafter_module(drafter))}", target=target.name,
                 target_hash=digest(target.model), needs=needs_of(crossing))
