"""`python -m specbench.export`: a command kept at the package root; its code is specbench/tools/export.py."""
from specbench.tools.export import main

if __name__ == "__main__":
    main()
