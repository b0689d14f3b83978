"""`python -m specbench.trainmem`: a command kept at the package root; its code is specbench/tools/trainmem.py."""
from specbench.tools.trainmem import main

if __name__ == "__main__":
    main()
