"""A drafter's target, recognised in any dtype (specbench/decode/identity.py): fp32, bf16 and fp16 loads of the same weights
are one target; other weights are not."""
import json
from pathlib import Path

import pytest
import torch

from specbench.decode.checkpoints import check_target, target_identity
from specbench.errors import SpecbenchError
from specbench.decode.identity import mismatch, signature
from tests.helpers import tiny_llama, tiny_target

REPO = Path(__file__).resolve().parents[1]


def test_the_same_weights_match_in_every_dtype_and_other_weights_do_not():
    ref = signature(tiny_llama(seed=0))
    for cast in ([torch.bfloat16], [torch.float16], [torch.float16, torch.bfloat16], [torch.bfloat16, torch.float16]):
        m = tiny_llama(seed=0)
        for dtype in cast:  # double rounding included (an fp16 copy served in bf16)
            m.to(dtype)
        assert mismatch(ref, signature(m)) is None, cast
    assert "differs" in mismatch(ref, signature(tiny_llama(seed=1)))  # another model of the same shape
    tuned = tiny_llama(seed=0)
    with torch.no_grad():  # a fine-tune: every weight moved by 5%
        for p in tuned.parameters():
            p.mul_(1.05)
    assert "differs" in mismatch(ref, signature(tuned))
    assert mismatch(ref, signature(tiny_llama(seed=0, hidden=64))) == "its tensor names or shapes differ"


def test_a_checkpoint_of_an_fp32_target_loads_on_its_bf16_copy_and_not_on_another(tmp_path):
    """The measured defect: the exact fingerprint refused every committed drafter under model.dtype=bfloat16."""
    fp32 = tiny_target(seed=0)
    meta = {"target": "tiny", **target_identity(fp32)}
    bf16 = tiny_target(seed=0)
    bf16.model.to(torch.bfloat16)
    check_target(tmp_path, meta, bf16)
    legacy = {"target": "tiny", "target_fingerprint": meta["target_fingerprint"]}  # before signatures
    check_target(tmp_path, legacy, fp32)
    with pytest.raises(SpecbenchError, match="exact fingerprint only"):
        check_target(tmp_path, legacy, bf16)
    with pytest.raises(SpecbenchError, match="trained for target 'tiny', not the loaded"):
        check_target(tmp_path, meta, tiny_target(seed=3))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_committed_drafters_load_on_the_embedded_target_in_half_precision(make_cfg, dtype):
    """Every committed drafter's recorded target is the embedded SmolLM2 loaded in bf16 or fp16, and its weights load
    into the module its config builds today (every name and shape: a rebuilt module orphans old weights)."""
    from hydra.utils import get_class

    from specbench.core.config import ModelConfig, to_dataclass
    from specbench.core.models import load_model
    from specbench.decode.target import TargetModel

    cfg = make_cfg(f"model.dtype={dtype}", tiny=False)
    mc = to_dataclass(ModelConfig, cfg.model)
    model, tok, dev = load_model(mc)
    target = TargetModel(model, tok, dev, mc.name)
    assert target.dtype == getattr(torch, dtype)
    metas = sorted((REPO / "weights" / "smollm2-135m").glob("*/config.json"))
    assert len(metas) >= 9
    misfits = set()
    for path in metas:
        check_target(path.parent, json.loads(path.read_text()), target)
        cls = get_class(make_cfg(f"drafter={path.parent.name}", tiny=False).drafter._target_)
        try:
            module = cls.load_module(target, str(path.parent), None)
        except SpecbenchError as e:
            assert "does not fit" in str(e), e
            misfits.add(path.parent.name)
            continue
        # every floating tensor in the target's dtype (EAGLE-3's d2t is an integer buffer-like parameter)
        assert {p.dtype for p in module.parameters() if p.is_floating_point()} == {target.dtype}, path.parent.name
    assert not misfits  # every committed drafter loads (moa_tli1 did not, until retrained for MoA's rebuilt module)
