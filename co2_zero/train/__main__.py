"""`python -m co2_zero.train` (also under torchrun: `torchrun --nproc_per_node 4 -m co2_zero.train`)."""

from co2_zero.train import main

raise SystemExit(main())
