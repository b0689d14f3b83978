"""`python -m specbench.cluster` (make cluster-test): a command kept at the package root; its code is
specbench/tools/cluster.py."""
from specbench.tools.cluster import main

if __name__ == "__main__":
    main()
