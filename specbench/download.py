"""`python -m specbench.download`: a command kept at the package root; its code is specbench/tools/download.py."""
from specbench.tools.download import main

if __name__ == "__main__":
    main()
