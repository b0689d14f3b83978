"""`python -m specbench.fetch_data`: a command kept at the package root; its code is specbench/data/fetch_data.py."""
from specbench.data.fetch_data import main

if __name__ == "__main__":
    main()
