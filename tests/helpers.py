"""Tiny real models and test drafters (no mocks of the engine)."""
from __future__ import annotations

import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specbench.decode.drafter import Drafter
from specbench.decode.engine import Engine
from specbench.decode.target import TargetModel
from specbench.decode.types import DraftTree, SamplingParams, TargetState


def tiny_llama(vocab: int = 128, layers: int = 6, hidden: int = 32, seed: int = 0, eos: int | None = None,
               scale: float = 1.0) -> LlamaForCausalLM:
    """A random Llama; `scale` sharpens its distributions (larger logits) so greedy text has structure to draft."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=eos, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos if eos is not None else 0
    return model


def tiny_target(**kw) -> TargetModel:
    return TargetModel(tiny_llama(**kw), None, torch.device("cpu"), "tiny")


def hf_greedy(model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=model.generation_config.eos_token_id, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class RandomTreeDrafter(Drafter):
    """Random trees that know part of the true greedy continuation (`reference`): right and wrong siblings in random
    order, so verification meets non-contiguous accepted nodes, rejections at every depth and EOS inside trees.
    With `sampling=True` every child is an iid sample from a per-node random q (SpecInfer-style siblings) and
    draft_probs carries q; otherwise children are deterministic (q = None)."""

    name = "random-tree"

    def __init__(self, vocab: int, reference: list[int] | None = None, seed: int = 0, sampling: bool = False,
                 max_depth: int = 4, width: int = 3):
        self.vocab, self.reference, self.sampling = vocab, reference or [], sampling
        self.rng = random.Random(seed)
        self.max_depth, self.width = max_depth, width
        self.prompt_len = 0

    def prefill(self, state: TargetState) -> None:
        self.prompt_len = state.num_tokens - 1

    def _q(self, key: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(key)
        return torch.softmax(3 * torch.randn(self.vocab, generator=g), -1)

    def propose(self, state: TargetState) -> DraftTree:
        pos = state.num_tokens - self.prompt_len  # index in the continuation of the next token
        tokens, parents, qs = [], [], []
        frontier = [(-1, pos)]
        for _depth in range(self.rng.randint(0, self.max_depth)):
            nxt = []
            for parent, p in frontier:
                q = self._q(self.rng.randrange(1 << 30))
                kids = self.rng.randint(1, self.width)
                for _ in range(kids):
                    if self.sampling:
                        tok = int(torch.multinomial(q, 1, generator=state.generator).item())
                    elif p < len(self.reference) and self.rng.random() < 0.6:
                        tok = self.reference[p]
                    else:
                        tok = self.rng.randrange(self.vocab)
                    tokens.append(tok)
                    parents.append(parent)
                    qs.append(q)
                    nxt.append((len(tokens) - 1, p + 1))
            frontier = [f for f in nxt if self.rng.random() < 0.7] or nxt[:1]
        if not tokens:
            return DraftTree.empty()
        probs = torch.stack(qs)[None] if self.sampling else None
        return DraftTree(torch.tensor([tokens]), torch.tensor([parents]), probs)

    def on_verified(self, state: TargetState) -> None:
        pass

    # the rows protocol (a test double: row by row in Python, each row's tree as at batch 1, the RNG shared in row
    # order; a row samples from its own generator)
    batched = True

    def prefill_rows(self, state: TargetState) -> None:
        self.prompt_lens = [n - 1 for n in (state.lengths or [state.num_tokens] * state.rows)]

    def propose_rows(self, state: TargetState) -> DraftTree:
        trees = []
        for r, n in enumerate(self.prompt_lens):
            self.prompt_len = n
            trees.append(self.propose(state.row(r)) if state.lengths is not None else self.propose(state))
        return DraftTree.stack(trees)

    def on_verified_rows(self, state: TargetState) -> None:
        pass

    def keep_rows(self, leave) -> None:
        self.prompt_lens = [self.prompt_lens[i] for i in leave.index]


def engine_greedy(target: TargetModel, drafter: Drafter, prompt: list[int], max_new_tokens: int) -> list[int]:
    return Engine(target, drafter, SamplingParams()).generate(prompt, max_new_tokens).new_tokens
