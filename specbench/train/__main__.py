"""`python -m specbench.train`: the Trainer (specbench/train/trainer.py)."""
from specbench.train.trainer import main

if __name__ == "__main__":
    main()
