"""Single-process reference simulation of CO2 (Sun et al., ICLR 2024).

R data-parallel replicas are simulated as a list of full model copies, each
with its own inner optimizer. Every ``tau`` inner steps the replicas' mean
displacement (the pseudo-gradient) goes through the outer step; with
``overlap`` it is applied one round late, damped by the staleness-gap penalty.
Everything is a plain loop over per-parameter tensors, deliberately without
any of the tricks (flattening, sharding, collectives) of the real library.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import Tensor, nn

Params = dict[str, Tensor]
Batch = tuple[Tensor, Tensor]

EPS = 1e-12
DEFAULTS: dict[str, Any] = {
    "tau": 32,
    "outer_lr": "auto",  # 0.5, or SPARSE_DEFAULTS' with topk < 1
    "outer_momentum": "auto",  # 0.9, likewise
    "nesterov": True,
    "overlap": True,
    "stand_in": "auto",
    "sync_delay": "auto",
    "gap_penalty": {"mode": "none", "value": 1.0, "strength": 2.0},
    "clip": {"mode": "none", "threshold": 1.0},
}
DENSE_DEFAULTS = {"outer_lr": 0.5, "outer_momentum": 0.9}
SPARSE_DEFAULTS = {"outer_lr": 1.0, "outer_momentum": 0.0}  # with topk < 1 (its decay: reference_compress)


def resolve_config(config: dict) -> dict[str, Any]:
    """Fill in defaults, drop keys that do not change the math, validate. The `auto` choices: stand_in
    `local` with overlap (`shared` in blocking mode); sync_delay the round end (what "auto" does while it
    measures: a caller comparing past round 4 passes the fixed d and delay_from)."""
    cfg = {key: config.get(key, value) for key, value in DEFAULTS.items()}
    for key in DENSE_DEFAULTS:  # left out or "auto": the exchange's own default
        if cfg[key] == "auto":
            cfg[key] = (SPARSE_DEFAULTS if config.get("topk", 1.0) < 1.0 else DENSE_DEFAULTS)[key]
    for key in ("gap_penalty", "clip"):
        cfg[key] = {**DEFAULTS[key], **(config.get(key) or {})}
    if isinstance(cfg["tau"], bool) or not isinstance(cfg["tau"], int) or cfg["tau"] < 1:
        raise ValueError(f"tau must be a positive int, got {cfg['tau']!r}")
    if cfg["gap_penalty"]["mode"] not in ("none", "constant", "adaptive"):
        raise ValueError(f"unknown gap_penalty mode {cfg['gap_penalty']['mode']!r}")
    if cfg["clip"]["mode"] not in ("none", "value", "norm"):
        raise ValueError(f"unknown clip mode {cfg['clip']['mode']!r}")
    if cfg["stand_in"] == "auto":
        cfg["stand_in"] = "local" if cfg["overlap"] else "shared"
    if cfg["sync_delay"] == "auto":
        cfg["sync_delay"] = None
    if cfg["stand_in"] not in ("shared", "local"):
        raise ValueError(f"unknown stand_in {cfg['stand_in']!r}")
    if cfg["stand_in"] != "shared" and not cfg["overlap"]:
        raise ValueError("a stand-in needs overlap")
    delay = cfg["sync_delay"]
    if delay is not None and (not cfg["overlap"] or not 1 <= delay <= cfg["tau"]):
        raise ValueError("sync_delay needs overlap and 1 <= sync_delay <= tau")
    return cfg


def stand_in_words(config: dict, strategy: str, partition: int) -> int:
    """fp32 words a rank's stand-in holds over its (padded) partition (docs/design.md §3): its own start;
    with outer momentum, local's copy of the outer momentum where the momentum is sharded
    (reduce_scatter; with all_reduce it reads the momentum itself)."""
    cfg = resolve_config(config)
    if cfg["stand_in"] == "shared":
        return 0
    copy = strategy == "reduce_scatter"
    return partition * (2 if cfg["outer_momentum"] and copy else 1)


def local_starts(shared: Params, owns: list[Params], ends: list[Params], m: Params, cfg: dict[str, Any]) -> None:
    """The `local` stand-in (docs/design.md §3): replica r's next round start is the outer step the
    average will take from ``shared``, with the outer momentum ``m`` as of ``shared`` (not updated), on
    its own displacement (own start − own end) instead of the average, clipped as the step clips (the
    norm over the replica's whole model). Replaces ``owns[r]``."""
    alpha, beta = cfg["outer_lr"], cfg["outer_momentum"]
    for r in range(len(owns)):
        d = {n: owns[r][n] - ends[r][n] for n in shared}
        m_next = {n: beta * m[n] + d[n] for n in shared}
        clip_momentum(m_next, cfg)
        u = {n: beta * m_next[n] + d[n] for n in shared} if cfg["nesterov"] else m_next
        owns[r] = {n: shared[n] - alpha * u[n] for n in shared}


def follow_applied_step(copy: Params, before: Params, after: Params, cfg: dict[str, Any]) -> None:
    """The `local` stand-in's copy of the outer momentum where the momentum itself is sharded
    (reduce_scatter; docs/design.md §3): from the shared start's move ``before`` -> ``after`` = −α·u it
    sees applied, m = u (heavy ball) or m = (u + β·m) / (1 + β) (Nesterov). With int8/fp8 the new start
    arrives quantized, so the copy follows the quantized move, not the momentum. Updates ``copy``."""
    alpha, beta = cfg["outer_lr"], cfg["outer_momentum"]
    for n in copy:
        u = (before[n] - after[n]) / alpha
        copy[n] = (u + beta * copy[n]) / (1 + beta) if cfg["nesterov"] else u


class Publisher:
    """What the round end makes of the outer step's result with ``exchange`` (None: the exact one): the next
    start point it publishes, and the momentum the `local` stand-in reads. Where the exchange publishes
    another start than the result (a compressed ``reduce_scatter``), local's copy of the momentum follows
    the published moves (:func:`follow_applied_step`); otherwise it reads the outer momentum itself."""

    def __init__(self, exchange: Any, cfg: dict[str, Any], like: Params) -> None:
        self.exchange, self.cfg = exchange, cfg
        follows = cfg["stand_in"] == "local" and getattr(exchange, "strategy", None) == "reduce_scatter"
        self.momentum_copy = {n: torch.zeros_like(v) for n, v in like.items()} if follows else None

    def stand_in_momentum(self, m: Params) -> Params:
        return m if self.momentum_copy is None else self.momentum_copy

    def publish(self, base: Params, result: Params) -> Params:
        if self.exchange is None:
            return result
        published = self.exchange.publish(base, result)
        if self.momentum_copy is not None:
            follow_applied_step(self.momentum_copy, base, published, self.cfg)
        return published


def clip_momentum(m: Params, cfg: dict[str, Any]) -> None:
    """Outer momentum clipping (docs/design.md §3 e), in place: every element to [-φ, φ] ("value"), or
    the whole momentum scaled to norm φ when its global norm is above it ("norm")."""
    phi, mode = float(cfg["clip"]["threshold"]), cfg["clip"]["mode"]
    if mode == "value":
        for name in m:
            m[name] = m[name].clamp(-phi, phi)
    elif mode == "norm":
        total = torch.linalg.vector_norm(torch.cat([t.flatten() for t in m.values()]))
        if total > phi:
            for name in m:
                m[name] = m[name] * (phi / total)


def outer_step(base: Params, g: Params, gap: Params, m: Params, cfg: dict[str, Any]) -> tuple[Params, Params, Params]:
    """One outer step; updates ``m`` in place, returns (result, u, penalty Λ)."""
    alpha, beta = cfg["outer_lr"], cfg["outer_momentum"]
    pen = cfg["gap_penalty"]
    lam: Params = {}
    scaled: Params = {}
    for name, g_l in g.items():
        if pen["mode"] == "none":
            lam[name] = torch.tensor(1.0)
        elif pen["mode"] == "constant":
            lam[name] = torch.tensor(float(pen["value"]))
        else:
            lam[name] = 1.0 + pen["strength"] * gap[name] / (torch.linalg.vector_norm(g_l) + EPS)
        scaled[name] = g_l / lam[name]
        m[name] = beta * m[name] + scaled[name]
    clip_momentum(m, cfg)
    if cfg["nesterov"]:
        u = {name: beta * m[name] + scaled[name] for name in m}
    else:
        u = {name: m[name].clone() for name in m}
    result = {name: base[name] - alpha * u[name] for name in base}
    return result, u, lam


def _params(model: nn.Module) -> Params:
    """fp32 detached copies of the model's parameters."""
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _set_params(model: nn.Module, values: Params) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(values[n])


def _buffers(model: nn.Module) -> Params:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _set_buffers(model: nn.Module, values: Params) -> None:
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(values[n])


def _average_float_buffers(bufs: list[list[Params]]) -> None:
    """Replace every float buffer of every (replica, shard) by the mean over all."""
    flat = [b for replica in bufs for b in replica]
    for name, value in flat[0].items():
        if value.is_floating_point():
            mean = torch.stack([b[name].float() for b in flat]).mean(0)
            for b in flat:
                b[name] = mean.to(value.dtype).clone()


def _inner_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    micro: list[Batch],
    bufs: list[Params],
) -> None:
    """One synchronous step of one replica: gradient = mean over its shards."""
    named = list(model.named_parameters())
    per_shard: list[Params] = []
    for s, (inputs, targets) in enumerate(micro):
        _set_buffers(model, bufs[s])
        model.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()
        bufs[s] = _buffers(model)
        per_shard.append({n: p.grad.detach().clone() for n, p in named if p.grad is not None})
    for n, p in named:
        grads = [shard[n] for shard in per_shard if n in shard]
        p.grad = torch.stack(grads).sum(0) / len(micro) if grads else None
    opt.step()


def _start_replicas(
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    replicas: int,
    shards: int,
) -> tuple[list[nn.Module], list[torch.optim.Optimizer], list[list[Params]]]:
    """The replicas' models (replica 0's x_0 and buffers everywhere, even if the caller forgot to seed),
    inner optimizers, and the buffers each of the S ranks of a replica keeps (its own forward passes)."""
    models = [make_model() for _ in range(replicas)]
    for model in models[1:]:
        _set_params(model, _params(models[0]))
        _set_buffers(model, _buffers(models[0]))
    for model in models:
        model.train()
    opts = [make_optimizer(list(model.parameters())) for model in models]
    return models, opts, [[_buffers(model) for _ in range(shards)] for model in models]


def _results(models: list[nn.Module], bufs: list[list[Params]]) -> list[Params]:
    """Per replica, detached clones of its named parameters and (shard 0's) buffers."""
    out: list[Params] = []
    for model, replica_bufs in zip(models, bufs):
        _set_buffers(model, replica_bufs[0])
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
        state.update(_buffers(model))
        out.append(state)
    return out


def _next_round(
    models: list[nn.Module],
    bufs: list[list[Params]],
    shared: Params,
    owns: list[Params],
    cfg: dict[str, Any],
    record: list[Params] | None,
) -> list[Params]:
    """Start the next round at a round end: every replica at its stand-in (local's, made before the outer
    step, which moves the momentum they read) or at the shared start ``shared``; buffers
    averaged; ``shared`` recorded. Returns where each replica starts."""
    if cfg["stand_in"] == "shared":
        owns = [shared] * len(models)
    for model, own in zip(models, owns):
        _set_params(model, own)
    _average_float_buffers(bufs)
    if record is not None:
        record.append({n: v.clone() for n, v in shared.items()})
    return owns


def simulate(
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    batch: Callable[[int, int], Batch],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    config: dict,
    replicas: int,
    steps: int,
    finalize: bool = True,
    shards: int = 1,
    shard_batch: Callable[[int, int, int], Batch] | None = None,
    *,
    record: list[Params] | None = None,
    trace: list[dict[str, Any]] | None = None,
    step_record: list[list[Params]] | None = None,
    exchange: Any = None,
    fresh_inner_at: int | None = None,
    schedule: Sequence[Collection[int] | None] | None = None,
    joins: Collection[tuple[int, int]] = (),
    restarts: Collection[tuple[int, int]] = (),
    heals: Collection[tuple[int, int]] = (),
    delay_from: int = 0,
    reshard_at: tuple[int, int] | None = None,
) -> list[Params]:
    """Train ``replicas`` copies with CO2 for ``steps`` inner steps.

    Returns, per replica, detached clones of its named parameters and buffers.
    ``record`` (if given) receives each round's start point (fp32 parameters),
    x_0 first, then one entry per round end. ``trace`` (if given) receives one
    dict per outer step: ``round`` (int), ``g``, ``gap`` (α‖u_prev‖, 0-dim),
    ``penalty`` (Λ, 0-dim), ``m`` (after clipping), ``u``, ``base``, ``result``
    (each {name: tensor}). ``step_record`` (if given) receives one entry per
    inner step: the list of every replica's fp32 parameters as the next step
    starts from them (after the round end when the step ends a round).
    ``exchange`` (if given) replaces the exact exchange:
    ``exchange.average(owns, xs)`` gives g (each replica's displacement from its
    own round start), ``exchange.publish(base, result)`` the next start point
    (tests/reference_compress.py: int8/fp8 with error feedback); with the local
    stand-in and ``exchange.strategy`` reduce_scatter, the stand-in reads a copy
    of the momentum that follows the published starts (:func:`follow_applied_step`).
    ``fresh_inner_at`` (if given): before that inner step every replica's inner
    optimizer is built anew, as a resharded checkpoint load leaves it (state fresh).
    ``schedule`` (if given; elastic membership, docs/design.md §12): entry t is the
    set of replicas whose displacement round t averages, or None when round t's
    exchange was cut: then every replica skips it (the next start point is the
    base, the momentum is unchanged and the update counts as zero for the next
    gap). Replicas outside the set still train (their result is simply unused).
    With a ``stand_in`` other than ``shared`` (overlap only), each replica's
    displacement is measured from its own round start, its stand-in
    (:func:`local_starts`); ``record`` keeps the shared start
    points and ``finalize`` gives every replica the shared one.
    ``joins``: (replica, round) pairs: the replica (re)joined at the end of round
    - 1, so its inner optimizer is built anew before that round's first step; with
    the local stand-in its stand-in there is made from a zero displacement (it took
    the shared start from a peer and trained nothing since).
    ``restarts``: (replica, round) pairs: the replica's displacement of round - 1
    held NaN or Inf (``nonfinite: "skip_round"``; the schedule cuts that round):
    it starts round ``round`` from the shared start point, its stand-in too, with
    its inner optimizer built anew.
    ``heals``: (replica, round) pairs: the replica cut round - 2's exchange while
    its peers committed it (only its copy of the average was lost: the schedule's
    entry is theirs, its displacement included), so it is one outer step behind
    them, and it healed from a live peer at the end of round - 1, the next round
    end. It starts ``round`` from the shared start it received, not from the
    stand-in it made from its own, stale outer state; it keeps its inner optimizer
    state. Until then its stand-in came from the shared state, so nothing else of
    the cut shows (a heal at a later round end is not simulated). A cut in the last
    round heals in finalize, which gives every replica the shared start anyway.
    ``sync_delay`` d < tau in the config: :func:`_simulate_sync_delay`; ``delay_from``: the first round
    whose average is applied d steps into the next, earlier rounds' a round late (``sync_delay: "auto"``
    before it fixes d).
    ``reshard_at``: (step, new replica count): a resharded checkpoint load at that round start
    (:func:`_reshard`); with a sync delay d < tau the average still to be applied there is applied at once.
    """
    cfg = resolve_config(config)
    tau, alpha, overlap = cfg["tau"], cfg["outer_lr"], cfg["overlap"]
    elastic = schedule is not None or bool(heals)
    if replicas < 1 or shards < 1 or steps < 0:
        raise ValueError("replicas and shards must be >= 1 and steps >= 0")
    if shards > 1 and shard_batch is None:
        raise ValueError("shards > 1 needs shard_batch")
    if reshard_at is not None and (reshard_at[0] % cfg["tau"] or elastic or joins or restarts or exchange):
        raise ValueError("a reshard is simulated at a round start, without membership, joins, restarts or exchange")

    models, opts, bufs = _start_replicas(make_model, make_optimizer, replicas, shards)
    if cfg["sync_delay"] not in (None, tau):
        unsupported = (exchange, fresh_inner_at, trace)
        if elastic or joins or restarts or any(given is not None for given in unsupported):
            raise ValueError("a sync delay is simulated without a compressed exchange, membership, joins or trace")

        def micro(r: int, k: int) -> list[Batch]:
            return [batch(r, k)] if shards == 1 else [shard_batch(r, s, k) for s in range(shards)]  # type: ignore[misc]

        reshard = None if reshard_at is None else (*reshard_at, make_optimizer)
        return _simulate_sync_delay(
            models, opts, bufs, micro, loss_fn, cfg, steps, finalize, record, step_record, delay_from, reshard
        )

    start = _params(models[0])  # B: this round's start point x_t
    pending = {n: v.clone() for n, v in start.items()}  # overlap: x_{t+1}
    m = {n: torch.zeros_like(v) for n, v in start.items()}
    u_prev: Params | None = None
    owns = [start] * replicas  # where each replica's round started (a stand-in: its own start)
    publisher = Publisher(exchange, cfg, start)
    if record is not None:
        record.append({n: v.clone() for n, v in start.items()})

    for k in range(steps):
        if k == fresh_inner_at:
            opts = [make_optimizer(list(model.parameters())) for model in models]
        if reshard_at is not None and k == reshard_at[0]:
            models, opts, bufs, owns = _reshard(models, bufs, owns, reshard_at[1], make_optimizer)
            replicas = reshard_at[1]
        for r, first_round in (*joins, *restarts):
            if k == first_round * tau:
                opts[r] = make_optimizer(list(models[r].parameters()))
        for r, (model, opt) in enumerate(zip(models, opts)):
            if shards == 1:
                micro = [batch(r, k)]
            else:
                assert shard_batch is not None
                micro = [shard_batch(r, s, k) for s in range(shards)]
            _inner_step(model, opt, loss_fn, micro, bufs[r])
        if (k + 1) % tau == 0:
            xs = [_params(model) for model in models]
            members = range(replicas) if schedule is None else schedule[(k + 1) // tau - 1]
            if members is None:  # a cut exchange: skipped everywhere
                g = None
            elif exchange is None:
                g = {n: torch.stack([owns[r][n] - xs[r][n] for r in sorted(members)]).mean(0) for n in start}
            else:
                g = exchange.average(owns, xs)
            if overlap and u_prev is not None:
                gap = {n: alpha * torch.linalg.vector_norm(u_prev[n]) for n in start}
            else:
                gap = {n: torch.tensor(0.0) for n in start}
            base = pending if overlap else start
            if cfg["stand_in"] == "local":  # from the next start, with the momentum before this round's step
                joining = {r for r, first_round in joins if first_round == (k + 1) // tau}
                # a replica that joins here took the shared start from a peer: its displacement is zero
                ends = [owns[r] if r in joining else x for r, x in enumerate(xs)]
                local_starts(base, owns, ends, publisher.stand_in_momentum(m), cfg)
                # a restart: its round will be skipped everywhere; a heal: the shared start it received;
                # either way the next shared start, not its stand-in
                for r, first_round in (*restarts, *heals):
                    if first_round == (k + 1) // tau:
                        owns[r] = base
            if g is None:
                result = {n: v.clone() for n, v in base.items()}
                u, lam = {n: torch.zeros_like(v) for n, v in base.items()}, {}
            else:
                result, u, lam = outer_step(base, g, gap, m, cfg)
            if g is not None:
                result = publisher.publish(base, result)
            if trace is not None:
                trace.append(
                    {
                        "round": (k + 1) // tau - 1,
                        "g": g,
                        "gap": gap,
                        "penalty": lam,
                        "m": {n: v.clone() for n, v in m.items()},
                        "u": u,
                        "base": {n: v.clone() for n, v in base.items()},
                        "result": {n: v.clone() for n, v in result.items()},
                    }
                )
            u_prev = u
            if overlap:
                start, pending = pending, result
            else:
                start = result
            owns = _next_round(models, bufs, start, owns, cfg, record)
        if step_record is not None:
            step_record.append([_params(model) for model in models])

    if finalize:
        final = pending if overlap else start
        for model in models:
            _set_params(model, final)
        _average_float_buffers(bufs)

    return _results(models, bufs)


def _reshard(
    models: list[nn.Module],
    bufs: list[list[Params]],
    owns: list[Params],
    replicas: int,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
) -> tuple[list[nn.Module], list[torch.optim.Optimizer], list[list[Params]], list[Params]]:
    """A resharded checkpoint load at a round start (docs/checkpoints.md): ``replicas`` replicas, replica m
    continuing saved replica m % (saved R) from where that one's round starts (its stand-in, or the shared
    start) with its buffers; every inner optimizer built anew (its state is not carried)."""
    saved = len(models)
    new_models = [copy.deepcopy(models[m % saved]) for m in range(replicas)]
    for model, m in zip(new_models, range(replicas)):
        _set_params(model, owns[m % saved])
    opts = [make_optimizer(list(model.parameters())) for model in new_models]
    new_bufs = [[dict(b) for b in bufs[m % saved]] for m in range(replicas)]
    return new_models, opts, new_bufs, [owns[m % saved] for m in range(replicas)]


def replica_round_starts(record: list[Params], step_record: list[list[Params]], tau: int) -> list[list[Params]]:
    """Per round start, every replica's parameters there, from one ``simulate`` run's ``record`` and
    ``step_record``: x_0, then where each replica started the round (the shared start, or its stand-in),
    which is what a replica's live model holds at its round starts."""
    replicas = len(step_record[0]) if step_record else 1
    return [[record[0]] * replicas] + [step_record[t * tau - 1] for t in range(1, len(record))]


def round_starts(*args: Any, **kwargs: Any) -> list[Params]:
    """Run :func:`simulate` and return the start point of every round (x_0 first)."""
    starts: list[Params] = []
    simulate(*args, record=starts, **kwargs)
    return starts


def _simulate_sync_delay(
    models: list[nn.Module],
    opts: list[torch.optim.Optimizer],
    bufs: list[list[Params]],
    micro: Callable[[int, int], list[Batch]],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    cfg: dict[str, Any],
    steps: int,
    finalize: bool,
    record: list[Params] | None,
    step_record: list[list[Params]] | None,
    delay_from: int = 0,
    reshard: tuple[int, int, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] | None = None,
) -> list[Params]:
    """CO2 with a sync delay d < tau, written as the algorithm reads (docs/design.md §3, "The sync delay").

    At the end of round t the replicas' mean displacement Δ̄_t, each measured from where its replica
    started the round, goes through the outer step on the shared start S_t the round was rebased on:
    S_{t+1} = outer_step(S_t, Δ̄_t), its staleness gap α·‖u_{t−1}‖ scaled by d/tau. The replicas start
    round t+1 from S_t or their stand-in (:func:`local_starts`). After d inner steps
    of round t+1, S_{t+1} arrives: every replica moves by S_{t+1} − (where it started the round), keeping
    its d steps of progress, and the round's start becomes S_{t+1} for every replica. ``finalize`` applies
    a result that has not arrived yet and gives every replica the shared start. ``micro(r, k)``: replica
    r's shard batches of step k; ``record`` receives the shared start after every round end (x_0 first).

    Rounds before ``delay_from`` go as published instead (sync_delay "auto" while it measures): the average
    of round t is applied a round late, to the next start x_{t+1}, gap unscaled, and the replicas start
    round t+1 at x_{t+1}. The last of them, x_{delay_from+1}, arrives d steps into round delay_from.
    ``reshard``: (step, new replica count, make_optimizer), as ``simulate``'s ``reshard_at``.
    """
    tau, delay, alpha, replicas = cfg["tau"], cfg["sync_delay"], cfg["outer_lr"], len(models)

    shared = _params(models[0])  # S_t
    owns = [shared] * replicas  # where each replica started the current round
    m = {n: torch.zeros_like(v) for n, v in shared.items()}
    u_prev: Params | None = None
    arriving: Params | None = None  # S_{t+1}, applied d steps into round t+1
    pending = {n: v.clone() for n, v in shared.items()}  # before delay_from: x_{t+1}, the next start
    if record is not None:
        record.append({n: v.clone() for n, v in shared.items()})

    for k in range(steps):
        if reshard is not None and k == reshard[0]:
            if arriving is not None:  # the average still to be applied in this round: at once
                shared, arriving = arriving, None
                owns = [shared] * replicas
            models, opts, bufs, owns = _reshard(models, bufs, owns, *reshard[1:])
            replicas = reshard[1]
        for r, (model, opt) in enumerate(zip(models, opts)):
            _inner_step(model, opt, loss_fn, micro(r, k), bufs[r])
        if arriving is not None and (k + 1) % tau == delay:
            for model, own in zip(models, owns):
                x = _params(model)
                _set_params(model, {n: x[n] + (arriving[n] - own[n]) for n in x})
            shared, arriving = arriving, None
            owns = [shared] * replicas
        if (k + 1) % tau == 0:
            ends = [_params(model) for model in models]
            g = {n: torch.stack([owns[r][n] - ends[r][n] for r in range(replicas)]).mean(0) for n in shared}
            round_late = (k + 1) // tau - 1 < delay_from
            staleness = 1.0 if round_late else delay / tau
            if u_prev is None:
                gap = {n: torch.tensor(0.0) for n in shared}
            else:
                gap = {n: alpha * staleness * torch.linalg.vector_norm(u_prev[n]) for n in shared}
            base = pending if round_late else shared
            if cfg["stand_in"] == "local":  # with the momentum before this round's step
                local_starts(base, owns, ends, m, cfg)
            result, u_prev, _ = outer_step(base, g, gap, m, cfg)
            if round_late:  # the next round starts at x_{t+1}; the last x_{t+2} arrives d steps into it
                shared, pending = pending, result
                arriving = result if (k + 1) // tau == delay_from else None
            else:
                arriving = result
            owns = _next_round(models, bufs, shared, owns, cfg, record)
        if step_record is not None:
            step_record.append([_params(model) for model in models])

    if finalize:
        final = arriving if arriving is not None else pending if steps // tau < delay_from else shared
        for model in models:
            _set_params(model, final)
        _average_float_buffers(bufs)

    return _results(models, bufs)


def simulate_paced(
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    batch: Callable[[int, int], Batch],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    config: dict,
    replica_tau: Sequence[int],
    rounds: int,
    extra_steps: Sequence[int] | None = None,
    finalize: bool = True,
    shards: int = 1,
    shard_batch: Callable[[int, int, int], Batch] | None = None,
    *,
    step_record: list[list[Params]] | None = None,
    exchange: Any = None,
    round_taus: Sequence[Sequence[int]] | None = None,
    uniform_rounds: int = 0,
    fresh_inner_at_round: int | None = None,
    restarts: Collection[tuple[int, int]] = (),
) -> list[Params]:
    """CO2 with replicas of different speeds (docs/design.md §3, "Replicas of different speeds").

    In every round replica r runs ``replica_tau[r]`` inner steps on its own batches ``batch(r, k)``, k
    counting its own steps. At the round end the displacements, each from where its replica started the
    round, are averaged with weights w_r = τ_r / Στ (the tokens each trained) and go through the outer step
    exactly as the uniform rounds do (overlap: applied a round late, with the gap; the shared or local
    stand-in, local from the replica's own unweighted displacement). Then replica r runs
    ``extra_steps[r]`` more steps (a partial round; ``finalize`` drops them). ``step_record`` (if given)
    receives, per replica, its fp32 parameters after each of its own inner steps (after the round end when
    the step ends a round). ``exchange`` (if given) replaces the exact exchange as in :func:`simulate`, its
    ``average(owns, xs, weights)`` weighing the displacements (tests/reference_compress.py: replica r sends
    R·w_r·D_r with its error feedback). The sync delay is the round end; joins are not simulated
    here. ``round_taus`` (if given): the steps each replica trains round by round instead of
    ``replica_tau`` (elastic ``replica_tau: "auto"`` measures them every round), the weights each round's.
    ``uniform_rounds``: the first rounds run every replica at max(replica_tau), weighed
    1/R (``replica_tau: "auto"`` while it measures the speeds). ``fresh_inner_at_round``: a resharded
    checkpoint load at the start of that round, R kept (:func:`_reshard`: every inner optimizer built anew,
    each replica from its own round start and at its own step count). ``restarts``: (replica, round)
    pairs, as :func:`simulate`'s (``nonfinite: "skip_round"``): the replica's displacement of round - 1 was
    non-finite, so round - 1's outer update is skipped on every replica (the next start point is the base,
    the momentum unchanged, the update zero for the next gap), and the replica starts ``round`` from the
    shared start point, its stand-in too, with its inner optimizer built anew (its own steps still count).
    """
    cfg = resolve_config({**config, "tau": max(replica_tau)})
    if cfg["sync_delay"] not in (None, cfg["tau"]):
        raise ValueError("replicas of different speeds are simulated with the round end")
    if shards > 1 and shard_batch is None:
        raise ValueError("shards > 1 needs shard_batch")
    replicas, alpha, overlap = len(replica_tau), cfg["outer_lr"], cfg["overlap"]
    models, opts, bufs = _start_replicas(make_model, make_optimizer, replicas, shards)
    start = _params(models[0])
    pending = {n: v.clone() for n, v in start.items()}
    m = {n: torch.zeros_like(v) for n, v in start.items()}
    u_prev: Params | None = None
    owns = [start] * replicas
    publisher = Publisher(exchange, cfg, start)
    steps_taken = [0] * replicas
    records: list[list[Params]] = [[] for _ in range(replicas)]

    def train(r: int, count: int) -> None:
        for _ in range(count):
            k = steps_taken[r]
            micro = [batch(r, k)] if shards == 1 else [shard_batch(r, s, k) for s in range(shards)]  # type: ignore[misc]
            _inner_step(models[r], opts[r], loss_fn, micro, bufs[r])
            steps_taken[r] += 1
            records[r].append(_params(models[r]))

    for t in range(rounds):
        if t == fresh_inner_at_round:
            models, opts, bufs, owns = _reshard(models, bufs, owns, replicas, make_optimizer)
        for r, first_round in restarts:
            if t == first_round:
                opts[r] = make_optimizer(list(models[r].parameters()))
        restarting = {r for r, first_round in restarts if first_round == t + 1}
        if round_taus is not None:
            taus = round_taus[t]
        else:
            taus = [cfg["tau"]] * replicas if t < uniform_rounds else replica_tau
        weights = [tau / sum(taus) for tau in taus]
        for r in range(replicas):
            train(r, taus[r])
        xs = [_params(model) for model in models]
        if exchange is None:
            g = {n: sum(weights[r] * (owns[r][n] - xs[r][n]) for r in range(replicas)) for n in start}
        else:
            g = exchange.average(owns, xs, weights)
        if overlap and u_prev is not None:
            gap = {n: alpha * torch.linalg.vector_norm(u_prev[n]) for n in start}
        else:
            gap = {n: torch.tensor(0.0) for n in start}
        base = pending if overlap else start
        if cfg["stand_in"] == "local":
            local_starts(base, owns, xs, publisher.stand_in_momentum(m), cfg)
            for r in restarting:
                owns[r] = base
        if restarting:  # skipped everywhere
            result, u_prev = {n: v.clone() for n, v in base.items()}, {n: torch.zeros_like(v) for n, v in base.items()}
        else:
            result, u_prev, _ = outer_step(base, g, gap, m, cfg)
            result = publisher.publish(base, result)
        if overlap:
            start, pending = pending, result
        else:
            start = result
        owns = _next_round(models, bufs, start, owns, cfg, None)
        for r in range(replicas):
            records[r][-1] = _params(models[r])  # the step that ended the round: after the round end
    for r in range(replicas):
        train(r, (extra_steps or [0] * replicas)[r])
    if step_record is not None:
        step_record.extend(records)
    if finalize:
        for model in models:
            _set_params(model, pending if overlap else start)
        _average_float_buffers(bufs)
    return _results(models, bufs)
