#!/usr/bin/env bash
# Validation acceptance after training in fp32 and under bf16 autocast (train.precision), eagle with two seeds, hass with one, on the
# embedded budget cut to 400 conversations (the same self-distilled text for every run). Writes
# results/trainspeed/acceptance/<drafter>__<precision>__s<seed>/{log.jsonl,config.json}; `make figures` tabulates them.
#   bash scripts/bf16_acceptance.sh                 (eagle x 4 and hass x 2, the runs recorded: ~40 min on 2 CPU cores)
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-checkpoints/bf16}   # under the ignored checkpoints/
RUNS=${RUNS:-"eagle:fp32:0 eagle:bf16:0 eagle:fp32:1 eagle:bf16:1 hass:fp32:0 hass:bf16:0"}
for run in $RUNS; do
  IFS=: read -r d prec seed <<< "$run"
  $PY -m specbench.train drafter="$d" model=smollm2-135m train=embedded train.conversations=400 train.resume=false \
    train.precision="$prec" train.seed="$seed" train.out_dir="$OUT/${prec}_s${seed}"
  dest=results/trainspeed/acceptance/${d}__${prec}__s${seed}
  mkdir -p "$dest"
  cp "$OUT/${prec}_s${seed}/smollm2-135m/$d/log.jsonl" "$OUT/${prec}_s${seed}/smollm2-135m/$d/final/config.json" "$dest/"
done
