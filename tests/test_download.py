"""The authors' published drafter weights per model (conf/model/<name>.yaml: published): `make download` fetches them
where the drafter configs look, and a sweep missing them says which command makes them."""
import pytest
from hydra import compose, initialize_config_dir

from specbench.core.config import ModelConfig, register_schema, to_dataclass
from specbench.tools.download import download
from specbench.errors import SpecbenchError
from specbench.bench.sweep import missing_weights
from tests.conftest import CONF


def composed(*overrides):
    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_models_list_the_published_checkpoints_that_exist():
    published = {m: to_dataclass(ModelConfig, composed(f"model={m}").model).published
                 for m in ("vicuna-7b", "llama2-7b", "llama3-8b", "smollm2-135m")}
    assert published["vicuna-7b"] == {"eagle": "yuhuili/EAGLE-Vicuna-7B-v1.3",
                                      "medusa": "FasterDecoding/medusa-vicuna-7b-v1.3", "sd": "double7/vicuna-68m"}
    assert published["llama2-7b"] == {"eagle": "yuhuili/EAGLE-llama2-chat-7B", "hass": "HArmonizedSS/HASS-LLaMA2-Chat-7B"}
    assert published["llama3-8b"] == {"eagle": "yuhuili/EAGLE-LLaMA3-Instruct-8B",
                                      "hass": "HArmonizedSS/HASS-LLaMA3-Instruct-8B",
                                      "moa": "huawei-noah/MOASpec-Llama-3-8B-Instruct"}
    assert published["smollm2-135m"] == {}


def test_the_preflight_names_download_or_train():
    eagle2 = missing_weights(composed("model=vicuna-7b", "drafter=eagle2"))
    assert "download the authors' (yuhuili/EAGLE-Vicuna-7B-v1.3) with `make download MODEL=vicuna-7b`" in eagle2
    beagle = missing_weights(composed("model=vicuna-7b", "drafter=beagle"))  # no Beagle weights are public
    assert "make train MODEL=vicuna-7b TRAIN_DRAFTERS=beagle" in beagle
    assert missing_weights(composed("drafter=eagle2")) is None  # the embedded target's are committed


def test_download_without_hub_access_is_one_line(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    model = to_dataclass(ModelConfig, composed("model=llama3-8b").model)
    with pytest.raises(SpecbenchError) as e:
        download(model, tmp_path / "weights")
    assert "yuhuili/EAGLE-LLaMA3-Instruct-8B could not be downloaded" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SpecbenchError, match="lists no published drafter weights"):
        download(to_dataclass(ModelConfig, composed().model), tmp_path / "weights")
