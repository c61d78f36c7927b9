"""How the training job counts steps when its replicas take different numbers of them (`--replica_tau`;
docs/configuration.md, "Replicas of different speeds").

The job's step is the fastest replica's: --max_steps, --save_every, the LR schedule, the log lines and the
checkpoints' names count it, and at every round end every replica is at the same job step, rounds x tau.
Replica r trains τ_r of its own optimizer steps per round, so each of them is tau / τ_r job steps
(`co2_zero.core.pace.Pace.clock_step`), and a round's tokens are those of Σ τ_r steps per shard. Without
`replica_tau` (and for ddp / none) a job step is an optimizer step.
"""

from __future__ import annotations

from typing import Any


class JobSteps:
    """The job's step and tokens from this rank's optimizer steps; bound to the CO2 engine's pace once the
    trainer is built (`replica_tau: "auto"` fixes the τ_r during the run, so the pace is read each time)."""

    def __init__(self, tokens_per_rank_step: int, world: int) -> None:
        self.tokens_per_rank_step, self.world = tokens_per_rank_step, world
        self.opt: Any = None

    @property
    def per_step(self) -> int:
        """Tokens of one optimizer step of every rank."""
        return self.tokens_per_rank_step * self.world

    def bind(self, trainer: Any) -> None:
        """Count on `trainer`'s CO2 pace (ddp / none: every optimizer step is a job step)."""
        self.opt = trainer.opt if trainer.co2 else None

    @property
    def engine(self) -> Any:
        """The CO2 engine, read each time (an integration may build a new one, e.g. FairScale on a load)."""
        return None if self.opt is None else self.opt.engine

    def clock(self, own: int) -> float:
        """This rank's `own` optimizer steps on the job's clock: what the LR schedule reads."""
        engine = self.engine
        if engine is None:
            return float(own)
        return engine.pace.clock_step(engine.topology.replica_index, own)

    def after(self, own: int) -> int:
        """The job step after this rank's `own` optimizer steps (inside a round, rounded down)."""
        engine = self.engine
        if engine is None:
            return own
        return engine.pace.agreed_step(engine.topology.replica_index, own)

    def own_at(self, step: int) -> int:
        """This rank's optimizer steps at job step `step`; with replica_tau `step` is a round end (where a
        checkpoint is taken: --save_every is a multiple of tau)."""
        pace = self._pace()
        if pace is None:
            return step
        return pace.steps_at_round(self.engine.topology.replica_index, step // max(pace.taus))

    def tokens(self, step: int) -> int:
        """Tokens every rank of the job trained by job step `step` (with replica_tau, a round end)."""
        pace = self._pace()
        if pace is None:
            return step * self.per_step
        replicas = len(pace.taus)
        rounds = step // max(pace.taus)
        steps = sum(pace.steps_at_round(r, rounds) for r in range(replicas))
        return steps * (self.world // replicas) * self.tokens_per_rank_step

    def _pace(self) -> Any:
        """The engine's pace when its replicas' steps differ, else None."""
        engine = self.engine
        return None if engine is None or engine.pace.uniform else engine.pace
