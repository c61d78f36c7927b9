"""A user's script: CO2Optimizer trains, finalize(), the world group destroyed, the optimizer still in
scope and no garbage collection. Writes OUT_DIR/rank<R>.json: the gloo threads still alive then.

    torchrun --nproc_per_node 2 tests/workers/groups_after_finalize.py OUT_DIR

finalize() (and close()) release the CO2 groups: none of their threads may outlive it, or they end
with the interpreter, where they can abort the process (docs/design.md §8).
tests/integrations/test_optim.py expects none.
"""

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  before the world group (design §8): this test is about the CO2 groups
import torch.distributed as dist
from threads_after_job import GLOO_THREADS, live_threads  # this script's folder comes first on sys.path

from co2_zero import CO2Optimizer

if __name__ == "__main__":
    gc.disable()  # what a reference cycle would keep stays kept: only references dropped on purpose end
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 2)
    opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), {"tau": 2}, model=model)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
    opt.finalize()
    dist.destroy_process_group()
    gloo = [name for name in live_threads() if name in GLOO_THREADS]
    (Path(sys.argv[1]) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(gloo))
