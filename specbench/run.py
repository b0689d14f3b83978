"""`python -m specbench.run`: a command kept at the package root; its code is specbench/bench/run.py."""
from specbench.bench.run import main

if __name__ == "__main__":
    main()
