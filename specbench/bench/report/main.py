"""`make figures` (`python -m specbench.report`): every table and figure from results/ alone."""
from __future__ import annotations

import argparse
from pathlib import Path
from specbench.bench.report.cells import (
    Table, cell_key, file_stem, load_failures, load_runs, option_key, render)
from specbench.bench.report.tables import (
    AutoTable, BaselinesTable, BatchTable, BoardTable, ClientServerTable, VocabTable, experiment_report)
from specbench.bench.report.figures import figure_cost, figure_leviathan
from specbench.bench.report.logs import training_curves, trainmem, trainspeed
from specbench.bench.report.scaling import train_scaling
from specbench.bench.report.client_server import client_server_report
from specbench.bench.report.experiments import (
    baselines_report, batch_report, board_report, tree_auto_report, vocab_report)


def report(results: Path) -> list[Path]:
    written = []
    for exp_dir in sorted(p for p in results.iterdir() if p.is_dir()) if results.is_dir() else []:
        spec = experiment_report(exp_dir.name)
        if spec is None:
            continue
        tables, figures = spec
        paper = [t for t in tables if isinstance(t, Table)]
        options = {t.option for t in paper}
        if len(options) > 1:
            raise ValueError(f"conf/experiment/{exp_dir.name}.yaml: its tables name different options {sorted(options)}")
        option = next(iter(options), "")
        key_of = option_key(option) if option else cell_key
        settings = load_runs(exp_dir, key_of) if paper else {}
        failed = load_failures(exp_dir, key_of) if paper else {}
        for setting in failed:  # a setting whose every job failed still gets its tables, naming the failures
            settings.setdefault(setting, {})
        for setting, runs in sorted(settings.items()):
            stem = file_stem(setting, settings)
            for table in paper:
                md, tex = render(table, runs, setting, failed.get(setting))
                for suffix, text in ((".md", md), (".tex", tex)):
                    path = exp_dir / f"{table.name}.{stem}{suffix}"
                    path.write_text(text)
                    written.append(path)
            if "leviathan" in figures:
                figure_leviathan(runs, exp_dir, stem)
            if "cost" in figures:
                for ds in paper[0].datasets:
                    figure_cost(runs, exp_dir, ds, stem)
        for table in (t for t in tables if isinstance(t, AutoTable)):
            written += tree_auto_report(exp_dir, table, "tree_size" in figures)
        for table in (t for t in tables if isinstance(t, VocabTable)):
            written += vocab_report(exp_dir, table)
        for table in (t for t in tables if isinstance(t, BaselinesTable)):
            written += baselines_report(exp_dir, table)
        for table in (t for t in tables if isinstance(t, BatchTable)):
            written += batch_report(exp_dir, table, "batch" in figures)
        for table in (t for t in tables if isinstance(t, BoardTable)):
            written += board_report(exp_dir, table)
        for table in (t for t in tables if isinstance(t, ClientServerTable)):
            written += client_server_report(exp_dir, table, "client_server" in figures)
    training_curves(results / "training", results / "training")
    written += train_scaling(results / "train_scaling", results / "training")
    trainmem(results / "trainmem")
    trainspeed(results / "trainspeed")
    return written


def main() -> None:
    from specbench.bench.report.docs import doc_files, sync_docs
    from specbench.core.envinfo import REPO

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="results", type=Path)
    args = ap.parse_args()
    for p in report(args.results):
        print(f"written: {p}")
    if args.results.resolve() == (REPO / "results").resolve():  # the committed results: the docs show their tables
        for p in sync_docs(REPO, doc_files(REPO))[0]:
            print(f"written: {p}")


if __name__ == "__main__":
    main()
