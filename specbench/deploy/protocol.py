"""The client-server protocol (issue 78; MoA paper section 4.2 and Table 7): small, versioned, binary. Pure encoding
and decoding of bytes; the socket side is specbench/deploy/tcp.py.

Every message is one frame: an 8-byte header `!2sBBI` = magic b"SB", protocol VERSION (u8), message type (u8),
payload length (u32, at most MAX_PAYLOAD), then the payload. Integers are big-endian.

  HELLO   client -> server  the client's identity: drafter, target name and hash, the activations it needs
  WELCOME server -> client  the server's identity, same layout (both sides check with `check_peer`)
  PROMPT  client -> server  the answer's budget (u32 new tokens) and the prompt's token ids, 3 bytes each
  PREFILL server -> client  the first new token and the prompt's activations: an answer, gzip-compressed
  TREE    client -> server  one step's draft tree, 4 bytes per node
  ANSWER  server -> client  the accepted tokens then the next token (3 bytes each) and their activations
  ERROR   either way        one line of UTF-8 text (a refusal, or the server's failure), then the connection closes
  BYE     either way        empty: the end of the session
  TIMES   server -> client  after an answer's last ANSWER: the server's seconds per step (u32 microseconds each),
                            so that the client splits each step's time into drafting, verification and the link

Declared choices (the paper leaves them open):
- Token ids are 3-byte unsigned integers (Table 7's 3 bytes: vocabularies below 2^24 = 16.7M ids).
- Tree: M nodes in topological order (a parent before its children), each 3 bytes of token id + 1 byte of tree
  position = its parent's index + 1 (0 = the root, the last verified token). So M <= 255 (paper trees: 60-62
  nodes). The payload is exactly Table 7's 4M bytes; no draft probabilities are sent, so the split verifies
  deterministic drafts only (greedy; T > 0 with sampled drafts would need q per node, which Table 7 does not count).
- Answer: u16 A, u32 R, then A tokens (3 bytes each: the A - 1 accepted draft tokens, then the target's next token,
  bonus or correction), then each activation tensor the HELLO named, in that order, as R rows: R fp16 scales (2R
  bytes) then R x width int8 values. In a step's ANSWER R = A (the rows of the root and the accepted nodes, whose
  outputs produced the A tokens); in PREFILL, R = the prompt's length and A = 1.
- Quantisation: per-row absmax, symmetric int8: scale = fp16(max|x_row| / 127), q = clamp(round(x / scale), -127,
  127); x' = q * scale. Error per element <= scale / 2 (a row of zeros has scale 0). Non-finite activations are refused.
- PREFILL's payload (the same layout) is gzip-compressed (level 6, mtime 0: the same bytes every time).

Bytes beyond Table 7's formulas (`answer_overhead`): per ANSWER frame 8 (header) + 6 (A and R) + 2 per row per tensor
(the scales): EAGLE (one tensor of width E): 3A + A*E + 14 + 2A; MoA (2 (TLI + 1) tensors of width E_kv, the keys
and values of TLI + 1 layers): 3A + 2A*E_kv*(TLI + 1) + 14 + 4A(TLI + 1); independent drafter (no tensor): 3A + 14.
Per TREE frame: 4M + 8. The paper's caption says "before quantisation" yet counts one byte per element: Table 7's
formulas are taken as counting the 8-bit elements.
"""
from __future__ import annotations

import gzip
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum
from typing import Sequence

import numpy as np
import torch

from specbench.deploy.errors import ProtocolError, Refused

MAGIC = b"SB"
VERSION = 1
HEADER = struct.Struct("!2sBBI")  # magic, version, message type, payload length
HEADER_BYTES = HEADER.size  # 8
MAX_PAYLOAD = 1 << 30  # a larger length is garbage or an attack, not a prompt's activations
TOKEN_BYTES = 3
MAX_TOKEN = 1 << (8 * TOKEN_BYTES)
MAX_TREE_NODES = 255  # the one-byte tree position holds parent + 1
ANSWER_COUNTS = struct.Struct("!HI")  # A, R
QMAX = 127


class MsgType(IntEnum):
    HELLO = 1
    WELCOME = 2
    PROMPT = 3
    PREFILL = 4
    TREE = 5
    ANSWER = 6
    ERROR = 7
    BYE = 8
    TIMES = 9


# ------------------------------------------------------------------------------------------------------------ frames

def pack_header(kind: MsgType, length: int) -> bytes:
    if not 0 <= length <= MAX_PAYLOAD:
        raise ProtocolError(f"a {kind.name} payload of {length} bytes (at most {MAX_PAYLOAD})")
    return HEADER.pack(MAGIC, VERSION, int(kind), length)


def frame(kind: MsgType, payload: bytes = b"") -> bytes:
    return pack_header(kind, len(payload)) + payload


def unpack_header(raw: bytes) -> tuple[MsgType, int]:
    """(message type, payload length); refuses a non-specbench peer, another version, an unknown type."""
    magic, version, kind, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"not a specbench peer: its first bytes are {raw[:4]!r}, not the magic {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(f"protocol version mismatch: the peer speaks specbench protocol v{version}, this side "
                            f"v{VERSION}: run the same specbench version on both sides")
    try:
        kind = MsgType(kind)
    except ValueError:
        raise ProtocolError(f"unknown message type {kind} from the peer") from None
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"a {kind.name} frame of {length} bytes (at most {MAX_PAYLOAD}): not a specbench peer?")
    return kind, length


# ------------------------------------------------------------------------------------------------------ the hello

@dataclass(frozen=True)
class ActivationSpec:
    """One activation tensor the drafter needs per accepted token: a name the server knows and its width."""

    name: str  # e.g. "hidden" (EAGLE family: the last hidden state), "k3"/"v3" (MoA: a layer's keys and values)
    width: int  # elements per token row (E, or E_kv)


@dataclass(frozen=True)
class Hello:
    """A side's identity: sent by the client as HELLO, answered by the server's as WELCOME."""

    drafter: str  # the drafter config's name (moa, eagle2, sd, ...)
    target: str  # the target model's name
    target_hash: str  # the target's identity (its weights' digest): a drafter is trained for one target
    needs: tuple[ActivationSpec, ...] = ()  # in the order the answer carries them; () for an independent drafter


def _pack_str(s: str, what: str) -> bytes:
    raw = s.encode("utf-8")
    if len(raw) > 255:
        raise ProtocolError(f"{what} of {len(raw)} bytes (at most 255): {s[:40]!r}...")
    return bytes([len(raw)]) + raw


class _Reader:
    """Reads a payload front to back; any shortfall or leftover is a malformed message, said in one line."""

    def __init__(self, data: bytes, what: str):
        self.data, self.pos, self.what = data, 0, what

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ProtocolError(f"malformed {self.what}: {len(self.data)} bytes, {self.pos + n} needed")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct) -> tuple:
        return st.unpack(self.take(st.size))

    def string(self) -> str:
        n = self.take(1)[0]
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"malformed {self.what}: a name that is not UTF-8") from None

    def end(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(f"malformed {self.what}: {len(self.data) - self.pos} bytes left over")


_WIDTH = struct.Struct("!I")


def encode_hello(h: Hello) -> bytes:
    if len(h.needs) > 255:
        raise ProtocolError(f"{len(h.needs)} activation tensors (at most 255)")
    out = [_pack_str(h.drafter, "a drafter name"), _pack_str(h.target, "a target name"),
           _pack_str(h.target_hash, "a target hash"), bytes([len(h.needs)])]
    for spec in h.needs:
        if spec.width < 1:
            raise ProtocolError(f"activation {spec.name!r} of width {spec.width}")
        out += [_pack_str(spec.name, "an activation name"), _WIDTH.pack(spec.width)]
    return b"".join(out)


def decode_hello(payload: bytes) -> Hello:
    r = _Reader(payload, "HELLO")
    drafter, target, target_hash = r.string(), r.string(), r.string()
    needs = tuple(ActivationSpec(r.string(), r.unpack(_WIDTH)[0]) for _ in range(r.take(1)[0]))
    r.end()
    return Hello(drafter, target, target_hash, needs)


def check_peer(ours: Hello, theirs: Hello) -> None:
    """Refuse, in one line, a peer that does not belong with this side (the version was checked in the header)."""
    if theirs.drafter != ours.drafter:
        raise Refused(f"drafter mismatch: this side runs {ours.drafter!r}, the peer {theirs.drafter!r}: start both "
                      f"sides with the same drafter=")
    if (theirs.target, theirs.target_hash) != (ours.target, ours.target_hash):
        raise Refused(f"target mismatch: this side runs {ours.target!r} ({ours.target_hash}), the peer "
                      f"{theirs.target!r} ({theirs.target_hash}): the drafter belongs to one target")
    if theirs.needs != ours.needs:
        show = lambda h: ", ".join(f"{s.name}[{s.width}]" for s in h.needs) or "none"  # noqa: E731
        raise Refused(f"activation mismatch for drafter {ours.drafter!r}: this side expects {show(ours)}, the peer "
                      f"{show(theirs)}")


# ----------------------------------------------------------------------------------------------- tokens and trees

def encode_tokens(tokens: torch.Tensor | Sequence[int]) -> bytes:
    """[n] token ids -> 3n bytes (big-endian u24)."""
    t = np.asarray(tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens), dtype=np.int64)
    if t.size and (t.min() < 0 or t.max() >= MAX_TOKEN):
        raise ProtocolError(f"token id {int(t.min()) if t.min() < 0 else int(t.max())} does not fit 3 bytes "
                            f"(0 <= id < {MAX_TOKEN})")
    return t.astype(">u4").view(np.uint8).reshape(-1, 4)[:, 1:].tobytes()


def decode_tokens(raw: bytes) -> torch.Tensor:
    """3n bytes -> [n] int64."""
    if len(raw) % TOKEN_BYTES:
        raise ProtocolError(f"malformed token list: {len(raw)} bytes is not a multiple of {TOKEN_BYTES}")
    b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, TOKEN_BYTES)
    padded = np.concatenate([np.zeros((len(b), 1), dtype=np.uint8), b], axis=1)
    return torch.from_numpy(padded.view(">u4").reshape(-1).astype(np.int64))


@dataclass(frozen=True)
class TreeMsg:
    """One step's draft tree as the client sends it (the engine's DraftTree without its draft probabilities)."""

    tokens: torch.Tensor  # [M] int64 token ids
    parents: torch.Tensor  # [M] int64: the parent's node index, -1 = the root (the last verified token)


def encode_tree(tree: TreeMsg) -> bytes:
    """[M] nodes -> 4M bytes: each node's 3-byte token id, then its parent + 1."""
    tokens, parents = tree.tokens.reshape(-1), tree.parents.reshape(-1)
    m = len(tokens)
    if len(parents) != m:
        raise ProtocolError(f"a tree of {m} tokens and {len(parents)} parents")
    if m > MAX_TREE_NODES:
        raise ProtocolError(f"a tree of {m} nodes: the 1-byte tree position holds at most {MAX_TREE_NODES}")
    p = parents.to(torch.int64)
    if m and (bool((p < -1).any()) or bool((p >= torch.arange(m)).any())):
        raise ProtocolError("a tree's nodes must come after their parents (parent index in -1..i-1)")
    out = np.empty((m, 4), dtype=np.uint8)
    out[:, :3] = np.frombuffer(encode_tokens(tokens), dtype=np.uint8).reshape(m, 3)
    out[:, 3] = (p + 1).numpy().astype(np.uint8)
    return out.tobytes()


def decode_tree(payload: bytes) -> TreeMsg:
    if len(payload) % 4:
        raise ProtocolError(f"malformed TREE: {len(payload)} bytes is not 4 per node")
    b = np.frombuffer(payload, dtype=np.uint8).reshape(-1, 4)
    parents = torch.from_numpy(b[:, 3].astype(np.int64)) - 1
    if len(b) and bool((parents >= torch.arange(len(b))).any()):
        raise ProtocolError("malformed TREE: a node before its parent")
    return TreeMsg(tokens=decode_tokens(b[:, :3].tobytes()), parents=parents)


# ----------------------------------------------------------------------------------------------------- activations

@dataclass(frozen=True)
class QuantRows:
    """A [R, width] float tensor as per-row absmax symmetric int8 with an fp16 scale per row."""

    q: torch.Tensor  # [R, width] int8
    scale: torch.Tensor  # [R] float16

    def dequantise(self) -> torch.Tensor:
        """[R, width] float32."""
        return self.q.to(torch.float32) * self.scale.to(torch.float32)[:, None]


def quantise_rows(x: torch.Tensor) -> QuantRows:
    """x [R, width] float -> QuantRows. The scale is rounded to fp16 first and q computed against the rounded scale,
    so the error bound holds for what the client dequantises."""
    if x.dim() != 2:
        raise ProtocolError(f"activations must be [rows, width], got shape {tuple(x.shape)}")
    x = x.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise ProtocolError("non-finite activations (inf or nan) cannot be quantised")
    amax = x.abs().amax(dim=1) if x.shape[1] else torch.zeros(x.shape[0])
    scale = (amax / QMAX).to(torch.float16)
    if bool(torch.isinf(scale).any()):
        raise ProtocolError(f"an activation of magnitude {float(amax.max()):.3g} overflows the fp16 scale")
    s = scale.to(torch.float32)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.where(s[:, None] > 0, torch.round(x / safe[:, None]), torch.zeros_like(x)).clamp(-QMAX, QMAX)
    return QuantRows(q=q.to(torch.int8), scale=scale)


# ---------------------------------------------------------------------------------------------------------- answers

@dataclass(frozen=True)
class AnswerMsg:
    """The server's answer to a tree (ANSWER) or to the prompt (PREFILL), as decoded by the client."""

    tokens: torch.Tensor  # [A] int64: the accepted draft tokens, then the target's next token
    activations: tuple[QuantRows, ...]  # one per HELLO need, each [R, width]


def encode_answer(tokens: torch.Tensor | Sequence[int], activations: Sequence[torch.Tensor],
                  needs: Sequence[ActivationSpec], compress: bool = False) -> bytes:
    """The payload of an ANSWER (compress=False) or a PREFILL (compress=True): tokens [A], activations each
    [R, width] float in the order of `needs`."""
    if len(activations) != len(needs):
        raise ProtocolError(f"{len(activations)} activation tensors for {len(needs)} declared needs")
    tok = encode_tokens(tokens)
    a = len(tok) // TOKEN_BYTES
    rows = {int(x.shape[0]) for x in activations} if activations else {0}
    if len(rows) != 1:
        raise ProtocolError(f"activation tensors of different row counts {sorted(rows)}")
    r = rows.pop()
    if a >= 1 << 16:
        raise ProtocolError(f"an answer of {a} tokens (at most 65535)")
    parts = [ANSWER_COUNTS.pack(a, r), tok]
    for x, spec in zip(activations, needs):
        if x.dim() != 2 or x.shape[1] != spec.width:
            raise ProtocolError(f"activation {spec.name!r}: shape {tuple(x.shape)}, declared [rows, {spec.width}]")
        qr = quantise_rows(x)
        parts += [qr.scale.numpy().astype(">f2").tobytes(), qr.q.numpy().tobytes()]
    body = b"".join(parts)
    return gzip.compress(body, compresslevel=6, mtime=0) if compress else body


def decode_answer(payload: bytes, needs: Sequence[ActivationSpec], compressed: bool = False) -> AnswerMsg:
    what = "PREFILL" if compressed else "ANSWER"
    if compressed:
        try:
            payload = gzip.decompress(payload)
        except (OSError, EOFError, zlib.error) as e:
            raise ProtocolError(f"malformed {what}: not gzip data ({e})") from None
    rd = _Reader(payload, what)
    a, r = rd.unpack(ANSWER_COUNTS)
    tokens = decode_tokens(rd.take(TOKEN_BYTES * a))
    acts = []
    for spec in needs:
        scale = torch.from_numpy(np.frombuffer(rd.take(2 * r), dtype=">f2").astype(np.float16))
        q = torch.from_numpy(np.frombuffer(rd.take(r * spec.width), dtype=np.int8).reshape(r, spec.width).copy())
        acts.append(QuantRows(q=q, scale=scale))
    rd.end()
    return AnswerMsg(tokens=tokens, activations=tuple(acts))


_BUDGET = struct.Struct("!I")


def encode_prompt(budget: int, tokens: torch.Tensor | Sequence[int]) -> bytes:
    """PROMPT: the answer's budget (new tokens, u32; the server stops where the client does), then the ids."""
    if not 0 < budget < 1 << 32:
        raise ProtocolError(f"a budget of {budget} new tokens")
    return _BUDGET.pack(budget) + encode_tokens(tokens)


def decode_prompt(payload: bytes) -> tuple[int, torch.Tensor]:
    rd = _Reader(payload, "PROMPT")
    (budget,) = rd.unpack(_BUDGET)
    tokens = decode_tokens(rd.take(len(payload) - _BUDGET.size))
    if not len(tokens):
        raise ProtocolError("malformed PROMPT: no tokens")
    return budget, tokens


def encode_times(seconds: Sequence[float]) -> bytes:
    """TIMES: the server's verification seconds of each step of one answer, u32 microseconds each."""
    return np.asarray([min(round(s * 1e6), (1 << 32) - 1) for s in seconds], dtype=">u4").tobytes()


def decode_times(payload: bytes) -> list[float]:
    if len(payload) % 4:
        raise ProtocolError(f"malformed TIMES: {len(payload)} bytes is not 4 per step")
    return (np.frombuffer(payload, dtype=">u4").astype(np.float64) / 1e6).tolist()


def encode_error(text: str) -> bytes:
    return " ".join(text.split()).encode("utf-8")  # one line, always


def decode_error(payload: bytes) -> str:
    return payload.decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------------------ Table 7's formulas

def table7_client_bytes(m: int) -> int:
    """Table 7, sent by the client per step: 4M (M draft nodes)."""
    return 4 * m


def table7_server_bytes(a: int, widths: Sequence[int]) -> int:
    """Table 7, sent by the server per step: 3A + A * (sum of the activation widths per token): EAGLE's widths are [E]
    (3A + AE), MoA's 2 (TLI + 1) x [E_kv] (3A + 2A E_kv (TLI + 1)), an independent drafter's none (3A)."""
    return 3 * a + a * sum(widths)


def answer_overhead(a: int, n_tensors: int, rows: int | None = None) -> int:
    """Bytes an ANSWER frame carries beyond table7_server_bytes: the header (8), A and R (6), and an fp16 scale per row
    of each tensor (rows = A in a step's answer)."""
    return HEADER_BYTES + ANSWER_COUNTS.size + 2 * (a if rows is None else rows) * n_tensors


def tree_overhead() -> int:
    """Bytes a TREE frame carries beyond table7_client_bytes: the header."""
    return HEADER_BYTES
