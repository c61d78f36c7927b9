"""Elastic training under failures: step efficiency and recovery times of co2_zero against torchft's DiLoCo.

On the emulated cluster (scripts/emulated_cluster.py), P nodes at one link rate, every node one
replica (one rank, S = 1) and node 0 also the torchft Lighthouse. Every method runs twice in the same
invocation: failure-free for --baseline_minutes, then for --minutes under a kill schedule: every
--kill_every_s one node's replica is SIGKILLed (its whole process group) and restarted
--restart_after_s later with the same replica id, rotating over the nodes (docs/elastic-job.md). Methods:
`co2` is the training job's elastic mode (`python -m co2_zero.train --lighthouse`), `torchft-diloco`
and `torchft-streaming` torchft's own DiLoCo / Streaming DiLoCo driven by scripts/torchft_peer.py on
the same model, data and τ. Every node runs with its own hostname (torchft's checkpoint transport
advertises it for healing).

Everything is read from the replicas' --events_jsonl logs (co2_zero/train/events.py), after the run:

- step efficiency: tokens/s with failures over tokens/s failure-free; tokens are every replica's
  completed steps inside a quorum (a peer replica's steps before its first quorum are discarded by its
  heal: not counted), from the moment every replica has stepped, for --minutes (--baseline_minutes).
- kill -> next step: from the SIGKILL to the first step every survivor completes in the smaller
  quorum (the stall at the round end included), and the longest pause between two of a survivor's
  steps in that time; restart -> first step: from the launch to the joiner's first step in a quorum.
- rounds dropped: rounds some replica logged as cut (its exchange failed; never applied).
- identical at end: at the end the benchmark writes a stop step (every replica's next few rounds)
  into the --stop_file; every replica stops at that round end and logs its parameter digest.

Results: <out_dir>/elastic.json and elastic.md (docs/elastic-job.md renders the JSON). The whole thing
takes about (minutes + baseline_minutes + 1.5) x methods minutes.

    python -m scripts.bench_elastic                              # the full run: 10 min + 3 min per method
    python -m scripts.bench_elastic --minutes 1.5 --kill_every_s 30 --restart_after_s 10 \\
        --baseline_minutes 0.5 --out_dir /tmp/elastic            # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from co2_zero.train.cli import ToolParser, run_tool
from scripts import emulated_cluster as ec
from scripts import torchft_peer

ROOT = Path(__file__).resolve().parent.parent
METHODS = {  # label -> the module every replica runs, and its own flags ({P}: the number of nodes)
    # CO2 as published, as the committed results were measured (the membership's waits do not depend on the
    # stand-in; the defaults run elastically since, tests/elastic/test_elastic.py)
    "co2": ("co2_zero.train", ["--method", "co2_published", "--start_replicas", "{P}"]),
    "torchft-diloco": ("scripts.torchft_peer", ["--peer", "diloco"]),
    "torchft-streaming": ("scripts.torchft_peer", ["--peer", "streaming"]),
}
LIGHTHOUSE_PORT = 29510
STORE_PORT = 29400  # + the incarnation number: a restarted replica never waits for the old port


# ----------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class Action:
    """At `t` seconds after every replica's first step: `kind` ('kill' | 'restart') node `node`."""

    t: float
    kind: str
    node: int


def kill_schedule(duration_s: float, kill_every_s: float, restart_after_s: float, nodes: int) -> list[Action]:
    """A kill every kill_every_s (nodes 1, 2, ..., P-1, 0, 1, ... in turn), each restarted
    restart_after_s later; only kills whose restart falls before the end, so every node is back then."""
    if kill_every_s <= 0 or restart_after_s <= 0 or restart_after_s >= kill_every_s:
        raise ValueError(f"kill_every_s={kill_every_s}, restart_after_s={restart_after_s}: accepted: "
                         f"0 < restart_after_s < kill_every_s (one node down at a time)")  # fmt: skip
    actions, k = [], 1
    while k * kill_every_s + restart_after_s < duration_s:
        node = k % nodes
        actions += [Action(k * kill_every_s, "kill", node), Action(k * kill_every_s + restart_after_s, "restart", node)]
        k += 1
    return actions


def parse_events(text: str) -> list[dict]:
    """The JSON lines of an events log; a line cut by a SIGKILL (not valid JSON) is skipped."""
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


@dataclass
class Incarnation:
    """One launch of one node's replica: when it started and was killed (None: it ran to the end)."""

    node: int
    started: float
    events: list[dict] = field(default_factory=list)
    path: Optional[Path] = None  # its events log
    killed: Optional[float] = None
    exit_code: Optional[int] = None

    def steps(self) -> list[dict]:
        """Its steps inside a quorum (replicas > 0)."""
        return [e for e in self.events if e["event"] == "step" and e.get("replicas", 0) > 0]

    def alive_at(self, t: float) -> bool:
        return self.started <= t and (self.killed is None or t < self.killed)


def tokens_per_s(incarnations: Sequence[Incarnation], t0: float, t1: float, tokens_per_step: int) -> float:
    """Every replica's steps (in a quorum) completed in (t0, t1], as tokens per second."""
    steps = sum(1 for inc in incarnations for e in inc.steps() if t0 < e["t"] <= t1)
    return steps * tokens_per_step / (t1 - t0)


def without(step: dict, node: int, size_before: int) -> bool:
    """Whether a step's quorum no longer holds `node`: by the replica ids where logged, else by its size."""
    return node not in step["quorum"] if "quorum" in step else step["replicas"] < size_before


def kill_recovery(incarnations: Sequence[Incarnation], killed: Incarnation) -> dict:
    """Kill -> the first step every survivor completes in a quorum without the killed replica
    (`kill_to_next_step_s`: the slowest survivor's), and the longest pause between two of a survivor's
    steps until then (`stall_s`). Survivors: the replicas that had stepped before the kill (not one still
    joining). None where some survivor never got there."""
    t_kill, ends, stall = killed.killed, [], 0.0
    for inc in incarnations:
        steps = inc.steps()
        before = [e for e in steps if e["t"] <= t_kill]
        if inc is killed or not inc.alive_at(t_kill) or not before:
            continue
        size = before[-1]["replicas"]
        after = next((e for e in steps if e["t"] > t_kill and without(e, killed.node, size)), None)
        if after is None:
            return {"node": killed.node, "t": t_kill, "kill_to_next_step_s": None, "stall_s": None}
        times = [e["t"] for e in steps if before[-1]["t"] <= e["t"] <= after["t"]]
        stall = max([stall, *(b - a for a, b in zip(times, times[1:]))])
        ends.append(after["t"])
    return {"node": killed.node, "t": t_kill, "kill_to_next_step_s": max(ends) - t_kill if ends else None,
            "stall_s": stall if ends else None}  # fmt: skip


def join_recovery(joiner: Incarnation) -> dict:
    """Restart -> the joiner's first step in a quorum (None: it never got one)."""
    steps = joiner.steps()
    first = steps[0]["t"] - joiner.started if steps else None
    return {"node": joiner.node, "t": joiner.started, "restart_to_first_step_s": first}


def rounds_dropped(incarnations: Sequence[Incarnation]) -> list[int]:
    """The rounds some replica logged as cut (its exchange failed and the round was dropped)."""
    return sorted({e["round"] for inc in incarnations for e in inc.events if e["event"] == "round" and
                   not e["committed"]})  # fmt: skip


def identical_at_end(last: Sequence[Incarnation]) -> dict:
    """Whether the last incarnation of every node logged one final digest, and the same one, at one step."""
    finals = [next((e for e in inc.events if e["event"] == "final"), None) for inc in last]
    done = [f for f in finals if f is not None]
    same = len(done) == len(last) and len({(f["digest"], f["step"]) for f in done}) == 1
    return {"identical": same, "finished": len(done), "replicas": len(last),
            "steps": sorted({f["step"] for f in done}), "digests": len({f["digest"] for f in done})}  # fmt: skip


def median_max(values: Sequence[Optional[float]]) -> Optional[dict]:
    """{median, max, n, missing} of the measured values (None: not measured) or None if none was."""
    got = [v for v in values if v is not None]
    if not got:
        return None
    return {"median": statistics.median(got), "max": max(got), "n": len(got), "missing": len(values) - len(got)}


def summarize(run: dict, incarnations: list[Incarnation], tokens_per_step: int) -> dict:
    """A run's numbers from its incarnations: tokens/s over the window, recoveries, drops, the end."""
    t0, t1 = run["t0"], run["t0"] + run["duration_s"]
    kills = [kill_recovery(incarnations, inc) for inc in incarnations if inc.killed is not None]
    joins = [join_recovery(inc) for inc in incarnations if inc.started > t0]
    last = [max((i for i in incarnations if i.node == n), key=lambda i: i.started)
            for n in sorted({i.node for i in incarnations})]  # fmt: skip
    return {
        "tokens_per_s": tokens_per_s(incarnations, t0, t1, tokens_per_step),
        "kills": kills, "joins": joins,
        "kill_to_next_step_s": median_max([k["kill_to_next_step_s"] for k in kills]),
        "stall_s": median_max([k["stall_s"] for k in kills]),
        "restart_to_first_step_s": median_max([j["restart_to_first_step_s"] for j in joins]),
        "rounds_dropped": rounds_dropped(incarnations), "end": identical_at_end(last),
    }  # fmt: skip


def _seconds(stat: Optional[dict]) -> str:
    if stat is None:
        return "–"
    missing = f" ({stat['missing']} never)" if stat["missing"] else ""
    return f"{stat['median']:.1f} / {stat['max']:.1f}{missing}"


def table(result: dict) -> str:
    """The markdown table of a result (elastic.md, docs/elastic-job.md)."""
    head = ["method", "step efficiency", "kill → survivors' next step, s (median / max)",
            "restart → joiner's first step, s (median / max)", "rounds dropped", "identical at end",
            "tokens/s failure-free"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, m in result["methods"].items():
        f, end = m["failures"], m["failures"]["end"]
        ident = "yes" if end["identical"] else f"NO ({end['digests']} digests, {end['finished']}/{end['replicas']})"
        lines.append(f"| `{label}` | {m['step_efficiency']:.3f} | {_seconds(f['kill_to_next_step_s'])} | "
                     f"{_seconds(f['restart_to_first_step_s'])} | {len(f['rounds_dropped'])} | {ident} | "
                     f"{m['baseline']['tokens_per_s']:,.0f} |")  # fmt: skip
    return "\n".join(lines)


def report(result: dict) -> str:
    """What was run, the table and the command (elastic.md below its title; docs/elastic-job.md renders it)."""
    s = result["settings"]
    return "\n".join([
        f"P = {s['nodes']} replicas (one rank each) at {s['rate']} on the emulated cluster, `{s['train_flags']}`, "
        f"τ = {s['tau']}. **{cpu_note(s, result['host']['cores'])}** {s['minutes']:g} min with a SIGKILL of "
        f"one replica every {s['kill_every_s']:g} s, restarted {s['restart_after_s']:g} s later; failure-free "
        f"baseline {s['baseline_minutes']:g} min in the same invocation.",
        "",
        table(result),
        "",
        f"Command (as root): `{result['command']}` ({result['total_s'] / 60:.0f} min).",
    ])  # fmt: skip


def cpu_note(settings: dict, cores: int) -> str:
    """How the replicas shared the host's CPU: the caveat printed next to every table."""
    nodes, cap = settings["nodes"], settings.get("cpus_per_node")
    if cap is None:
        return (f"{cores} cores for {nodes} replicas, uncapped: they compete for CPU, so tokens/s are this "
                f"host's, not a cluster's; a replica that is down leaves its CPU to the others, which flatters "
                f"step efficiency.")  # fmt: skip
    return (f"Each replica capped at {cap:g} core (cgroup CPU quota; {cores} cores for {nodes} replicas): a "
            f"replica that is down leaves its share idle, as a lost machine would. Tokens/s are those of "
            f"{cap:g}-core nodes, not of a real cluster's.")  # fmt: skip


def default_cpus_per_node(nodes: int, cores: int) -> float:
    """One core per replica where the host has them, else an equal share of its cores."""
    return min(1.0, cores / nodes)


def markdown(result: dict) -> str:
    return f"# Elastic training under failures\n\n{report(result)}\n"


def _spread(values: Sequence[float], fmt: str) -> str:
    """median [min–max] of repetitions."""
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}–{format(max(values), fmt)}]"


def combine(results: Sequence[dict]) -> dict:
    """Repetitions of one command (each one invocation, its methods side by side): per method the step
    efficiency, tokens/s with failures and failure-free, and each method's tokens/s with failures over
    the first method's in the same invocation; the median over repetitions of the recovery medians,
    rounds dropped per run, and in how many runs the replicas ended identical."""
    methods = list(results[0]["methods"])
    if any(list(r["methods"]) != methods for r in results):
        raise ValueError(
            f"combine: every run must hold the methods {methods}; got {[list(r['methods']) for r in results]}"
        )
    first = methods[0]
    combined = {}
    for label in methods:
        runs = [r["methods"][label] for r in results]
        medians = {key: [f[key]["median"] for f in (m["failures"] for m in runs) if f.get(key)] for key in
                   ("kill_to_next_step_s", "stall_s", "restart_to_first_step_s")}  # fmt: skip
        combined[label] = {
            "step_efficiency": [m["step_efficiency"] for m in runs],
            "tokens_per_s_failures": [m["failures"]["tokens_per_s"] for m in runs],
            "tokens_per_s_baseline": [m["baseline"]["tokens_per_s"] for m in runs],
            f"failures_over_{first}": [
                m["failures"]["tokens_per_s"] / r["methods"][first]["failures"]["tokens_per_s"]
                for m, r in zip(runs, results)
            ],  # fmt: skip
            "kill_to_next_step_s": medians["kill_to_next_step_s"],
            "stall_s": medians["stall_s"],
            "restart_to_first_step_s": medians["restart_to_first_step_s"],
            "rounds_dropped": [len(m["failures"]["rounds_dropped"]) for m in runs],
            "identical_at_end": sum(bool(m["failures"]["end"]["identical"]) for m in runs),
        }
    return {"runs": len(results), "first": first, "methods": combined,
            "commands": [r["command"] for r in results], "settings": results[0]["settings"],
            "host": results[0]["host"]}  # fmt: skip


def combined_table(c: dict) -> str:
    """The markdown table of `combine`'s result: median [min–max] over the repetitions."""
    n, first = c["runs"], c["first"]
    head = ["method", "step efficiency", "tokens/s with failures", f"… over `{first}`'s", "tokens/s failure-free",
            "kill → survivors' next step, s", "survivors' longest pause, s", "restart → joiner's first step, s",
            "rounds dropped", "identical at end"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, m in c["methods"].items():
        cells = [_spread(m["step_efficiency"], ".3f"), _spread(m["tokens_per_s_failures"], ",.0f"),
                 _spread(m[f"failures_over_{first}"], ".3f"), _spread(m["tokens_per_s_baseline"], ",.0f"),
                 _spread(m["kill_to_next_step_s"], ".1f") if m["kill_to_next_step_s"] else "–",
                 _spread(m["stall_s"], ".1f") if m.get("stall_s") else "–",
                 _spread(m["restart_to_first_step_s"], ".1f") if m["restart_to_first_step_s"] else "–",
                 " / ".join(map(str, m["rounds_dropped"])), f"{m['identical_at_end']} of {n} runs"]  # fmt: skip
        lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- running it


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = ToolParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", nargs="+", default=["co2", "torchft-diloco"], choices=tuple(METHODS))
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate", default="1gbit", help="every node's link: 100mbit | 1gbit | 10gbit | <x>[kmg]bit")
    p.add_argument("--minutes", type=float, default=10.0, help="length of the run with failures")
    p.add_argument("--baseline_minutes", type=float, default=3.0, help="length of the failure-free run")
    p.add_argument("--kill_every_s", type=float, default=60.0)
    p.add_argument("--restart_after_s", type=float, default=20.0)
    p.add_argument("--cpus_per_node", type=float, default=None,
                   help="cap every replica's node at this many cores (cgroup quota; default: one core each, or "
                        "cores / nodes on a smaller host); 0: no cap, the replicas share the host")  # fmt: skip
    p.add_argument("--model", default="tiny", help="the training job's --model preset")
    p.add_argument("--train_flags", default="", help="more flags of every replica (training job flags), one string")
    p.add_argument("--start_timeout_s", type=float, default=600, help="deadline for every replica's first step")
    p.add_argument("--end_timeout_s", type=float, default=300, help="deadline for every replica to stop at the end")
    p.add_argument("--out_dir", default=str(ROOT / "benchmarks" / "elastic"))
    p.add_argument("--log_dir", default=None, help="replica logs (default: /tmp/c2z-elastic-<time>)")
    p.add_argument("--combine", nargs="+", metavar="DIR", default=None,
                   help="run nothing: combine the elastic.json of these earlier runs (repetitions) into "
                        "<out_dir>/elastic_runs.json and .md, median [min–max]")  # fmt: skip
    return p.parse_args(argv)


def combined_report(combined: dict) -> str:
    """What was repeated, the table and the commands (elastic_runs.md; docs/elastic-job.md and the README
    render it)."""
    s = combined["settings"]
    return "\n".join([
        f"{combined['runs']} runs of the same command, each one invocation with its methods side by side; median "
        f"[min–max] over the runs. P = {s['nodes']} replicas (one rank each) at {s['rate']} on the emulated "
        f"cluster, `{s['train_flags']}`, τ = {s['tau']}, a SIGKILL of one replica every {s['kill_every_s']:g} s, "
        f"restarted {s['restart_after_s']:g} s later, for {s['minutes']:g} min; failure-free "
        f"{s['baseline_minutes']:g} min before. **{cpu_note(s, combined['host']['cores'])}**", "",
        combined_table(combined), "",
        "Commands (as root): " + "; ".join(f"`{c}`" for c in combined["commands"]) + "; then "
        f"`python -m scripts.bench_elastic --combine {' '.join(combined['combined_from'])}`.",
    ])  # fmt: skip


def write_combined(dirs: Sequence[str], out_dir: Path) -> str:
    """--combine: the repetitions' report, also written to out_dir/elastic_runs.{json,md}."""
    combined = combine([json.loads((Path(d) / "elastic.json").read_text()) for d in dirs])
    combined["combined_from"] = list(dirs)
    text = f"# Elastic training under failures: repetitions\n\n{combined_report(combined)}\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "elastic_runs.json").write_text(json.dumps(combined, indent=1))
    (out_dir / "elastic_runs.md").write_text(text)
    return text


def job_settings(a: argparse.Namespace) -> tuple[list[str], int, int]:
    """(every replica's training flags, τ, tokens per replica step), as the training job resolves them."""
    from co2_zero.train.args import co2_config
    from co2_zero.train.args import get_args as train_args

    flags = ["--model", a.model, "--eval_every", "0", "--eval_batches", "1", "--no_progress", "--max_steps", "1000000",
             *shlex.split(a.train_flags)]  # fmt: skip
    job = train_args(flags)
    return flags, co2_config(job).tau, job.batch_size * job.block_size * job.grad_accum


class Job:
    """One run of one method on the cluster: a Lighthouse, a replica per node, the kill schedule."""

    def __init__(self, cluster: ec.EmulatedCluster, method: str, flags: list[str], tau: int, log_dir: Path) -> None:
        self.cluster, self.method, self.flags, self.tau, self.log_dir = cluster, method, flags, tau, log_dir
        self.stop_file = log_dir / "stop"
        self.incarnations: list[Incarnation] = []
        self.procs: dict[int, Any] = {}  # id(incarnation) -> its process
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, node: int) -> Incarnation:
        """Launch node's replica (its k-th incarnation) in its namespace, with its own hostname."""
        k = sum(1 for i in self.incarnations if i.node == node)
        inc = Incarnation(node, time.time(), path=self.log_dir / f"node{node}_{k}.jsonl")
        module, own = METHODS[self.method]
        argv = [sys.executable, "-m", module, *(f.format(P=self.cluster.nodes) for f in own), *self.flags,
                "--lighthouse", f"http://{self.cluster.ip(0)}:{LIGHTHOUSE_PORT}", "--replica_id", str(node),
                "--events_jsonl", str(inc.path), "--stop_file", str(self.stop_file)]  # fmt: skip
        env = {"MASTER_ADDR": self.cluster.ip(node), "MASTER_PORT": str(STORE_PORT + k)}
        proc = self.cluster.popen(node, argv, env=env, log=self.log_dir / f"node{node}_{k}.log", own_hostname=True)
        self.incarnations.append(inc)
        self.procs[id(inc)] = proc
        return inc

    def live(self, node: int) -> Incarnation:
        return next(i for i in reversed(self.incarnations) if i.node == node)

    def lighthouse(self) -> Any:
        argv = torchft_peer.lighthouse_argv(1, bind=f"[::]:{LIGHTHOUSE_PORT}")
        return self.cluster.popen(0, argv, log=self.log_dir / "lighthouse.log", capped=False)

    def wait_first_steps(self, timeout_s: float) -> float:
        """The time at which every live replica has completed a step in a quorum (raises after timeout_s)."""
        deadline = time.time() + timeout_s
        live = [inc for inc in self.incarnations if inc.killed is None]
        while time.time() < deadline:
            firsts = [_first_step_t(inc.path) for inc in live]
            if all(t is not None for t in firsts):
                return max(firsts)
            dead = [inc.node for inc in live if self.procs[id(inc)].poll() is not None]
            if dead:
                raise ec.HarnessError(f"{self.method}: replica(s) {dead} exited before their first step; "
                                      f"logs in {self.log_dir}")  # fmt: skip
            time.sleep(0.5)
        raise ec.HarnessError(f"{self.method}: not every replica stepped within {timeout_s:g}s; logs in {self.log_dir}")

    def kill(self, node: int) -> None:
        inc = self.live(node)
        inc.killed = time.time()
        self.cluster.kill(self.procs[id(inc)])

    def stop(self, timeout_s: float) -> None:
        """Name a stop step a few rounds ahead of every replica; wait for all to get there (kill after
        timeout_s). First every replica that is still joining steps: one that joined at the stop step would
        go on alone."""
        self.wait_first_steps(timeout_s)
        reached = max((e["step"] for inc in self.incarnations if inc.killed is None
                       for e in parse_events(_read(inc.path)) if e["event"] == "step"), default=0)  # fmt: skip
        target = -(-(reached + 2 * self.tau) // self.tau) * self.tau
        tmp = self.stop_file.with_suffix(".tmp")
        tmp.write_text(str(target))
        tmp.replace(self.stop_file)
        live = [self.procs[id(inc)] for inc in self.incarnations if inc.killed is None]
        codes = self.cluster.wait_all(live, timeout_s)
        for inc, code in zip([i for i in self.incarnations if i.killed is None], codes):
            inc.exit_code = code

    def run(self, duration_s: float, schedule: Sequence[Action], start_timeout_s: float, end_timeout_s: float) -> dict:
        lighthouse = self.lighthouse()
        try:
            time.sleep(1.0)
            for node in range(self.cluster.nodes):
                self.start(node)
            t0 = self.wait_first_steps(start_timeout_s)
            for action in schedule:
                _sleep_until(t0 + action.t)
                self.kill(action.node) if action.kind == "kill" else self.start(action.node)
                print(f"   {self.method}: {action.kind} node {action.node} at +{time.time() - t0:.1f}s",
                      file=sys.stderr, flush=True)  # fmt: skip
            _sleep_until(t0 + duration_s)
            self.stop(end_timeout_s)
        finally:
            self.cluster.kill(lighthouse)
            for inc in self.incarnations:
                self.cluster.kill(self.procs[id(inc)])
        for inc in self.incarnations:
            inc.events = parse_events(_read(inc.path))
        return {"t0": t0, "duration_s": duration_s, "schedule": [vars(x) for x in schedule],
                "exit_codes": [inc.exit_code for inc in self.incarnations], "log_dir": str(self.log_dir)}  # fmt: skip


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _first_step_t(path: Path) -> Optional[float]:
    inc = Incarnation(0, 0.0, parse_events(_read(path)))
    steps = inc.steps()
    return steps[0]["t"] if steps else None


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def run_method(cluster: ec.EmulatedCluster, method: str, a: argparse.Namespace, log_root: Path) -> dict:
    """The failure-free run, then the run with failures; their numbers and the step efficiency."""
    flags, tau, tokens_per_step = job_settings(a)
    out = {}
    for name, minutes, schedule in (
        ("baseline", a.baseline_minutes, []),
        ("failures", a.minutes, kill_schedule(a.minutes * 60, a.kill_every_s, a.restart_after_s, cluster.nodes)),
    ):
        print(f"== {method} {name}: {minutes:g} min, load {ec.load_average()}", file=sys.stderr, flush=True)
        job = Job(cluster, method, flags, tau, log_root / f"{method}_{name}")
        run = job.run(minutes * 60, schedule, a.start_timeout_s, a.end_timeout_s)
        run.update(summarize(run, job.incarnations, tokens_per_step))
        out[name] = run
        print(f"   {method} {name}: {run['tokens_per_s']:,.0f} tok/s, end {run['end']}", file=sys.stderr, flush=True)
    out["step_efficiency"] = out["failures"]["tokens_per_s"] / out["baseline"]["tokens_per_s"]
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = get_args(argv)
    if a.combine:
        print(write_combined(a.combine, Path(a.out_dir)))
        return 0
    ec.require_privileges()
    flags, tau, _ = job_settings(a)
    cores = os.cpu_count() or 1
    cap = default_cpus_per_node(a.nodes, cores) if a.cpus_per_node is None else (a.cpus_per_node or None)
    log_root = Path(a.log_dir or f"/tmp/c2z-elastic-{int(time.time())}")
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "command": shlex.join(["python", "-m", "scripts.bench_elastic", *(sys.argv[1:] if argv is None else argv)]),
        "settings": {"nodes": a.nodes, "rate": a.rate, "minutes": a.minutes, "baseline_minutes": a.baseline_minutes,
                     "kill_every_s": a.kill_every_s, "restart_after_s": a.restart_after_s,
                     "train_flags": shlex.join(flags), "tau": tau, "cpus_per_node": cap},
        "host": {"cores": cores, "load_avg_start": ec.load_average()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "methods": {},
    }  # fmt: skip
    began = time.time()
    with ec.EmulatedCluster(a.nodes, a.rate, cpus_per_node=cap) as cluster:
        result["self_check"] = cluster.self_check(strict=False)
        print(f"self-check: {json.dumps(result['self_check'])}", file=sys.stderr, flush=True)
        for method in a.methods:
            result["methods"][method] = run_method(cluster, method, a, log_root)
            result["total_s"] = round(time.time() - began, 1)
            (out_dir / "elastic.json").write_text(json.dumps(result, indent=1))  # after every method
            (out_dir / "elastic.md").write_text(markdown(result))
    print(markdown(result))
    print(f"logs: {log_root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(Path(__file__).name, main))
