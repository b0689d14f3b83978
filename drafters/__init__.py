"""Drafters: one module per method, all decoding through the shared engine (specbench/decode/engine.py).

Adding a drafter, in three steps:

1. Write `drafters/<name>.py` with a class implementing `specbench.decode.drafter.Drafter`:
   `prefill(state)`, `propose(state) -> DraftTree`, `on_verified(result, state)`, and a class-level `needs`
   (a subset of {"hidden", "kv", "layers"}) naming the target outputs it reads from `TargetState`. For batches
   (decoding.batch_size > 1) it also implements the rows protocol (`batched = True`: `prefill_rows`,
   `propose_rows`, `on_verified_rows`, `keep_rows`, every live row in the same forwards; `RowsDrafter` derives the
   one-row methods from them); a drafter with the one-row methods only decodes at batch 1. Its constructor takes
   `target` (a `specbench.decode.target.TargetModel`, for the vocabulary, device and frozen weights) plus its options.
   It never calls the target or touches the target's cache; it rolls back its own state in `on_verified`.
   `pld.py` is the worked example (no weights, deterministic); `sd.py` keeps a draft model and its own KV cache.
2. Write `conf/drafter/<name>.yaml` opening with the command that uses it, with `_target_: drafters.<name>.<Class>`,
   `name: <name>` and the constructor options. The engine has no per-method branches: that file is the registration.
3. Run `make test`: the conformance suite (tests/test_conformance.py) picks up every YAML in conf/drafter/ and checks
   greedy output == the target's greedy output token for token (several prompts, EOS inside a tree, max_new_tokens
   mid-tree) and that proposals depend only on the verified tokens (correct rollback) over many steps.
"""
