"""Checks of the single-process CO2 reference against hand-derivable facts."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

try:
    from tests.reference import Params, round_starts, simulate
except ImportError:  # tests/ collected as a plain directory
    from reference import Params, round_starts, simulate

torch.set_num_threads(1)

TAU = 3


def linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def mlp_bn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.05)


def batch(replica: int, step: int, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1000 * replica + step)
    inputs = torch.randn(8, 4, generator=gen)
    return inputs, scale * torch.randn(8, 3, generator=gen)


def big_batch(replica: int, step: int) -> tuple[Tensor, Tensor]:
    return batch(replica, step, scale=100.0)


mse = nn.functional.mse_loss


def cfg(**overrides: object) -> dict:
    """Plain local-SGD-like config (every math field spelled out, not the library's defaults), overridable."""
    base: dict = {
        "tau": TAU,
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "nesterov": False,
        "stand_in": "shared",
        "sync_delay": None,
        "overlap": False,
        "gap_penalty": {"mode": "none"},
        "clip": {"mode": "none"},
    }
    return {**base, **overrides}


def train(make_model, start: Params | None, replica: int, first: int, n: int) -> nn.Module:
    """Plain SGD training of one model from ``start`` on batch(replica, first..first+n-1)."""
    model = make_model()
    model.train()
    if start is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(start[name])
    opt = sgd(list(model.parameters()))
    for k in range(first, first + n):
        inputs, targets = batch(replica, k)
        opt.zero_grad()
        mse(model(inputs), targets).backward()
        opt.step()
    return model


def params(model: nn.Module) -> Params:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def close(a: Params, b: Params, atol: float = 1e-6) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[n], b[n], atol=atol, rtol=0) for n in a)


def mean_displacement(start: Params, round_: int, replicas: int = 2) -> Params:
    """Independently computed mean over replicas of start − (start after τ SGD steps)."""
    ends = [params(train(linear, start, r, round_ * TAU, TAU)) for r in range(replicas)]
    return {n: sum(start[n] - e[n] for e in ends) / replicas for n in start}


def test_blocking_start_is_mean_of_replicas() -> None:
    starts = round_starts(linear, sgd, batch, mse, cfg(), replicas=2, steps=3 * TAU)
    assert len(starts) == 4
    assert close(starts[0], params(linear()))
    for t in range(3):
        ends = [params(train(linear, starts[t], r, t * TAU, TAU)) for r in range(2)]
        mean = {n: (ends[0][n] + ends[1][n]) / 2 for n in ends[0]}
        assert close(starts[t + 1], mean)
        assert not close(starts[t + 1], ends[0])  # the replicas really differ


def test_blocking_single_replica_is_plain_training() -> None:
    starts: list[Params] = []
    live = simulate(linear, adam, batch, mse, cfg(), 1, 3 * TAU + 2, finalize=False, record=starts)
    model = linear()
    opt = adam(list(model.parameters()))
    for k in range(3 * TAU + 2):
        if k % TAU == 0:
            assert close(starts[k // TAU], params(model), atol=1e-5)
        inputs, targets = batch(0, k)
        opt.zero_grad()
        mse(model(inputs), targets).backward()
        opt.step()
    assert close({n: live[0][n] for n in ("weight", "bias")}, params(model), atol=1e-5)


def test_overlap_applies_displacement_one_round_late() -> None:
    trace: list[dict] = []
    starts: list[Params] = []
    out = simulate(
        linear,
        sgd,
        batch,
        mse,
        cfg(overlap=True),
        2,
        4 * TAU,
        record=starts,
        trace=trace,
    )
    assert len(starts) == 5 and len(trace) == 4
    assert close(starts[1], starts[0])  # x_1 = x_0
    gs = [mean_displacement(starts[t], t) for t in range(4)]
    for t in range(3):
        step = {n: starts[t + 2][n] - starts[t + 1][n] for n in gs[t]}
        assert close(step, {n: -v for n, v in gs[t].items()})
        assert close(trace[t]["g"], gs[t])
    x5 = {n: starts[4][n] - gs[3][n] for n in gs[3]}  # finalize returns the last result
    for replica in out:
        assert close({n: replica[n] for n in x5}, x5)
    assert not close(starts[2], starts[1])


def test_finalize_drops_partial_round() -> None:
    for overlap in (False, True):
        c = cfg(overlap=overlap)
        full = simulate(linear, sgd, batch, mse, c, 2, 2 * TAU)
        partial = simulate(linear, sgd, batch, mse, c, 2, 2 * TAU + 2)
        live = simulate(linear, sgd, batch, mse, c, 2, 2 * TAU + 2, finalize=False)
        for a, b, x in zip(full, partial, live):
            assert close(a, b)
            assert not close(a, x)
        assert not close(live[0], live[1])
    # No round end at all: overlap returns x_0.
    none = simulate(linear, sgd, batch, mse, cfg(overlap=True), 2, TAU - 1)
    assert close(none[0], params(linear()))


def test_clip_value_caps_momentum() -> None:
    trace: list[dict] = []
    c = cfg(outer_momentum=0.9, clip={"mode": "value", "threshold": 0.05})
    simulate(linear, sgd, big_batch, mse, c, 2, 4 * TAU, trace=trace)
    for entry in trace:
        for n, m in entry["m"].items():
            assert m.abs().max() <= 0.05 + 1e-7
            assert torch.equal(entry["u"][n], m)
            assert torch.allclose(entry["result"][n], entry["base"][n] - entry["u"][n])
    assert any(g.abs().max() > 0.05 for g in trace[0]["g"].values())  # clipping was needed
    assert any((m.abs() == 0.05).any() for m in trace[0]["m"].values())


def test_clip_norm_caps_global_norm() -> None:
    trace: list[dict] = []
    c = cfg(outer_momentum=0.5, clip={"mode": "norm", "threshold": 0.1})
    simulate(linear, sgd, big_batch, mse, c, 2, 3 * TAU, trace=trace)
    for entry in trace:
        total = torch.cat([m.flatten() for m in entry["m"].values()]).norm()
        assert total == pytest.approx(0.1, rel=1e-5)
        g_total = torch.cat([g.flatten() for g in entry["g"].values()]).norm()
        assert g_total > 0.1
    # The direction is kept: first m is g rescaled.
    g0, m0 = trace[0]["g"], trace[0]["m"]
    ratio = m0["weight"] / g0["weight"]
    assert torch.allclose(ratio, ratio.flatten()[0].expand_as(ratio), rtol=1e-5)


def test_adaptive_penalty_formula() -> None:
    trace: list[dict] = []
    alpha, gamma = 0.7, 2.0
    c = cfg(
        overlap=True,
        outer_lr=alpha,
        outer_momentum=0.5,
        gap_penalty={"mode": "adaptive", "strength": gamma},
    )
    simulate(linear, sgd, batch, mse, c, 2, 4 * TAU, trace=trace)
    for lam in trace[0]["penalty"].values():
        assert lam.item() == 1.0
    for t in range(1, len(trace)):
        prev, entry = trace[t - 1], trace[t]
        for n, g in entry["g"].items():
            gap = alpha * prev["u"][n].norm()
            expected = 1.0 + gamma * gap / (g.norm() + 1e-12)
            assert entry["gap"][n].item() == pytest.approx(gap.item(), rel=1e-6)
            assert entry["penalty"][n].item() == pytest.approx(expected.item(), rel=1e-6)
            assert entry["penalty"][n].item() > 1.0
    # m follows β·m + g/Λ (no clipping).
    m1 = {n: 0.5 * trace[0]["m"][n] + trace[1]["g"][n] / trace[1]["penalty"][n] for n in trace[1]["g"]}
    assert close(trace[1]["m"], m1)


def test_blocking_adaptive_penalty_is_one() -> None:
    trace: list[dict] = []
    c = cfg(outer_momentum=0.5, gap_penalty={"mode": "adaptive"})
    simulate(linear, sgd, batch, mse, c, 2, 3 * TAU, trace=trace)
    assert all(lam.item() == 1.0 for e in trace for lam in e["penalty"].values())


def test_constant_penalty_divides() -> None:
    trace: list[dict] = []
    c = cfg(overlap=True, gap_penalty={"mode": "constant", "value": 4.0})
    simulate(linear, sgd, batch, mse, c, 2, 2 * TAU, trace=trace)
    for entry in trace:
        assert close(entry["u"], {n: g / 4.0 for n, g in entry["g"].items()})


def test_nesterov() -> None:
    for beta, differs in ((0.9, True), (0.0, False)):
        heavy = cfg(overlap=True, outer_momentum=beta)
        nest = {**heavy, "nesterov": True}
        trace: list[dict] = []
        a = simulate(linear, sgd, batch, mse, heavy, 2, 4 * TAU)
        b = simulate(linear, sgd, batch, mse, nest, 2, 4 * TAU, trace=trace)
        assert close(a[0], b[0]) != differs
        for entry in trace:
            u = {n: beta * entry["m"][n] + g / entry["penalty"][n] for n, g in entry["g"].items()}
            assert close(entry["u"], u)


def test_float_buffers_averaged_int_untouched() -> None:
    out = simulate(mlp_bn, sgd, batch, mse, cfg(), 2, TAU)
    ends = [train(mlp_bn, None, r, 0, TAU) for r in range(2)]
    bufs = [dict(e.named_buffers()) for e in ends]
    for name in ("1.running_mean", "1.running_var"):
        mean = (bufs[0][name] + bufs[1][name]) / 2
        assert not torch.allclose(bufs[0][name], mean)
        for replica in out:
            assert torch.allclose(replica[name], mean, atol=1e-6)
    for replica in out:
        assert replica["1.num_batches_tracked"].item() == TAU
    mean_w = (params(ends[0])["0.weight"] + params(ends[1])["0.weight"]) / 2
    assert torch.allclose(out[0]["0.weight"], mean_w, atol=1e-6)


class Counting(nn.Module):
    """Linear layer with an int and a float buffer that differ between replicas."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)
        self.register_buffer("hits", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: Tensor) -> Tensor:
        self.hits += (x > 0).sum()
        self.ema.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return self.fc(x)


def test_buffers_at_round_end_and_finalize() -> None:
    def expected(replica: int, n: int) -> tuple[int, Tensor]:
        hits, ema = 0, torch.zeros(4)
        for k in range(n):
            inputs = batch(replica, k)[0]
            hits += int((inputs > 0).sum())
            ema = 0.5 * ema + 0.5 * inputs.mean(0)
        return hits, ema

    exp = [expected(r, TAU) for r in range(2)]
    assert exp[0][0] != exp[1][0]
    out = simulate(Counting, sgd, batch, mse, cfg(), 2, TAU, finalize=False)
    for r, replica in enumerate(out):
        assert replica["hits"].item() == exp[r][0]
        assert torch.allclose(replica["ema"], (exp[0][1] + exp[1][1]) / 2, atol=1e-6)
    # Mid-round the float buffers are the replicas' own; finalize averages them.
    live = simulate(Counting, sgd, batch, mse, cfg(), 2, TAU + 1, finalize=False)
    assert not torch.allclose(live[0]["ema"], live[1]["ema"])
    done = simulate(Counting, sgd, batch, mse, cfg(), 2, TAU + 1)
    mean = (live[0]["ema"] + live[1]["ema"]) / 2
    for r, replica in enumerate(done):
        assert torch.allclose(replica["ema"], mean, atol=1e-6)
        assert replica["hits"].item() == live[r]["hits"].item()


def test_shards_average_gradients() -> None:
    def halves(replica: int, shard: int, step: int) -> tuple[Tensor, Tensor]:
        inputs, targets = batch(replica, step)
        return inputs[4 * shard : 4 * shard + 4], targets[4 * shard : 4 * shard + 4]

    c = cfg(overlap=True, outer_momentum=0.5)
    whole = simulate(linear, sgd, batch, mse, c, 2, 3 * TAU)
    sharded = simulate(linear, sgd, batch, mse, c, 2, 3 * TAU, shards=2, shard_batch=halves)
    one_shard = simulate(
        linear,
        sgd,
        batch,
        mse,
        c,
        2,
        3 * TAU,
        shards=2,
        shard_batch=lambda r, s, k: halves(r, 0, k),
    )
    for a, b, x in zip(whole, sharded, one_shard):
        assert close(a, b, atol=1e-5)
        assert not close(a, x, atol=1e-5)
    bn = simulate(mlp_bn, sgd, batch, mse, cfg(), 2, 2 * TAU, shards=2, shard_batch=halves)
    assert bn[0]["1.num_batches_tracked"].item() == 2 * TAU  # one forward per step per rank


@pytest.mark.parametrize("bad", [{"gap_penalty": {"mode": "bogus"}}, {"clip": {"mode": "l1"}}, {"tau": 0}])
def test_invalid_config(bad: dict) -> None:
    with pytest.raises(ValueError):
        simulate(linear, sgd, batch, mse, cfg(**bad), 2, TAU)


@pytest.mark.parametrize("stand_in", ["shared", "local"])
def test_a_delay_fixed_mid_run_starts_after_the_published_rounds(stand_in: str) -> None:
    """sync_delay "auto" (docs/design.md §3, "The sync delay"): the rounds before ``delay_from`` are the
    published schedule, step for step; round delay_from - 1's average, x_{t+2}, then arrives d steps into
    round delay_from instead of at its end: each replica moves by x_{t+2} - its round start (x_{t+1}, or
    its stand-in), keeping its steps."""
    tau, d, switch, rounds = 4, 2, 2, 5
    c = cfg(overlap=True, outer_lr=0.7, outer_momentum=0.9, nesterov=True, tau=tau, stand_in=stand_in,
            gap_penalty={"mode": "adaptive", "strength": 1.5})  # fmt: skip
    published, starts, switched = [], [], []
    simulate(linear, sgd, batch, mse, c, 2, rounds * tau, step_record=published, record=starts)
    simulate(linear, sgd, batch, mse, {**c, "sync_delay": d}, 2, rounds * tau, step_record=switched,
             delay_from=switch)  # fmt: skip
    apply_step = switch * tau + d - 1  # the index of the step after which it arrives
    for k in range(apply_step):
        for m in range(2):
            assert close(switched[k][m], published[k][m]), k
    for m in range(2):  # x_{t+2} - where replica m started round delay_from (x_{t+1}, or its stand-in)
        jump = {n: starts[switch + 1][n] - published[switch * tau - 1][m][n] for n in starts[0]}
        assert max(v.abs().max() for v in jump.values()) > 1e-3
        moved = {n: published[apply_step][m][n] + jump[n] for n in jump}
        assert close(switched[apply_step][m], moved, atol=1e-5)
    late = [], []
    simulate(linear, sgd, batch, mse, {**c, "sync_delay": d}, 2, rounds * tau, step_record=late[0],
             delay_from=rounds)  # fmt: skip
    assert all(close(a[m], b[m]) for a, b in zip(late[0], published) for m in range(2))  # never switched


def test_a_healed_replica_starts_the_next_round_from_the_shared_start() -> None:
    """``heals`` (docs/design.md §3, §12): a replica that healed from a peer at a round end starts the next
    round from the shared start it received, not from its stand-in; its peers keep theirs, and every step
    before the heal is the run's without it."""
    c = cfg(overlap=True, stand_in="local", outer_lr=0.7, outer_momentum=0.6, nesterov=True)
    rounds, first_round = 4, 2  # replica 1 heals at round end 1 and starts round 2 from the shared start
    plain, healing, shared = [], [], []
    simulate(linear, sgd, batch, mse, c, 2, rounds * TAU, step_record=plain)
    simulate(linear, sgd, batch, mse, c, 2, rounds * TAU, step_record=healing, record=shared, heals=[(1, first_round)])
    heal = first_round * TAU - 1  # the step that ends round first_round - 1
    assert all(close(a[m], b[m]) for a, b in zip(plain[:heal], healing) for m in range(2))
    assert close(healing[heal][1], shared[first_round]) and not close(plain[heal][1], shared[first_round])
    assert close(healing[heal][0], plain[heal][0]) and not close(healing[heal][0], shared[first_round])
