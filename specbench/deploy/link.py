"""A network link emulated in user space on the TCP send path (issue 78): this machine's kernel has no netem, so the
5G and 4G profiles of the MoA paper (section 4.2) are applied by delaying each message before it is written to a real
socket. Two layers: `LinkModel`, the pure, seeded delay model (a message of n bytes sent at t arrives at t + d; tests
drive it on a virtual clock), and `LinkedSocket`, which wraps a connected socket's send path with it (a delivery
thread writes each message to the socket at its emulated arrival time; sendall returns at once, as a kernel's would).

The model, declared (every choice is ours: the paper names only the netem parameters):
- A message is cut into packets of `mss_bytes` payload (1448: a 1500-byte Ethernet MTU less 52 bytes of IPv4, TCP and
  TCP-timestamp headers, Linux's default); each message starts a new packet (the sockets set TCP_NODELAY, so Nagle
  does not merge a message into the previous one's tail).
- Bandwidth (netem `rate`): packets leave one at a time through a FIFO bottleneck, each taking (payload +
  `header_bytes`) * 8 / bandwidth seconds; a message sent while the bottleneck is busy queues behind the earlier ones.
  Unlimited bandwidth: no serialisation time (loopback's own is ~microseconds, not modelled).
- Delay (netem `delay MEAN JITTER distribution normal`): each packet, after leaving the bottleneck, takes
  base_delay + max(0, N(delay_mean, delay_std)) to arrive. The normal is clipped at 0 as netem does (a negative sample
  is sent at once), so the delay's mean is above delay_mean: 10.83 ms for 5G's N(10, 10), not 10 (`one_way_moments`).
  The base delay is a fixed propagation delay under the jitter: 0 in the paper's profiles (netem ran on top of a real
  ~9 ms / 50 Mbit/s link, which loopback does not have; base_delay_ms=4.5 puts that ping back).
- In order: TCP hands bytes to the application in order, so a message is delivered when its last packet has arrived
  and not before the previous message (a message cannot overtake the previous one; `Delivery.held_s` is the wait).
- Loss (netem `loss`): each packet, and each retransmission of it, is lost with probability `loss`. A lost packet is
  resent after Linux's retransmission timeout, RTO = SRTT + max(4 * RTTVAR, rto_min) with rto_min = 200 ms (Linux's
  tcp_set_rto floors RTTVAR's term at TCP_RTO_MIN, rather than RFC 6298's 1 s floor on the whole RTO), doubled on
  each further loss of the same packet (exponential backoff). SRTT and RTTVAR are the estimator's steady state for
  this profile, computed once: SRTT = the RTT's mean (two one-way delays: the data and its ACK, both directions
  carrying the profile), RTTVAR = the RTT's mean absolute deviation, sqrt(2/pi) * its standard deviation (exact for a
  normal RTT; the clipped sum is near one). For 5G and 4G the floor wins: RTO = 222 ms and 245 ms.
  Why the RTO and not a faster repair: fast retransmit needs three later packets (duplicate ACKs), which a
  one-packet tree never has; Linux's tail-loss probe would repair a tail loss after about 2 * SRTT (45-90 ms here)
  instead, so this model is the conservative end. At 0.1% loss either costs < 0.3 ms per packet on average.
  Not modelled: lost ACKs (cumulative ACKs make one harmless), slow start and the congestion window (Linux's initial
  window of 10 packets, 14 kB, holds every per-step message; only the gzip'd prompt message can exceed it).
- Direction: a LinkModel shapes one direction. The profile applies to each direction of the connection (each side
  wraps its own send path, with its own seed), as netem on both hosts' egress would.
- Disconnection: `LinkedSocket.cut()` drops what is in flight and shuts the socket down; the peer sees the connection
  close, this side gets `LinkDown`. When to cut (after B new tokens, `LinkConfig.disconnect_after_tokens`) is the
  split's decision: the link knows bytes, not tokens.
"""
from __future__ import annotations

import math
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from specbench.deploy.errors import LinkDown, PeerGone
from specbench.errors import SpecbenchError


@dataclass
class LinkConfig:
    """conf/link/*.yaml: one link profile (the schema the YAMLs are validated against)."""

    name: str = "none"
    base_delay_ms: float = 0.0  # fixed one-way propagation delay under the jitter
    delay_mean_ms: float = 0.0  # netem `delay MEAN JITTER distribution normal`: the normal's mean ...
    delay_std_ms: float = 0.0  # ... and its standard deviation (the sample is clipped at 0)
    bandwidth_mbit: Optional[float] = None  # netem `rate`; None = unlimited
    loss: float = 0.0  # netem `loss`: each packet's probability of being dropped (0.001 = 0.1%)
    mss_bytes: int = 1448  # TCP payload per packet (1500-byte MTU less IPv4 + TCP + timestamp headers)
    header_bytes: int = 52  # bytes on the wire per packet beside the payload (what a rate limit counts)
    rto_min_ms: float = 200.0  # Linux's TCP_RTO_MIN: the floor of the retransmission timeout's variance term
    # the split's disconnection test (issue 78, Table 4): the client cuts the link once its answer has this many new
    # tokens and finishes alone; None = never
    disconnect_after_tokens: Optional[int] = None

    def check(self) -> None:
        """Refuse a profile no link can have, in one line."""
        bad = [f"{k}={getattr(self, k)}" for k in ("base_delay_ms", "delay_mean_ms", "delay_std_ms", "rto_min_ms")
               if not (math.isfinite(getattr(self, k)) and getattr(self, k) >= 0)]
        if self.bandwidth_mbit is not None and not (math.isfinite(self.bandwidth_mbit) and self.bandwidth_mbit > 0):
            bad.append(f"bandwidth_mbit={self.bandwidth_mbit} (null for unlimited)")
        if not 0 <= self.loss < 1:
            bad.append(f"loss={self.loss} (a probability below 1)")
        if self.mss_bytes < 1 or self.header_bytes < 0:
            bad.append(f"mss_bytes={self.mss_bytes}, header_bytes={self.header_bytes}")
        if self.disconnect_after_tokens is not None and self.disconnect_after_tokens < 0:
            bad.append(f"disconnect_after_tokens={self.disconnect_after_tokens}")
        if bad:
            raise SpecbenchError(f"link {self.name!r}: impossible values: {', '.join(bad)}")

    @property
    def ideal(self) -> bool:
        """No delay, no rate limit, no loss: the socket is written at once, with no delivery thread."""
        return (self.base_delay_ms == 0 and self.delay_mean_ms == 0 and self.delay_std_ms == 0
                and self.bandwidth_mbit is None and self.loss == 0)


def one_way_moments(cfg: LinkConfig) -> tuple[float, float]:
    """(mean, standard deviation) in seconds of one packet's delay, base + max(0, N(mean, std)), before any
    serialisation: the clipped normal's moments (with a = -mean/std: E = mean(1 - Phi(a)) + std phi(a),
    E[Y^2] = (mean^2 + std^2)(1 - Phi(a)) + mean std phi(a))."""
    mu, sd, base = cfg.delay_mean_ms / 1e3, cfg.delay_std_ms / 1e3, cfg.base_delay_ms / 1e3
    if sd == 0:
        return base + max(mu, 0.0), 0.0
    a = -mu / sd
    pdf = math.exp(-a * a / 2) / math.sqrt(2 * math.pi)
    above = 1 - 0.5 * (1 + math.erf(a / math.sqrt(2)))  # P(X > 0)
    mean = mu * above + sd * pdf
    second = (mu * mu + sd * sd) * above + mu * sd * pdf
    return base + mean, math.sqrt(max(second - mean * mean, 0.0))


def retransmission_timeout(cfg: LinkConfig) -> float:
    """Seconds before a lost packet is resent (its first resend; doubled for each further loss): Linux's rule
    SRTT + max(4 RTTVAR, rto_min) at this profile's steady state (module docstring)."""
    mean, std = one_way_moments(cfg)
    rtt_mean, rtt_std = 2 * mean, math.sqrt(2) * std
    rttvar = math.sqrt(2 / math.pi) * rtt_std
    return rtt_mean + max(4 * rttvar, cfg.rto_min_ms / 1e3)


@dataclass(frozen=True)
class Delivery:
    """One message's fate on the link (times in the clock's seconds)."""

    sent_at: float
    deliver_at: float  # when the receiving application can read its last byte
    arrived_at: float  # when its last packet arrived (deliver_at is later only when held behind the previous message)
    nbytes: int
    packets: int
    retransmissions: int  # packet sends lost and repeated

    @property
    def delay_s(self) -> float:
        return self.deliver_at - self.sent_at

    @property
    def held_s(self) -> float:
        return self.deliver_at - self.arrived_at


class LinkModel:
    """The pure delay model of one direction (module docstring), seeded; `schedule` is called in send order."""

    def __init__(self, cfg: LinkConfig, seed: int):
        cfg.check()
        self.cfg = cfg
        self.rto_s = retransmission_timeout(cfg)
        self._rng = np.random.default_rng(seed)
        self._free_at = -math.inf  # when the bottleneck finishes the last packet queued on it
        self._last_delivery = -math.inf

    def _delays(self, n: int) -> np.ndarray:
        c = self.cfg
        jitter = self._rng.normal(c.delay_mean_ms, c.delay_std_ms, n) if c.delay_std_ms else np.full(n, c.delay_mean_ms)
        return (c.base_delay_ms + np.maximum(jitter, 0.0)) / 1e3

    def schedule(self, now: float, nbytes: int) -> Delivery:
        """The delivery of a message of `nbytes` bytes handed to the link at `now` (seconds, non-decreasing)."""
        c = self.cfg
        if nbytes < 0:
            raise SpecbenchError(f"a message of {nbytes} bytes")
        n = max(1, -(-nbytes // c.mss_bytes))
        payload = np.full(n, c.mss_bytes, dtype=np.float64)
        payload[-1] = nbytes - (n - 1) * c.mss_bytes
        tx = (payload + c.header_bytes) * 8 / (c.bandwidth_mbit * 1e6) if c.bandwidth_mbit else np.zeros(n)
        departs = max(now, self._free_at) + np.cumsum(tx)  # [n] when each packet has left the bottleneck
        self._free_at = float(departs[-1])
        arrive = departs + self._delays(n)
        resent = 0
        if c.loss > 0:
            for i in np.flatnonzero(self._rng.random(n) < c.loss):
                # the timer runs from the lost send; each resend is serialised and delayed afresh, and may be lost too
                t, k = float(departs[i]), 0
                while True:
                    t += self.rto_s * 2**k
                    k += 1
                    arrived = t + float(tx[i]) + float(self._delays(1)[0])
                    if self._rng.random() >= c.loss:
                        break
                arrive[i] = arrived
                resent += k
        last = float(arrive.max())
        self._last_delivery = max(last, self._last_delivery)
        return Delivery(sent_at=now, deliver_at=self._last_delivery, arrived_at=last, nbytes=nbytes, packets=n,
                        retransmissions=resent)


class LinkedSocket:
    """A connected socket whose send path goes through a LinkModel. One `sendall` is one message. Reads are the
    socket's own (the incoming direction is delayed by the peer's LinkedSocket). Not for concurrent senders: one
    thread sends (the protocol loop); the delivery thread writes.

    sendall returns the message's Delivery at once (as a kernel returns once the bytes are queued); the delivery
    thread sleeps until each message's deliver_at and writes it, so the peer cannot read it earlier. With an ideal
    profile the socket is written directly, with no thread."""

    def __init__(self, sock: socket.socket, model: LinkModel, clock: Callable[[], float] = time.monotonic):
        self.sock = sock
        self.model = model
        self.clock = clock
        self.sent: list[Delivery] = []  # every message's fate, in send order (the run's link measurements)
        self._down = False
        self._failed: Optional[OSError] = None
        self._cut = threading.Event()
        self._pending = 0  # messages handed to the delivery thread and not yet written (guarded by _written)
        self._written = threading.Condition()
        self._queue: queue.Queue[Optional[tuple[float, bytes]]] = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        if not model.cfg.ideal:
            self._thread = threading.Thread(target=self._deliver, name="link-delivery", daemon=True)
            self._thread.start()

    def _deliver(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None or self._cut.is_set():
                    return
                at, data = item
                if self._cut.wait(max(0.0, at - self.clock())):
                    return  # cut while in flight: the message is lost with the link
                self.sock.sendall(data)
            except OSError as e:  # the peer is gone; the next sendall says so
                self._failed = e
                return
            finally:
                if item is not None:
                    with self._written:
                        self._pending -= 1
                        self._written.notify_all()

    def _raise_if_unusable(self) -> None:
        if self._down:
            raise LinkDown(f"link {self.model.cfg.name!r} was cut: nothing more goes over it")
        if self._failed is not None:
            raise PeerGone(f"the peer is gone: a delayed message could not be written ({self._failed.strerror or self._failed})")

    def sendall(self, data: bytes) -> Delivery:
        self._raise_if_unusable()
        d = self.model.schedule(self.clock(), len(data))
        self.sent.append(d)
        if self._thread is None:
            self.sock.sendall(data)
        else:
            with self._written:
                self._pending += 1
            self._queue.put((d.deliver_at, bytes(data)))
        return d

    def recv(self, n: int) -> bytes:
        if self._down:
            raise LinkDown(f"link {self.model.cfg.name!r} was cut: nothing more comes in over it")
        return self.sock.recv(n)

    def settimeout(self, seconds: Optional[float]) -> None:
        self.sock.settimeout(seconds)

    @property
    def is_down(self) -> bool:
        return self._down

    def flush(self, timeout_s: float) -> None:
        """Wait until every message sent so far has been written to the socket (bounded)."""
        with self._written:
            done = self._written.wait_for(lambda: self._pending == 0 or self._down or self._failed is not None,
                                          timeout=timeout_s)
        self._raise_if_unusable()
        if not done:
            raise SpecbenchError(f"link {self.model.cfg.name!r}: messages still in flight after {timeout_s} s")

    def cut(self) -> None:
        """The emulated disconnection: what is in flight is lost, the socket is shut down (the peer reads the close)."""
        self._down = True
        self._cut.set()
        self._queue.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by the peer: cut anyway
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver what is in flight (bounded by timeout_s), then close the socket."""
        if self._thread is not None and not self._down:
            self._queue.put(None)
            self._thread.join(timeout=timeout_s)
            self._cut.set()
        self.sock.close()
