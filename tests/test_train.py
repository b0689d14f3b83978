"""The training pipeline on a tiny target: conversations and loss masks, feature shards, the trainer (validation
logs, checkpoints, resume, target-fingerprint refusal) and DDP with two CPU processes (gloo)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drafters.beagle import BeagleDrafter
from drafters.coral import CoralDrafter, CoralRouterDrafter
from drafters.eagle import EagleDrafter
from drafters.eagle3 import Eagle3Drafter
from drafters.hass import HassDrafter
from drafters.medusa import MedusaDrafter
from drafters.moa import MoADrafter
from drafters.sd import IndependentDrafter
from specbench.core import envinfo
from specbench.decode.checkpoints import read_meta
from specbench.data.conversations import Conversation, encode, iter_records, load_conversations
from specbench.errors import SpecbenchError
from specbench.train.features import FeatureSet, extract
from specbench.core.models import load_model
from specbench.core.config import ModelConfig
from specbench.core.models import chat_prompt_ids
from specbench.core.records import read_jsonl
from specbench.train.selfdistill import read_done, target_answers
from specbench.decode.target import TargetModel
from specbench.train.trainer import Trainer
from tests.conftest import byte_tokenizer
from tests.helpers import engine_greedy, hf_greedy, tiny_llama

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def sharegpt_file(tmp_path) -> Path:
    convs = []
    for i in range(14):
        convs.append({"id": f"c{i}", "conversations": [
            {"from": "human", "value": f"Count from {i} please."},
            {"from": "gpt", "value": " ".join(str(i + j) for j in range(12))},
            {"from": "human", "value": "Again."},
            {"from": "gpt", "value": " ".join(str(i + j) for j in range(8))},
        ]})
    text = json.dumps(convs, indent=1)
    path = tmp_path / "convs.json"
    path.write_text(text[: len(text) - 40])  # cut off mid-record, like the packaged ShareGPT file
    return path


@pytest.fixture
def tiny_target(tiny_checkpoint) -> TargetModel:
    model, tok, dev = load_model(ModelConfig(name="tiny", hf_id="tiny", path=str(tiny_checkpoint)))
    return TargetModel(model, tok, dev, "tiny")


def test_truncated_json_array_decodes_record_by_record(sharegpt_file):
    recs = list(iter_records(sharegpt_file))
    assert len(recs) == 13 and recs[0]["id"] == "c0"


def test_split_is_deterministic_and_disjoint(sharegpt_file):
    train, val = load_conversations(sharegpt_file, 10, 3)
    assert [c.conv_id for c in train] == [f"c{i}" for i in range(10)]
    assert [c.conv_id for c in val] == ["c10", "c11", "c12"]
    with pytest.raises(SpecbenchError, match="only 13 usable"):
        load_conversations(sharegpt_file, 12, 3)


def test_loss_mask_covers_assistant_replies_only():
    tok = byte_tokenizer()
    conv = Conversation("x", (("user", "hi there"), ("assistant", "hello!"), ("user", "bye"), ("assistant", "ciao")))
    enc = encode(conv, tok, "be nice", 512)
    masked = tok.decode([t for t, m in zip(enc.input_ids, enc.loss_mask) if m])
    assert masked == "hello!<|im_end|>ciao<|im_end|>"
    cut = encode(conv, tok, None, 30)  # max_len truncates inside the first reply
    assert len(cut.input_ids) == 30 and 0 < sum(cut.loss_mask) < 6
    assert encode(conv, tok, None, 12) is None  # nothing trainable fits


def test_feature_shards_round_trip_and_resume(tiny_target, tmp_path, sharegpt_file):
    train, _ = load_conversations(sharegpt_file, 5, 0)
    enc = [encode(c, tiny_target.tokenizer, None, 200) for c in train]
    fs = extract(tiny_target, enc, tmp_path / "f", "float32", shard_size=2, kv=True)
    assert len(fs) == 5 and len(fs.manifest["shards"]) == 3
    x = fs.load(*fs.index()[3], kv=True)
    assert x["input_ids"].tolist() == enc[3].input_ids and x["loss_mask"].tolist() == enc[3].loss_mask
    fwd = tiny_target.forward(torch.tensor([enc[3].input_ids]), tiny_target.new_cache(), logits_rows=slice(0, 0))
    torch.testing.assert_close(x["hidden"], fwd.hidden[0])
    assert len(x["kv"]) == tiny_target.model.config.num_hidden_layers
    # interrupted after two shards: the manifest lists them, the third is redone
    manifest = json.loads((tmp_path / "f" / "manifest.json").read_text())
    manifest["shards"], manifest["complete"], manifest["count"] = manifest["shards"][:2], False, 4
    (tmp_path / "f" / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "f" / "shard-00002.safetensors").unlink()
    with pytest.raises(SpecbenchError, match="incomplete"):
        FeatureSet.open(tmp_path / "f")
    again = extract(tiny_target, enc, tmp_path / "f", "float32", shard_size=2, kv=True)
    assert len(again) == 5 and again.load(*again.index()[4])["input_ids"].tolist() == enc[4].input_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_online_kv_equals_stored(tiny_target, tmp_path, sharegpt_file, dtype):
    """MoA's K/V and TLI targets computed per (right-padded) batch from the frozen target are the stored features:
    the same values, rounded through the features' dtype alike (train.kv_features=online vs stored)."""
    from specbench.train.features import online_kv
    from specbench.train.trainer import collate

    train, _ = load_conversations(sharegpt_file, 3, 0)
    enc = [encode(c, tiny_target.tokenizer, None, 200) for c in train]
    assert len({len(e.input_ids) for e in enc}) > 1  # padding is exercised
    fs = extract(tiny_target, enc, tmp_path / "f", dtype, kv=True)
    batch = collate([fs.load(*ix, kv=True) for ix in fs.index()])
    kv, pre = online_kv(tiny_target, batch.input_ids, batch.attn_mask, dtype)
    real = batch.attn_mask.bool()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == "float32" else {"atol": 2e-2, "rtol": 1e-2}  # bf16: one ulp
    torch.testing.assert_close(kv[real], batch.kv[real], **tol)
    torch.testing.assert_close(pre[real], batch.pre[real], **tol)


def train_overrides(tmp_path, sharegpt_file, **extra) -> list[str]:
    base = {"train.data_path": sharegpt_file, "train.conversations": 10, "train.val_conversations": 3,
            "train.max_len": 96, "train.epochs": 2, "train.batch_size": 2, "train.val_new_tokens": 8,
            "train.val_depth": 3, "train.val_positions": 3, "train.features_dir": tmp_path / "features",
            "train.out_dir": tmp_path / "ckpt", "train.log_every": 1, "train.warmup_steps": 2, "train.lr": 1e-3,
            "train.answers": "dataset", "train.answers_from": tmp_path / "shipped" / "answers.jsonl"}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.mark.parametrize("drafter", ["sd", "medusa", "eagle", "hass", "coral", "beagle", "moa", "moa_tli1", "eagle3"])
def test_trainer_validates_checkpoints_and_the_checkpoint_decodes_losslessly(make_cfg, tmp_path, sharegpt_file,
                                                                              tiny_target, drafter):
    cfg = make_cfg(f"drafter={drafter}", *train_overrides(tmp_path, sharegpt_file))
    final = Trainer(cfg).run()
    log = read_jsonl(final.parent / "log.jsonl")
    vals = [r for r in log if r["kind"] == "val"]
    assert [r["epoch"] for r in vals] == [0, 1]
    assert all(len(r["alpha"]) == 3 and r["sim_tau"] >= 1 and r["train_tokens_per_s"] > 0 and r["peak_mem_bytes"]
               for r in vals)
    assert any(r["kind"] == "train" and "loss" in r for r in log)
    meta = read_meta(final)
    cls = {"sd": IndependentDrafter, "medusa": MedusaDrafter, "eagle": EagleDrafter, "hass": HassDrafter,
           "coral": CoralDrafter, "beagle": BeagleDrafter, "moa": MoADrafter, "moa_tli1": MoADrafter,
           "eagle3": Eagle3Drafter}[drafter]
    assert meta["target"] == "tiny" and meta["drafter"] == cls.name  # configs of one class share its name
    d = cls(tiny_target, checkpoint=str(final))
    prompt = tiny_target.tokenizer("Count from 3 please.")["input_ids"]
    assert engine_greedy(tiny_target, d, prompt, 30) == hf_greedy(tiny_target.model, prompt, 30)
    if drafter == "eagle3":  # its draft vocabulary came from the answers; the CLI writes it for SGLang
        from specbench.tools.export import export

        assert d.head.t2d.sum() == d.head.d2t.shape[0]
        out = export(make_cfg("drafter=eagle3", f"drafter.checkpoint={final}", f"export.out={tmp_path / 'sgl'}"))
        assert (out / "model.safetensors").is_file() and json.loads((out / "config.json").read_text())[
            "architectures"] == ["LlamaForCausalLMEagle3"]
        with pytest.raises(SpecbenchError, match="drafter 'medusa' has no serving layout"):
            export(make_cfg("drafter=medusa", f"drafter.checkpoint={final}"))
    if drafter == "medusa":  # validation measured each head's top-k accuracy; `tree: auto` builds the tree from them
        acc = meta["metrics"]["head_topk_acc"]
        assert len(acc) == 4 and all(len(row) == MedusaDrafter.ACC_RANKS and 0 <= sum(row) <= 1 for row in acc)
        auto = MedusaDrafter(tiny_target, checkpoint=str(final), tree="auto", tree_nodes=7)
        assert len(auto.paths) == 7
        assert engine_greedy(tiny_target, auto, prompt, 30) == hf_greedy(tiny_target.model, prompt, 30)
        with pytest.raises(SpecbenchError, match="tree=auto needs a checkpoint"):
            MedusaDrafter(tiny_target, tree="auto")


def test_coral_router_second_stage_on_the_trained_head(make_cfg, tmp_path, sharegpt_file, tiny_target):
    over = train_overrides(tmp_path, sharegpt_file, **{"train.epochs": 1})
    head = Trainer(make_cfg("drafter=coral", *over)).run()
    final = Trainer(make_cfg("drafter=coral_router", f"drafter.module.base={head}", "drafter.module.groups=4",
                             *over)).run()
    assert "hit1" in {k for r in read_jsonl(final.parent / "log.jsonl") for k in r}
    d = CoralRouterDrafter(tiny_target, checkpoint=str(final))  # decodes without the stage-1 checkpoint's path
    assert d.head.router.groups == 4
    torch.testing.assert_close(d.head.fc.weight, CoralDrafter(tiny_target, checkpoint=str(head)).head.fc.weight,
                               atol=1e-2, rtol=1e-2)  # bf16 checkpoints
    prompt = tiny_target.tokenizer("Count from 3 please.")["input_ids"]
    assert engine_greedy(tiny_target, d, prompt, 30) == hf_greedy(tiny_target.model, prompt, 30)


def test_resume_continues_after_the_last_epoch(make_cfg, tmp_path, sharegpt_file):
    over = train_overrides(tmp_path, sharegpt_file)
    Trainer(make_cfg("drafter=medusa", *over)).run()
    Trainer(make_cfg("drafter=medusa", *over, "train.epochs=3")).run()
    vals = [r["epoch"] for r in read_jsonl(tmp_path / "ckpt" / "tiny" / "medusa" / "log.jsonl") if r["kind"] == "val"]
    assert vals == [0, 1, 2]
    # another budget must not continue (or, finished, stand in for) this training
    with pytest.raises(SpecbenchError, match=r"another budget \(warmup_steps differ\)"):
        Trainer(make_cfg("drafter=medusa", *over, "train.epochs=3", "train.warmup_steps=3")).run()
    # nor other options of the method itself (HASS's Top-K stage, Beagle's vloss, here Medusa's decay)
    with pytest.raises(SpecbenchError, match=r"other drafter options \(decay differ\)"):
        Trainer(make_cfg("drafter=medusa", *over, "train.epochs=3", "drafter.module.decay=0.5")).run()


def test_a_checkpoint_that_predates_an_option_resumes_at_its_default(make_cfg, tmp_path, sharegpt_file):
    # an option added to a drafter after a training started (MoA's loss_weighting) must not refuse its resumption
    over = train_overrides(tmp_path, sharegpt_file)
    Trainer(make_cfg("drafter=medusa", *over)).run()
    meta_file = tmp_path / "ckpt" / "tiny" / "medusa" / "last" / "config.json"
    meta = json.loads(meta_file.read_text())
    assert meta["module"].pop("decay") == 0.8  # medusa.yaml's decay, MedusaOptions' default
    meta_file.write_text(json.dumps(meta))
    Trainer(make_cfg("drafter=medusa", *over, "train.epochs=3")).run()
    meta["module"]["decay"] = 0.5  # but a recorded value other than the config's still refuses
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(SpecbenchError, match=r"other drafter options \(decay differ\)"):
        Trainer(make_cfg("drafter=medusa", *over, "train.epochs=4")).run()


def test_a_checkpoint_records_the_commit_its_training_started_at(make_cfg, tmp_path, sharegpt_file, monkeypatch):
    # a commit made while a training runs must not be recorded as the code that trained it
    monkeypatch.setattr(envinfo, "git_commit", lambda: {"commit": "at-start", "dirty": False})
    trainer = Trainer(make_cfg("drafter=medusa", *train_overrides(tmp_path, sharegpt_file, **{"train.epochs": 1})))
    monkeypatch.setattr(envinfo, "git_commit", lambda: {"commit": "committed-meanwhile", "dirty": False})
    assert read_meta(trainer.run())["git"]["commit"] == "at-start"


def test_make_train_lists_every_trainable_drafter_after_the_weights_it_starts_from():
    """`make train`'s list (specbench/train/trainable.py) reads the drafter YAMLs' checkpoint paths, which name the weights
    root through ${oc.env:SPECBENCH_WEIGHTS,weights}: once it matched only a bare `weights/`, and listed nothing."""
    from specbench.train.trainable import trainable_drafters

    names = trainable_drafters()
    assert set(names) == {"beagle", "coral", "coral_router", "eagle", "eagle3", "hass", "medusa", "moa", "moa_tli1", "sd"}
    assert names.index("coral") < names.index("coral_router")


@pytest.mark.parametrize("drafter,stop", [("eagle", "kill"), ("moa", "kill"), ("moa", "kill_no_saves_inside"),
                                          ("eagle", "max_steps")])
def test_a_stopped_training_resumes_at_its_last_save_with_the_same_weights(make_cfg, tmp_path, sharegpt_file,
                                                                          monkeypatch, drafter, stop):
    """A run killed inside its second epoch resumes at its last `last/`: inside the epoch (train.save_every_min, 0 here:
    after every batch) or, with no saves inside epochs, at the first epoch's end; a run stopped by train.max_steps
    resumes inside its epoch when max_steps is lifted. Each ends with the weights of a run never stopped (every step
    seeds its own random draws: EAGLE's feature noise, MoA's block sampling), its log with each step once."""
    from safetensors.torch import load_file

    inside = stop != "kill_no_saves_inside"
    over = train_overrides(tmp_path, sharegpt_file, **{"train.save_every_min": 0 if inside else "null",
                                                       "train.noise": "uniform", "train.noise_scale": 0.1,
                                                       # planned over the budget, whatever max_steps stops
                                                       "train.lr_schedule": "cosine", "train.warmup_steps": 2})
    whole = Trainer(make_cfg(f"drafter={drafter}", *over, f"train.out_dir={tmp_path / 'whole'}")).run()
    real_step, calls = Trainer._step, []

    def dies_at_step_8(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 8:  # 5 batches an epoch: the third of the second epoch
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    cfg = make_cfg(f"drafter={drafter}", *over, f"train.out_dir={tmp_path / 'cut'}")
    if stop == "max_steps":
        Trainer(make_cfg(f"drafter={drafter}", *over, f"train.out_dir={tmp_path / 'cut'}", "train.max_steps=7")).run()
    else:
        with monkeypatch.context() as m:
            m.setattr(Trainer, "_step", dies_at_step_8)
            with pytest.raises(KeyboardInterrupt):
                Trainer(cfg).run()
    last = read_meta(tmp_path / "cut" / "tiny" / drafter / "last")
    assert (last["epoch"], last["step"], last.get("inside")) == ((0, 7, {"epoch": 1, "batches": 2}) if inside else
                                                                 (0, 5, None))
    resumed = Trainer(cfg).run()
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [r["step"] for r in read_jsonl(tmp_path / "cut" / "tiny" / drafter / "log.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, 11))


def test_a_checkpoint_for_another_target_is_refused(make_cfg, tmp_path, sharegpt_file):
    final = Trainer(make_cfg("drafter=medusa", *train_overrides(tmp_path, sharegpt_file, **{"train.epochs": 1}))).run()
    other = TargetModel(tiny_llama(vocab=258, seed=7), byte_tokenizer(), torch.device("cpu"), "other")
    with pytest.raises(SpecbenchError, match="trained for target 'tiny'"):
        MedusaDrafter(other, checkpoint=str(final))


def torchrun(tiny_checkpoint, drafter: str, over: list[str], nproc: int = 2) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=29517",
           "-m", "specbench.train", f"drafter={drafter}", f"model.path={tiny_checkpoint}", "model.name=tiny", *over]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.parametrize("drafter", ["medusa", "beagle", "hass", "moa"])
def test_ddp_two_cpu_processes(tmp_path, sharegpt_file, tiny_checkpoint, tiny_target, drafter):
    """medusa: one graph; beagle: one graph per simulated step (late stage in epoch 2); hass: n graphs; moa: its K/V
    online. On uneven data (9 conversations over 2 ranks) neither rank hangs; the two ranks extract the feature shards
    between them (shards of 2: 5 shards, 3 on rank 0 and 2 on rank 1), the same features one process extracts; after
    every epoch both hold the same weights, measured by the trainer across ranks (the largest difference of any weight,
    recorded with the epoch)."""
    over = train_overrides(tmp_path, sharegpt_file, **{"train.conversations": 9, "train.features_shard": 2})
    torchrun(tiny_checkpoint, drafter, over)
    meta = read_meta(tmp_path / "ckpt" / "tiny" / drafter / "final")
    assert meta["world_size"] == 2 and meta["metrics"]["rank_weight_spread"] == 0.0
    vals = [r for r in read_jsonl(tmp_path / "ckpt" / "tiny" / drafter / "log.jsonl") if r["kind"] == "val"]
    assert [r["rank_weight_spread"] for r in vals] == [0.0, 0.0]
    if drafter != "medusa":
        return
    (two,) = (tmp_path / "features").glob("*/*/train")  # the (only) training feature set
    shared = FeatureSet.open(two)
    assert [s["file"] for s in shared.manifest["shards"]] == [f"shard-{n:05d}.safetensors" for n in range(5)]
    train, _ = load_conversations(sharegpt_file, 9, 3)
    one = extract(tiny_target, [encode(c, tiny_target.tokenizer, None, 96) for c in train], tmp_path / "one",
                  "bfloat16", shard_size=2)
    assert shared.manifest["count"] == one.manifest["count"] == 9
    for a, b in zip(shared.index(), one.index()):
        x, y = shared.load(*a), one.load(*b)
        assert x["input_ids"].tolist() == y["input_ids"].tolist()
        torch.testing.assert_close(x["hidden"], y["hidden"])


def test_dataloader_workers_train_the_same_weights(tmp_path, sharegpt_file, make_cfg):
    """train.loader_workers=2 reads and collates the same batches in worker processes: the same weights as 0."""
    from safetensors.torch import load_file

    finals = []
    for workers in (0, 2):
        cfg = make_cfg("drafter=eagle", *train_overrides(tmp_path, sharegpt_file, **{
            "train.epochs": 1, "train.loader_workers": workers, "train.out_dir": tmp_path / f"w{workers}"}))
        finals.append(load_file(str(Trainer(cfg).run() / "model.safetensors")))
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


def test_two_ranks_train_what_one_process_trains(tmp_path, sharegpt_file, tiny_checkpoint, tiny_target):
    """2 ranks x batch 1 see, step by step, the pairs one process sees as batches of 2 (the shards interleave the same
    shuffled order); with averaged gradients the weights end where one process's do, up to the per-rank loss means
    (a mean of two means, not one mean over both) and the padded last step of the uneven data."""
    from safetensors.torch import load_file

    common = {"train.conversations": 9, "train.epochs": 1, "train.features_dir": tmp_path / "features"}
    torchrun(tiny_checkpoint, "eagle", train_overrides(tmp_path, sharegpt_file, **common, **{
        "train.batch_size": 1, "train.out_dir": tmp_path / "two"}))
    cmd = [sys.executable, "-m", "specbench.train", "drafter=eagle", f"model.path={tiny_checkpoint}", "model.name=tiny",
           *train_overrides(tmp_path, sharegpt_file, **common, **{"train.batch_size": 2, "train.out_dir": tmp_path / "one",
                                                                   "train.save_dtype": "float32"})]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    two = load_file(str(tmp_path / "two" / "tiny" / "eagle" / "last" / "model.safetensors"))
    one = load_file(str(tmp_path / "one" / "tiny" / "eagle" / "last" / "model.safetensors"))
    torch.manual_seed(0)  # the trainer's seed: the weights both started from
    init = EagleDrafter.build_module(tiny_target, EagleDrafter.options()).state_dict()
    moved = sum(float((one[k].float() - init[k]).norm() ** 2) for k in one) ** 0.5
    apart = sum(float((two[k].float() - one[k].float()).norm() ** 2) for k in one) ** 0.5
    # measured: apart / moved = 0.06 (0.057 on even data: the mean of two means); another seed gives 1.0
    assert moved > 0 and apart < 0.15 * moved, (apart, moved)


def test_trained_weights_decode_through_the_runner_and_name_the_run(make_cfg, tmp_path, sharegpt_file):
    """A drafter run with a checkpoint records the weights' digest, so retrained weights never resume old records."""
    final = Trainer(make_cfg("drafter=medusa", *train_overrides(tmp_path, sharegpt_file, **{"train.epochs": 1}))).run()
    from specbench.bench.run import Runner

    run = Runner(make_cfg("drafter=medusa", f"drafter.checkpoint={final}")).execute()
    meta = json.loads((run.path / "run.json").read_text())
    assert len(meta["config"]["drafter"]["checkpoint_sha256"]) == 16
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["lossless"]["rate"] == 1.0
    Trainer(make_cfg("drafter=medusa", *train_overrides(tmp_path, sharegpt_file, **{"train.epochs": 2,
                                                                                    "train.lr": 5e-3}))).run()
    again = Runner(make_cfg("drafter=medusa", f"drafter.checkpoint={final}")).execute()
    assert again.path != run.path


def test_medusa_paper_loss_trains_too(make_cfg, tmp_path, sharegpt_file):
    over = train_overrides(tmp_path, sharegpt_file, **{"train.epochs": 1})
    final = Trainer(make_cfg("drafter=medusa", "drafter.module.labels=ground_truth", *over)).run()
    assert read_meta(final)["module"]["labels"] == "ground_truth"
    with pytest.raises(SpecbenchError, match="labels"):
        Trainer(make_cfg("drafter=medusa", "drafter.module.labels=oracle", *over)).run()


def test_medusa_self_distillation_labels_are_the_targets_law_at_each_offset():
    """The one-pass label table equals computing softmax(LMHead(h_{t+k})) for every head separately."""
    from specbench.train.trainer import Batch

    torch.manual_seed(0)
    t = TargetModel(tiny_llama(vocab=50, layers=2), None, torch.device("cpu"), "t")
    opts = MedusaDrafter.options(num_heads=3, labels="target")
    m = MedusaDrafter.build_module(t, opts)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    ids, h = torch.randint(0, 50, (2, 20)), torch.randn(2, 20, 32)
    lm = (torch.rand(2, 20) > 0.3).long()
    loss, _ = MedusaDrafter.training_loss(m, Batch(ids, lm, torch.ones_like(ids), h, h), t, opts)
    feats, ref = m(h), 0.0
    for k in range(1, 4):
        mask = lm[:, k + 1 :].bool()
        logits = t.lm_head(feats[:, : -(k + 1), k - 1][mask])
        soft = t.lm_head(h[:, k:-1][mask]).softmax(-1)
        ref = ref + 0.8**k * -(soft * logits.log_softmax(-1)).sum(-1).mean()
    torch.testing.assert_close(loss, ref)


def test_sd_distillation_loss_equals_kl_over_every_assistant_position():
    """The LM heads applied only where the loss mask is set give KL(p_target || q_draft) on the full logits."""
    from specbench.train.trainer import Batch

    torch.manual_seed(0)
    t = TargetModel(tiny_llama(vocab=50, layers=3), None, torch.device("cpu"), "t")
    opts = IndependentDrafter.options(init_layers=[0, -1])
    m = IndependentDrafter.build_module(t, opts)
    ids, attn = torch.randint(0, 50, (2, 20)), torch.ones(2, 20, dtype=torch.long)
    attn[1, 14:] = 0  # right padding
    lm = (torch.rand(2, 20) > 0.4).long() * attn
    with torch.no_grad():
        h = t.model(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states[-1]
    loss, parts = IndependentDrafter.training_loss(m, Batch(ids, lm, attn, h, h), t, opts)
    mask = lm[:, 1:].bool()
    logq = m(input_ids=ids, attention_mask=attn).logits[:, :-1][mask].log_softmax(-1)
    p = t.lm_head(h[:, :-1][mask]).softmax(-1)
    torch.testing.assert_close(loss, (p * (p.log() - logq)).sum(-1).mean())
    assert 0.0 <= parts["top1"] <= 1.0 and loss.item() > 0


def test_lr_schedule_warms_up_then_stays_or_decays_to_zero():
    from specbench.core.config import TrainConfig
    from specbench.train.trainer import lr_at

    const, cos = TrainConfig(lr=1.0, warmup_steps=4), TrainConfig(lr=1.0, warmup_steps=4, lr_schedule="cosine")
    assert [lr_at(s, const, 20) for s in (0, 3, 19)] == [0.25, 1.0, 1.0]
    cosine = [lr_at(s, cos, 20) for s in range(21)]
    assert cosine[:5] == [0.25, 0.5, 0.75, 1.0, 1.0] and cosine[12] == pytest.approx(0.5) and cosine[20] == 0.0
    assert all(a >= b for a, b in zip(cosine[4:], cosine[5:]))
    linear = [lr_at(s, TrainConfig(lr=1.0, warmup_steps=4, lr_schedule="linear"), 20) for s in range(21)]
    assert linear[:5] == [0.25, 0.5, 0.75, 1.0, 1.0] and linear[12] == pytest.approx(0.5) and linear[20] == 0.0
    assert linear[8] == pytest.approx(0.75) and cosine[8] > linear[8]  # a straight line, below the cosine early on
    with pytest.raises(SpecbenchError, match="lr_schedule"):
        lr_at(30, TrainConfig(lr_schedule="step"), 40)


def test_peak_constant_is_moas_warm_up_decay_over_one_epoch_then_constant():
    """MoA's code (zero_peak_constant_scheduler): up to the peak in the warm-up, a straight line down to peak x floor
    over one epoch's steps after it, constant from there (our warm-up counts step 0 as the first, as every schedule's)."""
    from specbench.core.config import TrainConfig
    from specbench.train.trainer import lr_at

    cfg = TrainConfig(lr=20.0, lr_floor=0.05, warmup_steps=4, epochs=2, lr_schedule="peak_constant")
    got = [lr_at(s, cfg, 40) for s in range(40)]  # 40 steps over 2 epochs: the decay spans steps 4..24
    assert got[:4] == [5.0, 10.0, 15.0, 20.0]
    for s in range(4, 40):
        want = 20.0 - 19.0 * (s - 4) / 20 if s < 24 else 1.0  # theirs: peak - (peak - lr) x progress, then lr
        assert got[s] == pytest.approx(want)
    with pytest.raises(SpecbenchError, match="lr_floor"):
        lr_at(5, TrainConfig(lr_schedule="peak_constant", lr_floor=1.5), 40)


def test_trainmem_graph_memory_is_flat_for_beagle_and_grows_for_hass(tmp_path, sharegpt_file, tiny_checkpoint):
    """The exact saved-for-backward bytes: Beagle's late stage keeps 2T keys whatever s; HASS's graph grows with s."""
    from hydra import compose, initialize_config_dir

    from specbench.tools import trainmem

    over = train_overrides(tmp_path, sharegpt_file, **{"train.max_len": 40})
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="trainmem", overrides=[f"model.path={tiny_checkpoint}", "model.name=tiny",
                                                         "trainmem.steps=[2,3]", "bench.repeats=1", *over])
        todo = trainmem.jobs(cfg)
    rows = {(r["method"], r["steps"]): r for r in map(trainmem.measure, todo)}
    assert rows["beagle", 3]["graph_bytes"] == rows["beagle", 2]["graph_bytes"]
    assert rows["hass", 3]["graph_bytes"] > 1.3 * rows["hass", 2]["graph_bytes"]
    assert all(r["step_s"] > 0 and r["peak_bytes"] > 0 for r in rows.values())


def test_trainspeed_measures_each_method_in_fp32_and_under_bf16_autocast(tmp_path, sharegpt_file, tiny_checkpoint):
    """`make trainspeed`: one point per method and precision; under bf16 autocast the tensors autograd saves are bf16,
    so the graph is smaller (autocast is really on, in the trainer's own context), MoA gets its K/V features and
    EAGLE-3 its layer features and data-sized draft vocabulary, as in the trainer."""
    from hydra import compose, initialize_config_dir

    from specbench.tools import trainmem

    over = train_overrides(tmp_path, sharegpt_file, **{"train.max_len": 40})
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="trainspeed", overrides=[f"model.path={tiny_checkpoint}", "model.name=tiny",
                                                           "trainmem.methods=[eagle,moa,eagle3]", "bench.warmup=1",
                                                           "bench.repeats=1", *over])
        todo = trainmem.jobs(cfg)
    rows = {(r["method"], r["precision"]): r for r in map(trainmem.measure, todo)}
    assert sorted(rows) == [(m, p) for m in ("eagle", "eagle3", "moa") for p in ("bf16", "fp32")]
    for method in ("eagle", "moa", "eagle3"):
        assert rows[method, "bf16"]["graph_bytes"] < 0.8 * rows[method, "fp32"]["graph_bytes"]
        assert rows[method, "fp32"]["tokens_per_s"] == rows[method, "fp32"]["tokens"] / rows[method, "fp32"]["step_s"]


def test_self_distilled_answers_are_the_targets_greedy_answers_and_resume(tiny_target, tmp_path, sharegpt_file,
                                                                          monkeypatch):
    train, _ = load_conversations(sharegpt_file, 4, 0)  # questions of 20 and 21 bytes: a padded batch
    long_question = Conversation("long", (("user", "why? " * 40), ("assistant", "no")))
    convs = [*train, long_question]
    path = tmp_path / "answers.jsonl"
    sizes = []
    generate = tiny_target.model.generate
    spy = lambda **kw: sizes.append(len(kw["input_ids"])) or generate(**kw)  # noqa: E731
    monkeypatch.setattr(tiny_target.model, "generate", spy)
    first = target_answers(tiny_target, convs, None, 96, 24, 2, path)
    assert [e.conv_id for e in first] == ["c0", "c1", "c2", "c3", "long"] and sizes == [2, 2, 1]
    monkeypatch.undo()
    for conv, enc in zip(convs, first):
        n = enc.loss_mask.index(1)
        prompt, answer = enc.input_ids[:n], enc.input_ids[n:]
        assert enc.loss_mask == [0] * n + [1] * len(answer) and 0 < len(answer) <= 24
        assert len(prompt) <= 96 - 24
        if conv.conv_id != "long":  # the long question is cut to fit, the others are whole
            assert prompt == chat_prompt_ids(tiny_target.tokenizer, [{"role": "user", "content": conv.messages[0][1]}], None)
        greedy = hf_greedy(tiny_target.model, prompt, 24)  # unbatched
        eos = next((i for i, t in enumerate(greedy) if t in tiny_target.eos_token_ids), len(greedy) - 1)
        assert answer == greedy[: eos + 1]
    # interrupted: two answers written, the third torn; only the missing three are generated again
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:15])
    sizes.clear()
    monkeypatch.setattr(tiny_target.model, "generate", spy)
    again = target_answers(tiny_target, convs, None, 96, 24, 2, path)
    assert sum(sizes) == 3 and again == first and len(path.read_text().splitlines()) == 5
    with pytest.raises(SpecbenchError, match="answer_tokens=96 must be between"):
        target_answers(tiny_target, convs, None, 96, 96, 2, tmp_path / "x.jsonl")


def test_trainer_on_self_distilled_answers(make_cfg, tmp_path, sharegpt_file, monkeypatch):
    over = train_overrides(tmp_path, sharegpt_file, **{"train.answers": "target", "train.answer_tokens": 16,
                                                       "train.epochs": 1})
    final = Trainer(make_cfg("drafter=sd", *over)).run()
    assert read_meta(final)["train"]["answers"] == "target"
    answers = list((tmp_path / "features").rglob("answers.jsonl"))
    assert len(answers) == 1 and len(answers[0].read_text().splitlines()) == 10
    train_set = FeatureSet.open(answers[0].parent / "train")
    assert all(int(train_set.load(*i)["loss_mask"].sum()) <= 16 for i in train_set.index())
    # MoA's stored K/V (another feature directory) read the same answers: they were generated again (~15 min here)
    from specbench.train.trainer import prepare_features

    trainer = Trainer(make_cfg("drafter=moa", *over, "train.kv_features=stored"))

    def no_answers(*a, **k):
        raise AssertionError("the answers were generated again")

    monkeypatch.setattr(trainer.target.model, "generate", no_answers)
    stored, _ = prepare_features(trainer.target, trainer.tc, trainer.model_cfg, True, 0)
    assert len(stored.load(*stored.index()[0], kv=True)["kv"]) > 0  # K/V stored beside the same answers
    assert len(list((tmp_path / "features").rglob("answers.jsonl"))) == 1
    # the finished answers were shipped beside the weights (train.answers_from): another machine of the same target
    # and budget (here: another features cache) starts from them and generates nothing
    shipped = tmp_path / "shipped" / "answers.jsonl"
    assert shipped.read_text() == answers[0].read_text()
    desc = json.loads(shipped.with_suffix(".json").read_text())
    assert desc["rows"] == 10 and desc["answer_tokens"] == 16 and desc["target_fingerprint"]
    other = Trainer(make_cfg("drafter=sd", *over, f"train.features_dir={tmp_path / 'features2'}"))
    monkeypatch.setattr(other.target.model, "generate", no_answers)
    prepare_features(other.target, other.tc, other.model_cfg, False, 0)
    assert (next((tmp_path / "features2").rglob("answers.jsonl")).read_text() == shipped.read_text())
    # shipped for other answer settings: not used (the answers are generated)
    longer = Trainer(make_cfg("drafter=sd", *over, f"train.features_dir={tmp_path / 'features3'}",
                              "train.answer_tokens=12"))
    with pytest.raises(AssertionError, match="generated again"):
        monkeypatch.setattr(longer.target.model, "generate", no_answers)
        prepare_features(longer.target, longer.tc, longer.model_cfg, False, 0)
    with pytest.raises(SpecbenchError, match="train.answers='bogus' is not one of dataset, target"):
        Trainer(make_cfg("drafter=sd", *train_overrides(tmp_path, sharegpt_file, **{"train.answers": "bogus"}))).run()


def test_grad_clip_mode_and_noise_are_checked_and_value_clipping_clamps(make_cfg, tmp_path, sharegpt_file):
    with pytest.raises(SpecbenchError, match="grad_clip_mode"):
        Trainer(make_cfg("drafter=eagle", *train_overrides(tmp_path, sharegpt_file, **{"train.grad_clip_mode": "both"})))
    with pytest.raises(SpecbenchError, match="train.noise='rand'"):  # refused before features or training
        Trainer(make_cfg("drafter=eagle", *train_overrides(tmp_path, sharegpt_file, **{"drafter.optim.noise": "rand"})))
    final = Trainer(make_cfg("drafter=eagle", *train_overrides(tmp_path, sharegpt_file, **{
        "train.epochs": 1, "train.grad_clip_mode": "value", "train.grad_clip": 0.01}))).run()
    assert read_meta(final)["train"]["grad_clip_mode"] == "value"


def test_feature_noise_kinds_bound_and_placement():
    """uniform: |noise| <= s; uniform_by_length (EAGLE's and HASS's code): <= s * 512 / T with T each row's own length,
    so the shorter row's noise is wider; gaussian has spread s; pads stay clean; an unknown kind is named."""
    from specbench.train.trainer import Batch, add_noise

    attn = torch.tensor([[1] * 8, [1] * 4 + [0] * 4])
    b = Batch(torch.zeros(2, 8, dtype=torch.long), attn, attn, torch.zeros(2, 8, 4096))
    add_noise(b, "uniform", 0.1, torch.Generator().manual_seed(0))
    assert b.hidden_in.abs().max() <= 0.1 and b.hidden_in.abs().max() > 0.09 and b.hidden_in[1, 4:].eq(0).all()
    add_noise(b, "uniform_by_length", 0.1, torch.Generator().manual_seed(0))
    row0, row1 = b.hidden_in[0].abs().max(), b.hidden_in[1, :4].abs().max()
    assert 6.0 < row0 <= 0.1 * 512 / 8 and 12.0 < row1 <= 0.1 * 512 / 4 and b.hidden_in[1, 4:].eq(0).all()
    add_noise(b, "gaussian", 0.2, torch.Generator().manual_seed(0))
    assert abs(b.hidden_in[0].std().item() - 0.2) < 0.01
    add_noise(b, "none", 0.2, torch.Generator())
    assert b.hidden_in is b.hidden
    with pytest.raises(SpecbenchError, match="train.noise='rand' is not one of none, uniform, uniform_by_length"):
        add_noise(b, "rand", 0.1, torch.Generator())


@pytest.mark.parametrize(("n", "world"), [(7, 2), (9, 4), (8, 2), (1, 3)])
def test_every_rank_gets_the_same_number_of_batches(n, world):
    """Uneven data: a rank with fewer batches would hang in the others' all-reduce; every item is used."""
    from specbench.train.trainer import shard

    shards = [shard(list(range(n)), r, world) for r in range(world)]
    assert len({len(s) for s in shards}) == 1
    assert set().union(*shards) == set(range(n))


def test_two_ranks_share_the_self_distilled_answers(tmp_path, sharegpt_file, tiny_checkpoint, make_cfg):
    """train.answers=target under torchrun: each rank answers its share (i mod world) into its own file, and the
    features are extracted from all of them: the same answers one process writes. (Rank 0 alone answered before,
    while the others waited at a barrier until NCCL's watchdog ended the job on long generations.)"""
    over = {"train.answers": "target", "train.answer_tokens": 16, "train.epochs": 1, "train.conversations": 5}
    torchrun(tiny_checkpoint, "medusa", train_overrides(tmp_path / "two", sharegpt_file, **over))
    parts = sorted((tmp_path / "two" / "features").rglob("answers.rank*of2.jsonl"))
    assert [p.name for p in parts] == ["answers.rank0of2.jsonl", "answers.rank1of2.jsonl"]
    two = {i: e for p in parts for i, e in read_done(p).items()}
    assert sorted(i for i in read_done(parts[0])) == [0, 2, 4] and sorted(read_done(parts[1])) == [1, 3]
    Trainer(make_cfg("drafter=medusa", *train_overrides(tmp_path / "one", sharegpt_file, **over))).run()
    (single,) = (tmp_path / "one" / "features").rglob("answers.jsonl")
    assert read_done(single) == two


def test_a_bf16_target_trains_fp32_master_weights(make_cfg, tmp_path, sharegpt_file, monkeypatch):
    """`sd` copies the target's layers: on a bf16 target its module was bf16, and AdamW's small updates fell below
    half an ulp. The trainable weights are fp32 whatever the target's dtype."""
    seen = {}
    real = torch.optim.AdamW

    def spy(params, **kw):
        params = list(params)
        seen["dtypes"] = {p.dtype for p in params}
        return real(params, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", spy)
    over = train_overrides(tmp_path, sharegpt_file, **{"train.epochs": 1, "train.max_steps": 2})
    Trainer(make_cfg("drafter=sd", "model.dtype=bfloat16", *over)).run()
    assert seen["dtypes"] == {torch.float32}


def test_the_batch_pins_every_tensor_field(monkeypatch):
    """torch's DataLoader (pin_memory=True) pins tensors and collections it knows and calls `pin_memory()` on other
    objects; without the method a Batch came back unpinned and every copy to the GPU was synchronous. Pinning needs
    CUDA: here Tensor.pin_memory is replaced by a marker."""
    from specbench.train.trainer import Batch

    pinned_ids = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned_ids.append(id(t)) or t.clone())
    b = Batch(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
              torch.ones(1, 2, dtype=torch.long), torch.zeros(1, 2, 4), None, torch.zeros(1, 2, 3, 8), None)
    b.hidden_in = b.hidden
    p = b.pin_memory()
    assert len(pinned_ids) == 5 and p.hidden_in is p.hidden and p.pre is None
    from torch.utils.data._utils.pin_memory import pin_memory as loader_pin

    assert isinstance(loader_pin(b), Batch)  # the loader's own pinning goes through the method


def test_feature_extraction_that_cannot_fit_the_disk_is_refused(make_cfg, tmp_path, sharegpt_file, monkeypatch):
    import shutil as sh
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage(10**6, 10**6, 1000))
    with pytest.raises(SpecbenchError, match=r"the training features need ~.* GiB and .* has 0.0 GiB free: point "
                                             r"train.features_dir \(or SPECBENCH_CACHE\)"):
        Trainer(make_cfg("drafter=medusa", *train_overrides(tmp_path, sharegpt_file))).run()
    assert not list((tmp_path / "features").rglob("shard-*.safetensors"))


def test_each_rank_sets_its_gpu_before_nccl_starts(make_cfg, tmp_path, sharegpt_file, monkeypatch):
    """NCCL's communicator binds to the current CUDA device: set_device came after init_process_group, so every rank's
    communicator started on GPU 0. The order, and the device_id torch takes for it, seen through stand-ins (no GPU)."""
    import torch.distributed as dist

    calls = []

    class Started(Exception):
        pass

    def init(backend, **kw):
        calls.append(("init", backend, kw.get("device_id")))
        raise Started

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init)
    with pytest.raises(Started):
        Trainer(make_cfg("drafter=medusa", *train_overrides(tmp_path, sharegpt_file)))
    assert calls == [("set_device", 1), ("init", "nccl", torch.device("cuda", 1))]


def test_a_restart_starts_a_fresh_optimiser_and_schedule(make_cfg, tmp_path, sharegpt_file):
    """HASS's Top-K stage (a Restart at 4/5 of the budget): the last checkpoint's AdamW counts only the steps since
    the restart, the logged lr warms up again to a third of the peak, and the Top-K term appears from that step."""
    final = Trainer(make_cfg("drafter=hass", *train_overrides(tmp_path, sharegpt_file, **{"train.lr": 3e-3}))).run()
    rows = [r for r in read_jsonl(final.parent / "log.jsonl") if r["kind"] == "train"]
    total = rows[-1]["step"]
    first = math.ceil(0.8 * total - 1e-9)  # stage_starts: the first step whose progress reaches 0.8
    state = torch.load(final.parent / "last" / "trainer_state.pt", weights_only=True)["optimizer"]["state"]
    assert {int(s["step"]) for s in state.values()} == {total - first}
    lr = {r["step"]: r["lr"] for r in rows}  # the lr the step ran with (logged after it)
    assert lr[first + 1] == pytest.approx(1e-3 / 2) and lr[first] < 1e-3 / 2
    assert all(("top1" in r) == (r["step"] > first) for r in rows)


def test_the_shipped_answers_are_looked_for_beside_the_models_weights(make_cfg, tmp_path, sharegpt_file):
    """conf/train/embedded.yaml's answers_from names the model (an interpolation into another group): it resolves
    in the trainer's config and in the vocabulary tool's alike."""
    from specbench.core.config import TrainConfig, to_dataclass

    over = [o for o in train_overrides(tmp_path, sharegpt_file) if not o.startswith("train.answers_from")]
    cfg = make_cfg("drafter=sd", *over)
    assert Trainer(cfg).tc.answers_from.endswith("/tiny/answers.jsonl")
    assert to_dataclass(TrainConfig, cfg.train).answers_from == Trainer(cfg).tc.answers_from


def test_a_subset_trains_on_the_first_conversations_and_validates_on_the_budgets_held_out_ones(
        make_cfg, tmp_path, sharegpt_file):
    """train.subset=4 of a 10-conversation budget (the data-scaling experiment): 4 conversations a epoch (2 batches
    of 2), the same 3 held-out conversations as the whole budget, features cached apart; a subset outside 1..10 is
    refused before anything loads."""
    over = train_overrides(tmp_path, sharegpt_file, **{"train.subset": 4, "train.out_dir": tmp_path / "part"})
    final = Trainer(make_cfg("drafter=medusa", *over)).run()
    log = read_jsonl(final.parent / "log.jsonl")
    assert [r["step"] for r in log if r["kind"] == "val"] == [2, 4]
    sets = {p.name: FeatureSet.open(p) for p in (tmp_path / "features").glob("*/*/*") if p.is_dir()}
    assert sets["train"].manifest["count"] == 4 and sets["val"].manifest["count"] == 3
    whole = Trainer(make_cfg("drafter=medusa", *train_overrides(tmp_path, sharegpt_file, **{"train.epochs": 1})))
    whole.run()
    val_sets = [FeatureSet.open(p) for p in (tmp_path / "features").glob("*/*/val")]
    assert len(val_sets) == 2
    a, b = (list(v.index()) for v in val_sets)
    assert [v.load(*i)["input_ids"].tolist() for v, i in ((val_sets[0], x) for x in a)] == \
        [v.load(*i)["input_ids"].tolist() for v, i in ((val_sets[1], x) for x in b)]
    with pytest.raises(SpecbenchError, match="train.subset=0 must be at least 1"):
        Trainer(make_cfg("drafter=medusa", *train_overrides(tmp_path, sharegpt_file, **{"train.subset": 0})))
    with pytest.raises(SpecbenchError, match="only 13 usable conversations, 14 asked for"):  # before the target loads
        Trainer(make_cfg("drafter=medusa", *train_overrides(tmp_path, sharegpt_file, **{"train.subset": 11})))


def test_a_subset_above_the_budget_adds_the_conversations_after_its_held_out_ones_and_grows_the_shipped_answers(
        make_cfg, tmp_path, sharegpt_file, monkeypatch):
    """The data-scaling experiment's 2x point: train.subset=8 of a 6-conversation budget trains on the budget's 6
    and the 2 after its 3 held-out ones (c9, c10), validates on the same c6..c8, starts from the 6 shipped answers
    (generating only the 2 new ones) and grows the shipped file to 8 rows, the first 6 unchanged."""
    from specbench.core.config import TrainConfig
    from specbench.train.trainer import budget_conversations, prepare_features

    base = TrainConfig(conversations=6, val_conversations=3, data_path=str(sharegpt_file))
    ids = lambda convs: [c.conv_id for c in convs]  # noqa: E731
    assert [ids(x) for x in budget_conversations(base)] == [[f"c{i}" for i in range(6)], ["c6", "c7", "c8"]]
    assert ids(budget_conversations(TrainConfig(**{**vars(base), "subset": 4}))[0]) == ["c0", "c1", "c2", "c3"]
    train, val = budget_conversations(TrainConfig(**{**vars(base), "subset": 8}))
    assert ids(train) == [f"c{i}" for i in range(6)] + ["c9", "c10"] and ids(val) == ["c6", "c7", "c8"]

    over = train_overrides(tmp_path, sharegpt_file, **{"train.answers": "target", "train.answer_tokens": 16,
                                                       "train.conversations": 6})
    whole = Trainer(make_cfg("drafter=sd", *over))
    prepare_features(whole.target, whole.tc, whole.model_cfg, False, 0)
    shipped = tmp_path / "shipped" / "answers.jsonl"
    six = shipped.read_text()
    assert len(six.splitlines()) == 6
    more = Trainer(make_cfg("drafter=sd", *over, "train.subset=8"))
    calls = []
    generate = more.target.model.generate
    monkeypatch.setattr(more.target.model, "generate", lambda **k: calls.append(len(k["input_ids"])) or generate(**k))
    # the Trainer's own split (read before the target loaded) is not parsed again
    monkeypatch.setattr("specbench.train.trainer.load_conversations", lambda *a: pytest.fail("parsed again"))
    train_set, val_set = prepare_features(more.target, more.tc, more.model_cfg, False, 0, convs=more.convs)
    monkeypatch.undo()
    assert calls[0] == 2 and train_set.manifest["count"] == 8  # (then the held-out answers, one at a time)
    assert shipped.read_text().startswith(six) and len(shipped.read_text().splitlines()) == 8
    desc = json.loads(shipped.with_suffix(".json").read_text())
    assert desc["rows"] == 8 and desc["added"][0]["rows"] == "6-7" and desc["conversations"] == 6
    rows = read_done(shipped)
    assert [rows[i].conv_id for i in (6, 7)] == ["c9", "c10"]
    # the whole budget on another machine (features cache) seeds its 6 from the grown file and generates nothing
    again = Trainer(make_cfg("drafter=sd", *over, f"train.features_dir={tmp_path / 'features2'}"))
    monkeypatch.setattr(again.target.model, "generate", lambda **k: pytest.fail("the answers were generated again"))
    prepare_features(again.target, again.tc, again.model_cfg, False, 0)
    assert next((tmp_path / "features2").rglob("answers.jsonl")).read_text() == six
