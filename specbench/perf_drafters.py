"""`python -m specbench.perf_drafters`: a command kept at the package root; its code is specbench/tools/perf_drafters.py."""
from specbench.tools.perf_drafters import main

if __name__ == "__main__":
    main()
