"""`make figures` (`python -m specbench.report`): every paper table and figure, from the records in results/ only.

For each experiment directory results/<experiment>/ that holds runs, the tables and figures its experiment declares
(conf/experiment/<experiment>.yaml, `report:`; adding an experiment touches that one file):
markdown and LaTeX with the paper's rows and columns, our numbers, and in the caption the model, its dtype and the
budget, the paper's draft tree, the tree (or chain) each drafter's runs decoded with (from their run.json) and the
device(s) and commit(s) of the runs. Runs of different models (or dtypes, or presets) never share a table: each gets
its own files, `<table>.<model>.md` (the dtype and budget added where one model has several); runs
that do not exist are shown as "–" (never as zeros). Figures (matplotlib, PNG) for the training
curves (results/training/), the Leviathan speedup-vs-alpha curves with our measured chain points, the draft / verify
cost decomposition and the training-memory-vs-steps result (results/trainmem/). Output is deterministic: running it
twice gives byte-identical files (sorted inputs, fixed formats, PNGs without timestamps).
    python -m specbench.report [--results results]

Modules, each importing only those above it in this list: cells (runs -> formatted cells, the shared
formatting), tables (the experiments' table declarations), figures, logs (the tools' results), experiments (the
families with tables of their own), main (`report`, `main`)."""
import matplotlib

matplotlib.use("Agg")  # headless: set before any module of the package imports pyplot
