# specbench — see README.md. Every target but gpu-check sets up (or refreshes) the virtual environment first.
PY       ?= python3
VENV     ?= .venv
PEER_VENV ?= .peer-venv
BIN      := $(VENV)/bin
MODEL    ?= smollm2-135m
EXPERIMENT ?= beagle_table1
PRESET   ?= cpu
ARGS     ?=
# STRICT=1: make bench refuses the whole sweep if any drafter lacks weights (by default it skips those jobs)
STRICT   ?=
PERF_ARGS ?=
# processes `make test` runs the suite on (pytest-xdist, whole files per worker; the cores shared out among them)
TEST_WORKERS ?= 2
# where runs are written and the tables read (out.root); a rehearsal or a scratch sweep points it elsewhere
RESULTS  ?= results

TRAIN    ?= embedded
# processes per machine for `make train` (DDP): NPROC=8 runs torchrun --nproc_per_node=8, one GPU per rank
NPROC    ?= 1
TRAIN_CMD = $(if $(filter 1,$(NPROC)),$(BIN)/python -m specbench.train,$(BIN)/torchrun --nproc_per_node=$(NPROC) -m specbench.train)
# the trainable drafters, from their own YAMLs (specbench/train/trainable.py); expanded when `make train` runs, after setup
TRAIN_DRAFTERS ?= $(shell $(BIN)/python -m specbench.trainable)

.PHONY: setup data rehearse test test-fast cluster-test train-scaling train-scaling-tau bench perf limit perf-drafters peer train trainmem trainspeed figures download gpu-check

$(VENV)/.stamp: requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements-nodeps.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

setup: $(VENV)/.stamp

# the authors' EAGLE environment too: tests/test_peer.py runs their EaModel against ours on a tiny target
test: setup $(PEER_VENV)/.stamp
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile
	$(MAKE) cluster-test

# A real single-node SLURM cluster on this machine (Debian's slurm-wlm, slurmdbd, munge, mariadb-server, installed
# with apt-get when missing and root), started in its own namespaces (loopback only), tests/cluster/ run through it
# (sweeps as SLURM jobs, a cancelled and a requeued job resuming, torchrun across two node ranks), then stopped
# (specbench/tools/cluster.py). A shell on such a cluster: .venv/bin/python -m specbench.cluster run -- bash
cluster-test: setup
	$(BIN)/python -m specbench.cluster run -- $(BIN)/python -m pytest -q -p no:cacheprovider tests/cluster

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile

# The main job: an experiment (conf/experiment/$(EXPERIMENT).yaml, a Hydra sweep) on MODEL with a preset
# (conf/preset/: cpu = the embedded default on 2 cores, paper = full sets for a GPU); the baseline (drafter=none) runs
# first in every job; re-running skips finished runs and resumes a killed one. Then the tables and figures.
# A job whose drafter has no weights for MODEL is skipped with one line naming the command that makes them (`make
# download` or `make train`), the others run; the end lists what ran and what was skipped; it exits 0 when a drafted
# job ran and none failed. STRICT=1 instead refuses the whole sweep, before decoding, if any drafter lacks weights.
#   make bench                                   every drafter x MT-Bench/GSM8K/CNN-DM on the embedded SmolLM2 (CPU)
#   make bench MODEL=llama2-7b PRESET=paper      the same on a GPU;  ARGS='drafter=none,eagle2' narrows the sweep
# The question files no package ships (EAGLE's and Spec-Bench's sets, GSM8K), from their pinned origins, checked by
# sha256, into $$SPECBENCH_DATA (default ~/.cache/specbench/data); where ../shared/data holds them, nothing is fetched.
data: setup
	$(BIN)/python -m specbench.fetch_data

# The tables are written even when a job failed (they name the failure); make then exits with the sweep's status.
bench: setup data
	st=0; $(BIN)/python -m specbench.run -m model=$(MODEL) +experiment=$(EXPERIMENT) +preset=$(PRESET) out.root=$(RESULTS) $(if $(filter 1,$(STRICT)),hydra.callbacks.checks.strict=true) $(ARGS) || st=$$?; \
	$(BIN)/python -m specbench.report --results $(RESULTS) && exit $$st

# Day one on a GPU box, rehearsed here: tiny replicas of every target and published drafter under their real hub ids in
# a private HF cache (offline), then make download / make bench PRESET=paper / the tables for each model in fp32, bf16
# and fp16, checked (specbench/tools/rehearse.py). ARGS='--models vicuna-7b --dtypes bfloat16 --limit 1' narrows it.
rehearse: setup
	$(BIN)/python -m specbench.rehearse $(ARGS)

# Every table and figure from results/ alone (specbench/bench/report/).
figures: setup
	$(BIN)/python -m specbench.report --results $(RESULTS)

# Our engine vs transformers' assisted generation / prompt lookup on the same prompts, in one process.
perf: setup
	$(BIN)/python -m specbench.perf model=$(MODEL) $(PERF_ARGS)

# The authors' published drafter weights for MODEL (conf/model/$(MODEL).yaml: published) into weights/$(MODEL)/.
download: setup
	$(BIN)/python -m specbench.download model=$(MODEL)

# Our eagle against the authors' own EAGLE (PyPI eagle-llm==1.2.1) on one trained head (specbench/tools/peer.py ->
# results/peer/). The authors' code runs in its own environment, $(PEER_VENV), with the versions it pins.
$(PEER_VENV)/.stamp: peer/requirements.txt
	test -x $(PEER_VENV)/bin/python || $(PY) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install -q -r peer/requirements.txt
	$(PEER_VENV)/bin/python -m pip install -q --no-deps eagle-llm==1.2.1
	touch $@

peer: setup $(PEER_VENV)/.stamp
	$(BIN)/python -m specbench.peer model=$(MODEL) peer.python=$(PEER_VENV)/bin/python $(ARGS)

# The baseline's ms per token vs the bare-matmul time of the same weights, per target cache (results/limit/).
limit: setup
	$(BIN)/python -m specbench.limit model=$(MODEL) $(PERF_ARGS)

# On a lent GPU, everything it can tell in one command (specbench/tools/gpu_check.py -> results/gpu_check/): every
# drafter lossless eager and compiled, random-weight Llama-2-7B / Llama-3-8B timings, kernel profile. ARGS narrows it.
# No setup: a lent GPU box has torch and no registry; it runs on $(PY) with the wheels its docstring names installed.
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m specbench.gpu_check $(ARGS)

# Every drafter's draft ms/step, verify ms/step, tokens/s and host round trips per step (results/perf/).
perf-drafters: setup
	$(BIN)/python -m specbench.perf_drafters model=$(MODEL) $(PERF_ARGS)

# The data-scaling experiment (issue 79): each of SCALING_DRAFTERS trained on the budget's recipe with only the first
# n of its conversations, n in SCALING_SUBSETS (the same held-out set, answers, epochs and schedule shape; SEED for the
# seed spread; n above the budget's 1600, e.g. the 2x point 3200: its own and the next ones after the held-out set, the
# target's answers for those generated once and added to the shipped weights/$(MODEL)/answers.jsonl), cheapest first;
# each point its own checkpoint directory (resumes), its log copied to results/train_scaling/$(MODEL)/<drafter>/
# n<n>[_seed<s>]/ (with its config.json: the command and commit) and its weights to weights/$(MODEL)/scaling/. The 1x point is the committed weights (results/training/). make figures draws it.
SCALING_DRAFTERS ?= eagle eagle3 hass moa
SCALING_SUBSETS ?= 200 400 800
SEED ?= 0
# SCALING_CKPT: where each point's checkpoints live (a run resumes from there)
SCALING_CKPT ?= checkpoints/scaling
train-scaling: setup
	set -e; for n in $(SCALING_SUBSETS); do for d in $(SCALING_DRAFTERS); do \
		p=n$${n}$(if $(filter 0,$(SEED)),,_seed$(SEED)); ck=$(SCALING_CKPT)/$$p; \
		$(TRAIN_CMD) drafter=$$d model=$(MODEL) train=$(TRAIN) train.subset=$$n train.seed=$(SEED) train.out_dir=$$ck $(ARGS); \
		mkdir -p results/train_scaling/$(MODEL)/$$d/$$p weights/$(MODEL)/scaling/$$p; \
		cp $$ck/$(MODEL)/$$d/log.jsonl $$ck/$(MODEL)/$$d/final/config.json results/train_scaling/$(MODEL)/$$d/$$p/; \
		rm -rf weights/$(MODEL)/scaling/$$p/$$d; cp -r $$ck/$(MODEL)/$$d/final weights/$(MODEL)/scaling/$$p/$$d; \
	done; done

# Each data-scaling point's weights (and the committed 1x weights) decoded for measured τ on MT-Bench and GSM8K at
# MoA Table 2's tree (conf/experiment/train_scaling_tau.yaml); resumes (a decoded point is skipped). The trained name
# eagle decodes as eagle2 (one head: the tree is the decoding's). `make figures` adds the τ to scaling.md.
train-scaling-tau: setup
	set -e; $(foreach d,$(SCALING_DRAFTERS),for ck in weights/$(MODEL)/$(d) weights/$(MODEL)/scaling/*/$(d); do \
		[ -d $$ck ] || continue; $(BIN)/python -m specbench.run -m model=$(MODEL) +experiment=train_scaling_tau \
		+preset=cpu drafter=$(if $(filter eagle,$(d)),eagle2,$(d)) drafter.checkpoint=$$ck $(ARGS); done;)

# Peak training memory and step time vs simulated steps: Beagle's late stage vs HASS (results/trainmem/).
trainmem: setup
	$(BIN)/python -m specbench.trainmem model=$(MODEL) $(ARGS)

# Every trainable method's training tokens/s in fp32 and under bf16 autocast (results/trainspeed/).
trainspeed: setup
	$(BIN)/python -m specbench.trainmem --config-name trainspeed model=$(MODEL) $(ARGS)

# Train every drafter with the same budget (conf/train/$(TRAIN).yaml) and copy the final weights, with their
# validation log, to weights/$(MODEL)/<drafter>/ (what the drafter configs load). Resumes from checkpoints/;
# add ARGS=train.resume=false to start over.
train: setup
	set -e; for d in $(TRAIN_DRAFTERS); do \
		$(TRAIN_CMD) drafter=$$d model=$(MODEL) train=$(TRAIN) $(ARGS); \
		rm -rf weights/$(MODEL)/$$d; mkdir -p weights/$(MODEL); \
		cp -r checkpoints/$(MODEL)/$$d/final weights/$(MODEL)/$$d; \
		cp checkpoints/$(MODEL)/$$d/log.jsonl weights/$(MODEL)/$$d/log.jsonl; \
		mkdir -p results/training/$(MODEL)/$$d; cp checkpoints/$(MODEL)/$$d/log.jsonl results/training/$(MODEL)/$$d/; \
	done
