"""The client-server protocol (specbench/deploy/protocol.py) and its TCP framing (specbench/deploy/tcp.py), issue 78:
messages round-trip; their sizes are Table 7's formulas plus the declared overhead; activations are int8 with the
declared error bound; a version, drafter or target mismatch is refused in one line; over loopback: an exchange, a port
in use, a server killed mid-message (by pid), a link cut."""
from __future__ import annotations

import gzip
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specbench.deploy import protocol as P
from specbench.deploy.errors import LinkDown, PeerGone, PortInUse, ProtocolError, Refused
from specbench.deploy.link import LinkConfig, LinkedSocket, LinkModel
from specbench.deploy.protocol import ActivationSpec, Hello, MsgType, TreeMsg
from specbench.deploy.tcp import Connection, client_handshake, connect, listen, serve, server_handshake
from specbench.errors import SpecbenchError

# SmolLM2-135M (the embedded target): hidden 576, 3 KV heads x 64; Llama-3-8B (the paper's): 4096, 8 x 128
DIMS = {"smollm2-135m": (576, 192), "llama3-8b": (4096, 1024)}


def needs_for(kind: str, e: int, e_kv: int, tli: int = 0) -> tuple[ActivationSpec, ...]:
    if kind == "eagle":
        return (ActivationSpec("hidden", e),)
    if kind == "moa":  # the keys and values of TLI + 1 layers (Table 7's 2 E_kv (TLI + 1))
        return tuple(ActivationSpec(f"{kv}{layer}", e_kv) for layer in range(tli + 1) for kv in "kv")
    return ()


# ------------------------------------------------------------------------------------------------------ encoding

def test_tokens_take_three_bytes():
    ids = [0, 1, 255, 256, 49151, 128255, (1 << 24) - 1]
    raw = P.encode_tokens(torch.tensor(ids))
    assert len(raw) == 3 * len(ids) and raw[6:9] == b"\x00\x00\xff"
    assert P.decode_tokens(raw).tolist() == ids
    for bad in (1 << 24, -1):
        with pytest.raises(ProtocolError, match="does not fit 3 bytes"):
            P.encode_tokens([5, bad])


def test_a_tree_is_four_bytes_per_node():
    tree = TreeMsg(tokens=torch.tensor([0x010203, 7, 8, 9]), parents=torch.tensor([-1, 0, 0, 2]))
    raw = P.encode_tree(tree)
    assert raw == b"\x01\x02\x03\x00" + b"\x00\x00\x07\x01" + b"\x00\x00\x08\x01" + b"\x00\x00\x09\x03"
    back = P.decode_tree(raw)
    assert back.tokens.tolist() == tree.tokens.tolist() and back.parents.tolist() == tree.parents.tolist()
    assert P.decode_tree(P.encode_tree(TreeMsg(torch.tensor([], dtype=torch.long),
                                               torch.tensor([], dtype=torch.long)))).tokens.numel() == 0
    big = TreeMsg(tokens=torch.arange(255), parents=torch.arange(255) - 1)  # a 255-node chain: the most one byte holds
    assert len(P.encode_tree(big)) == 4 * 255 and P.decode_tree(P.encode_tree(big)).parents.tolist() == list(range(-1, 254))
    with pytest.raises(ProtocolError, match="at most 255"):
        P.encode_tree(TreeMsg(tokens=torch.arange(256), parents=torch.arange(256) - 1))
    with pytest.raises(ProtocolError, match="after their parents"):
        P.encode_tree(TreeMsg(tokens=torch.tensor([1, 2]), parents=torch.tensor([1, -1])))
    with pytest.raises(ProtocolError, match="malformed TREE"):
        P.decode_tree(b"\x00\x00\x01\x02")  # node 0 claims parent 1


@given(st.lists(st.tuples(st.integers(0, (1 << 24) - 1), st.integers(0, 1 << 10)), max_size=255))
def test_any_tree_round_trips(nodes):
    """Any topologically ordered tree (each parent drawn among the earlier nodes, or the root) of up to 255 nodes."""
    tokens = torch.tensor([t for t, _ in nodes], dtype=torch.long)
    parents = torch.tensor([r % (i + 1) - 1 for i, (_, r) in enumerate(nodes)], dtype=torch.long)
    raw = P.encode_tree(TreeMsg(tokens, parents))
    back = P.decode_tree(raw)
    assert len(raw) == 4 * len(nodes)
    assert back.tokens.tolist() == tokens.tolist() and back.parents.tolist() == parents.tolist()


def test_quantisation_is_per_row_absmax_int8_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(16, 576) * torch.logspace(-3, 2, 16)[:, None]  # rows of very different scales
    x[3] = 0.0
    qr = P.quantise_rows(x)
    assert qr.q.dtype == torch.int8 and qr.scale.dtype == torch.float16 and qr.scale.shape == (16,)
    assert int(qr.q.abs().max()) == 127 and int(qr.q[3].abs().max()) == 0 and float(qr.scale[3]) == 0
    err = (qr.dequantise() - x).abs()
    bound = qr.scale.float()[:, None] / 2 * (1 + 1e-3) + 1e-12
    assert bool((err <= bound).all())
    assert float(err.max()) > 0  # (it is lossy: the test could fail)
    for bad in (float("inf"), float("nan")):
        y = x.clone()
        y[0, 0] = bad
        with pytest.raises(ProtocolError, match="non-finite activations"):
            P.quantise_rows(y)


@pytest.mark.parametrize("model", sorted(DIMS))
@pytest.mark.parametrize("kind, tli", [("eagle", 0), ("moa", 0), ("moa", 1), ("moa", 3), ("independent", 0)])
def test_message_sizes_are_table7_plus_the_declared_overhead(model, kind, tli):
    """Client: 4M + the 8-byte header. Server: 3A + A * (E | 2 E_kv (TLI + 1) | 0) + 8 (header) + 6 (A, R) + 2 bytes
    of fp16 scale per row per tensor."""
    e, e_kv = DIMS[model]
    needs = needs_for(kind, e, e_kv, tli)
    widths = [s.width for s in needs]
    paper = {"eagle": lambda a: 3 * a + a * e, "moa": lambda a: 3 * a + 2 * a * e_kv * (tli + 1),
             "independent": lambda a: 3 * a}[kind]
    for m in (1, 10, 60):
        tree = TreeMsg(tokens=torch.randint(0, 49152, (m,)), parents=torch.arange(m) - 1)
        assert len(P.frame(MsgType.TREE, P.encode_tree(tree))) == P.table7_client_bytes(m) + P.tree_overhead() == 4 * m + 8
    for a in (1, 3, 7):
        acts = [torch.randn(a, w) for w in widths]
        wire = len(P.frame(MsgType.ANSWER, P.encode_answer(torch.arange(a), acts, needs)))
        assert P.table7_server_bytes(a, widths) == paper(a)
        assert wire == paper(a) + P.answer_overhead(a, len(needs)) == paper(a) + 14 + 2 * a * len(needs)


def test_an_answer_round_trips():
    needs = needs_for("moa", 576, 192, tli=1)
    torch.manual_seed(1)
    acts = [torch.randn(4, s.width) for s in needs]
    msg = P.decode_answer(P.encode_answer([11, 12, 13, 49151], acts, needs), needs)
    assert msg.tokens.tolist() == [11, 12, 13, 49151]
    assert len(msg.activations) == 4
    for got, x in zip(msg.activations, acts):
        assert got.q.shape == (4, 192)
        assert torch.allclose(got.dequantise(), x, atol=float(x.abs().max()) / 127)
    with pytest.raises(ProtocolError, match="declared"):
        P.encode_answer([1], [torch.randn(1, 100)], needs[:1])
    with pytest.raises(ProtocolError, match="malformed ANSWER"):
        P.decode_answer(P.encode_answer([1], [torch.randn(1, 192)], needs[:1])[:-1], needs[:1])
    with pytest.raises(ProtocolError, match="left over"):
        P.decode_answer(P.encode_answer([1], [torch.randn(1, 192)], needs[:1]) + b"\x00", needs[:1])


def test_the_prefill_is_gzipped_after_quantisation():
    """The prompt's activations (R = the prompt's length, A = 1): the payload is gzip of the ANSWER layout,
    byte-identical across calls (mtime 0), and smaller than the raw layout for activation-like values."""
    needs = needs_for("eagle", 576, 192)
    torch.manual_seed(2)
    prompt_acts = [torch.randn(200, 576)]
    raw = P.encode_answer([42], prompt_acts, needs)
    packed = P.encode_answer([42], prompt_acts, needs, compress=True)
    assert gzip.decompress(packed) == raw and P.encode_answer([42], prompt_acts, needs, compress=True) == packed
    assert len(packed) < 0.95 * len(raw)
    msg = P.decode_answer(packed, needs, compressed=True)
    assert msg.tokens.tolist() == [42] and msg.activations[0].q.shape == (200, 576)
    assert len(raw) == 3 + 200 * 576 + 6 + 2 * 200  # the rows' scales: R of them, not A
    with pytest.raises(ProtocolError, match="malformed PREFILL: not gzip data"):
        P.decode_answer(raw, needs, compressed=True)


def test_hello_round_trips_and_mismatches_are_refused_in_one_line():
    ours = Hello("moa", "smollm2-135m", "sha256:ab12", needs_for("moa", 576, 192, tli=1))
    assert P.decode_hello(P.encode_hello(ours)) == ours
    assert P.decode_hello(P.encode_hello(Hello("sd", "t", "h"))) == Hello("sd", "t", "h")
    P.check_peer(ours, ours)
    cases = [(Hello("eagle2", ours.target, ours.target_hash, ours.needs), "drafter mismatch: this side runs 'moa', the peer 'eagle2'"),
             (Hello("moa", "llama3-8b", ours.target_hash, ours.needs), "target mismatch: this side runs 'smollm2-135m'"),
             (Hello("moa", ours.target, "sha256:ffff", ours.needs), r"target mismatch: .*\(sha256:ab12\), the peer 'smollm2-135m' \(sha256:ffff\)"),
             (Hello("moa", ours.target, ours.target_hash, ours.needs[:2]), r"activation mismatch for drafter 'moa': this side expects k0\[192\], v0\[192\], k1\[192\], v1\[192\], the peer k0\[192\], v0\[192\]")]
    for theirs, words in cases:
        with pytest.raises(Refused, match=words) as e:
            P.check_peer(ours, theirs)
        assert "\n" not in str(e.value)


def test_the_header_refuses_strangers_and_other_versions():
    kind, n = P.unpack_header(P.pack_header(MsgType.TREE, 240))
    assert (kind, n) == (MsgType.TREE, 240) and P.HEADER_BYTES == 8
    with pytest.raises(ProtocolError, match="protocol version mismatch: the peer speaks specbench protocol v2, this side v1"):
        P.unpack_header(b"SB\x02\x05\x00\x00\x00\x00")
    with pytest.raises(ProtocolError, match="not a specbench peer: its first bytes are b'GET '"):
        P.unpack_header(b"GET / HT")
    with pytest.raises(ProtocolError, match="unknown message type 99"):
        P.unpack_header(b"SB\x01\x63\x00\x00\x00\x00")
    with pytest.raises(ProtocolError, match="at most"):
        P.unpack_header(b"SB\x01\x06\xff\xff\xff\xff")
    assert P.encode_error("two\nlines  here") == b"two lines here"


# ------------------------------------------------------------------------------------------------------ over TCP

SERVER = Hello("eagle2", "smollm2-135m", "sha256:0011", (ActivationSpec("hidden", 8),))


def verifier(conn: Connection) -> None:
    """A stand-in server: answers each tree with its first two tokens + 99 and their 'activations'."""
    server_handshake(conn, SERVER)
    while True:
        kind, payload = conn.expect(MsgType.TREE, MsgType.BYE)
        if kind == MsgType.BYE:
            conn.send(MsgType.BYE)
            return
        tree = P.decode_tree(payload)
        tokens = [*tree.tokens[:2].tolist(), 99]
        rows = torch.arange(len(tokens) * 8, dtype=torch.float32).reshape(len(tokens), 8)
        conn.send(MsgType.ANSWER, P.encode_answer(tokens, [rows], SERVER.needs))


def start_server(handle, **kw) -> tuple[int, threading.Thread, list]:
    listener = listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    errors: list[BaseException] = []

    def run():
        try:
            serve(listener, handle, connections=1, accept_timeout_s=10, **kw)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread, which asserts on it
            errors.append(e)
        finally:
            listener.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return port, t, errors


@pytest.mark.parametrize("link", [None, LinkConfig(name="custom", base_delay_ms=25.0)])
def test_an_exchange_over_loopback(link):
    port, thread, errors = start_server(verifier)
    sock = connect("127.0.0.1", port, timeout_s=5)
    conn = Connection(sock, link=LinkedSocket(sock, LinkModel(link, seed=0)) if link else None, timeout_s=10)
    assert client_handshake(conn, SERVER) == SERVER
    for step in range(3):
        t0 = time.monotonic()
        m = conn.send(MsgType.TREE, P.encode_tree(TreeMsg(torch.tensor([5 + step, 6, 7]), torch.tensor([-1, 0, 1]))))
        _, payload = conn.expect(MsgType.ANSWER)
        rtt = time.monotonic() - t0
        ans = P.decode_answer(payload, SERVER.needs)
        assert m == 8 + 12 and ans.tokens.tolist() == [5 + step, 6, 99]
        assert torch.allclose(ans.activations[0].dequantise(), torch.arange(24.0).reshape(3, 8), atol=23 / 127 / 2 + 1e-3)
        if link:
            assert rtt >= 0.025  # the up direction went through the emulated link
    conn.send(MsgType.BYE)
    assert conn.expect(MsgType.BYE)[0] == MsgType.BYE
    conn.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and not errors
    hello = 8 + len(P.encode_hello(SERVER))
    assert conn.bytes_sent == hello + 3 * 20 + 8
    assert conn.bytes_received == hello + 3 * (8 + P.table7_server_bytes(3, [8]) + 6 + 2 * 3) + 8


def test_a_mismatched_client_is_refused_on_both_sides_in_one_line():
    port, thread, errors = start_server(verifier)
    conn = Connection(connect("127.0.0.1", port), timeout_s=10)
    other = Hello("eagle2", "smollm2-135m", "sha256:ffff", SERVER.needs)
    with pytest.raises(Refused, match=r"the peer stopped: target mismatch: this side runs 'smollm2-135m' \(sha256:0011\)") as e:
        client_handshake(conn, other)
    assert "\n" not in str(e.value)
    conn.close()
    thread.join(timeout=10)
    assert len(errors) == 1 and isinstance(errors[0], Refused)


def test_another_protocol_version_is_refused_before_anything_is_decoded():
    """A client speaking v2 (raw bytes here): the server raises the mismatch and sends it back as an ERROR frame."""
    port, thread, errors = start_server(verifier)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(b"SB\x02\x01\x00\x00\x00\x03abc")
        got = b""
        while chunk := raw.recv(4096):
            got += chunk
    thread.join(timeout=10)
    assert isinstance(errors[0], ProtocolError)
    kind, n = P.unpack_header(got[:8])
    assert kind == MsgType.ERROR and P.decode_error(got[8:8 + n]).startswith(
        "protocol version mismatch: the peer speaks specbench protocol v2, this side v1")


def test_a_port_in_use_is_said_in_one_line():
    held = listen("127.0.0.1", 0)
    port = held.getsockname()[1]
    try:
        with pytest.raises(PortInUse, match=f"127.0.0.1:{port} is in use") as e:
            listen("127.0.0.1", port)
        assert "\n" not in str(e.value)
    finally:
        held.close()
    with pytest.raises(SpecbenchError, match=f"no server at 127.0.0.1:{port} \\(connection refused\\)"):
        connect("127.0.0.1", port, timeout_s=5)


# a server that starts an ANSWER of 1000 bytes, sends 10 of them, then hangs until it is killed
PARTIAL = textwrap.dedent("""
    import socket, struct, sys, time
    s = socket.create_server(("127.0.0.1", 0))
    print(s.getsockname()[1], flush=True)
    c, _ = s.accept()
    c.sendall(struct.pack("!2sBBI", b"SB", 1, 6, 1000) + b"x" * 10)
    print("sent", flush=True)
    time.sleep(60)
""")


def test_a_server_killed_mid_message_is_said_in_one_line():
    proc = subprocess.Popen([sys.executable, "-c", PARTIAL], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        conn = Connection(connect("127.0.0.1", port), timeout_s=10)
        assert proc.stdout.readline().strip() == "sent"
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(PeerGone, match="the peer closed the connection mid-message: 10 of 1000 bytes of the ANSWER payload") as e:
            conn.recv()
        assert "\n" not in str(e.value)
        conn.close()
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_silent_peer_and_a_closed_peer():
    port, thread, errors = start_server(lambda c: c.sock.recv(1))  # accepts, waits for one byte, closes
    conn = Connection(connect("127.0.0.1", port), timeout_s=0.3)
    with pytest.raises(PeerGone, match=r"the peer sent nothing for 0.3 s while a frame header was awaited \(0 of 8 bytes\)"):
        conn.recv()
    conn.sock.sendall(b"x")  # the server's handler returns and closes
    conn.sock.settimeout(10)  # (however slowly a loaded machine gets there)
    with pytest.raises(PeerGone, match="the peer closed the connection where a frame was awaited"):
        conn.recv()
    conn.close()
    thread.join(timeout=10)


def test_a_cut_link_is_link_down_here_and_peer_gone_there():
    seen: list[BaseException] = []

    def handle(conn: Connection) -> None:
        try:
            conn.recv()
        except PeerGone as e:
            seen.append(e)

    port, thread, errors = start_server(handle)
    sock = connect("127.0.0.1", port)
    link = LinkedSocket(sock, LinkModel(LinkConfig(name="5g", delay_mean_ms=10.0, delay_std_ms=10.0), seed=0))
    conn = Connection(sock, link=link, timeout_s=10)
    link.cut()
    with pytest.raises(LinkDown, match="link '5g' was cut"):
        conn.send(MsgType.TREE, b"")
    with pytest.raises(LinkDown):
        conn.recv()
    conn.close()
    thread.join(timeout=10)
    assert len(seen) == 1 and "closed the connection" in str(seen[0])
