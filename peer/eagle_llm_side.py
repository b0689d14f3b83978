"""The authors' side of `make peer`: SafeAILab's own EAGLE (PyPI eagle-llm==1.2.1, `eagle.model.ea_model.EaModel`),
run in its own environment (.peer-venv: transformers 4.36.2 and accelerate 0.21.0 as the authors' requirements.txt
pins them). It imports nothing from specbench (another transformers), and changes nothing in the authors' code.

    .peer-venv/bin/python peer/eagle_llm_side.py <target dir> <head dir> <threads>

Answers JSON lines on stdout, one per request line on stdin:
    {"method": "eagle" | "greedy", "ids": [prompt token ids], "max_new": N}
 -> {"tokens": [...], "known": [...], "times": [...]}
`tokens`: what the authors' generator had put in input_ids when it stopped (it ran until N tokens or an EOS were in
them). For "eagle", one entry of `known` / `times` per tree-verification step of `EaModel.ea_generate` (their
generator, EAGLE-1's mc_sim_7b_63 tree): the tokens known after that step — the ones in input_ids plus the pending
bonus token that becomes the next step's root — and the seconds since the call started. For "greedy" (their
`naive_generate`, one target forward per token) one entry per token.
"""
from __future__ import annotations

import json
import sys
import time

import torch
from eagle.model.choices import mc_sim_7b_63
from eagle.model.ea_model import EaModel


def run(model: EaModel, method: str, ids: list[int], max_new: int, eos: int) -> dict:
    prompt = torch.tensor([ids])
    n = prompt.shape[1]
    gen = (model.ea_generate(prompt, temperature=0.0, max_steps=max_new + 1, tree_choices=mc_sim_7b_63)
           if method == "eagle" else model.naive_generate(prompt, temperature=0.0, max_steps=max_new + 1))
    # ea_generate's input_ids hold the accepted tokens; the step's bonus token waits as the next root (+1)
    pending = 1 if method == "eagle" else 0
    known, times, out = [], [], prompt
    t0 = time.perf_counter()
    for out in gen:
        times.append(time.perf_counter() - t0)
        known.append(out.shape[1] - n + pending)
        new = out[0, n:].tolist()
        if len(new) >= max_new or eos in new:
            break
    return {"tokens": out[0, n:].tolist(), "known": known, "times": times}


def main() -> None:
    target, head, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(threads)
    model = EaModel.from_pretrained(base_model_path=target, ea_model_path=head, torch_dtype=torch.float32)
    model.eval()
    eos = model.tokenizer.eos_token_id
    print(json.dumps({"ready": True, "eos": eos, "tree": mc_sim_7b_63}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps(run(model, req["method"], req["ids"], req["max_new"], eos)), flush=True)


if __name__ == "__main__":
    main()
