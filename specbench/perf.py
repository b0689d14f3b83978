"""`python -m specbench.perf`: a command kept at the package root; its code is specbench/tools/perf.py."""
from specbench.tools.perf import main

if __name__ == "__main__":
    main()
