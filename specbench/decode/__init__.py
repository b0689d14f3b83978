"""The decoding core: the tree-verification engine and everything a decode needs, importing nothing from the
rest of specbench (only specbench.errors).

types (DraftTree, TargetState, Lookahead, SamplingParams), tree (masks, positions, ancestors), verify (greedy and
speculative-sampling acceptance as pure functions), outcome (a step's emitted tokens, stops and counters, decided on
the device and read once), sampling, kvcache (the preallocated cache), compiled (the
torch.compile'd target and drafter forwards over static caches), target (TargetModel: prefill / verify forwards),
drafter (the Drafter protocol and the TrainableDrafter contract), engine (Engine.generate / generate_batch),
roundtrips (host-read counting), identity and checkpoints (which target a drafter's weights belong to; their files),
vocab (draft vocabularies: pruned LM heads).
"""
