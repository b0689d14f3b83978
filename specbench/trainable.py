"""`python -m specbench.trainable` (make train's list): a command kept at the package root; its code is
specbench/train/trainable.py."""
from specbench.train.trainable import trainable_drafters

if __name__ == "__main__":
    print(" ".join(trainable_drafters()))
