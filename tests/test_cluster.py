"""Hosts on one machine (tests/cluster.py): network namespaces on a bridge, links shaped by tc, gloo ranks started
as torchrun starts them. The ``cluster`` tier: ``python -m pytest -m cluster -q`` (needs root and iproute2; each
test skips naming why where the machine cannot make namespaces)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from cluster import Cluster, Link, cluster_unavailable

pytestmark = [pytest.mark.distributed, pytest.mark.cluster]


@pytest.fixture(autouse=True)
def _namespaces_possible() -> None:
    reason = cluster_unavailable()
    if reason is not None:
        pytest.skip(reason)


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
    from autotp.runtime.hosts import local_host, this_host
    from autotp.runtime.inference_collectives import collective_forms

    torch.set_num_threads(1)
    model, (x,), _ = tiny_mlp(hidden=32, intermediate=64, batch=2, seq_len=3)
    expected = model(x)
    # compute slow enough that splitting pays: the plan puts a sum all-reduce in every graph
    slow = dataclasses.replace(get_hardware("cpu-gloo"), peak_tflops={"float32": 1e-5}, memory_bandwidth_gbps=0.01)
    within_host, _ = dist.new_subgroups(group_size=int(os.environ["LOCAL_WORLD_SIZE"]))
    out: dict[str, Any] = {"host": dataclasses.asdict(this_host(os.environ))}
    for name, group, host in (("across hosts", None, None), ("within a host", within_host, None),
                              ("across hosts, hostname only", None, local_host())):
        tp = autotp.compile(model, example_inputs=(x,), group=group, hardware=slow,
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
