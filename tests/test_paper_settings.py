"""The settings the methods' papers and authors' code fix, as the YAMLs compose them (issue 46): a change to one of
these changes what a table measures, so it is made here on purpose, with its docs, not by a stray edit."""
import pytest


@pytest.mark.parametrize(("drafter", "key", "value"), [
    # EAGLE-3 evaluated as its authors' scripts run it: --depth 5 --top-k 10 --total-token 60 (6 levels here)
    ("eagle3", "tree.depth", 6), ("eagle3", "tree.topk", 10), ("eagle3", "tree.total_tokens", 60),
    ("eagle3", "paper_tree.depth", 6),
    # its draft vocabulary sized by the coverage rule, not the authors' fixed 32,000 of Llama-3's vocabulary
    ("eagle3", "drafter.module.draft_vocab", None), ("eagle3", "drafter.module.draft_vocab_coverage", 0.995),
    # Beagle's App. A.3: constant lr after 2,000 warm-up steps
    ("beagle", "drafter.optim.lr_schedule", "constant"), ("beagle", "drafter.optim.warmup_steps", 2000),
    # MoA at its authors' code's widths; HASS with its authors' training attention
    ("moa", "drafter.module.widths", "code"), ("moa_tli1", "drafter.module.widths", "code"),
    ("hass", "drafter.module.train_attention", "authors"),
])
def test_a_drafter_composes_with_its_authors_setting(make_cfg, drafter, key, value):
    from omegaconf import OmegaConf

    assert OmegaConf.select(make_cfg(f"drafter={drafter}"), key) == value
