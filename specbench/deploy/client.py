"""The split's client (issue 78): the drafter in this process, the target behind a `RemoteVerifier` that speaks
protocol.py to specbench/deploy/server.py over TCP through the emulated link (link.py).

The engine's loop (specbench/decode/engine.py) runs unchanged: its verifier sends each step's tree and rebuilds, from
the server's answer (the accepted tokens, the next one, the crossing's 8-bit rows), what a LocalVerifier would have
given it: the acceptance (the target's choice known along the accepted path, so greedy_accept_rows walks the same
path), `decide`'s outcome with the client's own budget and EOS (the server cuts where the client does), and the rows
the drafter reads as TargetState.hidden. The client holds the target's weights only for what the drafter shares
(embeddings, LM head, MoA's TLI layers): the target's forward never runs here.

Per answer it measures the calls (verification forwards, the prefill excluded), the bytes each way per step (the
prompt's exchange apart), each step's round trip and the server's own time (TIMES) -> the link's share.
`link.disconnect_after_tokens = B`: once the answer holds B new tokens the link is cut and the engine asks the drafter
to finish alone (Drafter.continue_alone).
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specbench.decode.outcome import decide
from specbench.decode.rows import RowCounts, Rows
from specbench.decode.target import TargetModel
from specbench.decode.tree import ancestor_matrices
from specbench.decode.types import DraftTree
from specbench.decode.verifier import Crossing, Finished, Prefilled, Verified
from specbench.decode.verify import greedy_accept_rows
from specbench.deploy import protocol as P
from specbench.deploy.errors import LinkDown, PeerGone, ProtocolError
from specbench.deploy.link import LinkConfig, LinkedSocket, LinkModel
from specbench.deploy.protocol import AnswerMsg, MsgType, TreeMsg
from specbench.deploy.split import DeployConfig, crossing_of, identity
from specbench.deploy.tcp import Connection, client_handshake, connect
from specbench.errors import SpecbenchError


class ServerGone(SpecbenchError):
    """The server vanished mid-answer (not a disconnection the run asked for)."""


class RemoteVerifier:
    """One generation (batch 1) verified by the server over `conn`."""

    def __init__(self, client: "SplitClient", conn: Connection):
        self.client, self.conn, self.target = client, conn, client.target
        self.eos = torch.tensor(sorted(self.target.eos_token_ids), dtype=torch.long, device=self.target.device)
        self.online = True
        self.new_tokens = 0  # received from the server so far (the disconnection counts them)
        self.up: list[int] = []  # per step: the TREE frame's bytes
        self.down: list[int] = []  # per step: the ANSWER frame's bytes
        self.rtt: list[float] = []  # per step: TREE sent -> ANSWER read, seconds
        self.answered: list[int] = []  # per step: A, the tokens the ANSWER carried (accepted + next, uncut)
        self.prompt_bytes = (0, 0)  # (PROMPT up, PREFILL down)
        self.cut_at: int | None = None  # new tokens when the link was cut

    # ---- messages --------------------------------------------------------------------------------------------------
    def _send(self, kind: MsgType, payload: bytes, what: str) -> int:
        try:
            return self.conn.send(kind, payload)
        except (PeerGone, LinkDown) as e:
            raise ServerGone(f"the server is gone mid-answer ({what}): {e}") from None

    def _recv(self, kind: MsgType, what: str) -> bytes:
        try:
            return self.conn.expect(kind)[1]
        except (PeerGone, LinkDown) as e:
            raise ServerGone(f"the server is gone mid-answer ({what}): {e}") from None

    def _rows(self, msg: AnswerMsg) -> torch.Tensor | None:
        """The crossing's rows side by side, [1, R, sum of widths] in the target's dtype (None: nothing crossed)."""
        if not msg.activations:
            return None
        x = torch.cat([q.dequantise() for q in msg.activations], -1)
        return x[None].to(self.target.device, self.target.dtype)

    def _check_cut(self) -> None:
        b = self.client.link.disconnect_after_tokens
        if b is not None and self.online and self.new_tokens >= b:
            self.conn.link.cut()  # the server reads the close; this side finishes alone
            self.online, self.cut_at = False, self.new_tokens

    # ---- the verifier interface (specbench/decode/verifier.py) --------------------------------------------------------
    def prefill(self, prompts: list[list[int]], budgets: list[int], capacity: int, generators) -> Prefilled:
        del capacity, generators  # the server sizes its own cache; greedy
        (prompt,), (budget,) = prompts, budgets
        up = self._send(MsgType.PROMPT, P.encode_prompt(budget, prompt), "sending the prompt")
        payload = self._recv(MsgType.PREFILL, "the prompt's answer")
        msg = P.decode_answer(payload, self.client.needs, compressed=True)
        self.prompt_bytes = (up, P.HEADER_BYTES + len(payload))
        self.new_tokens = 1
        dev = self.target.device
        pre = Prefilled(torch.tensor([prompt], device=dev), msg.tokens.to(dev), None, self._rows(msg), None)
        self._check_cut()
        return pre

    def verify(self, tree: DraftTree, rows: Rows, limits: RowCounts) -> Verified:
        """The tree to the server, its answer back; the acceptance and outcome rebuilt here (module docstring)."""
        dev, n = self.target.device, tree.tokens.shape[1]
        tokens, parents = tree.tokens[0].cpu(), tree.parents[0].cpu()
        t0 = time.perf_counter()
        self.up.append(self._send(MsgType.TREE, P.encode_tree(TreeMsg(tokens, parents)), "sending a tree"))
        payload = self._recv(MsgType.ANSWER, "a step's answer")
        self.rtt.append(time.perf_counter() - t0)
        self.down.append(P.HEADER_BYTES + len(payload))
        msg = P.decode_answer(payload, self.client.needs)
        # the target's choice at the root and along the accepted path (-1 elsewhere: never a token)
        choice = torch.full((n + 1,), -1, dtype=torch.long)
        node, got = -1, msg.tokens.tolist()
        self.answered.append(len(got))
        for tok in got[:-1]:
            kids = [i for i in range(n) if parents[i] == node and tokens[i] == tok]
            if not kids:
                raise ProtocolError(f"the server accepted token {tok}, which the tree has no node for there")
            choice[node + 1], node = tok, kids[0]
        choice[node + 1] = got[-1]
        anc = ancestor_matrices(tree.parents)
        acc = greedy_accept_rows(tree.tokens, tree.parents, anc, choice[None].to(dev), tree.valid)
        out = decide(acc, tree.tokens, tree.parents, anc.sum(-1), tree.valid, limits.dev - rows.prefix.dev - 1,
                     self.eos)
        rows.ids.scatter_(1, rows.prefix.dev[:, None] + 1 + torch.arange(n + 1, device=dev), out.new)
        return Verified(tree, acc, out, None, self._rows(msg), None)

    def finish(self, step: Verified, rows: Rows, staged: torch.Tensor | None) -> Finished:
        del rows
        read = step.out.read(staged)
        accepted = RowCounts(tuple(st.accepted for st in read.rows), step.acc.length)
        self.new_tokens += len(read.rows[0].emitted)
        if read.rows[0].stop is None:
            self._check_cut()
        return Finished(read, accepted, step.hidden, None)

    def leave(self, step, rows) -> None:
        raise AssertionError("a split decodes one row")  # (the engine stops when its row is done)

    def kv(self) -> tuple[None, None]:
        return None, None  # the target's K/V stay on the server (MoA's crossing carries what it reads of them)

    def end(self, gens: list) -> None:
        """The answer is over: the server's seconds per step (TIMES), and the answer's measurements."""
        server = self.client.read_times(self) if self.online else []
        (gen,) = gens
        calls = len(self.rtt)
        cut = len(server) != calls  # (cut: the server never said)
        gen.split = {
            "calls": calls,
            "bytes_up": sum(self.up), "bytes_down": sum(self.down),
            "bytes_up_per_step": self.up, "bytes_down_per_step": self.down,
            "prompt_bytes_up": self.prompt_bytes[0], "prefill_bytes_down": self.prompt_bytes[1],
            "answer_tokens_per_step": self.answered,
            "round_trip_s": sum(self.rtt),
            "server_s": None if cut else sum(server),
            "link_s": None if cut else sum(r - s for r, s in zip(self.rtt, server)),
            "disconnected_at": self.cut_at,
            "alone_tokens": gen.alone_tokens,
            # what crossed per verified token (name, width), so Table 7's formula is read from the run itself
            "needs": [[a.name, a.width] for a in self.client.needs],
        }


class SplitClient:
    """The client's side of a run: the connection (made again after a cut), one RemoteVerifier per generation, and
    the server process when this run started it (stopped by its pid in `close`)."""

    def __init__(self, target: TargetModel, drafter, name: str, deploy: DeployConfig, link: LinkConfig, seed: int,
                 port: int, server: subprocess.Popen | None = None):
        if deploy.client_threads:
            torch.set_num_threads(deploy.client_threads)
        self.target, self.drafter, self.name, self.deploy, self.link = target, drafter, name, deploy, link
        self.seed, self.port, self.server = seed, port, server
        self.crossing: Crossing = crossing_of(drafter, name)
        self.hello = identity(drafter, name, target, self.crossing)
        self.needs = self.hello.needs
        self.conn: Connection | None = None
        self.connections = 0
        self._connect()  # the handshake before anything is decoded: a mismatch is refused in one line
        if self.crossing.client is not None:
            self.crossing.client()

    def _connect(self) -> None:
        sock = connect(self.deploy.host, self.port)
        link = LinkedSocket(sock, LinkModel(self.link, seed=self.seed + self.connections))
        self.conn = Connection(sock, link=link, timeout_s=self.deploy.timeout_s)
        self.connections += 1
        try:
            client_handshake(self.conn, self.hello)
        except SpecbenchError:
            self.conn.close()
            self.conn = None
            raise

    def verifier_for(self, drafter) -> RemoteVerifier:
        del drafter  # (the engine's; the split checked it at the start)
        if self.conn is None or self.conn.link.is_down:  # a cut link: the next answer on a new connection
            if self.conn is not None:
                self.conn.close()
            self._connect()
        return RemoteVerifier(self, self.conn)

    def read_times(self, v: RemoteVerifier) -> list[float]:
        try:
            return P.decode_times(self.conn.expect(MsgType.TIMES)[1])
        except (PeerGone, LinkDown) as e:
            raise ServerGone(f"the server is gone at an answer's end: {e}") from None

    def close(self) -> None:
        """BYE (the server stops), then the spawned server's process is waited for, or ended by its pid."""
        if self.conn is None or self.conn.link.is_down:  # (after a cut: a new connection to say BYE on)
            if self.conn is not None:
                self.conn.close()
            try:
                self._connect()
            except SpecbenchError:
                self.conn = None  # the server is gone already: stop it below
        if self.conn is not None:
            try:
                self.conn.send(MsgType.BYE)
                self.conn.expect(MsgType.BYE)
            except SpecbenchError:
                pass  # the server is gone already: stop it below
            self.conn.close()
        self.conn = None
        stop_server(self.server)


def stop_server(proc: subprocess.Popen | None, wait_s: float = 10.0) -> None:
    """Wait for a spawned server to stop; end it by its pid if it does not."""
    if proc is None:
        return
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=wait_s)


def spawn_server(spec: dict, deploy: DeployConfig, workdir: Path | None = None) -> tuple[subprocess.Popen, int]:
    """`python -m specbench.deploy.server --spec` as a child process; (the process, its port) once it listens. Its
    failure to start (a port in use, a drafter it cannot build) is its own one line. Its spec and log are written to
    `workdir` (a run's directory)."""
    d = Path(workdir or tempfile.mkdtemp(prefix="specbench-server-"))
    d.mkdir(parents=True, exist_ok=True)
    path = d / "server_spec.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": str(deploy.server_threads)}
    err = d / "server.log"
    with err.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "specbench.deploy.server", "--spec", str(path)],
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    deadline = time.monotonic() + deploy.startup_timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("listening "):
                return proc, int(line.split()[1])
        if proc.poll() is not None:
            lines = [x for x in err.read_text().splitlines() if x.startswith("error: ")]
            raise SpecbenchError(f"the server did not start: {lines[-1][7:] if lines else 'exit ' + str(proc.returncode)}"
                                 f" ({err})")
    proc.kill()
    proc.wait()
    raise SpecbenchError(f"the server did not listen within {deploy.startup_timeout_s} s ({err})")
