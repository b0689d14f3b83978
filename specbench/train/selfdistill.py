"""Self-distilled training text: the target's own answers to the training conversations' first user turns.

Medusa's self-distillation (papers/001, "Self-distillation workflow"): seed prompts from ShareGPT, answers generated
by the target. A drafter is judged by how often it guesses the *target's* next token on the *target's* text, but
ShareGPT's replies are ChatGPT's text; on a small target the two differ enough that a drafter trained on ShareGPT
replies learns a distribution it never meets at decode time (train.answers=dataset keeps the papers' setting).

Greedy answers (temperature 0, the setting every table's T=0 column decodes at), batched with left padding through
transformers' `generate` (the numbers of a batched forward may differ from an unbatched one in the last bits: this is
training text, not a lossless claim). Written one JSON line per conversation as each batch finishes, so an
interrupted run resumes where it stopped.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specbench.data.conversations import Conversation, Encoded
from specbench.errors import SpecbenchError
from specbench.core.models import chat_prompt_ids
from specbench.decode.target import TargetModel


def question_ids(target: TargetModel, question: str, system: str | None, max_prompt: int) -> list[int] | None:
    """The chat prompt for one user turn, its text cut at the end so the prompt fits in max_prompt tokens."""
    tok = target.tokenizer
    ids = chat_prompt_ids(tok, [{"role": "user", "content": question}], system)
    for _ in range(3):  # re-tokenising a cut text can move a boundary by a token: shrink again if needed
        excess = len(ids) - max_prompt
        if excess <= 0:
            return ids
        content = tok(question, add_special_tokens=False)["input_ids"]
        if len(content) <= excess:
            return None  # the template alone does not fit
        question = tok.decode(content[: len(content) - excess - 1])
        ids = chat_prompt_ids(tok, [{"role": "user", "content": question}], system)
    return ids if len(ids) <= max_prompt else None


def read_done(path: Path) -> dict[int, Encoded]:
    done: dict[int, Encoded] = {}
    if not path.is_file():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break  # a line torn by a crash: everything after it is regenerated
        done[row["index"]] = Encoded(row["conv_id"], row["input_ids"], row["loss_mask"])
    return done


def row_json(index: int, enc: Encoded) -> str:
    return json.dumps({"index": index, "conv_id": enc.conv_id, "input_ids": enc.input_ids, "loss_mask": enc.loss_mask}) + "\n"


@torch.inference_mode()
def target_answers(target: TargetModel, convs: list[Conversation | None], system: str | None, max_len: int,
                   answer_tokens: int, batch_size: int, path: Path) -> list[Encoded]:
    """Encoded (prompt + the target's greedy answer, loss on the answer and its end-of-turn token) per conversation,
    in the order of `convs`; conversations whose question cannot fit are skipped, and so are None entries (another
    rank's share). Resumes from `path` (JSONL)."""
    if not 0 < answer_tokens < max_len:
        raise SpecbenchError(f"train.answer_tokens={answer_tokens} must be between 1 and train.max_len={max_len}")
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(target.eos_token_ids), 0)
    done = read_done(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:  # rewrite what survived, so a torn last line is not appended to
        for i, enc in done.items():
            f.write(row_json(i, enc))
    todo = []
    for i, conv in enumerate(convs):
        if conv is None:
            continue
        if i not in done and (ids := question_ids(target, conv.messages[0][1], system, max_len - answer_tokens)):
            todo.append((i, ids))
    todo.sort(key=lambda x: len(x[1]))  # similar lengths per batch: less padding
    eos = sorted(target.eos_token_ids)
    share = sum(c is not None for c in convs)
    with path.open("a", encoding="utf-8") as f, tqdm(total=share, initial=share - len(todo),
                                                    desc="target answers", unit="conv", dynamic_ncols=True) as bar:
        for b in range(0, len(todo), batch_size):
            group = todo[b : b + batch_size]
            width = max(len(ids) for _, ids in group)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in group], device=target.device)
            attn = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in group], device=target.device)
            out = target.model.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=answer_tokens,
                                        do_sample=False, temperature=None, top_p=None, top_k=None,
                                        pad_token_id=pad, eos_token_id=eos or None)
            for (i, ids), row in zip(group, out[:, width:].tolist()):
                answer = []
                for t in row:  # up to and including the first end-of-turn token; what follows is padding
                    answer.append(t)
                    if t in target.eos_token_ids:
                        break
                enc = Encoded(convs[i].conv_id, ids + answer, [0] * len(ids) + [1] * len(answer))
                f.write(row_json(i, enc))
                done[i] = enc
            f.flush()
            bar.update(len(group))
    return [done[i] for i in range(len(convs)) if i in done]


def shipped_meta(path: Path) -> Path:
    """The description beside a shipped answers file: answers.jsonl -> answers.json."""
    return path.with_suffix(".json")


def seed_answers(shipped: Path, dst: Path, meta: dict, convs: list) -> int:
    """Start `dst` (a budget's answers cache, absent) from a shipped copy made for the same target and budget: its
    description must equal `meta` in every key `meta` has (the target's exact fingerprint, the data and the answer
    settings), and each row's conversation must be the budget's at that index. Rows that do not fit are left out
    (generated as usual). -> rows seeded (0: nothing shipped, or shipped for something else)."""
    if dst.exists() or not shipped.is_file() or not shipped_meta(shipped).is_file():
        return 0
    desc = json.loads(shipped_meta(shipped).read_text())
    if any(desc.get(k) != v for k, v in meta.items()):
        return 0
    rows = {i: e for i, e in read_done(shipped).items() if i < len(convs) and convs[i].conv_id == e.conv_id}
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.write_text("".join(row_json(i, e) for i, e in sorted(rows.items())), encoding="utf-8")
    tmp.rename(dst)
    return len(rows)


def ship_answers(src: Path, out: Path, meta: dict) -> Path | None:
    """A finished answers cache copied to `out` (the model's weights folder), with its description, for the next
    machine to seed from. A shipped copy is never overwritten, only grown: by a cache for the same target and settings
    (`meta`) that holds every shipped row unchanged and more (train.subset above the budget's conversations)."""
    rows, desc = read_done(src), {**meta}
    if out.exists():
        old, desc = read_done(out), json.loads(shipped_meta(out).read_text()) if shipped_meta(out).is_file() else {}
        if len(rows) <= len(old) or any(desc.get(k) != v for k, v in meta.items() if k not in ("git", "date")) \
                or any(rows.get(i) != e for i, e in old.items()):
            return None
        # the first rows keep their provenance; the growth is recorded beside it
        desc["added"] = [*desc.get("added", []), {"rows": f"{len(old)}-{len(rows) - 1}", "git": meta.get("git"),
                                                   "date": meta.get("date")}]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("".join(row_json(i, e) for i, e in sorted(rows.items())), encoding="utf-8")
    shipped_meta(out).write_text(json.dumps({**desc, "rows": len(rows)}, indent=1, sort_keys=True) + "\n")
    tmp.rename(out)
    return out
