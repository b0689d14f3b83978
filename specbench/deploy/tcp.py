"""Frames of specbench/deploy/protocol.py over a real TCP socket: listen and connect with one-line errors (a port in
use, no server), a `Connection` that sends and reads whole frames (counting the bytes each way) and says in one line
when the peer disappears mid-message, the handshake, and a bounded server loop. A connection's send path may go
through an emulated link (specbench/deploy/link.py LinkedSocket); reads are always the socket's own.
"""
from __future__ import annotations

import errno
import socket
import time
from typing import Callable, Optional

from specbench.deploy.errors import LinkDown, PeerGone, ProtocolError, PortInUse, Refused
from specbench.deploy.link import Delivery, LinkedSocket
from specbench.deploy.protocol import (HEADER_BYTES, Hello, MsgType, check_peer, decode_error, decode_hello,
                                       encode_error, encode_hello, frame, unpack_header)
from specbench.errors import SpecbenchError


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free port; read it from getsockname()). SO_REUSEADDR is set, so
    a port left in TIME_WAIT by a previous run is reused, while one another process listens on is refused."""
    try:
        return socket.create_server((host, port), backlog=4)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(f"{host}:{port} is in use (another server is listening there): stop it or choose "
                            f"another port") from None
        raise SpecbenchError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def connect(host: str, port: int, timeout_s: float = 10.0) -> socket.socket:
    try:
        return socket.create_connection((host, port), timeout=timeout_s)
    except ConnectionRefusedError:
        raise SpecbenchError(f"no server at {host}:{port} (connection refused): start the server first") from None
    except socket.timeout:
        raise SpecbenchError(f"no answer from {host}:{port} within {timeout_s} s") from None
    except OSError as e:
        raise SpecbenchError(f"cannot connect to {host}:{port}: {e.strerror or e}") from None


class Connection:
    """One peer over a connected socket. `send` writes one frame (through the link when there is one); `recv` reads
    one whole frame; `expect` reads one of a given type and turns the peer's ERROR into a one-line error here."""

    def __init__(self, sock: socket.socket, link: Optional[LinkedSocket] = None, timeout_s: Optional[float] = 60.0):
        if link is not None and link.sock is not sock:
            raise SpecbenchError("the link must wrap this connection's socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one message, its own packets (link.py)
        sock.settimeout(timeout_s)
        self.sock, self.link, self.timeout_s = sock, link, timeout_s
        self.bytes_sent = 0  # whole frames, headers included
        self.bytes_received = 0
        self.last_delivery: Optional[Delivery] = None  # the link's fate of the last frame sent (None without a link)

    # ------------------------------------------------------------------------------------------------- sending

    def send(self, kind: MsgType, payload: bytes = b"") -> int:
        """Write one frame; returns its size on the wire (header + payload)."""
        data = frame(kind, payload)
        try:
            if self.link is not None:
                self.last_delivery = self.link.sendall(data)
            else:
                self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise PeerGone(f"the peer is gone: {e.strerror} while sending a {kind.name}") from None
        except socket.timeout:
            raise PeerGone(f"the peer stopped reading: a {kind.name} could not be sent in {self.timeout_s} s") from None
        self.bytes_sent += len(data)
        return len(data)

    def send_error(self, text: str) -> None:
        """Best effort: tell the peer why this side stops (it may be gone already)."""
        try:
            self.send(MsgType.ERROR, encode_error(text))
        except (PeerGone, LinkDown):
            pass

    # ------------------------------------------------------------------------------------------------- reading

    def _read_exactly(self, n: int, what: str) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = (self.link.recv if self.link is not None else self.sock.recv)(min(n - len(buf), 1 << 20))
            except socket.timeout:
                raise PeerGone(f"the peer sent nothing for {self.timeout_s} s while {what} was awaited "
                               f"({len(buf)} of {n} bytes)") from None
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                if self.link is not None and self.link.is_down:
                    raise LinkDown(f"link {self.link.model.cfg.name!r} was cut while {what} was awaited")
                if not buf and what == "a frame header":
                    raise PeerGone("the peer closed the connection where a frame was awaited")
                raise PeerGone(f"the peer closed the connection mid-message: {len(buf)} of {n} bytes of {what}")
            buf += chunk
        self.bytes_received += n
        return bytes(buf)

    def recv(self) -> tuple[MsgType, bytes]:
        kind, length = unpack_header(self._read_exactly(HEADER_BYTES, "a frame header"))
        return kind, self._read_exactly(length, f"the {kind.name} payload")

    def expect(self, *kinds: MsgType) -> tuple[MsgType, bytes]:
        """The next frame, which must be one of `kinds`; the peer's ERROR is raised here as Refused with its text."""
        kind, payload = self.recv()
        if kind == MsgType.ERROR and MsgType.ERROR not in kinds:
            raise Refused(f"the peer stopped: {decode_error(payload)}")
        if kind not in kinds:
            raise ProtocolError(f"expected {' or '.join(k.name for k in kinds)} from the peer, got {kind.name}")
        return kind, payload

    # ------------------------------------------------------------------------------------------------- closing

    def close_after_error(self, text: str, linger_s: float = 1.0) -> None:
        """Send ERROR, stop sending, read what the peer still sends until it closes (bounded), then close: closing
        with unread bytes would reset the connection and could destroy the ERROR before the peer reads it."""
        self.send_error(text)
        try:
            if self.link is not None:
                self.link.flush(timeout_s=linger_s)
            self.sock.shutdown(socket.SHUT_WR)
            self.sock.settimeout(linger_s)
            deadline = time.monotonic() + linger_s
            while time.monotonic() < deadline and self.sock.recv(1 << 16):
                pass
        except (OSError, SpecbenchError):
            pass  # the peer is gone or slow to close: close anyway
        self.close()

    def close(self) -> None:
        if self.link is not None:
            self.link.close(timeout_s=5.0)
        else:
            self.sock.close()


# ------------------------------------------------------------------------------------------------------ handshake

def client_handshake(conn: Connection, ours: Hello) -> Hello:
    """HELLO, then the server's WELCOME; either side's mismatch is one line (Refused or ProtocolError)."""
    conn.send(MsgType.HELLO, encode_hello(ours))
    _, payload = conn.expect(MsgType.WELCOME)
    theirs = decode_hello(payload)
    check_peer(ours, theirs)
    return theirs


def server_handshake(conn: Connection, ours: Hello) -> Hello:
    """The client's HELLO checked against this server before anything is decoded: a mismatch is sent back as ERROR
    (the client raises it) and raised here."""
    try:
        _, payload = conn.expect(MsgType.HELLO)
        theirs = decode_hello(payload)
        check_peer(ours, theirs)
    except (ProtocolError, Refused) as e:
        conn.close_after_error(str(e))
        raise
    conn.send(MsgType.WELCOME, encode_hello(ours))
    return theirs


# ---------------------------------------------------------------------------------------------------- server loop

def serve(listener: socket.socket, handle: Callable[[Connection], None], *, connections: int,
          accept_timeout_s: float, wrap: Callable[[socket.socket], Connection] = Connection) -> None:
    """Accept `connections` clients one after the other (each waited for at most accept_timeout_s) and run `handle`
    on each; the connection is closed after it. Bounded by design: a server that must outlive its clients loops
    over serve itself."""
    listener.settimeout(accept_timeout_s)
    for _ in range(connections):
        try:
            sock, _ = listener.accept()
        except socket.timeout:
            raise SpecbenchError(f"no client connected within {accept_timeout_s} s") from None
        conn = wrap(sock)
        try:
            handle(conn)
        finally:
            conn.close()
