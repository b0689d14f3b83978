"""Training every drafter on one budget: the target's self-distilled answers (selfdistill), the frozen target's
features (features), the one Trainer (trainer; `python -m specbench.train` runs it), and the list of trainable
drafters (trainable). Imports decode, core and data only.
"""
