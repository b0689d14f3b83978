"""Vanilla speculative decoding (Leviathan et al. 2023, Algorithm 1; papers/001): an independent draft model M_q
that shares the target's tokenizer drafts a chain of gamma tokens x_i ~ q_i(x) (argmax at T=0); the engine verifies
them with min(1, p/q) and samples the recovered token from norm(max(0, p - q)).

Draft model, in order of precedence:
- `model_path`: any HF causal LM with the target's vocabulary (e.g. JackFram/llama-68m for Llama-2);
- otherwise our own small Llama, as MoA's "Independent" baseline (papers/002): the target's embeddings and LM head
  (shared, frozen, not saved) and `len(module.init_layers)` decoder layers initialised from those target layers
  (negative indices count from the end), trained by distillation, KL(p_target || q_draft) on assistant tokens, by the
  shared trainer (`python -m specbench.train drafter=sd`). `checkpoint` loads the trained layers; without one the
  module is the untrained layer-truncated target (lossless, weak).

`tree` (conf/drafter/sd_tree.yaml): instead of the chain, the same draft model grows a draft tree with a shared
policy (drafters/trees.py), as MoA decodes its "Independent" baseline (EAGLE-2's dynamic tree, papers/002 Sec. 4).
Tree nodes are deterministic top-k choices, so at T>0 they are verified with q = 1 (lossless, but not Algorithm 1's
sampled chain: `gamma` is then unused).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from specbench.decode.drafter import OwnTree, TrainableDrafter, chain_paths
from drafters.distill import kl, teacher_probs, top1
from drafters.trees import GrowingTree, Grown, Level, make_tree
from specbench.decode.checkpoints import resolve
from specbench.decode.compiled import decode
from specbench.decode.draftcache import CachedRows, CompiledTree, DraftCache
from specbench.errors import SpecbenchError
from specbench.decode.rows import RowCounts
from specbench.decode.sampling import logits_to_probs, sample
from specbench.decode.types import DraftTree, SamplingParams, TargetState
from specbench.decode.verifier import Crossing


def small_llama(target, init_layers: list[int]) -> PreTrainedModel:
    """A stock HF causal LM of the target's class with copies of `init_layers` and the target's own embedding and
    LM head modules (shared by reference, frozen)."""
    big = target.model
    n = big.config.num_hidden_layers
    layers = [i % n for i in init_layers]
    if not layers or any(not -n <= i < n for i in init_layers):
        raise SpecbenchError(f"sd: init_layers must index the target's {n} layers, got {list(init_layers)}")
    cfg = big.config.__class__.from_dict(big.config.to_dict())
    cfg.num_hidden_layers = len(layers)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [big.config.layer_types[i] for i in layers]
    small = type(big)(cfg).to(dtype=big.dtype, device=big.device)
    decoder, big_decoder = small.get_decoder(), big.get_decoder()
    with torch.no_grad():
        for j, i in enumerate(layers):
            decoder.layers[j].load_state_dict(big_decoder.layers[i].state_dict(), strict=True)
        decoder.norm.load_state_dict(big_decoder.norm.state_dict(), strict=True)
    decoder.embed_tokens = big_decoder.embed_tokens  # shared: the target's, frozen
    small.lm_head = big.get_output_embeddings()
    small.requires_grad_(True)
    decoder.embed_tokens.requires_grad_(False)
    small.lm_head.requires_grad_(False)
    return small


def hidden_states(module: PreTrainedModel, input_ids: torch.Tensor, **kw) -> torch.Tensor:
    """The small model's last hidden states in training, where its own layers are fp32 masters and the embedding it
    shares with the target is in the target's dtype (bf16 on a GPU): the embeddings are cast to the layers' dtype."""
    decoder = module.get_decoder()
    emb = decoder.embed_tokens(input_ids).to(decoder.norm.weight.dtype)
    return decoder(inputs_embeds=emb, use_cache="past_key_values" in kw, **kw).last_hidden_state


def head(module: PreTrainedModel, hs: torch.Tensor) -> torch.Tensor:
    """The shared LM head (the target's dtype) on the small model's hidden states."""
    return module.lm_head(hs.to(module.lm_head.weight.dtype))


def published_draft(checkpoint: str | None) -> str | None:
    """The checkpoint directory when it holds a whole HF causal LM (a published draft such as Spec-Bench's
    double7/vicuna-68m, put into weights/<model>/sd by `make download`) rather than a specbench checkpoint."""
    if not checkpoint:
        return None
    cfg = resolve(checkpoint) / "config.json"
    if not cfg.is_file():
        return None
    meta = json.loads(cfg.read_text())
    return str(resolve(checkpoint)) if "drafter" not in meta and "model_type" in meta else None


def check_same_tokenizer(model_path: str, target) -> None:
    """A draft model must map text to ids as the target does: the same token at the same id, every one (a row count
    would let Llama-2 + Mistral through, drafting garbage). Their embedding tables may be padded to different sizes
    (Qwen2.5-0.5B and -7B): the drafter then works on the rows both have (`fit_vocab`)."""
    if target.tokenizer is None:  # a bare target (tests): nothing to compare
        return
    try:
        draft = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        raise SpecbenchError(f"sd: draft model {model_path!r} has no tokenizer to compare with the target's: "
                             f"{str(e).splitlines()[0]}") from None
    ours, theirs = target.tokenizer.get_vocab(), draft.get_vocab()
    if ours != theirs:
        tok = next(t for t in sorted(set(ours) | set(theirs)) if ours.get(t) != theirs.get(t))
        raise SpecbenchError(f"sd: draft model {model_path!r} tokenizes differently from the target: {tok!r} is id "
                             f"{theirs.get(tok)} there and {ours.get(tok)} in the target ({len(theirs)} vs "
                             f"{len(ours)} tokens)")


def fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits [..., V_draft] on the target's rows [..., vocab]: rows the target lacks are dropped, rows the
    draft lacks can never be drafted (-inf)."""
    v = logits.shape[-1]
    if v == vocab:
        return logits
    if v > vocab:
        return logits[..., :vocab]
    return torch.nn.functional.pad(logits, (0, vocab - v), value=float("-inf"))


@dataclass
class SDOptions:
    init_layers: list[int] = field(default_factory=lambda: [0, -1])  # target layers copied before distillation


class IndependentDrafter(CachedRows, TrainableDrafter):
    name = "sd"
    Options = SDOptions

    def __init__(self, target, gamma: int = 5, model_path: str | None = None, checkpoint: str | None = None,
                 module: dict | None = None, tree: dict | None = None):
        if gamma < 1:
            raise SpecbenchError("sd: gamma must be >= 1")
        self.gamma = gamma
        self.vocab = target.vocab_size  # drafts are made on the target's rows
        self.policy = make_tree(**tree) if tree else None  # None: the chain of gamma tokens (Algorithm 1)
        self.region = CompiledTree()  # model.compile: a tree's growth, compiled
        model_path = model_path or published_draft(checkpoint)
        if model_path:  # an HF draft model: the checkpoint (our trained small Llama) does not apply
            try:
                self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=target.dtype).to(target.device)
            except OSError as e:
                raise SpecbenchError(f"sd: draft model {model_path!r} could not be loaded: {str(e).splitlines()[0]}") from None
            check_same_tokenizer(model_path, target)
        else:
            self.model = self.load_module(target, checkpoint, module)
        self.model.eval().requires_grad_(False)
        self.target = target
        self.cache: DraftCache | None = None  # the draft model's, per generation (prefill_rows)
        self.plain = True  # its logits are LM-head(hidden) (set per generation from its config, prefill_rows)

    @classmethod
    def own_tree(cls, spec: dict) -> OwnTree | None:
        """The chain (no tree policy): tree=auto tunes gamma, its first n drafts being a gamma-n chain's."""
        if spec.get("tree") is not None:
            return None
        n = int(spec.get("gamma", 5))
        return OwnTree({"kind": "static", "name": f"chain of {n}", "paths": chain_paths(n)},
                       lambda s, cut: {**s, "gamma": len(cut["paths"])})

    # ---- training side -------------------------------------------------------------------------------------------
    @classmethod
    def build_module(cls, target, opts: SDOptions) -> PreTrainedModel:
        return small_llama(target, list(opts.init_layers))

    @classmethod
    def training_loss(cls, module, batch, target, opts: SDOptions):
        del opts  # the loss has no option
        # the 49k-way LM heads (student and teacher) dominate the cost: apply them only where there is a loss
        # (assistant tokens: ~40% of the real tokens, fewer of the padded ones), not on every position
        hs = hidden_states(module, batch.input_ids, attention_mask=batch.attn_mask)
        mask = batch.loss_mask[:, 1:].bool()  # position t predicts token t+1
        logq = head(module, hs[:, :-1][mask]).float().log_softmax(-1)  # [N, V]
        p = teacher_probs(target, batch.hidden[:, :-1][mask])  # [N, V]
        loss = kl(p, logq)
        return loss, {"kl": loss.item(), "top1": top1(logq, p)}

    @classmethod
    @torch.no_grad()
    def chain_predict(cls, module, input_ids, hidden, positions, depth, target):
        out = []
        for t in positions:
            cache = DynamicCache(config=module.config)
            logits = head(module, hidden_states(module, input_ids[None, : t + 1], past_key_values=cache)[:, -1])
            row = []
            for _ in range(depth):
                x = logits.argmax(-1)
                row.append(x)
                logits = head(module, hidden_states(module, x[:, None], past_key_values=cache)[:, -1])
            out.append(torch.cat(row))
        return torch.stack(out)  # [P, depth]

    # ---- decoding side -------------------------------------------------------------------------------------------
    # The draft model's cache (specbench/decode/draftcache.py) holds one row per batch row at every B, 1 included
    # (each row's verified tokens, then its drafts, behind its own length); a row's catch-up tokens are fed
    # left-aligned, causal among themselves, and every chain step or tree level is one forward for all rows.
    def prefill_rows(self, state: TargetState) -> None:
        cfg = self.model.config
        # model.compile compiles the draft model's decoder (its LM head applied after it, eagerly): a model whose
        # logits are more than LM-head(hidden) (a logit scale or soft-cap) keeps its own forward
        text = cfg.get_text_config()
        self.plain = (getattr(text, "logits_scaling", 1.0) in (None, 1.0)
                      and not any(getattr(text, k, None) for k in ("logit_scale", "final_logit_softcapping")))
        self.cache = DraftCache.for_decoder(self.target, cfg, state, self.model.get_decoder() if self.plain else None)

    def _logits(self, ids: torch.Tensor, counts: RowCounts | None = None, laid_out: bool = False,
                **kw) -> torch.Tensor:
        """The draft model on ids [A, Q] over its cache -> logits on the target's rows, [A, Q, V] or, with `counts`
        [A], each row's last column counts[b] - 1 only ([A, V]: the LM head applied to those positions alone).
        laid_out: inside CompiledTree's region (specbench/decode/compiled.py decode)."""
        def pick(x: torch.Tensor) -> torch.Tensor:
            return x if counts is None else counts.last(x)
        if self.plain:  # (model.compile: the compiled decoder on its static cache)
            hidden = decode(self.model.get_decoder(), self.cache.cache, laid_out, input_ids=ids, **kw)
            logits = self.model.get_output_embeddings()(pick(hidden))
        else:
            logits = pick(self.model(input_ids=ids, past_key_values=self.cache.cache, use_cache=True, **kw).logits)
        return fit_vocab(logits, self.vocab)

    def _append(self, ids: torch.Tensor, counts: RowCounts) -> torch.Tensor:
        """Row b's counts[b] tokens of ids [A, Q] (left-aligned) written behind its cached ones -> the logits after
        each row's last one [A, V]."""
        pos, mask = self.cache.extend(counts, ids.shape[1], self.model.get_output_embeddings().weight.dtype)
        logits = self._logits(ids, counts, position_ids=pos, attention_mask=mask)
        self.cache.commit(counts)
        return logits

    @torch.inference_mode()
    def propose_rows(self, state: TargetState) -> DraftTree:
        logits = self._catch_up(state)  # [A, V]
        if self.policy is not None:  # (model.compile: the whole tree one compiled region)
            return self.cache.grow(self._grow, logits, self.region, self.policy, logits.shape[-1])
        return DraftTree.chain(*self._chain(logits, self.gamma, state, state.sampling))

    def _catch_up(self, state: TargetState) -> torch.Tensor:
        """The verified tokens the draft model has not read, appended -> the logits after each row's last one [A, V]."""
        counts, ids = self.cache.unseen(state)
        return self._append(ids, counts)

    def _chain(self, logits: torch.Tensor, n: int, state: TargetState,
               sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        """n tokens, each drawn from the logits after the one before (logits [A, V]: after each row's last verified
        token) and fed back -> tokens [A, n] and the laws q [A, n, V] they were sampled from (None when greedy)."""
        one = RowCounts.copy([1] * state.rows, state.tokens.device)
        tokens, qs = [], []
        gens = state.generators or (state.generator,) * state.rows
        for i in range(n):
            if sampling.greedy:
                x = logits.argmax(-1)  # [A]
            else:
                q = logits_to_probs(logits, sampling)  # [A, V]
                x = torch.cat([sample(q[r : r + 1], g) for r, g in enumerate(gens)])  # each row its own RNG
                qs.append(q)
            tokens.append(x)
            if i + 1 < n:  # (a draft stays in the cache: on_verified_rows keeps the accepted ones)
                logits = self._append(x[:, None], one)
        return torch.stack(tokens, dim=1), torch.stack(qs, dim=1) if qs else None

    def _grow(self, root_logits: torch.Tensor, at, laid_out: bool) -> Grown:
        """Tree drafting (MoA's "Independent" row uses EAGLE-2's tree, papers/002 Sec. 4): root_logits [A, V] -> the
        policy's trees, each level one forward of the draft model at the positions and mask `at(seen [A, m, S],
        depth, dtype)` gives: each expanded node attends to its row's verified tokens, its ancestors and itself
        (laid_out: inside CompiledTree's region). Drafts are top-k choices (q = 1): lossless at any T."""
        book = GrowingTree(self.policy.max_nodes, root_logits.device, trees=root_logits.shape[0])

        def expand(level: Level) -> torch.Tensor:
            seen = book.add(level.nodes, level.parents)  # [A, m, S]
            pos, mask = at(seen, level.depth, self.model.get_output_embeddings().weight.dtype)
            return self._logits(level.tokens, laid_out=laid_out, position_ids=pos, attention_mask=mask)  # [A, m, V]

        return self.policy.grow_rows(root_logits, expand)

    def on_verified_rows(self, state: TargetState) -> None:
        if self.policy is not None:
            return  # the cache holds the verified tokens up to the old root; the new ones are fed at the next propose
        # row b's cache = its verified tokens before this step + drafts x_1..x_{gamma-1}; keep the accepted ones
        fresh = state.fresh  # accepted + 1 (a row still decoding emitted them all)
        self.cache.set_verified(state.lengths - fresh + (fresh - 1).clamp(max=self.gamma - 1))

    # ---- client-server split (specbench/deploy, issue 78) ----------------------------------------------------------
    def crossing(self) -> Crossing:
        """Split: an independent model reads nothing of the target; only the tokens cross (Table 7's 3A)."""
        return Crossing()

    @torch.inference_mode()
    def continue_alone(self, state: TargetState, max_new: int) -> torch.Tensor:
        """The target is gone (Table 4): the draft model continues as a plain LM, greedy, [A, max_new]."""
        return self._chain(self._catch_up(state), max_new, state, SamplingParams())[0]
