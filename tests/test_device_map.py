"""A target split over GPUs (model.device_map), checked without GPUs: the placement the engine and the drafters need,
NVML by UUID, memory and sync over every device. What only real GPUs can show (kernels on two devices, NCCL) is not
claimed here: the conformance test decodes every layer through the same mapped path on the CPU."""
from types import SimpleNamespace

import pytest
import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM, LlamaConfig

from specbench.errors import SpecbenchError
from specbench.core.metrics import PeakMemory, nvml_handle
from specbench.core.models import pin_engine_modules


@pytest.fixture(scope="module")
def meta_llama():
    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(cfg)


def test_the_norm_rotary_and_lm_head_come_home_to_the_embeddings_gpu(meta_llama):
    """accelerate's balanced map of a 2-GPU box puts the final norm and the LM head after the last layer, on GPU 1:
    every learned drafter (EAGLE's features through target.lm_head, Medusa, MoA) then indexed across devices."""
    accelerate_map = {"model.embed_tokens": 0, "model.rotary_emb": 1, "model.layers.0": 0, "model.layers.1": 0,
                      "model.layers.2": 0, "model.layers.3": 0, "model.layers.4": 1, "model.layers.5": 1,
                      "model.layers.6": 1, "model.layers.7": 1, "model.norm": 1, "lm_head": 1}
    full = pin_engine_modules(meta_llama, accelerate_map)
    assert {k: full[k] for k in ("model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head")} == dict.fromkeys(
        ("model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head"), 0)
    assert [full[f"model.layers.{i}"] for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # the layers stay split


def test_a_coarse_user_map_is_spelt_out_and_pinned(meta_llama):
    full = pin_engine_modules(meta_llama, {"model": 1, "model.layers.6": 2, "model.layers.7": 2, "lm_head": 2})
    assert full["model.embed_tokens"] == full["model.norm"] == full["lm_head"] == full["model.rotary_emb"] == 1
    assert full["model.layers.5"] == 1 and full["model.layers.7"] == 2
    with pytest.raises(SpecbenchError, match="places no module named 'model.embed_tokens'"):
        pin_engine_modules(meta_llama, {"model.layers": 0, "lm_head": 0})


def test_nvml_is_asked_by_uuid_not_by_cuda_ordinal(monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=3 torch's cuda:0 is NVML's GPU 3: the handle must come from the UUID."""
    asked = []
    fake = SimpleNamespace(nvmlDeviceGetHandleByUUID=lambda u: asked.append(u) or "handle",
                           nvmlDeviceGetHandleByIndex=lambda i: pytest.fail("looked up by ordinal"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(uuid="5d2a-ff"))
    assert nvml_handle(fake, torch.device("cuda", 0)) == "handle" and asked == ["GPU-5d2a-ff"]


def test_memory_covers_every_device_of_the_target(monkeypatch):
    peaks = {0: 5, 1: 7}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: peaks[d.index])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: peaks.__setitem__(d.index, 0))
    mem = PeakMemory((torch.device("cuda", 0), torch.device("cuda", 1)))
    mem._nvml = []  # (no NVML here; its lookup is the test above)
    assert mem.read() == {"peak_mem_bytes": 12, "peak_mem_bytes_per_device": [5, 7]}
    mem.reset()
    assert mem.read()["peak_mem_bytes"] == 0
    cpu = PeakMemory(torch.device("cpu")).read()
    assert cpu["peak_mem_bytes"] > 0


def test_sync_waits_on_every_device(monkeypatch):
    from specbench.decode.engine import sync

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: synced.append(d.index))
    sync((torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")))
    assert synced == [0, 1]
