"""The baseline's import path in its config (conf/drafter/none.yaml: `_target_: drafters.base.NoDrafter`), kept
because run names hash the drafter config: the committed baseline runs keep their names. The contracts themselves
(Drafter, NoDrafter, TrainableDrafter) live in specbench/decode/drafter.py; drafters/ imports specbench/, never the reverse."""
from specbench.decode.drafter import NoDrafter

__all__ = ["NoDrafter"]
