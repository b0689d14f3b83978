"""Drafters: one module per method, all decoding through the shared engine (specbench/decode/engine.py).

Adding a drafter, in three steps:

1. Write `drafters/<name>.py` with a class implementing `specbench.decode.drafter.Drafter` through the rows
   protocol, which the engine drives at every batch size, 1 included (`RowsDrafter` first in its bases:
   `prefill_rows(state)`, `propose_rows(state) -> DraftTree`, `on_verified_rows(state)`, `keep_rows(leave)`,
   every live row in the same forwards), and a class-level `needs` (a subset of {"hidden", "kv", "layers"}) naming
   the target outputs it reads from `TargetState`. A drafter with only the one-row methods (`prefill`, `propose`,
   `on_verified`) decodes at batch 1. Its constructor takes `target` (a `specbench.decode.target.TargetModel`, for
   the vocabulary, device and frozen weights) plus its options. It never calls the target or touches the target's
   cache; its own keys and values live in a `specbench.decode.draftcache.DraftCache`, which keeps each row's length,
   drops drafted entries and follows a leaving row (`CachedRows` in place of `RowsDrafter` gives that keep_rows). `pld.py` is the worked example (no weights, deterministic);
   `sd.py` keeps a draft model and its own KV cache.
2. Write `conf/drafter/<name>.yaml` opening with the command that uses it, with `_target_: drafters.<name>.<Class>`,
   `name: <name>` and the constructor options. The engine has no per-method branches: that file is the registration.
3. Run `make test`: the conformance suite (tests/test_conformance.py) picks up every YAML in conf/drafter/ and checks
   greedy output == the target's greedy output token for token (several prompts, EOS inside a tree, max_new_tokens
   mid-tree) and that proposals depend only on the verified tokens (correct rollback) over many steps.
"""
