"""The tables that README.md and docs/*.md show, written by `make figures` from the files it writes under results/,
so that no measured number in the documentation is typed by hand.

A block in a markdown file

    <!-- table: results/beagle_table1/table1.smollm2-135m.md -->
    ...
    <!-- end table -->

is replaced by that file's text (its caption and table); with `columns: method, mtbench Spu, mtbench τ` after the
path, by its first table cut to those columns (header names as in the file), without the caption; `columns: *`: its
first table whole, without the caption. `path#n` reads the file from its n-th table on (1-based; with `columns`, that
table stands for its first), for a record that holds several tables, e.g. `make gpu-check`'s. Paths are relative
to the repository. A block whose file is missing is left as it is and named.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

from specbench.core.records import atomic_write_text

log = logging.getLogger("specbench.report")
BLOCK = re.compile(r"(?P<open><!-- table: (?P<src>\S+?)(?: columns: (?P<cols>[^>]*?))? -->\n)(?P<body>.*?)"
                   r"(?P<close><!-- end table -->)", re.S)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table_columns(text: str, columns: list[str]) -> str:
    """The first markdown table of `text`, cut to `columns` (in that order) -> its lines."""
    start = next((i for i, ln in enumerate(text.splitlines()) if ln.startswith("|")), 0)
    block = text.splitlines()[start:]
    lines = block[: next((i for i, ln in enumerate(block) if not ln.startswith("|")), len(block))]  # the first table's
    if len(lines) < 2:
        raise ValueError("no markdown table")
    if columns == ["*"]:  # the first table as the file has it
        return "\n".join(lines) + "\n"
    header = _cells(lines[0])
    missing = [c for c in columns if c not in header]
    if missing:
        raise ValueError(f"no column {', '.join(missing)} (columns: {', '.join(header)})")
    idx = [header.index(c) for c in columns]
    rows = [header, ["---"] * len(header)] + [_cells(ln) for ln in lines[2:]]
    return "\n".join("| " + " | ".join(r[i] for i in idx) + " |" for r in rows) + "\n"


def nth_table_on(text: str, n: int) -> str:
    """`text` from the first line of its n-th markdown table (1-based) on."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, ln in enumerate(lines) if ln.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))]
    if not 1 <= n <= len(starts):
        raise ValueError(f"no table {n} (the file has {len(starts)})")
    return "".join(lines[starts[n - 1]:])


def render_block(repo: Path, src: str, cols: str | None) -> str | None:
    src, _, nth = src.partition("#")
    path = repo / src
    if not path.is_file():
        return None
    text = path.read_text()
    if nth:  # a later table of the file: cut to it, then read as the file's first
        text = nth_table_on(text, int(nth))
    if cols is None:
        return text.rstrip("\n") + "\n"
    return table_columns(text, [c.strip() for c in cols.split(",")])


def sync_docs(repo: Path, files: list[Path]) -> tuple[list[Path], list[str]]:
    """Rewrite every table block of `files` from its source -> (files changed, sources missing)."""
    changed, missing = [], []
    for f in files:
        text = f.read_text()

        def fill(m: re.Match) -> str:
            body = render_block(repo, m["src"], m["cols"])
            if body is None:
                missing.append(f"{f.relative_to(repo)}: {m['src']}")
                return m.group(0)
            return m["open"] + body + m["close"]

        new = BLOCK.sub(fill, text)
        if new != text:
            atomic_write_text(f, new)
            changed.append(f)
    for m in missing:
        log.warning("a documented table's source is missing: %s", m)
    return changed, missing


def doc_files(repo: Path) -> list[Path]:
    return [p for p in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))] if p.is_file()]
