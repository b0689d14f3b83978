"""`python -m specbench.vocab`: a command kept at the package root; its code is specbench/tools/vocab.py."""
from specbench.tools.vocab import main

if __name__ == "__main__":
    main()
