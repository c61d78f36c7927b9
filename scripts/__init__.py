"""The benchmarks and their harness, as modules of one package: run them from the repository root as
`python -m scripts.bench_throughput ...` (they import each other as `scripts.<name>`). The training job
and the τ tuner live in the library (co2_zero.train, co2_zero.train.tune_tau); scripts/train_lm.py and
scripts/tune_tau.py are their command-line shims."""
