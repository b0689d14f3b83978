"""`python -m specbench.gpu_check` (make gpu-check): a command kept at the package root; its code is
specbench/tools/gpu_check.py."""
from specbench.tools.gpu_check import main

if __name__ == "__main__":
    main()
