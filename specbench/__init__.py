"""specbench: one lossless tree-verification engine and one set of counters for every speculative-decoding drafter."""

__version__ = "0.1.0"
