"""The split's server (issue 78): the target and a LocalVerifier behind a TCP port; `python -m specbench.deploy.server
--spec SPEC.json` (the client run writes SPEC and starts it, docs/deploy.md), or `serve` on a listener in a thread.

Per connection: the handshake (drafter, target and what crosses, checked before anything is decoded), then answers:
PROMPT -> PREFILL (the first token and the prompt's crossing rows, gzip-compressed), then TREE -> ANSWER (the accepted
tokens, the next token, their crossing rows, 8-bit) until the answer stops where the client's does (EOS or its
budget), then TIMES (the server's seconds per step). BYE ends the session and the server. The server builds the
drafter only for its declared crossing (MoA's Layer Self-Attention weights run here); it never drafts. Greedy only:
no draft probabilities cross (protocol.py).
"""
from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import time

import torch

from specbench.decode.engine import Generation, open_rows, target_state
from specbench.decode.rows import Row, Rows
from specbench.decode.target import TargetModel
from specbench.decode.types import DraftTree, SamplingParams, TargetState
from specbench.decode.verifier import LocalVerifier, layer_ids
from specbench.deploy import protocol as P
from specbench.deploy.errors import LinkDown, PeerGone, ProtocolError, Refused
from specbench.deploy.link import LinkConfig, LinkedSocket, LinkModel
from specbench.deploy.protocol import MsgType
from specbench.deploy.split import crossing_of, identity
from specbench.deploy.tcp import Connection, listen, server_handshake
from specbench.errors import SpecbenchError

log = logging.getLogger("specbench.deploy.server")


class SplitServer:
    """Answers one client at a time for one (target, drafter) pair."""

    def __init__(self, target: TargetModel, drafter, name: str):
        self.target, self.drafter = target, drafter
        self.crossing = crossing_of(drafter, name)
        self.hello = identity(drafter, name, target, self.crossing)
        self.sampling = SamplingParams()  # greedy: no draft probabilities cross

    def handle(self, conn: Connection) -> bool:
        """One connection's session; True when the client ended it for good (BYE)."""
        server_handshake(conn, self.hello)
        while True:
            kind, payload = conn.expect(MsgType.PROMPT, MsgType.BYE)
            if kind == MsgType.BYE:
                conn.send(MsgType.BYE)
                return True
            budget, prompt = P.decode_prompt(payload)
            self.answer(conn, budget, prompt.tolist())

    def _rows(self, state: TargetState) -> list[torch.Tensor]:
        return [] if self.crossing.server is None else self.crossing.server(state)

    @torch.inference_mode()
    def answer(self, conn: Connection, budget: int, prompt: list[int]) -> None:
        """One prompt, step by step, as the engine's loop would verify it (the same LocalVerifier)."""
        target = self.target
        v = LocalVerifier(target, self.sampling, self.drafter.needs, layer_ids(self.drafter))
        opened = open_rows(v, [prompt], [budget], [None], target.max_positions)  # as the engine opens its rows
        pre, limits = opened.pre, opened.limits
        rows = Rows([Row(0, Generation([], len(prompt), 0.0, 0.0), budget, None, None)], opened.ids, opened.prefix)
        first = int(pre.first[0])
        acts = self._rows(target_state(rows, pre.hidden, rows.prefix, v))
        conn.send(MsgType.PREFILL, P.encode_answer([first], acts, self.hello.needs, compress=True))
        times: list[float] = []
        left = budget - 1
        if first in target.eos_token_ids or left <= 0:
            conn.send(MsgType.TIMES, P.encode_times(times))
            return
        while True:
            _, payload = conn.expect(MsgType.TREE)
            t0 = time.perf_counter()
            msg = P.decode_tree(payload)
            m = len(msg.tokens)
            chain = bool((msg.parents == torch.arange(-1, m - 1)).all())
            tree = DraftTree(msg.tokens[None].to(target.device), msg.parents[None].to(target.device), is_chain=chain)
            step = v.verify(tree, rows, limits)
            fin = v.finish(step, rows, None)
            st = fin.read.rows[0]
            a = st.accepted + 1  # the accepted tokens then the next one, uncut (the client cuts as it decides)
            start = rows.prefix[0] + 1
            tokens = rows.ids[0, start : start + a]
            rows.prefix = rows.prefix + (fin.accepted + 1)
            acts = self._rows(target_state(rows, fin.hidden, fin.accepted + 1, v))
            body = P.encode_answer(tokens, acts, self.hello.needs)
            times.append(time.perf_counter() - t0)
            conn.send(MsgType.ANSWER, body)
            if st.stop is not None:
                conn.send(MsgType.TIMES, P.encode_times(times))
                return


def serve(listener: socket.socket, server: SplitServer, link: LinkConfig, seed: int, accept_timeout_s: float,
          timeout_s: float = 120.0, connections: int = 1000) -> None:
    """Accept clients one after the other until one says BYE, none comes within accept_timeout_s, or `connections`
    were served (bounded by design). A client gone mid-answer (a disconnection, a crash) ends its connection only."""
    listener.settimeout(accept_timeout_s)
    for i in range(connections):
        try:
            sock, _ = listener.accept()
        except socket.timeout:
            log.info("no client within %.0f s: the server stops", accept_timeout_s)
            return
        conn = Connection(sock, link=LinkedSocket(sock, LinkModel(link, seed=seed + 1000 + i)), timeout_s=timeout_s)
        try:
            if server.handle(conn):
                return
        except (PeerGone, LinkDown, ProtocolError, Refused) as e:
            log.info("client %d: %s", i, e)
        finally:
            conn.close()


def build(spec: dict) -> tuple[TargetModel, object]:
    """The target and the drafter a SPEC names (the client's resolved config: model, drafter, seed)."""
    from hydra.utils import instantiate

    from specbench.core.config import ModelConfig, to_dataclass
    from specbench.core.models import load_model

    model_cfg = to_dataclass(ModelConfig, spec["model"])
    model, tok, device = load_model(model_cfg)
    target = TargetModel(model, tok, device, model_cfg.name)
    torch.manual_seed(spec["seed"])  # an untrained module is built from the run's seed, as the client's
    try:
        drafter = instantiate(spec["drafter"], target=target, _convert_="object")
    except Exception as e:  # noqa: BLE001 - Hydra wraps constructor errors; report them in one line
        cause = e.__cause__ or e
        raise SpecbenchError(f"the server could not build drafter {spec['name']!r}: {cause}") from None
    return target, drafter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specbench.deploy.server",
                                     description="the target side of deploy=client_server (docs/deploy.md)")
    parser.add_argument("--spec", required=True, help="the JSON the client run writes: model, drafter, link, deploy")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="server: %(message)s", stream=sys.stderr)
    try:
        spec = json.loads(open(args.spec).read())
        deploy = spec["deploy"]
        torch.set_num_threads(int(deploy["server_threads"]))
        link = LinkConfig(**spec["link"])
        link.check()
        listener = listen(deploy["host"], int(deploy["port"]))  # before loading: a port in use fails at once
        target, drafter = build(spec)
        server = SplitServer(target, drafter, spec["name"])
        print(f"listening {listener.getsockname()[1]}", flush=True)  # the client reads the port here
        serve(listener, server, link, int(spec["seed"]), float(deploy["accept_timeout_s"]),
              float(deploy["timeout_s"]))
    except SpecbenchError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
