"""Measurement and day-one tools built on the layers below: our engine against transformers (perf), per-drafter
step costs (perf_drafters), the baseline against its matmul floor (limit), our EAGLE against the authors' (peer),
serving exports (export), the GPU-day rehearsal and its replicas (rehearse, replicas), training memory and speed
(trainmem), token counts for draft vocabularies (vocab) and published weights (download). May import every layer.
"""
