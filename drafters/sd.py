"""Vanilla speculative decoding (Leviathan et al. 2023, Algorithm 1; papers/001): an independent draft model M_q
that shares the target's tokenizer drafts a chain of gamma tokens x_i ~ q_i(x) (argmax at T=0); the engine verifies
them with min(1, p/q) and samples the recovered token from norm(max(0, p - q)).

The draft model is any HF causal LM with the target's vocabulary (`model_path`), or, when none is given, a copy of the
target that keeps only `keep_layers` of its decoder layers (an untrained early-exit model: a weak but honest drafter
until the distilled one from the training pipeline exists). The drafter keeps its own KV cache and crops it back to
the verified prefix after each step.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from drafters.base import Drafter
from specbench.errors import SpecbenchError
from specbench.sampling import logits_to_probs, sample
from specbench.types import DraftTree, TargetState, VerifyResult


def keep_decoder_layers(model: PreTrainedModel, layers: list[int]) -> PreTrainedModel:
    """A new model of the same class holding copies of `layers` (in order), the embeddings, final norm and LM head."""
    n = model.config.num_hidden_layers
    if not layers or any(not 0 <= i < n for i in layers):
        raise SpecbenchError(f"keep_layers must name layers in 0..{n - 1}, got {layers}")
    cfg = model.config.__class__.from_dict(model.config.to_dict())
    cfg.num_hidden_layers = len(layers)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [model.config.layer_types[i] for i in layers]
    small = type(model)(cfg).to(dtype=model.dtype, device=model.device)
    remap = {f".layers.{i}.": f".layers.{j}." for j, i in enumerate(layers)}
    state = {}
    for key, value in model.state_dict().items():
        if ".layers." in key:
            head, rest = key.split(".layers.", 1)
            idx, tail = rest.split(".", 1)
            new = remap.get(f".layers.{idx}.")
            if new is None:
                continue
            key = f"{head}{new}{tail}"
        state[key] = value.clone()
    small.load_state_dict(state, strict=True)
    return small.eval().requires_grad_(False)


class IndependentDrafter(Drafter):
    name = "sd"

    def __init__(self, target, gamma: int = 5, model_path: str | None = None, keep_layers: list[int] | None = None):
        if gamma < 1:
            raise SpecbenchError("sd: gamma must be >= 1")
        self.gamma = gamma
        if model_path:
            try:
                self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=target.dtype).to(target.device)
            except OSError as e:
                raise SpecbenchError(f"sd: draft model {model_path!r} could not be loaded: {str(e).splitlines()[0]}") from None
            self.model.eval().requires_grad_(False)
            vocab = self.model.get_output_embeddings().weight.shape[0]
            if vocab != target.vocab_size:
                raise SpecbenchError(f"sd: draft model vocabulary {vocab} != target vocabulary {target.vocab_size}")
        else:
            self.model = keep_decoder_layers(target.model, list(keep_layers or [0]))
        self.cache: DynamicCache | None = None
        self.cached = 0  # tokens in self.cache: always a prefix of the verified tokens plus the last drafts

    def prefill(self, state: TargetState) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.cached = 0

    @torch.inference_mode()
    def _next_logits(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cached += ids.shape[1]
        return out.logits[:, -1]  # [B, V]

    def propose(self, state: TargetState) -> DraftTree:
        logits = self._next_logits(state.tokens[:, self.cached :])
        tokens, qs = [], []
        for i in range(self.gamma):
            if state.sampling.greedy:
                x = logits.argmax(-1)  # [B]
            else:
                q = logits_to_probs(logits, state.sampling)  # [B, V]
                x = sample(q, state.generator)
                qs.append(q)
            tokens.append(x)
            if i + 1 < self.gamma:
                logits = self._next_logits(x[:, None])
        probs = torch.stack(qs, dim=1) if qs else None  # [B, gamma, V]
        return DraftTree.chain(torch.stack(tokens, dim=1), probs)

    def on_verified(self, result: VerifyResult, state: TargetState) -> None:
        # cache = verified tokens before this step + drafts x_1..x_{gamma-1}; keep the accepted ones
        before = state.num_tokens - len(result.emitted)
        keep = before + min(result.accept_length, self.gamma - 1)
        self.cache.crop(keep - self.cached)
        self.cached = keep
