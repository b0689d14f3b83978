"""The table declarations of conf/experiment/*.yaml (`report:`) as typed tables, one kind per experiment family."""
from __future__ import annotations

from dataclasses import dataclass
from omegaconf import OmegaConf
from specbench.core.cli import CONF_DIR
from specbench.bench.report.cells import Table


def router_table(*datasets: str) -> Table:
    """CORAL's LM-head router (papers/003 Sec. 3.3): the same frozen head and tree with and without the router, so the
    draft time per SD iteration (Td) differs only by the LM head; verify time (Tv) is the control."""
    return Table("router", "Draft latency of the CORAL LM-head router: Td / Tv = draft / verify ms per SD iteration "
                 "(papers/003 Sec. 3.3)", ("coral", "coral_router"), datasets, ("draft_ms", "verify_ms", "tau"))


@dataclass(frozen=True)
class DatasetsTable:
    """A report of its own kind over the experiment's runs on `datasets`, written as <name>.<model>.md."""

    name: str
    datasets: tuple[str, ...]


class AutoTable(DatasetsTable):
    """Each drafter's paper-tree and tree=auto runs side by side (tree_auto_report)."""


class VocabTable(DatasetsTable):
    """The EAGLE family's draft-vocabulary pruning (module.draft_vocab) per drafter, tree and N (vocab_report)."""


class BatchTable(DatasetsTable):
    """Every drafter's speedup against batch size (batch_report), at its paper tree and at tree=auto per B."""


class BaselinesTable(DatasetsTable):
    """Every drafter against the eager baseline and against the compiled one (baselines_report, issue 30)."""


@dataclass(frozen=True)
class BoardTable:
    """Spec-Bench's board (board_report): drafters x its six tasks in its own columns, with a published board beside."""

    name: str
    columns: tuple[tuple[str, str], ...]  # (Spec-Bench's column title, our dataset)
    drafters: tuple[str, ...]
    published: dict | None = None  # source, device, model, settings, rows {method: [6 speedups, accepted, overall]}
    ours: tuple[tuple[str, str], ...] = ()  # (published method, our drafter) where they are the same method


@dataclass(frozen=True)
class ClientServerTable:
    """MoA's client-server setting (client_server_report, issue 78): Tables 3, 4 and 7 of papers/002 mirrored over one
    sweep of drafter x split_case (conf/experiment/moa_client_server.yaml), written as <name>3/4/7.<model>.md."""

    name: str
    dataset: str
    drafters: tuple[str, ...]
    links: tuple[str, ...]  # Table 3's link profiles (conf/link/), in its column order
    cuts: tuple[int, ...]  # Table 4's B (link.disconnect_after_tokens); B = ∞ is the first link's run (no cut)
    published: dict | None = None  # the paper's rows: {table3: {method: [5G, 4G, τ, calls]}, table4: {method: [...]}}


DATASET_KINDS = {"auto": AutoTable, "vocab": VocabTable, "batch": BatchTable, "baselines": BaselinesTable}


def experiment_report(exp: str) -> tuple[list, list[str]] | None:
    """What an experiment renders, from its own YAML (conf/experiment/<exp>.yaml, `report:`): tables (`kind: table`,
    the default, in the paper's layout; `router`; `auto`) and figures (leviathan, cost, tree_size). None when the
    directory is not an experiment's or declares nothing."""
    path = CONF_DIR / "experiment" / f"{exp}.yaml"
    node = (OmegaConf.to_container(OmegaConf.load(path)) or {}).get("report") if path.is_file() else None
    if not node:
        return None
    tables: list = []
    for t in node.get("tables", []):
        kind = t.get("kind", "table")
        if kind == "router":
            tables.append(router_table(*t["datasets"]))
        elif kind in DATASET_KINDS:
            tables.append(DATASET_KINDS[kind](t["name"], tuple(t["datasets"])))
        elif kind == "board":
            tables.append(BoardTable(t["name"], tuple(t["columns"].items()), tuple(t["drafters"]), t.get("published"),
                                     tuple((t.get("ours") or {}).items())))
        elif kind == "client_server":
            tables.append(ClientServerTable(t["name"], t["dataset"], tuple(t["drafters"]), tuple(t["links"]),
                                            tuple(int(b) for b in t["cuts"]), t.get("published")))
        elif kind == "table":
            tables.append(Table(t["name"], t["caption"], tuple(t["drafters"]), tuple(t["datasets"]),
                                tuple(t["metrics"]), tuple(float(x) for x in t.get("temperatures", [0.0])),
                                bool(t.get("mean", False)), t.get("paper_tree", ""), t.get("option", "")))
        else:
            raise ValueError(f"{path}: report table kind {kind!r} is not table, router, auto, vocab, batch, baselines, "
                             f"board or client_server")
    return tables, list(node.get("figures", []))
