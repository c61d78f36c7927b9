"""The main job from a checkout: `torchrun --nproc_per_node 4 scripts/train_lm.py [flags]`.

The job itself is the package module co2_zero.train (installed: `co2-train`); see its docstring and
`--help`.
"""

from co2_zero.train import main

if __name__ == "__main__":
    raise SystemExit(main())
