"""`python -m specbench.limit`: a command kept at the package root; its code is specbench/tools/limit.py."""
from specbench.tools.limit import main

if __name__ == "__main__":
    main()
