"""Pick CO2's τ from a checkout: run exactly like scripts/train_lm.py, with the same flags.

The tuner itself is the package module co2_zero.train.tune_tau (installed: `co2-tune-tau`); see its docstring
and `--help`.
"""

from co2_zero.train.tune_tau import main

if __name__ == "__main__":
    raise SystemExit(main())
