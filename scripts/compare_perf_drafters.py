"""Two `make perf-drafters` records side by side (e.g. before and after a hot-path change), as a Markdown table:
tokens/s, draft and verify ms per step, host round trips per step, and whether every output is the same token for
token in both records.

    python scripts/compare_perf_drafters.py results/perf/<before>/perf_drafters.json results/perf/<after>/perf_drafters.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path: str) -> dict:
    return json.loads(Path(path).read_text())


def table(before: dict, after: dict) -> str:
    b, a = before["report"]["drafters"], after["report"]["drafters"]
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    rows = ["| drafter | tok/s before | tok/s after | after / before | draft ms/step | verify ms/step | "
            "host round trips/step (drafter's) | same outputs |",
            "|---|---:|---:|---:|---:|---:|---:|:---:|"]
    for name in a:
        if name not in b:
            continue
        x, y = b[name], a[name]
        tb, ta = x["tokens_per_s"], y["tokens_per_s"]
        rb, ra = x["round_trips"], y["round_trips"]
        rows.append(
            f"| {name} | {tb['mean']:.2f} ± {tb['std']:.2f} | {ta['mean']:.2f} ± {ta['std']:.2f} | "
            f"{ta['mean'] / tb['mean']:.2f}x | {f(x['draft_ms_per_step'])} → {f(y['draft_ms_per_step'])} | "
            f"{f(x['verify_ms_per_step'])} → {f(y['verify_ms_per_step'])} | "
            f"{rb['per_step']:.1f} ({rb['draft_per_step']:.1f}) → {ra['per_step']:.1f} ({ra['draft_per_step']:.1f}) | "
            f"{'yes' if x['outputs'] == y['outputs'] else 'NO'} |")
    return "\n".join(rows)


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    before, after = load(sys.argv[1]), load(sys.argv[2])
    print(f"before: {before['git']}  after: {after['git']}  ({after['report']['prompts']} prompts x "
          f"{after['report']['max_new_tokens']} new tokens, {after['report']['repeats']} repeats, T=0)\n")
    print(table(before, after))


if __name__ == "__main__":
    main()
