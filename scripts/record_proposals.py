"""Record every drafter config's proposals (tree tokens and parents, step by step) on a fixed greedy decode of the
tiny conformance target, to tests/data/proposals.json: tests/test_roundtrips.py checks that the drafters propose the
same trees, token for token, as the commit that recorded them (the trees were grown on the host before the hot-path
change; run this at a commit to record its proposals).

    python scripts/record_proposals.py [out.json]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from specbench.core import envinfo  # noqa: E402
from specbench.decode.engine import Engine  # noqa: E402
from specbench.decode.types import SamplingParams  # noqa: E402
from tests.test_conformance import DRAFTER_CONFIGS, PROMPTS, make_drafter, target_for  # noqa: E402

STEPS = 12  # proposals recorded per drafter
MAX_NEW = 48


class Recording:
    def __init__(self, inner):
        self.inner, self.needs, self.trees = inner, inner.needs, []
        self.hidden_layers = inner.hidden_layers

    def prefill(self, state):
        self.inner.prefill(state)

    def propose(self, state):
        tree = self.inner.propose(state)
        if len(self.trees) < STEPS:
            self.trees.append([tree.tokens[0].tolist(), tree.parents[0].tolist()])
        return tree

    def on_verified(self, state):
        self.inner.on_verified(state)


def record(names=None, overrides=()) -> dict:
    target = target_for()
    out = {}
    for name in names or DRAFTER_CONFIGS:
        rec = Recording(make_drafter(name, target, *overrides))
        Engine(target, rec, SamplingParams()).generate(PROMPTS[1], MAX_NEW)
        out[name] = rec.trees
    return out


if __name__ == "__main__":
    # python scripts/record_proposals.py [out.json] [--only moa,moa_tli1 --why "..."]: re-record some drafters (their
    # module changed), keeping the others' recording and saying at which commit and why
    args = sys.argv[1:]
    only = args[args.index("--only") + 1].split(",") if "--only" in args else None
    why = args[args.index("--why") + 1] if "--why" in args else None
    rest = [a for i, a in enumerate(args) if a not in ("--only", "--why") and (i == 0 or args[i - 1] not in ("--only", "--why"))]
    path = Path(rest[0] if rest else "tests/data/proposals.json")
    if only:
        data = json.loads(path.read_text())
        data["proposals"].update(record(only))
        data.setdefault("rerecorded", []).append({"drafters": only, "git": envinfo.git_commit(), "why": why})
    else:
        data = {"git": envinfo.git_commit(), "prompt": PROMPTS[1], "max_new_tokens": MAX_NEW, "proposals": record()}
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"written: {path}")
