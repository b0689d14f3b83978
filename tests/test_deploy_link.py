"""The user-space link emulator (specbench/deploy/link.py, issue 78): with a fixed seed, a stream of messages sees the
profile's delay distribution, loss rate and bandwidth; messages stay in order; the conf/link profiles are the paper's;
LinkedSocket delays a real socket's writes (never early), and cut() disconnects."""
from __future__ import annotations

import math
import socket
import time
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from specbench.core.config import to_dataclass
from specbench.deploy.errors import LinkDown, PeerGone
from specbench.deploy.link import LinkConfig, LinkedSocket, LinkModel, one_way_moments, retransmission_timeout
from specbench.errors import SpecbenchError

CONF = Path(__file__).resolve().parents[1] / "conf" / "link"


def profile(name: str, **over) -> LinkConfig:
    return to_dataclass(LinkConfig, OmegaConf.merge(OmegaConf.load(CONF / f"{name}.yaml"), over))


def test_the_profiles_are_the_papers():
    assert {p.stem for p in CONF.glob("*.yaml")} == {"none", "5g", "4g", "custom"}
    for p in CONF.glob("*.yaml"):
        assert p.read_text().startswith(f"# python -m specbench.run deploy=client_server link={p.stem} ")
        cfg = profile(p.stem)
        cfg.check()
        assert cfg.name == p.stem and cfg.disconnect_after_tokens is None
    g5, g4 = profile("5g"), profile("4g")
    assert (g5.delay_mean_ms, g5.delay_std_ms, g5.loss, g5.bandwidth_mbit) == (10, 10, 0.001, None)
    assert (g4.delay_mean_ms, g4.delay_std_ms, g4.loss, g4.bandwidth_mbit) == (21, 19, 0.001, 20)
    assert profile("none").ideal and not g5.ideal
    with pytest.raises(Exception):  # an unknown key is an error (the schema is the dataclass)
        profile("5g", jitter_ms=3)


def test_clipped_normal_moments_and_the_rto():
    """The analytic moments match a large sample; Linux's RTO floor wins for both paper profiles."""
    rng = np.random.default_rng(1)
    for mu, sd in ((10, 10), (21, 19)):
        x = np.maximum(rng.normal(mu, sd, 2_000_000), 0) / 1e3
        mean, std = one_way_moments(LinkConfig(delay_mean_ms=mu, delay_std_ms=sd))
        assert mean == pytest.approx(x.mean(), rel=2e-3) and std == pytest.approx(x.std(), rel=2e-3)
    assert one_way_moments(LinkConfig(delay_mean_ms=10, delay_std_ms=10))[0] == pytest.approx(0.010833, abs=1e-6)
    assert retransmission_timeout(profile("5g")) == pytest.approx(0.2217, abs=1e-4)
    assert retransmission_timeout(profile("4g")) == pytest.approx(0.2446, abs=1e-4)
    assert retransmission_timeout(profile("none")) == 0.2
    # a slow link's own variance outgrows the floor: 4 * RTTVAR = 4 * sqrt(2/pi) * sqrt(2) * 100 ms > 200 ms
    assert retransmission_timeout(LinkConfig(delay_mean_ms=500, delay_std_ms=100)) == pytest.approx(
        1.0 + 4 * math.sqrt(2 / math.pi) * math.sqrt(2) * 0.1, rel=1e-6)


@pytest.mark.parametrize("name", ["5g", "4g"])
def test_a_stream_sees_the_profiles_delay_distribution(name):
    """20,000 small messages, 200 ms apart (no queueing, no overtaking to hold back): the delays of those that lost no
    packet have the clipped normal's mean and deviation, the clipped share sits at the floor, and packets are lost at
    the profile's rate with each loss costing at least one RTO."""
    cfg = profile(name)
    model = LinkModel(cfg, seed=0)
    size = 200  # one packet
    d = [model.schedule(0.2 * i, size) for i in range(20_000)]
    tx = (size + cfg.header_bytes) * 8 / (cfg.bandwidth_mbit * 1e6) if cfg.bandwidth_mbit else 0.0
    clean = np.array([x.delay_s for x in d if x.retransmissions == 0 and x.held_s == 0]) - tx
    assert len(clean) > 19_900
    mean, std = one_way_moments(cfg)
    assert abs(clean.mean() - mean) < 0.4e-3, (clean.mean(), mean)  # ~3.5 standard errors
    assert abs(clean.std() - std) / std < 0.03, (clean.std(), std)
    p_clip = 0.5 * (1 + math.erf(-cfg.delay_mean_ms / cfg.delay_std_ms / math.sqrt(2)))  # P(N(mu, sd) < 0)
    assert abs(np.mean(clean < 1e-9) - p_clip) < 0.012, (np.mean(clean < 1e-9), p_clip)
    lossy = [x for x in d if x.retransmissions]
    assert all(x.delay_s >= model.rto_s for x in lossy)
    assert 5 <= len(lossy) <= 40  # 20 expected (binomial sd 4.5)


def test_loss_rate_over_many_packets():
    model = LinkModel(profile("4g"), seed=3)
    d = [model.schedule(1.0 * i, 1448 * 100) for i in range(2000)]  # 200,000 packets, 1 s apart (the link idle)
    packets, resent = sum(x.packets for x in d), sum(x.retransmissions for x in d)
    assert packets == 200_000
    assert abs(resent - 200) < 60, resent  # 0.1% of 200,000 (+ 0.1% of those resent), binomial sd 14


def test_bandwidth_is_the_profiles():
    """4G: a backlog of 100 kB messages drains at 20 Mbit/s on the wire, i.e. 20 * 1448/1500 Mbit/s of payload (its
    loss off: one lost packet in the last message would add an RTO to these 8 s); 5G has no rate limit (a 1 MB message
    takes only its delay)."""
    model = LinkModel(profile("4g", loss=0.0), seed=0)
    d = [model.schedule(0.0, 100_000) for _ in range(200)]
    goodput = 200 * 100_000 * 8 / d[-1].deliver_at
    assert goodput == pytest.approx(20e6 * 1448 / 1500, rel=0.01)
    assert all(b.deliver_at > a.deliver_at for a, b in zip(d, d[1:]))  # each queued behind the last
    big = LinkModel(profile("5g", loss=0.0), seed=0).schedule(0.0, 1_000_000)
    assert big.packets == 691 and big.delay_s < 0.1


def test_a_custom_link_is_exact_without_jitter():
    """10 full packets at 1 Mbit/s: 10 * 1500 bytes * 8 / 1e6 = 0.12 s of serialisation, then 30 ms."""
    model = LinkModel(LinkConfig(name="custom", base_delay_ms=30, bandwidth_mbit=1.0), seed=0)
    d = model.schedule(5.0, 14480)
    assert d.packets == 10 and d.delay_s == pytest.approx(0.15, abs=1e-9)
    later = model.schedule(5.01, 1)  # queued behind the first message's packets
    assert later.deliver_at == pytest.approx(5.0 + 0.12 + (1 + 52) * 8 / 1e6 + 0.03, abs=1e-9)
    assert LinkModel(profile("none"), seed=0).schedule(2.0, 10_000).delay_s == 0.0


def test_messages_stay_in_order():
    """4G's jitter (sd 19 ms) with messages 1 ms apart would reorder them; TCP's order holds them back instead."""
    model = LinkModel(profile("4g"), seed=0)
    d = [model.schedule(0.001 * i, 100) for i in range(2000)]
    assert all(b.deliver_at >= a.deliver_at for a, b in zip(d, d[1:]))
    assert all(x.deliver_at >= x.arrived_at for x in d)
    assert sum(x.held_s > 0 for x in d) > 500  # the rule binds: many would have overtaken


def test_seeded():
    run = lambda seed: [LinkModel(profile("4g"), seed=seed).schedule(0.0, 50_000).deliver_at for _ in range(3)]  # noqa: E731
    assert run(7) == run(7) and run(7) != run(8)


@pytest.mark.parametrize("over, words", [
    ({"delay_mean_ms": -1.0}, "delay_mean_ms=-1.0"), ({"loss": 1.0}, "loss=1.0"),
    ({"bandwidth_mbit": 0.0}, "bandwidth_mbit=0.0"), ({"disconnect_after_tokens": -2}, "disconnect_after_tokens=-2"),
])
def test_impossible_profiles_are_refused_in_one_line(over, words):
    with pytest.raises(SpecbenchError, match=f"link 'custom': impossible values: {words}") as e:
        LinkModel(profile("custom", **over), seed=0)
    assert "\n" not in str(e.value)


def read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, "closed early"
        buf += chunk
    return buf


def test_linked_socket_delays_real_writes_and_never_early():
    a, b = socket.socketpair()
    b.settimeout(5)
    link = LinkedSocket(a, LinkModel(LinkConfig(name="custom", base_delay_ms=200.0), seed=0))
    t0 = time.monotonic()
    sent = [link.sendall(bytes([i]) * 100) for i in range(3)]
    assert time.monotonic() - t0 < 0.1  # sendall queues; it does not sleep the 200 ms
    for i, d in enumerate(sent):
        msg = read_exactly(b, 100)
        now = time.monotonic()
        assert msg == bytes([i]) * 100
        assert now >= d.deliver_at  # never before the emulated arrival
        assert now < d.deliver_at + 0.5  # (generous: a loaded machine's scheduler)
    assert [d.delay_s for d in link.sent] == pytest.approx([0.2] * 3)
    link.close()
    b.close()


def test_an_ideal_link_writes_at_once():
    a, b = socket.socketpair()
    link = LinkedSocket(a, LinkModel(profile("none"), seed=0))
    link.sendall(b"hello")
    assert link._thread is None and b.recv(5) == b"hello"
    link.close()
    b.close()


def test_cut_loses_what_is_in_flight_and_refuses_more():
    a, b = socket.socketpair()
    b.settimeout(5)
    link = LinkedSocket(a, LinkModel(LinkConfig(name="custom", base_delay_ms=1000.0), seed=0))
    link.sendall(b"x" * 10)
    link.cut()
    assert b.recv(10) == b""  # the peer reads the close, not the message
    with pytest.raises(LinkDown, match="link 'custom' was cut"):
        link.sendall(b"y")
    with pytest.raises(LinkDown):
        link.recv(1)
    link.close()
    b.close()


def test_a_peer_gone_is_said_on_the_next_send():
    a, b = socket.socketpair()
    link = LinkedSocket(a, LinkModel(LinkConfig(name="custom", base_delay_ms=5.0), seed=0))
    b.close()
    link.sendall(b"x" * 10)
    with pytest.raises(PeerGone, match="the peer is gone"):
        link.flush(timeout_s=5)
    with pytest.raises(PeerGone):
        link.sendall(b"y")
    link.close()
