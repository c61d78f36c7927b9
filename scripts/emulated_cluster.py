"""An emulated cluster on one Linux machine: P nodes as network namespaces behind a shaped bridge.

Why: CO2 only pays off when the link between nodes is slow compared with compute. This harness gives
real ranks, real gloo traffic and a real bandwidth limit on one box (docs/design.md §9), so throughput
and convergence can be measured against DDP and the blocking baselines without a cluster.

Topology (names carry the owner's pid, so concurrent runs never collide and leftovers of a crashed
run are recognisable)::

    c2z<pid>n0: c2z0 10.213.0.10 ──veth── p0 ┐
    c2z<pid>n1: c2z0 10.213.0.11 ──veth── p1 ├─ br0 (in namespace c2z<pid>br)
    ...                                       ┘

Each node's link is shaped in both directions with `tc ... tbf`: upload on the node's own interface,
download on its bridge port. Optional one-way delay: this kernel has no netem, so bridged IPv4
packets are queued to NFQUEUE (iptables + br_netfilter in the bridge namespace) and released by a
small delay line (`DelayLine`, pure-Python nfnetlink) after the delay. Every address used lies in
10.213.0.0/24 *inside namespaces this harness created*; nothing else is ever addressed.

Use it from Python::

    with EmulatedCluster(nodes=4, rate="1gbit") as cluster:
        print(cluster.self_check())                      # raises ShapingError if not as configured
        cluster.torchrun("scripts/train_lm.py", ["--method", "co2"], log_dir="out/logs")

or from the shell (needs root, or an unprivileged user namespace; see `require_privileges`)::

    python scripts/emulated_cluster.py check --nodes 4 --rate 1gbit
    python scripts/emulated_cluster.py run --nodes 4 --rate 1gbit -- scripts/train_lm.py --method co2
    python scripts/emulated_cluster.py cleanup          # remove namespaces left by a killed run

The namespaces are always removed: on normal exit, on an exception, and on SIGINT/SIGTERM (turned
into exceptions so `finally` runs). Processes are killed by their own process-group id only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

PREFIX = "c2z"  # every namespace this harness creates is named c2z<owner pid>{br,n<i>}
SUBNET = "10.213.0"  # /24, only ever assigned inside our own namespaces
FIRST_HOST = 10  # node i gets 10.213.0.(10 + i)
IFNAME = "c2z0"  # the node's interface inside its namespace (GLOO_SOCKET_IFNAME)
BRIDGE = "br0"
MASTER_PORT = 29400  # inside node 0's namespace: cannot collide with anything on the host
RATES = {"100mbit": 100e6, "1gbit": 1e9, "10gbit": 10e9}
SELF_CHECK_LOW, SELF_CHECK_HIGH = 0.80, 1.10  # accepted achieved/configured all-reduce bus bandwidth
SCRIPT = Path(__file__).resolve()


class HarnessError(RuntimeError):
    """The harness cannot run here (privileges, tools, namespaces)."""


class ShapingError(RuntimeError):
    """The self-check measured a bandwidth that is not what was configured."""


# ----------------------------------------------------------------------------- helpers


def parse_rate(rate: Union[str, float, None]) -> Optional[float]:
    """'100mbit' | '1gbit' | '10gbit' | '2.5gbit' | bits/s as a number | None/'none'/'unshaped' -> bits/s or None."""
    if rate is None or (isinstance(rate, str) and rate.lower() in ("", "none", "unshaped", "0")):
        return None
    if isinstance(rate, (int, float)):
        return float(rate)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)bit\s*", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected e.g. 100mbit, 1gbit, 10gbit or 'unshaped'")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def rate_label(bits: Optional[float]) -> str:
    if bits is None:
        return "unshaped"
    for name, value in RATES.items():
        if value == bits:
            return name
    return f"{bits / 1e6:g}mbit"


def run_cmd(argv: Sequence[str], check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise HarnessError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def pid_alive(pid: int) -> bool:
    """True if the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def list_namespaces() -> list[str]:
    proc = run_cmd(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def ensure_tools(need_iptables: bool = False) -> None:
    """Install iproute2 (and iptables for the delay line) with apt-get if missing (root only)."""
    missing = [pkg for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2")) if shutil.which(tool) is None]
    if need_iptables and shutil.which("iptables") is None:
        missing.append("iptables")
    missing = sorted(set(missing))
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise HarnessError(f"emulated cluster: missing {missing}; install them: apt-get install {' '.join(missing)}")
    print(f"emulated cluster: installing {missing} with apt-get", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=False, env=env, capture_output=True)
    proc = subprocess.run(["apt-get", "install", "-y", "-qq", *missing], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise HarnessError(f"emulated cluster: apt-get install {missing} failed: {proc.stderr.strip()[-2000:]}")


def can_create_namespaces() -> tuple[bool, str]:
    """(ok, reason): whether this process can create network namespaces with `ip netns`."""
    if shutil.which("ip") is None:
        return False, "the `ip` tool (iproute2) is not installed"
    if os.geteuid() != 0:
        return False, (
            "creating network namespaces needs root. Run as root, or inside an unprivileged user "
            "namespace: unshare --user --map-root-user --net --mount sh -c 'mount -t tmpfs none /run && "
            "python scripts/emulated_cluster.py ...'"
        )
    probe = f"{PREFIX}{os.getpid()}probe"
    proc = run_cmd(["ip", "netns", "add", probe], check=False)
    if proc.returncode != 0:
        return False, f"`ip netns add` failed: {proc.stderr.strip()}"
    run_cmd(["ip", "netns", "del", probe], check=False)
    return True, ""


def require_privileges() -> None:
    ok, reason = can_create_namespaces()
    if not ok:
        raise HarnessError(f"emulated cluster: cannot run: {reason}")


def _kill_pids(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def cleanup_leftovers(force: bool = False) -> list[str]:
    """Delete our namespaces whose owner process is gone (all of ours with force=True).

    Processes still running inside them (ranks of a crashed run, a delay line) are killed by pid.
    """
    removed = []
    pattern = re.compile(rf"^{PREFIX}(\d+)(br|n\d+|probe)$")
    for ns in list_namespaces():
        m = pattern.match(ns)
        if not m or (not force and pid_alive(int(m.group(1))) and int(m.group(1)) != os.getpid()):
            continue
        pids = run_cmd(["ip", "netns", "pids", ns], check=False).stdout.split()
        _kill_pids([int(p) for p in pids if p.isdigit() and int(p) != os.getpid()])
        run_cmd(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    return removed + _cleanup_cgroups(pattern, force)


def _cleanup_cgroups(pattern: re.Pattern, force: bool) -> list[str]:
    """Remove the CPU-cap cgroups (`CpuCaps`) of runs that are gone, killing what still runs in them."""
    try:
        root, _ = cgroup_cpu_root()
    except HarnessError:
        return []
    removed = []
    for group in root.iterdir():
        m = pattern.match(group.name)
        if not m or not group.is_dir() or (not force and pid_alive(int(m.group(1)))):
            continue
        if remove_cgroup(group, timeout_s=2.0):
            removed.append(str(group))
    return removed


def remove_cgroup(group: Path, timeout_s: float) -> bool:
    """Kill what still runs in a cgroup and remove it once those processes have exited (True: gone)."""
    deadline = time.monotonic() + timeout_s
    while group.exists():
        try:
            group.rmdir()
        except OSError:
            _kill_pids([int(p) for p in _read_words(group / "cgroup.procs") if int(p) != os.getpid()])
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
    return True


@contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGINT into KeyboardInterrupt (even where it was inherited as ignored, e.g. `cmd &`) and
    SIGTERM/SIGHUP into SystemExit, so `finally` blocks run and the namespaces are removed."""

    def handler(signum, frame):  # noqa: ARG001
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: leave the handlers alone
        previous = {}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def host_cpu_busy(interval: float = 1.0) -> float:
    """Fraction of all CPU time that was busy over `interval` s (from /proc/stat); -1 if unknown."""

    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)  # idle + iowait, total

    try:
        i0, t0 = sample()
        time.sleep(interval)
        i1, t1 = sample()
    except OSError:
        return -1.0
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def wait_for_quiet_host(max_load: float, max_wait_s: float, poll_s: float = 30.0) -> dict:
    """Poll until the 1-minute load average is below max_load (or max_wait_s passed). Returns the record."""
    began = time.time()
    while True:
        load = load_average()
        if load[0] < max_load or time.time() - began >= max_wait_s:
            return {"load_avg": load, "waited_s": round(time.time() - began, 1), "quiet": load[0] < max_load}
        print(f"host busy: load average {load} >= {max_load}; waiting ({time.time() - began:.0f}s)", file=sys.stderr)
        time.sleep(poll_s)


def wait_for_idle_cpus(max_busy: float, max_wait_s: float) -> dict:
    """Sample the CPUs' busy fraction (1 s at a time) until it is below max_busy or max_wait_s passed.

    Before every timed run: the load average still counts the ranks of the run before, this does not.
    Returns the record (`quiet`: False when it gave up waiting)."""
    began = time.time()
    while True:
        busy = host_cpu_busy(1.0)
        if busy < max_busy or time.time() - began >= max_wait_s:
            return {"load_avg": load_average(), "cpu_busy": round(busy, 3), "waited_s": round(time.time() - began, 1),
                    "quiet": busy < max_busy}  # fmt: skip


# ----------------------------------------------------------------------------- the cluster


class CpuCaps:
    """At most `cpus` cores per node, each node its own cgroup (v2 `cpu.max`, or v1's CFS quota).

    Why: on a host with fewer cores than nodes the ranks share the CPU, and a node that is down hands
    its share to the others, so its loss costs the job less than a lost machine would (it flatters
    step efficiency under failures). Capped, every node runs at a fixed fraction of a core whether or
    not its neighbours run: a small, slow machine per node. Set cpus <= cores / nodes so the caps are
    also met. Root only; the cgroups carry the cluster's tag and are removed with it.
    """

    PERIOD_US = 100_000

    def __init__(self, tag: str, cpus: Union[float, Sequence[float]],
                 weights: Optional[Sequence[float]] = None) -> None:  # fmt: skip
        listed = list(cpus) if isinstance(cpus, (list, tuple)) else None
        if any(not c > 0 for c in (listed or [cpus])) or listed == []:
            raise ValueError(f"cpus_per_node={cpus}: expected a positive number of cores (or one per node), e.g. 0.5")
        if weights is not None and any(not w > 0 for w in weights):
            raise ValueError(f"cpu_weights={list(weights)}: expected a positive weight per node (1: the default)")
        self.tag, self.cpus = tag, [float(c) for c in listed] if listed is not None else float(cpus)
        self.weights = list(weights) if weights is not None else None
        self.root, self.v2 = cgroup_cpu_root()
        self.made: list[Path] = []

    def cores(self, i: int) -> float:
        """Node i's cap in cores (one for every node, or node i's own)."""
        return self.cpus[i] if isinstance(self.cpus, list) else self.cpus

    def path(self, i: int) -> Path:
        return self.root / f"{self.tag}n{i}"

    def create(self, nodes: int) -> None:
        try:
            self._create(nodes)
        except OSError as error:
            raise HarnessError(
                f"emulated cluster: cannot cap each node's CPU at {self.cpus} core in {self.root} ({error}); "
                f"run without a cap (cpus_per_node None, or --cpus_per_node 0)"
            ) from error

    def _create(self, nodes: int) -> None:
        for given, name in ((self.cpus, "cpus_per_node"), (self.weights, "cpu_weights")):
            if isinstance(given, list) and len(given) != nodes:
                raise ValueError(f"{name}={given}: {len(given)} values for {nodes} nodes; expected one per node")
        if self.v2:  # the root must hand the cpu controller down to its children
            (self.root / "cgroup.subtree_control").write_text("+cpu")
        for i in range(nodes):
            quota = max(1000, int(self.cores(i) * self.PERIOD_US))
            group = self.path(i)
            group.mkdir()
            self.made.append(group)
            if self.v2:
                (group / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
            if self.weights is not None:  # the scheduler's weight beside the host's other tasks (default 1)
                weight = self.weights[i]
                if self.v2:
                    (group / "cpu.weight").write_text(str(min(10_000, max(1, round(100 * weight)))))
                else:
                    (group / "cpu.shares").write_text(str(max(2, round(1024 * weight))))

    def argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """argv run inside node i's cgroup (its children inherit it)."""
        script = 'echo $$ > "$1" && shift && exec "$@"'
        return ["sh", "-c", script, "sh", str(self.path(i) / "cgroup.procs"), *argv]

    def admit(self, i: int, pid: int) -> None:
        """Put a running process and its descendants into node i's cgroup (every thread of each)."""
        for p in [pid, *descendants(pid)]:
            try:
                (self.path(i) / "cgroup.procs").write_text(str(p))
            except ProcessLookupError:
                pass  # exited in between

    def destroy(self, timeout_s: float = 10.0) -> None:
        """Remove the cgroups (a cgroup goes once its killed processes have exited)."""
        for group in reversed(self.made):
            if not remove_cgroup(group, timeout_s):
                print(f"emulated cluster: could not remove cgroup {group}", file=sys.stderr)
        self.made.clear()


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc/<pid>/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            children = [int(c) for c in _read_words(task / "children")]
            found += children
            todo += children
    return found


def cgroup_cpu_root() -> tuple[Path, bool]:
    """(the cgroup directory whose children get CPU caps, whether it is cgroup v2)."""
    if "cpu" in _read_words(Path("/sys/fs/cgroup/cgroup.controllers")):
        return Path("/sys/fs/cgroup"), True
    if Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists():
        return Path("/sys/fs/cgroup/cpu"), False
    raise HarnessError("emulated cluster: no cgroup CPU controller (v2 cpu.max or v1 cpu.cfs_quota_us) to cap nodes")


def _read_words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


class EmulatedCluster:
    """P network namespaces joined by veth pairs to a bridge in its own namespace, links shaped with tbf.

    nodes:    number of nodes (one rank each).
    rate:     per-node link rate in both directions: '100mbit', '1gbit', '10gbit', any '<x>[kmg]bit',
              bits/s, or None/'unshaped'.
    delay_ms: optional one-way delay added to every bridged IPv4 packet (NFQUEUE delay line).
    cpus_per_node: optional cap on each node's CPU, in cores, one for all or one per node (`CpuCaps`);
              None: the nodes share the host.
    cpu_weights: optional scheduler weight per capped node (1: a plain process's): on a host busy with
              other jobs a quota may not be what binds, and the nodes then share the CPU by weight.
    """

    def __init__(self, nodes: int, rate: Union[str, float, None] = None, delay_ms: float = 0.0,
                 cpus_per_node: Union[float, Sequence[float], None] = None,
                 cpu_weights: Optional[Sequence[float]] = None) -> None:  # fmt: skip
        if nodes < 1 or nodes > 200:
            raise ValueError(f"nodes={nodes}: expected 1..200")
        self.nodes = nodes
        self.rate = parse_rate(rate)
        self.delay_ms = float(delay_ms)
        self.tag = f"{PREFIX}{os.getpid()}"
        self.bridge_ns = f"{self.tag}br"
        self.created: list[str] = []
        self.delay_proc: Optional[subprocess.Popen] = None
        self._procs: list[subprocess.Popen] = []
        self._hosts: Optional[Path] = None  # hosts_file(), written on first use
        self.caps = CpuCaps(self.tag, cpus_per_node, cpu_weights) if cpus_per_node is not None else None

    # -- names and addresses
    def ns(self, i: int) -> str:
        return f"{self.tag}n{i}"

    def ip(self, i: int) -> str:
        return f"{SUBNET}.{FIRST_HOST + i}"

    @property
    def master_addr(self) -> str:
        return self.ip(0)

    def describe(self) -> dict:
        return {
            "nodes": self.nodes,
            "rate": rate_label(self.rate),
            "rate_bits": self.rate,
            "delay_ms": self.delay_ms,
            "namespaces": [self.ns(i) for i in range(self.nodes)],
            "addresses": [self.ip(i) for i in range(self.nodes)],
            "ifname": IFNAME,
            "cpus_per_node": self.caps.cpus if self.caps else None,
        }

    # -- lifecycle
    def __enter__(self) -> EmulatedCluster:
        self._signals = signals_raise()
        self._signals.__enter__()
        try:
            self.create()
        except BaseException:
            self.destroy()
            self._signals.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.destroy()
        finally:
            self._signals.__exit__(*exc)

    def create(self) -> None:
        ensure_tools(need_iptables=self.delay_ms > 0)
        require_privileges()
        cleanup_leftovers()
        self._add_ns(self.bridge_ns)
        br = ["ip", "-n", self.bridge_ns]
        run_cmd([*br, "link", "add", BRIDGE, "type", "bridge"])
        run_cmd([*br, "link", "set", BRIDGE, "up"])
        for i in range(self.nodes):
            ns, port = self.ns(i), f"p{i}"
            self._add_ns(ns)
            run_cmd([*br, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns])
            run_cmd([*br, "link", "set", port, "master", BRIDGE])
            run_cmd([*br, "link", "set", port, "up"])
            run_cmd(["ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", IFNAME])
            run_cmd(["ip", "-n", ns, "link", "set", IFNAME, "up"])
            if self.rate is not None:
                self._shape(ns, IFNAME)  # node upload
                self._shape(self.bridge_ns, port)  # node download
        if self.delay_ms > 0:
            self._start_delay_line()
        if self.caps:
            self.caps.create(self.nodes)
        self._wait_link()

    def _add_ns(self, name: str) -> None:
        run_cmd(["ip", "netns", "add", name])
        self.created.append(name)
        run_cmd(["ip", "-n", name, "link", "set", "lo", "up"])

    def _shape(self, ns: str, dev: str) -> None:
        """Token bucket at self.rate. Burst: 1 ms at line rate (>= 64 KiB so one GSO packet fits); queue: 50 ms."""
        burst = max(int(self.rate / 8 * 1e-3), 64 * 1024)
        run_cmd(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(self.rate)}bit",
                 "burst", str(burst), "latency", "50ms"])  # fmt: skip

    def _wait_link(self, timeout_s: float = 10.0) -> None:
        """Bridge ports take a moment to forward; ping node 0 from the last node until it answers."""
        if self.nodes < 2 or shutil.which("ping") is None:
            time.sleep(0.5)
            return
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            probe = ["ip", "netns", "exec", self.ns(self.nodes - 1), "ping", "-c", "1", "-W", "1", self.ip(0)]
            if run_cmd(probe, check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise HarnessError(f"emulated cluster: {self.ns(self.nodes - 1)} cannot reach {self.ip(0)} after {timeout_s}s")

    def destroy(self) -> None:
        """Idempotent: kill what we started, delete every namespace we created."""
        for proc in self._procs:
            _kill_group(proc)
        self._procs.clear()
        if self.delay_proc is not None:
            _kill_group(self.delay_proc)
            self.delay_proc = None
        for ns in reversed(self.created):
            pids = run_cmd(["ip", "netns", "pids", ns], check=False).stdout.split()
            _kill_pids([int(p) for p in pids if p.isdigit() and int(p) != os.getpid()])
            run_cmd(["ip", "netns", "del", ns], check=False)
        self.created.clear()
        if self.caps:
            self.caps.destroy()
        if self._hosts is not None:
            shutil.rmtree(self._hosts.parent, ignore_errors=True)
            self._hosts = None

    # -- delay line
    def _start_delay_line(self) -> None:
        br = ["ip", "netns", "exec", self.bridge_ns]
        run_cmd([*br, "sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=1"], check=False)
        run_cmd([*br, "iptables", "-A", "FORWARD", "-s", f"{SUBNET}.0/24", "-d", f"{SUBNET}.0/24",
                 "-j", "NFQUEUE", "--queue-num", "0"])  # fmt: skip
        self.delay_proc = subprocess.Popen(
            [*br, sys.executable, str(SCRIPT), "_delay_line", "--delay_ms", str(self.delay_ms)],
            start_new_session=True,
        )
        time.sleep(0.5)
        if self.delay_proc.poll() is not None:
            raise HarnessError("emulated cluster: the NFQUEUE delay line exited at start (see its error above)")

    # -- running ranks
    def env_for(self, i: int, extra: Optional[dict] = None) -> dict:
        env = dict(os.environ)
        env.update(GLOO_SOCKET_IFNAME=IFNAME, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR=self.master_addr,
                   MASTER_PORT=str(MASTER_PORT), EMULATED_CLUSTER_RATE=rate_label(self.rate))  # fmt: skip
        root = str(SCRIPT.parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        env.update(extra or {})
        return env

    def hostname(self, i: int) -> str:
        """Node i's own hostname (`own_hostname=True`): its namespace's name."""
        return self.ns(i)

    def hosts_file(self) -> Path:
        """An /etc/hosts naming every node (written once, removed with the cluster)."""
        if self._hosts is None:
            self._hosts = Path(tempfile.mkdtemp(prefix="c2z-hosts-")) / "hosts"
            names = "".join(f"{self.ip(i)} {self.hostname(i)}\n" for i in range(self.nodes))
            self._hosts.write_text(f"127.0.0.1 localhost\n{names}")
        return self._hosts

    def own_host_argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """argv run with node i's own hostname and the cluster's hosts file, in private UTS and mount
        namespaces (nothing on the host changes). Why: programs that advertise `gethostname()` to their
        peers (torchft's checkpoint transport) are then reachable across the nodes."""
        script = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
        return ["unshare", "--uts", "--mount", "sh", "-c", script, "sh", self.hostname(i), str(self.hosts_file()),
                *argv]  # fmt: skip

    def popen(self, i: int, argv: Sequence[str], env: Optional[dict] = None, log: Optional[Path] = None,
              cwd: Optional[str] = None, own_hostname: bool = False,
              capped: bool = True) -> subprocess.Popen:  # fmt: skip
        """Start argv inside node i's namespace (its own process group, killed by pgid on cleanup);
        own_hostname: with node i's own hostname (`own_host_argv`); capped: inside node i's CPU cap
        where the cluster has one (False: a helper such as a Lighthouse, not one of the node's ranks)."""
        out = open(log, "w") if log is not None else None  # noqa: SIM115 (closed in wait_all)
        argv = ["ip", "netns", "exec", self.ns(i), *(self.own_host_argv(i, argv) if own_hostname else argv)]
        if self.caps and capped:  # outside the namespace: `ip netns exec` mounts a sysfs without cgroups
            argv = self.caps.argv(i, argv)
        proc = subprocess.Popen(
            argv,
            env=self.env_for(i, env), stdout=out or subprocess.DEVNULL, stderr=subprocess.STDOUT if out else None,
            start_new_session=True, cwd=cwd,
        )  # fmt: skip
        proc._log_file = out  # type: ignore[attr-defined]
        self._procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL a process started with `popen` and everything in its process group (a whole replica)."""
        _kill_group(proc)
        if getattr(proc, "_log_file", None):
            proc._log_file.close()  # type: ignore[attr-defined]
        if proc in self._procs:
            self._procs.remove(proc)

    def torchrun_argv(self, i: int, script: str, args: Sequence[str], port: int = MASTER_PORT) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nodes), "--nproc_per_node", "1",
            "--node_rank", str(i), "--master_addr", self.master_addr, "--master_port", str(port),
            "--max_restarts", "0", "--monitor_interval", "0.5", str(script), *args,
        ]  # fmt: skip

    def torchrun(self, script: str, args: Union[Sequence[str], Callable[[int], Sequence[str]]] = (),
                 log_dir: Union[str, Path, None] = None, timeout_s: float = 1800.0, env: Optional[dict] = None,
                 port: int = MASTER_PORT) -> list[int]:  # fmt: skip
        """One `torchrun --nnodes P --node_rank i` per namespace; wait for all. Returns the exit codes.

        args: the script's arguments, or a function node -> arguments. A node that fails makes the
        others be killed after a 20 s grace period (they would otherwise wait on it until timeout).
        Raises HarnessError with the logs' tails if any node failed.
        """
        log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="c2z-logs-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        procs = []
        for i in range(self.nodes):
            node_args = args(i) if callable(args) else args
            procs.append(self.popen(i, self.torchrun_argv(i, script, node_args, port), env=env,
                                    log=log_dir / f"node{i}.log"))  # fmt: skip
        codes = self.wait_all(procs, timeout_s)
        if any(codes):
            logs = [log_dir / f"node{i}.log" for i in range(self.nodes)]
            tails = "\n".join(f"--- node {i} (exit {c}) {logs[i]}:\n" + log_tail(logs[i])
                              for i, c in enumerate(codes) if c)  # fmt: skip
            raise HarnessError(f"emulated cluster: ranks failed, exit codes {codes}\n{tails}")
        return codes

    def wait_all(self, procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
        deadline, failed_at = time.time() + timeout_s, None
        try:
            while any(p.poll() is None for p in procs):
                now = time.time()
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline or (failed_at is not None and now - failed_at > 20):
                    for p in procs:
                        _kill_group(p)
                    break
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    _kill_group(p)
                    p.wait()
                if getattr(p, "_log_file", None):
                    p._log_file.close()  # type: ignore[attr-defined]
                if p in self._procs:
                    self._procs.remove(p)
        return [p.returncode if p.returncode is not None else -9 for p in procs]

    # -- self-check
    def self_check(self, payload_mb: Optional[float] = None, reps: int = 3, strict: bool = True) -> dict:
        """Measure the gloo all-reduce bus bandwidth across all nodes and compare it with the setting.

        Bus bandwidth = 2(P-1)/P * bytes / time: what each node's link carries in a ring all-reduce,
        so it should reach the configured rate. Raises ShapingError (strict) when achieved/configured
        is outside [0.80, 1.10]; above means the shaping is not applied, below that the link (or the
        host) is slower than asked. Settings above what the host can move are reported as
        'host_limited' instead of failing: the setting is then not a real limit.
        """
        if self.nodes < 2:
            return {"status": "skipped", "reason": "one node: nothing to measure"}
        if payload_mb is None:  # about one second of traffic at the configured rate, 4..100 MB
            seconds_worth = 1e9 if self.rate is None else self.rate / 8 / (2 * (self.nodes - 1) / self.nodes)
            payload_mb = min(100.0, max(4.0, seconds_worth / 1e6))
        with tempfile.TemporaryDirectory(prefix="c2z-check-") as tmp:
            out = Path(tmp) / "allreduce.json"
            self.torchrun(str(SCRIPT), ["_allreduce_worker", "--mb", str(payload_mb), "--reps", str(reps),
                                        "--out", str(out)], log_dir=tmp, timeout_s=300)  # fmt: skip
            result = json.loads(out.read_text())
        result.update(nodes=self.nodes, rate=rate_label(self.rate), configured_bits=self.rate)
        if self.rate is None:
            result["status"] = "unshaped"
            return result
        ratio = result["bus_bits_per_s"] / self.rate
        result["achieved_over_configured"] = round(ratio, 3)
        if ratio > SELF_CHECK_HIGH:
            result["status"] = "fail"
            msg = (f"shaping not applied: {result['bus_bits_per_s'] / 1e9:.2f} Gbit/s measured at a "
                   f"{rate_label(self.rate)} setting ({ratio:.2f}x)")  # fmt: skip
        elif ratio < SELF_CHECK_LOW and self.rate > 2e9:
            result["status"] = "host_limited"
            result["note"] = (f"the host moves only {result['bus_bits_per_s'] / 1e9:.2f} Gbit/s between "
                              f"{self.nodes} namespaces: the {rate_label(self.rate)} setting is not a real "
                              f"limit here")  # fmt: skip
            return result
        elif ratio < SELF_CHECK_LOW:
            result["status"] = "fail"
            msg = (f"link slower than configured: {result['bus_bits_per_s'] / 1e6:.0f} Mbit/s at a "
                   f"{rate_label(self.rate)} setting ({ratio:.2f}x); is the host overloaded?")  # fmt: skip
        else:
            result["status"] = "ok"
            return result
        if strict:
            raise ShapingError(f"emulated cluster self-check FAILED: {msg}. Measurements: {result}")
        result["error"] = msg
        return result


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group we created for it (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def log_tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


# ----------------------------------------------------------------------------- workers (run inside namespaces)


def _allreduce_worker(argv: Sequence[str]) -> None:
    """Under torchrun: time a gloo all-reduce of --mb megabytes; rank 0 writes the result as JSON."""
    import torch
    import torch.distributed as dist

    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=100.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    x = torch.ones(int(a.mb * 1e6 / 4), device="cpu")  # gloo: CPU tensors
    dist.all_reduce(x)  # warm-up: connections, buffers
    times = []
    for _ in range(a.reps):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t)
    t_med = torch.tensor([statistics.median(times)], dtype=torch.float64, device="cpu")
    dist.all_reduce(t_med, op=dist.ReduceOp.MAX)  # the slowest rank's median
    nbytes = x.numel() * 4
    if dist.get_rank() == 0:
        bus = 2 * (world - 1) / world * nbytes * 8 / t_med.item()
        Path(a.out).write_text(json.dumps({
            "payload_bytes": nbytes, "reps": a.reps, "seconds": [round(t, 4) for t in times],
            "median_s": round(t_med.item(), 4), "bus_bits_per_s": bus,
        }))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def _delay_line(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--delay_ms", type=float, required=True)
    p.add_argument("--queue", type=int, default=0)
    a = p.parse_args(argv)
    DelayLine(a.queue, a.delay_ms / 1e3).run()


class DelayLine:
    """A fixed one-way delay for packets queued to NFQUEUE, speaking nfnetlink directly (no libraries).

    Every packet is held `delay_s` and then accepted. The delay is constant, so packets leave in the
    order they came: one NFQNL_MSG_VERDICT_BATCH accepts everything up to the newest due packet id.
    Packets are copied to user space as metadata only (NFQNL_COPY_META): the payload never leaves the
    kernel. In Python this sustains tens of thousands of packets/s (GSO packets are up to 64 KiB,
    so Gbit/s rates are fine); delay is meant for latency studies, not for a 10 Gbit/s link.
    """

    NETLINK_NETFILTER = 12
    NFNL_SUBSYS_QUEUE = 3
    NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 1, 2, 3
    NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
    NFQA_CFG_F_GSO = 4
    NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
    NFQNL_CFG_CMD_BIND, NFQNL_CFG_CMD_PF_BIND, NFQNL_CFG_CMD_PF_UNBIND = 1, 3, 4
    NFQNL_COPY_META = 1
    NLM_F_REQUEST, NLM_F_ACK = 1, 4
    NF_ACCEPT = 1

    def __init__(self, queue: int, delay_s: float) -> None:
        import socket

        self.queue, self.delay_s = queue, delay_s
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, self.NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.seq = 0

    def _msg(self, msg_type: int, attrs: bytes, res_id: int, family: int = 2, flags: int = 0) -> bytes:
        import struct

        self.seq += 1
        body = struct.pack(">BBH", family, 0, res_id) + attrs  # nfgenmsg: family, version 0, res_id
        header = struct.pack("=IHHII", 16 + len(body), (self.NFNL_SUBSYS_QUEUE << 8) | msg_type,
                             self.NLM_F_REQUEST | flags, self.seq, 0)  # fmt: skip
        return header + body

    @staticmethod
    def _attr(kind: int, payload: bytes) -> bytes:
        import struct

        raw = struct.pack("=HH", 4 + len(payload), kind) + payload
        return raw + b"\0" * (-len(raw) % 4)

    def _config(self) -> None:
        import struct

        cmd = lambda c, pf: self._attr(self.NFQA_CFG_CMD, struct.pack(">BxH", c, pf))  # noqa: E731
        self.sock.send(self._msg(self.NFQNL_MSG_CONFIG, cmd(self.NFQNL_CFG_CMD_PF_UNBIND, 2), 0))
        self.sock.send(self._msg(self.NFQNL_MSG_CONFIG, cmd(self.NFQNL_CFG_CMD_PF_BIND, 2), 0))
        self.sock.send(self._msg(self.NFQNL_MSG_CONFIG, cmd(self.NFQNL_CFG_CMD_BIND, 2), self.queue, family=0))
        params = self._attr(self.NFQA_CFG_PARAMS, struct.pack(">IB", 0, self.NFQNL_COPY_META))
        maxlen = self._attr(self.NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", 65536))
        # Take GSO packets whole (up to 64 KiB): without this flag the kernel segments them first.
        gso = self._attr(self.NFQA_CFG_MASK, struct.pack(">I", self.NFQA_CFG_F_GSO))
        gso += self._attr(self.NFQA_CFG_FLAGS, struct.pack(">I", self.NFQA_CFG_F_GSO))
        self.sock.send(self._msg(self.NFQNL_MSG_CONFIG, params + maxlen + gso, self.queue, family=0))

    def _accept_upto(self, packet_id: int) -> None:
        import struct

        verdict = self._attr(self.NFQA_VERDICT_HDR, struct.pack(">II", self.NF_ACCEPT, packet_id))
        self.sock.send(self._msg(self.NFQNL_MSG_VERDICT_BATCH, verdict, self.queue, family=0))

    def run(self) -> None:
        import collections
        import select
        import struct

        self._config()
        held: collections.deque = collections.deque()  # (due time, packet id), in arrival order
        while True:
            now = time.monotonic()
            due = None
            while held and held[0][0] <= now:
                due = held.popleft()[1]
            if due is not None:
                self._accept_upto(due)
            timeout = max(0.0, held[0][0] - time.monotonic()) if held else 1.0
            if not select.select([self.sock], [], [], timeout)[0]:
                continue
            data = self.sock.recv(1 << 16)
            arrived = time.monotonic()
            offset = 0
            while offset + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if length < 16:
                    break
                if kind == (self.NFNL_SUBSYS_QUEUE << 8) | self.NFQNL_MSG_PACKET:
                    pos, end = offset + 20, offset + length  # nlmsghdr (16) + nfgenmsg (4)
                    while pos + 4 <= end:
                        alen, atype = struct.unpack_from("=HH", data, pos)
                        if alen < 4:
                            break
                        if atype & 0x7FFF == self.NFQA_PACKET_HDR:
                            held.append((arrived + self.delay_s, struct.unpack_from(">I", data, pos + 4)[0]))
                            break
                        pos += (alen + 3) & ~3
                offset += (length + 3) & ~3


# ----------------------------------------------------------------------------- CLI


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_allreduce_worker":
        _allreduce_worker(argv[1:])
        return 0
    if argv and argv[0] == "_delay_line":
        _delay_line(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("check", "build the cluster, run the bandwidth self-check, remove it"),
                        ("run", "build it, run a script under torchrun on every node, remove it")):  # fmt: skip
        s = sub.add_parser(name, help=help_)
        s.add_argument("--nodes", type=int, default=2)
        s.add_argument("--rate", default="1gbit", help="100mbit | 1gbit | 10gbit | <x>[kmg]bit | unshaped")
        s.add_argument("--delay_ms", type=float, default=0.0, help="one-way delay (NFQUEUE delay line)")
        s.add_argument("--payload_mb", type=float, default=None, help="self-check all-reduce size")
        s.add_argument("--cpus_per_node", type=float, default=None, help="cap each node at this many cores")
    run = sub.choices["run"]
    run.add_argument("--check", action="store_true", help="run the self-check first")
    run.add_argument("--log_dir", default=None, help="per-node logs (default: a temp dir)")
    run.add_argument("script", help="the script torchrun runs on every node")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    clean = sub.add_parser("cleanup", help="delete namespaces left by runs that are gone")
    clean.add_argument("--all", action="store_true", help="also those of live harness processes")
    a = p.parse_args(argv)

    try:
        if a.cmd == "cleanup":
            require_privileges()
            removed = cleanup_leftovers(force=a.all)
            print(f"removed {len(removed)} namespace(s) and cgroup(s): {removed}")
            return 0
        with EmulatedCluster(a.nodes, a.rate, a.delay_ms, a.cpus_per_node) as cluster:
            print(json.dumps(cluster.describe()))
            if a.cmd == "check" or a.check:
                print(json.dumps(cluster.self_check(a.payload_mb)), flush=True)
            if a.cmd == "run":
                args = a.script_args[1:] if a.script_args[:1] == ["--"] else a.script_args
                log_dir = a.log_dir or tempfile.mkdtemp(prefix="c2z-logs-")
                print(f"logs: {log_dir}", file=sys.stderr)
                cluster.torchrun(a.script, args, log_dir=log_dir)
                print(log_tail(Path(log_dir) / "node0.log", 4000))
    except (HarnessError, ShapingError) as error:
        print(error, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; namespaces removed", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
