"""What a base install (`pip install torch==2.13.0 && pip install -e .`, nothing else) must run.

    torchrun --nproc_per_node 2 tests/workers/base_install_check.py

Imports co2_zero, builds a CO2Optimizer on every rank, trains two rounds, saves and reloads a
checkpoint, finalizes, and checks that the replicas end identical. numpy is hidden from the process
before torch is imported, so anything that needs it (pickling collectives such as
`all_gather_object`, `tensor.numpy()`) fails here as it would on a fresh machine. CI runs this in the
venv of the README's first command; tests/project/test_base_install.py runs it in the test venv.
"""

import sys

sys.modules["numpy"] = None  # as if numpy were not installed: `import numpy` raises ImportError

import gc  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401  before the group, as docs/plain.md says (design §8)
import torch.distributed as dist  # noqa: E402

import co2_zero  # noqa: E402
from co2_zero import CO2Config, CO2Optimizer, checkpoint  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = CO2Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), CO2Config(tau=2, timeout_s=60), model=model)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x = torch.randn(8, 4, generator=gen)
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    # One directory for every rank of this launch (same machine): the checkpoint is collective.
    where = os.path.join(tempfile.gettempdir(), f"co2_base_install_check_{os.environ.get('MASTER_PORT', '0')}")
    checkpoint.save(where, model, opt, extra={"step": 4})
    assert checkpoint.load(where, model, opt)["step"] == 4
    dist.barrier()
    if rank == 0:
        shutil.rmtree(where, ignore_errors=True)
    opt.finalize()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = flat.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    flat_min = flat.clone()
    dist.all_reduce(flat_min, op=dist.ReduceOp.MIN)
    assert torch.equal(spread, flat_min), "replicas differ after finalize()"
    if rank == 0:
        print(f"base install ok: co2_zero {co2_zero.__version__}, {dist.get_world_size()} ranks, replicas identical")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.collect()  # the optimizer's groups end here, not with the interpreter (design §8)
