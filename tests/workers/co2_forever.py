"""A torchrun worker that trains with CO2 until it is interrupted (for the Ctrl-C test)."""

import torch
import torch.distributed as dist

from co2_zero import CO2Config, CO2Optimizer


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.01), CO2Config(tau=2, timeout_s=30))
    generator = torch.Generator().manual_seed(rank)
    while True:
        loss = model(torch.randn(32, 16, generator=generator)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if opt.round_ended:
            print(f"rank {rank} round {opt.last_round['round']}", flush=True)


if __name__ == "__main__":
    main()
