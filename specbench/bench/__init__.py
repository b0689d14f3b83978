"""Benchmark runs and what is read from them: one run (run; `python -m specbench.run`), sweeps (sweep), failed jobs
(failures), the near-tie rule (divergence), the cost model behind tree=auto (costmodel) and every table and figure
(report). Imports decode, core, data and train only.
"""
