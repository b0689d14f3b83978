"""`python -m specbench.report`: a command kept at the package root; its code is specbench/bench/report/main.py."""
from specbench.bench.report.main import main

if __name__ == "__main__":
    main()
