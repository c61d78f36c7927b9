"""Smoke run of the emulated-cluster harness (scripts/emulated_cluster.py), unshaped, 2 nodes.

Creates two network namespaces behind a bridge, runs a few CO2 steps of scripts/train_lm.py with one
torchrun per namespace (gloo bound to the namespace interface), and checks that every namespace is
gone afterwards, also after a failing run. Needs root (CI runs as root): skipped otherwise, with
the reason. The benchmarks themselves are not part of the suite.
"""

import json
from pathlib import Path

import pytest

from co2_zero.train import tune_tau
from scripts import emulated_cluster as ec

ROOT = Path(__file__).resolve().parents[2]

TINY = [
    "--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--block_size", "32", "--batch_size", "4",
    "--data_bytes", "200000", "--eval_batches", "2", "--eval_every", "0", "--warmup_steps", "2",
    "--no_progress",
]  # fmt: skip


def _can_run():
    """(ok, reason). As root, installs iproute2 first if it is missing (what the harness does too)."""
    import os

    if os.geteuid() == 0:
        try:
            ec.ensure_tools()
        except ec.HarnessError as error:
            return False, str(error)
    return ec.can_create_namespaces()


@pytest.fixture
def namespaces():
    """Skip, with the reason, where network namespaces cannot be made (not root, no iproute2)."""
    ok, reason = _can_run()
    if not ok:
        pytest.skip(f"emulated cluster needs network namespaces: {reason}")


def _ours(tag):
    return [ns for ns in ec.list_namespaces() if ns.startswith(tag)]


def test_parse_rate():
    assert ec.parse_rate("100mbit") == 100e6
    assert ec.parse_rate("1gbit") == 1e9
    assert ec.parse_rate("2.5gbit") == 2.5e9
    assert ec.parse_rate("unshaped") is None and ec.parse_rate(None) is None
    assert ec.rate_label(1e9) == "1gbit" and ec.rate_label(None) == "unshaped"
    with pytest.raises(ValueError, match="expected e.g. 100mbit"):
        ec.parse_rate("fast")


@pytest.mark.slow
def test_smoke_unshaped_two_nodes(tmp_path, namespaces):
    out = tmp_path / "log.jsonl"
    with ec.EmulatedCluster(nodes=2, rate=None) as cluster:
        tag = cluster.tag
        assert sorted(_ours(tag)) == sorted([cluster.bridge_ns, cluster.ns(0), cluster.ns(1)])
        check = cluster.self_check(payload_mb=4, reps=1)
        assert check["status"] == "unshaped" and check["bus_bits_per_s"] > 1e8, check
        cluster.torchrun(
            str(ROOT / "scripts" / "train_lm.py"),
            ["--method", "co2", "--tau", "2", "--max_steps", "6", "--out_json", str(out), *TINY],
            log_dir=tmp_path / "logs",
            timeout_s=120,
        )
        # node 1 really ran in its own namespace, with gloo on the namespace interface
        assert "world=2" in (tmp_path / "logs" / "node0.log").read_text()
    assert _ours(tag) == [], "namespaces left behind"
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    summary = recs[-1]
    assert summary.get("summary") and summary["world_size"] == 2 and summary["steps"] == 6


@pytest.mark.slow
def test_failure_still_removes_namespaces(tmp_path, namespaces):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys; sys.exit(3)\n")
    with pytest.raises(ec.HarnessError, match="ranks failed"):
        with ec.EmulatedCluster(nodes=2, rate="1gbit") as cluster:
            tag = cluster.tag
            cluster.torchrun(str(bad), [], log_dir=tmp_path / "logs", timeout_s=60)
    assert _ours(tag) == []


BUSY_LOOP = "import time; t = time.time()\nwhile time.time() - t < 2.0: pass\nprint(time.process_time())"


def test_a_capped_node_gets_at_most_its_share_of_a_core(tmp_path, namespaces):
    """cpus_per_node: a node's processes run in a cgroup capped at that many cores (2 s of busy loop
    get about 0.2 s of CPU at 0.1 core; uncapped, a second or so), and the cgroups go with the cluster.
    The uncapped node beside it is the control: its busy loop is not held back."""
    import sys

    with ec.EmulatedCluster(nodes=2, rate=None, cpus_per_node=0.1) as cluster:
        groups = [cluster.caps.path(i) for i in range(2)]
        assert all(g.is_dir() for g in groups)
        capped = cluster.popen(0, [sys.executable, "-c", BUSY_LOOP], log=tmp_path / "capped.log")
        free = cluster.popen(1, [sys.executable, "-c", BUSY_LOOP], log=tmp_path / "free.log", capped=False)
        assert cluster.wait_all([capped, free], timeout_s=60) == [0, 0]
    cpu_capped = float((tmp_path / "capped.log").read_text().split()[-1])
    cpu_free = float((tmp_path / "free.log").read_text().split()[-1])
    assert cpu_capped < 0.45 < cpu_free, (cpu_capped, cpu_free)
    assert not any(g.exists() for g in groups), "cgroups left behind"


def test_a_cpu_cap_must_be_positive():
    with pytest.raises(ValueError, match="cpus_per_node=0"):
        ec.CpuCaps("c2z1", 0)
    with pytest.raises(ValueError, match=r"cpus_per_node=\[0.5, 0\]"):
        ec.CpuCaps("c2z1", [0.5, 0])


def test_nodes_get_their_own_caps_and_a_running_process_can_be_admitted(tmp_path, namespaces):
    """cpus_per_node as a list (scripts/bench_hetero.py's replicas of different speeds): node i's quota is
    its own, and `admit` caps a process started uncapped (with its descendants) from then on."""
    import sys

    with ec.EmulatedCluster(nodes=2, rate=None, cpus_per_node=[0.1, 0.5], cpu_weights=[0.5, 2]) as cluster:
        quotas = [_quota_cores(cluster.caps, i) for i in range(2)]
        assert quotas == [0.1, 0.5], quotas
        weights = [_weight(cluster.caps, i) for i in range(2)]
        assert weights == [0.5, 2.0], weights
        busy = cluster.popen(0, [sys.executable, "-c", BUSY_LOOP], log=tmp_path / "late.log", capped=False)
        cluster.caps.admit(0, busy.pid)
        assert str(busy.pid) in (cluster.caps.path(0) / "cgroup.procs").read_text().split()
        assert cluster.wait_all([busy], timeout_s=60) == [0]
    assert float((tmp_path / "late.log").read_text().split()[-1]) < 0.45
    with pytest.raises(ValueError, match="3 values for 2 nodes"), ec.EmulatedCluster(2, None, cpus_per_node=[1, 1, 1]):
        pass


def _weight(caps: ec.CpuCaps, i: int) -> float:
    """Node i's scheduler weight over a plain process's (v2 cpu.weight / 100, v1 cpu.shares / 1024)."""
    return int((caps.path(i) / "cpu.weight").read_text()) / 100 if caps.v2 else int(
        (caps.path(i) / "cpu.shares").read_text()) / 1024  # fmt: skip


def _quota_cores(caps: ec.CpuCaps, i: int) -> float:
    """Node i's cgroup quota in cores, as the kernel has it (v2 cpu.max or v1's CFS quota and period)."""
    if caps.v2:
        quota, period = (caps.path(i) / "cpu.max").read_text().split()
    else:
        quota, period = ((caps.path(i) / f"cpu.cfs_{f}_us").read_text() for f in ("quota", "period"))
    return int(quota) / int(period)


def test_recommend_tau_formula():
    """co2_zero.train.tune_tau's arithmetic: tau_comm = ceil(margin * t_comm / t_step), the largest candidate wins."""
    rec = tune_tau.recommend_tau(t_comm=0.26, t_step=0.11, margin=1.5)
    assert rec["tau_comm"] == 4 and rec["tau"] == 4  # ceil(1.5 * 2.36) = ceil(3.55)
    rec = tune_tau.recommend_tau(0.26, 0.11, 1.5, t_book=0.011, max_overhead=0.02, round_overhead=0.1,
                                 target_efficiency=0.95)  # fmt: skip
    assert rec["tau_book"] == 5  # ceil(0.011 / (0.02 * 0.11))
    assert rec["tau_efficiency"] == 18  # ceil(19 * 0.1 / 0.11)
    assert rec["tau"] == 18
    assert tune_tau.recommend_tau(0.0, 0.1)["tau"] == 1


@pytest.mark.slow
def test_torchft_replicas_run_one_per_node_and_merge(tmp_path, namespaces):
    """bench_throughput's torchft runs: a Lighthouse on node 0, one torchft_peer replica per namespace with
    its own store; the merged records count both replicas' tokens at every round end. A replica that
    fails is reported with its log, and the namespaces still go."""
    pytest.importorskip("torchft", reason="the torchft runs need torchft")
    from scripts import bench_throughput as bt

    flags = ["--tau", "2", "--max_steps", "6", "--method", "diloco", "--timeout_s", "60", *TINY]
    with ec.EmulatedCluster(nodes=2, rate=None) as cluster:
        tag = cluster.tag
        records = bt.run_peer(cluster, "diloco", flags, tmp_path / "ok", timeout_s=120)
        with pytest.raises(ec.HarnessError, match=r"(?s)exit codes \[2, 2\].*--n_layer=-1 is invalid"):
            bt.run_peer(cluster, "diloco", [*flags, "--n_layer", "-1"], tmp_path / "bad", timeout_s=120)
    assert _ours(tag) == [], "namespaces left behind"
    rounds = [r for r in records if not r.get("summary")]
    assert [r["step"] for r in rounds] == [0, 2, 4, 6]
    assert [r["tokens"] for r in rounds] == [2 * step * 4 * 32 for step in (0, 2, 4, 6)]  # 2 replicas, 4 × 32 a step
    assert records[-1]["summary"] and records[-1]["replicas"] == 2
    assert "listening on" in (tmp_path / "ok" / "lighthouse.log").read_text()
