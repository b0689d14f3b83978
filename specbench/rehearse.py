"""`python -m specbench.rehearse`: a command kept at the package root; its code is specbench/tools/rehearse.py."""
from specbench.tools.rehearse import main

if __name__ == "__main__":
    main()
