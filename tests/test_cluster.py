"""Hosts on one machine (tests/cluster.py): network namespaces on a bridge, links shaped by tc, gloo ranks started
as torchrun starts them. The ``cluster`` tier: ``python -m pytest -m cluster -q`` (needs root and iproute2; each
test skips naming why where the machine cannot make namespaces)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import pytest
from cluster import Cluster, Link, cluster_unavailable

pytestmark = [pytest.mark.distributed, pytest.mark.cluster]


@pytest.fixture(autouse=True)
def _namespaces_possible() -> None:
    reason = cluster_unavailable()
    if reason is not None:
        pytest.skip(reason)


def test_cluster_is_torn_down_after_a_failure_and_a_timeout() -> None:
    """2 hosts x 2 ranks of a shell, no torch: every rank sees torchrun's variables in its host's namespace; a
    rank that fails and ranks that outlive their time raise ClusterError naming them, and on exit no rank and
    no namespace of the cluster is left."""
    import subprocess

    from cluster import ClusterError

    show = ["sh", "-c", "echo $RANK $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR; ip -o -4 addr show autotp0"]
    with Cluster(2) as cluster:
        outputs = cluster.run(show, ranks_per_host=2, timeout_s=30.0)
        for rank, output in enumerate(outputs):
            host = rank // 2
            expected = f"{rank} {rank % 2} 2 {host} 10.77.0.1"
            assert output.startswith(expected) and f"10.77.0.{host + 1}/24" in output, (
                f"rank {rank}: expected {expected!r} and address 10.77.0.{host + 1}, got {output!r}")
        with pytest.raises(ClusterError, match=r"rank\(s\) \[3\] failed"):
            cluster.run(["sh", "-c", 'if [ "$RANK" = 3 ]; then exit 3; fi; sleep 30'], ranks_per_host=2)
        with pytest.raises(ClusterError, match="still running after 0.5 s"):
            cluster.run(["sleep", "30"], ranks_per_host=2, timeout_s=0.5)
        started = list(cluster.namespaces)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [name for name in started if name in listed], f"namespaces left after exit: {listed}"
    ours = []
    for pid in subprocess.run(["pgrep", "-f", "sleep 30"], capture_output=True, text=True).stdout.split():
        try:
            with open(f"/proc/{pid}/environ", errors="replace") as environ:
                if cluster.name in environ.read():  # TORCHELASTIC_RUN_ID: a rank of this cluster
                    ours.append(pid)
        except OSError:
            pass  # ended meanwhile
    assert not ours, f"ranks left running after exit: {ours}"


def test_hosts_get_cores_of_their_own() -> None:
    """``cores=True``: the ranks of one host run on one set of cores, the hosts' sets are disjoint and cover the
    machine's cores, and calibration's :func:`cpu_set` reads the set a rank was given (so the ranks sharing cores
    are measured as one machine)."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"one core here ({cores}): 2 hosts cannot get cores of their own")
    with Cluster(2, cores=True) as cluster:
        outputs = cluster.run([sys.executable, "-c", "from autotp.runtime.collectives.hosts import cpu_set; "
                               "print(','.join(map(str, cpu_set())))"], ranks_per_host=2, timeout_s=60.0)
    sets = [tuple(int(c) for c in output.strip().splitlines()[-1].split(",")) for output in outputs]
    assert sets[0] == sets[1] and sets[2] == sets[3], f"a host's ranks run on different cores: {sets}"
    assert not set(sets[0]) & set(sets[2]), f"the two hosts share cores: {sets}"
    assert sorted(sets[0] + sets[2]) == cores[:len(sets[0]) + len(sets[2])], f"cores left out: {sets} of {cores}"


def test_shaped_link_takes_bytes_over_rate() -> None:
    """2 hosts x 1 rank, links shaped to 50 Mbit/s: a 2 MiB send and a 2 MiB all-reduce (gloo's ring at 2 ranks
    sends the whole tensor each way) take about bytes / rate; an unshaped veth moves it in a few ms, so the
    bounds tell a shaped link from an unshaped one."""
    link, nbytes = Link(rate_mbit=50), 2 * 2**20
    with Cluster(2, link) as cluster:
        measured = cluster.run_function("cluster:measure_link", kwargs={"nbytes": nbytes, "repeats": 2})
    ideal_s = nbytes / link.bytes_per_s  # 0.336 s
    for what in ("send_s", "all_reduce_s"):
        seconds = measured[0][what]
        assert 0.8 * ideal_s <= seconds <= 1.5 * ideal_s, (
            f"{what}: expected about {ideal_s * 1e3:.0f} ms (2 MiB at 50 Mbit/s), measured {seconds * 1e3:.0f} ms")


def _forms_across_and_within_hosts(rank: int, world_size: int) -> dict[str, Any]:
    """tp=4 over the world (2 hosts), tp=2 over this host's ranks, and tp=4 with the host told by hostname only:
    the collective forms each rank-local graph took, and its largest difference from the single-process model."""
    import os

    import torch
    import torch.distributed as dist
    from models import tiny_mlp

    import autotp
    from autotp.cost_model import get_hardware
    from autotp.runtime.collectives.hosts import local_host, this_host
    from autotp.runtime.collectives.inference_collectives import collective_forms

    torch.set_num_threads(1)
    model, (x,), _ = tiny_mlp(hidden=32, intermediate=64, batch=2, seq_len=3)
    expected = model(x)
    # compute slow enough that splitting pays: the plan puts a sum all-reduce in every graph
    slow = dataclasses.replace(get_hardware("cpu-gloo"), peak_tflops={"float32": 1e-5}, memory_bandwidth_gbps=0.01)
    within_host, _ = dist.new_subgroups(group_size=int(os.environ["LOCAL_WORLD_SIZE"]))
    out: dict[str, Any] = {"host": dataclasses.asdict(this_host(os.environ))}
    for name, group, host in (("across hosts", None, None), ("within a host", within_host, None),
                              ("across hosts, hostname only", None, local_host())):
        tp = autotp.compile(model, example_inputs=(x,), group=group, options=autotp.PlanOptions(hardware=slow),
                            runtime=autotp.RuntimeOptions(host=host))
        out[name] = {"forms": sorted(collective_forms(tp.graph_module)),
                     "max_error": float((tp(x) - expected).abs().max())}
    return out


def test_hosts_come_from_the_launcher() -> None:
    """2 hosts x 2 ranks (namespaces: one /dev/shm, one hostname), tiny MLP: tp=4 over both hosts takes no
    shared memory, tp=2 inside each host does, and the same tp=4 told the host by hostname alone (as before the
    launcher was read) would, so the case tells the two apart; every output equals the single-process model."""
    with Cluster(2) as cluster:
        results = cluster.run_function("test_cluster:_forms_across_and_within_hosts", ranks_per_host=2,
                                       timeout_s=240.0)
    for rank, result in enumerate(results):
        assert result["host"]["node"] == str(rank // 2), f"rank {rank}: expected node {rank // 2}, got {result['host']}"
        assert "shared_memory" in result["across hosts, hostname only"]["forms"], (
            f"rank {rank}: the hostname alone puts all 4 ranks on one host (shared memory expected), got "
            f"{result['across hosts, hostname only']['forms']}: the case would not tell launcher from hostname")
        across = result["across hosts"]["forms"]
        assert across and "shared_memory" not in across, (
            f"rank {rank}: tp=4 over 2 hosts must use the backend's collectives, got {across}")
        assert result["within a host"]["forms"] == ["shared_memory"], (
            f"rank {rank}: tp=2 inside host {rank // 2} should take shared memory, got {result['within a host']['forms']}")
        for name in ("across hosts", "within a host", "across hosts, hostname only"):
            assert result[name]["max_error"] < 1e-5, (
                f"rank {rank}, {name}: max |tp - single process| = {result[name]['max_error']:.3g}, expected < 1e-5")


def _plans_for_both_links(rank: int, world_size: int, rate_mbit: float) -> dict[str, Any]:
    """tp=2 over 2 hosts: the link measured (1 MiB sent), then the model planned and compiled for a profile whose
    inter-node link has the measured bandwidth and for one with cpu-gloo's 10 Gbit/s; for each, whether the plan
    splits a weight, its largest difference from one process, and its forward's median time on this link."""
    import statistics
    import time

    import torch
    from cluster import measure_link
    from models import tiny_mlp

    import autotp
    from autotp.cost_model import get_hardware

    torch.set_num_threads(1)
    nbytes = 2**20
    measured = torch.tensor([measure_link(rank, world_size, nbytes, repeats=1)["send_s"]], dtype=torch.float64)
    torch.distributed.broadcast(measured, 0)  # rank 0's figure: every rank plans with the same profile
    bandwidth_gbps = nbytes / float(measured) / 1e9
    model, (x,), _ = tiny_mlp(hidden=512, intermediate=2048, batch=4, seq_len=64)
    expected = model(x)
    base = get_hardware("cpu-gloo")  # one rank per node: the tp group spans the link between the hosts
    out: dict[str, Any] = {"measured_gbps": bandwidth_gbps}
    for name, gbps in (("measured link", bandwidth_gbps), ("unshaped link", base.inter_node.bandwidth_gbps)):
        profile = dataclasses.replace(base, devices_per_node=1,
                                      inter_node=dataclasses.replace(base.inter_node, bandwidth_gbps=gbps))
        tp = autotp.compile(model, example_inputs=(x,),
                            options=autotp.PlanOptions(memory_budget=None, hardware=profile))
        got = tp(x)
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            tp(x)
            seconds.append(time.perf_counter() - start)
        out[name] = {"splits": sorted(p for p, placement in tp.plan.parameters.items() if str(placement) != "R"),
                     "max_error": float((got - expected).abs().max()), "forward_s": statistics.median(seconds)}
    return out


def test_plan_keeps_a_slow_link_out_of_the_split() -> None:
    """2 hosts x 1 rank, links shaped to 20 Mbit/s, an MLP (512 -> 2048 -> 512, 256 tokens): planned with the
    measured link, tp=2 keeps every weight whole (the split's all-reduce of 512 KiB would take ~0.2 s on the
    link); planned for cpu-gloo's 10 Gbit/s it splits (so the case tells the links apart); on the shaped link the
    whole model's forward is the faster of the two, as planned; both equal one process's outputs."""
    rate_mbit = 20.0
    with Cluster(2, Link(rate_mbit=rate_mbit)) as cluster:
        results = cluster.run_function("test_cluster:_plans_for_both_links", kwargs={"rate_mbit": rate_mbit},
                                       timeout_s=240.0)
    result = results[0]
    shaped_gbps = rate_mbit * 1e6 / 8 / 1e9
    assert 0.7 * shaped_gbps <= result["measured_gbps"] <= 1.3 * shaped_gbps, (
        f"expected the link measured at about {shaped_gbps:.4f} GB/s, got {result['measured_gbps']:.4f}")
    slow, fast = result["measured link"], result["unshaped link"]
    assert fast["splits"], f"planned for a 10 Gbit/s link, tp=2 should split the MLP, got no split: {fast}"
    assert not slow["splits"], f"planned for the measured {rate_mbit:g} Mbit/s link, tp=2 split {slow['splits']}"
    assert slow["forward_s"] < fast["forward_s"], (
        f"on the shaped link the unsplit forward ({slow['forward_s'] * 1e3:.1f} ms) should beat the split one "
        f"({fast['forward_s'] * 1e3:.1f} ms)")
    for rank, ranked in enumerate(results):
        for name in ("measured link", "unshaped link"):
            assert ranked[name]["max_error"] < 1e-4, (
                f"rank {rank}, {name}: max |tp - single process| = {ranked[name]['max_error']:.3g}, expected < 1e-4")


def test_calibrate_measures_both_links(tmp_path: Any) -> None:
    """2 hosts x 2 ranks, links shaped to 200 Mbit/s, `autotp calibrate` started on every rank as torchrun starts
    it (compute kept from cpu-gloo, links measured): the profile's inter-node bandwidth is the shaped rate
    (within 20% under it, at most 5% over: the rate a large transfer pays, not the token bucket's burst, which lifted
    a fit on relative error alone to 8-13% over), one-way sends at that rate after a burst about tbf's bucket, its
    intra-node link (loopback inside a namespace) many times faster, and devices_per_node is the launcher's 2. The
    rate is far below loopback's, so the check tells a measured network from a copied link."""
    import sys

    from autotp.cost_model.hardware import load_hardware_json

    link = Link(rate_mbit=200)
    output = tmp_path / "two-hosts.json"
    with Cluster(2, link) as cluster:
        cluster.run([sys.executable, "-m", "autotp.cli.main", "calibrate", "--quick", "--threads", "1",
                     "--links-only", "cpu-gloo", "-o", str(output)], ranks_per_host=2, timeout_s=120.0)
    profile = load_hardware_json(output)
    network_bytes_per_s = profile.inter_node.bandwidth_gbps * 1e9
    intra_bytes_per_s = profile.intra_node.bandwidth_gbps * 1e9
    assert 0.80 <= network_bytes_per_s / link.bytes_per_s <= 1.05, (
        f"expected the inter-node bandwidth within -20%/+5% of the shaped {link.bytes_per_s / 1e6:.1f} MB/s, got "
        f"{network_bytes_per_s / 1e6:.1f} MB/s ({profile.inter_node})")
    send = profile.inter_node_send
    assert send is not None and 0.80 <= send.bandwidth_gbps * 1e9 / link.bytes_per_s <= 1.05, (
        f"expected one-way sends between hosts measured near the shaped {link.bytes_per_s / 1e6:.1f} MB/s, got {send}")
    assert 0.25 * link.bucket_bytes <= send.burst_bytes <= 1.5 * link.bucket_bytes, (
        f"expected the sends' burst near tbf's bucket of {link.bucket_bytes} bytes, got {send}")
    assert intra_bytes_per_s > 4 * network_bytes_per_s, (
        f"expected the intra-host link far faster than the shaped network, got {intra_bytes_per_s / 1e6:.1f} MB/s "
        f"inside vs {network_bytes_per_s / 1e6:.1f} MB/s between hosts")
    assert profile.devices_per_node == 2, f"expected 2 devices per node (the launcher's), got {profile.devices_per_node}"
    assert profile.inter_node.name == "gloo-network-2hosts" and "measured across 2 hosts" in profile.source, (
        f"expected a measured network named in the profile, got {profile.inter_node.name!r}: {profile.source}")
