"""The client-server split (issue 78) on tiny real targets over loopback, link `none`: the server (SplitServer, in a
thread here; a process in test_deploy_faults.py) holds the target, the client the drafter and a RemoteVerifier.
Split decoding equals single-device decoding at T = 0 token for token; the bytes on the wire are Table 7's formulas
plus the declared overhead; a disconnection at B finishes alone."""
from __future__ import annotations

import threading

import pytest
import torch

from specbench.decode.engine import Engine
from specbench.decode.types import SamplingParams
from specbench.deploy import protocol as P
from specbench.deploy.client import SplitClient
from specbench.deploy.link import LinkConfig
from specbench.deploy.server import SplitServer, serve
from specbench.deploy.split import DeployConfig
from specbench.deploy.tcp import listen
from tests.helpers import hf_greedy
from tests.test_conformance import PROMPTS, make_drafter, target_for

SPLIT = ["sd", "eagle2", "moa", "moa_tli1"]
INHERITED = ["eagle", "hass", "coral", "coral_router"]  # EAGLE's crossing and continue_alone, inherited


def drafter(name, target):
    torch.manual_seed(0)  # both sides build the same untrained module (the handshake checks its digest)
    return make_drafter(name, target)


class Split:
    """A server thread on a free loopback port and a client connected to it; `close` ends both."""

    def __init__(self, name: str, target, link: LinkConfig | None = None, server_drafter=None,
                 server_link: LinkConfig | None = None):
        self.listener = listen("127.0.0.1", 0)
        port = self.listener.getsockname()[1]
        server = SplitServer(target, server_drafter or drafter(name, target), name)
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._serve, args=(server, server_link or LinkConfig()), daemon=True)
        self.thread.start()
        self.client_drafter = drafter(name, target)
        self.client = SplitClient(target, self.client_drafter, name, DeployConfig(name="client_server"),
                                  link or LinkConfig(), seed=0, port=port)
        self.engine = Engine(target, self.client_drafter, SamplingParams(), verifier=self.client.verifier_for)

    def _serve(self, server, link):
        try:
            serve(self.listener, server, link, seed=0, accept_timeout_s=20, timeout_s=20)
        except BaseException as e:  # noqa: BLE001 - the test reads what the thread raised
            self.errors.append(e)

    def close(self):
        self.client.close()
        self.thread.join(timeout=20)
        self.listener.close()
        assert not self.thread.is_alive() and not self.errors, self.errors


@pytest.fixture
def split_of(one_thread):
    made = []

    def make(name, target, **kw):
        made.append(Split(name, target, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("name", SPLIT + INHERITED)
def test_split_decoding_equals_single_device(name, split_of):
    target = target_for()
    local = Engine(target, drafter(name, target), SamplingParams())
    split = split_of(name, target)
    for prompt in PROMPTS:
        want = local.generate(prompt, 40)
        got = split.engine.generate(prompt, 40)
        assert got.new_tokens == want.new_tokens == hf_greedy(target.model, prompt, 40)
        assert got.split["calls"] == got.steps >= 1
        if name == "sd":  # nothing but tokens crosses: the drafts are the local ones
            assert got.tokens_per_step == want.tokens_per_step


@pytest.mark.parametrize("name", SPLIT)
def test_bytes_per_step_are_table7_plus_the_declared_overhead(name, split_of):
    target = target_for()
    split = split_of(name, target)
    g = split.engine.generate(PROMPTS[0], 30)
    s = g.split
    widths = [w for _, w in split.client.crossing.specs]
    cfg = target.model.config
    e, e_kv = cfg.hidden_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    tli = {"sd": None, "eagle2": None, "moa": 0, "moa_tli1": 1}[name]
    assert sum(widths) == (0 if name == "sd" else e if name == "eagle2" else 2 * e_kv * (tli + 1))
    for up, down, size, a in zip(s["bytes_up_per_step"], s["bytes_down_per_step"], g.tree_sizes,
                                 s["answer_tokens_per_step"], strict=True):
        assert up == P.table7_client_bytes(size) + P.tree_overhead() == 4 * size + 8
        assert down == P.table7_server_bytes(a, widths) + P.answer_overhead(a, len(widths))
    assert s["bytes_up"] == sum(s["bytes_up_per_step"]) and s["calls"] == g.steps
    assert s["prompt_bytes_up"] == 8 + 4 + 3 * len(PROMPTS[0])
    assert s["answer_tokens_per_step"][:-1] == g.tokens_per_step[:-1]  # (the last one cut at the budget)
    assert s["round_trip_s"] >= s["server_s"] > 0


@pytest.mark.parametrize("name", SPLIT)
def test_a_disconnection_at_b_finishes_alone(name, split_of):
    target = target_for()
    b = 7
    split = split_of(name, target, link=LinkConfig(disconnect_after_tokens=b))
    g = split.engine.generate(PROMPTS[1], 30)
    ref = hf_greedy(target.model, PROMPTS[1], 30)
    s = g.split
    assert s["disconnected_at"] >= b and len(g.new_tokens) == 30
    online = s["disconnected_at"]
    assert g.new_tokens[:online] == ref[:online]  # what the server verified is the target's
    assert g.alone_tokens == 30 - online and s["calls"] == g.steps
    if name == "sd":  # alone, the independent model is a plain greedy LM
        assert g.new_tokens[online:] == hf_greedy(split.client_drafter.model, PROMPTS[1] + g.new_tokens[:online],
                                                  30 - online)
    # the next answer reconnects
    again = split.engine.generate(PROMPTS[0], 12)
    assert again.split["disconnected_at"] >= b and len(again.new_tokens) == 12
    assert again.new_tokens[: again.split["disconnected_at"]] == hf_greedy(target.model, PROMPTS[0], 12)[
        : again.split["disconnected_at"]]


def test_a_delayed_link_shows_in_the_link_share(split_of):
    """5 ms each way on both sides' send paths: every step's round trip less the server's time holds 10 ms."""
    target = target_for()
    delayed = LinkConfig(name="custom", base_delay_ms=5.0)
    split = split_of("eagle2", target, link=delayed, server_link=delayed)
    g = split.engine.generate(PROMPTS[2], 16)
    assert g.new_tokens == hf_greedy(target.model, PROMPTS[2], 16)
    s = g.split
    assert s["link_s"] / s["calls"] >= 0.010 and s["round_trip_s"] >= s["server_s"] + 0.010 * s["calls"]


def test_prompt_and_times_round_trip():
    """PROMPT carries the budget (u32) and 3 bytes per token; TIMES 4 bytes (microseconds) per step."""
    raw = P.encode_prompt(64, [5, 1 << 20, 7])
    assert len(raw) == 4 + 9 and P.decode_prompt(raw)[0] == 64 and P.decode_prompt(raw)[1].tolist() == [5, 1 << 20, 7]
    assert P.decode_times(P.encode_times([0.25, 1e-6, 0.0])) == [0.25, 1e-6, 0.0]
    with pytest.raises(P.ProtocolError, match="a budget of 0 new tokens"):
        P.encode_prompt(0, [1])
    with pytest.raises(P.ProtocolError, match="malformed PROMPT: no tokens"):
        P.decode_prompt(raw[:4])


@pytest.mark.parametrize("name", SPLIT)
def test_an_eos_stops_both_sides_at_the_same_token(name, split_of):
    """An EOS inside an accepted path: the server stops its answer where the client's `decide` does, and the next
    answer on the same connection starts clean."""
    prompt = PROMPTS[0]
    free = hf_greedy(target_for().model, prompt, 40)
    k = next(i for i in range(8, 40) if free[i] not in free[:i])
    target = target_for(eos=free[k])
    split = split_of(name, target)
    assert split.engine.generate(prompt, 40).new_tokens == free[: k + 1]
    assert split.engine.generate(PROMPTS[2], 20).new_tokens == hf_greedy(target.model, PROMPTS[2], 20)
