"""The two `state_dict()` forms of `CO2OSS` and the way back from either: OSS's consolidated one (one file
per replica, every rank's CO2 state in it) and, where nothing was consolidated, this rank's own share (what
per-rank `co2_zero.checkpoint` files hold)."""

from __future__ import annotations

import warnings
from itertools import chain
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..checkpoint.record import load_record, optimizer_record, refused
from ..core.topology import Topology


def _cpu_copy(obj: Any) -> Any:
    """Detached CPU copies of the tensors in a (nested) state dict; a snapshot, never a live view."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    return {k: _cpu_copy(v) for k, v in obj.items()} if isinstance(obj, dict) else obj


class StateDictForms:
    """`CO2OSS`'s `consolidate_state_dict`, `state_dict` and `load_state_dict` (mixed in before OSS)."""

    _co2_states: list[Optional[dict[str, Any]]]  # every rank's CO2 state of the replica, where consolidated

    def _forget_consolidated(self) -> None:
        """A consolidated state is stale once the optimizer stepped: OSS's and the CO2 states alike."""
        self._all_states, self._co2_states = [], []

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """OSS's consolidation of the inner optimizer state, plus the CO2 state of every rank of the
        replica, onto `recipient_rank` of the replica (-1: every rank). Call it on all ranks.

        The inner optimizer state differs between replicas, so this checkpoint is one file per replica
        (saved by its recipient); it then holds everything the replica's ranks need to resume.
        """
        super().consolidate_state_dict(recipient_rank)
        mine = None if self.engine.finalized else _cpu_copy(self.engine.state_dict())
        states: list[Optional[dict[str, Any]]] = [None] * self.world_size
        if recipient_rank == -1:
            dist.all_gather_object(states, mine, group=self.group)
        else:
            receive = states if self.rank == recipient_rank else None
            dist.gather_object(mine, receive, dst=self._local_to_global_rank[recipient_rank], group=self.group)
        self._co2_states = states if recipient_rank in (-1, self.rank) else []

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:
        """Where OSS has a consolidated state (the recipient after `consolidate_state_dict()`, or
        `all_ranks`): OSS's PyTorch-compatible dict, plus `"co2"` (this rank's CO2 state) and
        `"co2_replica"` (that of every rank of the replica, for one file per replica).

        Elsewhere (where OSS would raise): this rank's own share, `{"oss_shard": ..., "co2": ...}`, what
        per-rank checkpoint files hold (`co2_zero.checkpoint.save`). Tensors are live references, as
        in `torch.optim.Optimizer.state_dict()`: save them before the next step.
        """
        if all_ranks or self._all_states:
            state = super().state_dict(all_ranks=all_ranks)
            state["co2"] = self._co2_states[self.rank]
            state["co2_replica"] = {
                "replica": self.topology.replica_index,
                "ranks": list(self.topology.inner_ranks),
                "states": self._co2_states,
            }
            return state
        framework = self.checkpoint_state(self._model)  # its capture brings the inner groups up to date
        record = optimizer_record(framework, finalized_ok=True)
        return {
            "oss_shard": {
                "rank": self.rank,
                "world_size": self.world_size,
                "state": framework.torch_state(record["framework"]),
            },
            "co2": record["co2"],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore either form of `state_dict()`, saved by the same rank (own share) or the same
        replica (consolidated) of a run with the same topology and co2 config. Call it on all ranks,
        after loading the model weights. Either form is read as this rank's record (its CO2 state and
        its share of the inner state) and loaded as `checkpoint.load` loads one: every check first, so
        a refused state changes nothing (ValueError naming the field).

        A state without CO2 state (a plain OSS checkpoint, or one saved after `finalize()`) loads the
        inner optimizer and restarts CO2 from the current parameters, with a warning.
        """
        what = "CO2OSS.load_state_dict"
        if not isinstance(state_dict, dict):
            raise refused(what, f"the state dict is a {type(state_dict).__name__}; expected a state_dict()")
        (mine, co2_field), (inner, inner_field) = self._saved_co2(state_dict), self._saved_inner(state_dict)
        framework = self.checkpoint_state(self._model)
        record = {"co2": mine, "framework": framework.framework_of(inner)}
        fields = {"framework": inner_field} if mine is None else {"co2": co2_field, "framework": inner_field}
        load_record(framework, record, what, fields)
        if mine is None:
            warnings.warn(
                "co2: the optimizer state carries no CO2 state (a plain OSS checkpoint, or one saved after "
                "finalize()); CO2 restarts from the current parameters",
                stacklevel=2,
            )
            self.engine.close()  # its worker and CO2 groups; OSS keeps the replica's group
            self.topology = Topology.build(self.config, inner_group=self.group)
            self.engine = self._new_engine()

    def _saved_co2(self, state_dict: dict[str, Any]) -> tuple[Any, str]:
        """This rank's CO2 state in either form of `state_dict()` (None: it has none), and its field."""
        replica = state_dict.get("co2_replica")
        if replica is None:
            return state_dict.get("co2"), "state_dict['co2']"
        if replica["replica"] != self.topology.replica_index or len(replica["states"]) != self.world_size:
            raise ValueError(
                f"co2 checkpoint: it holds the state of replica {replica['replica']} (global ranks "
                f"{replica['ranks']}) but this rank is in replica {self.topology.replica_index} (global "
                f"ranks {list(self.topology.inner_ranks)}); each replica loads the file its own recipient saved"
            )
        return replica["states"][self.rank], f"state_dict['co2_replica']['states'][{self.rank}]"

    def _saved_inner(self, state_dict: dict[str, Any]) -> tuple[Any, str]:
        """This rank's share of the inner optimizer state in either form of `state_dict()`, as its local
        optimizer's state dict, and its field."""
        shard = state_dict.get("oss_shard")
        if shard is None:
            return self._own_share_of(state_dict), "state_dict (OSS's consolidated state)"
        if (shard["rank"], shard["world_size"]) != (self.rank, self.world_size):
            raise ValueError(
                f"co2 checkpoint: this optimizer shard was saved by rank {shard['rank']} of a replica of "
                f"{shard['world_size']}; this is rank {self.rank} of {self.world_size}: load each rank's own file"
            )
        return shard["state"], "state_dict['oss_shard']['state']"

    def _own_share_of(self, consolidated: dict[str, Any]) -> dict[str, Any]:
        """The part of OSS's consolidated state dict (global parameter ids) that this rank owns, as its
        local optimizer's state dict: what its own share holds. Checks only what the mapping needs (the
        groups' sizes, the ids); `InnerOptimizerState.check` checks the rest."""
        groups, state = consolidated.get("param_groups"), consolidated.get("state", {})
        sizes = [len(g["params"]) for g in self.param_groups]
        saved = [len(g.get("params", ())) for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []
        if saved != sizes or not isinstance(state, dict):
            raise refused(
                "CO2OSS.load_state_dict",
                f"state_dict['param_groups'] has groups of sizes {saved} and state_dict['state'] is a "
                f"{type(state).__name__}; this optimizer has groups of sizes {sizes} (a different model?)",
            )
        owner = dict(zip(chain(*(g["params"] for g in groups)), chain(*(g["params"] for g in self.param_groups))))
        local = {id(p): i for i, p in enumerate(chain(*(g["params"] for g in self.optim.param_groups)))}
        unknown = sorted(map(str, set(state) - set(owner)))
        if unknown:
            raise refused(
                "CO2OSS.load_state_dict", f"state_dict['state'] names parameters {unknown[:5]}, not in its groups"
            )
        mine = {local[id(owner[key])]: entry for key, entry in state.items() if id(owner[key]) in local}
        here = [[local[id(p)] for p in g["params"]] for g in self.optim.param_groups]
        return {"state": mine, "param_groups": [{**g, "params": ids} for g, ids in zip(groups, here)]}
