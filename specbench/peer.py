"""`python -m specbench.peer`: a command kept at the package root; its code is specbench/tools/peer.py."""
from specbench.tools.peer import main

if __name__ == "__main__":
    main()
