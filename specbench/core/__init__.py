"""Run plumbing shared by every command: structured configs (config), the Hydra entry points and run headers
(cli), run records written atomically (records), the environment and commit (envinfo), loading the target model
(models) and the measurement counters (metrics). Imports specbench.decode only.
"""
