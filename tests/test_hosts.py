"""Which host a rank runs on (autotp/runtime/collectives/hosts.py): the launcher's node and the kernel; read once at the front
(fast tier: no process group)."""

from __future__ import annotations

import dataclasses

import pytest

from autotp.runtime.collectives.hosts import Host, launcher_node, local_host, one_host, this_host
from autotp.runtime.execution.options import RuntimeOptions, runtime_host, runtime_options


def test_launcher_node_from_torchrun_variables() -> None:
    """torchrun's GROUP_RANK names the node; without it RANK - LOCAL_RANK (a node's ranks are consecutive);
    without either, no node (the hostname decides)."""
    cases = [({"GROUP_RANK": "1", "RANK": "2", "LOCAL_RANK": "0"}, "1"),
             ({"RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "4"),
             ({"RANK": "3"}, None), ({}, None), ({"GROUP_RANK": ""}, None)]
    for environ, expected in cases:
        assert launcher_node(environ) == expected, f"{environ}: expected node {expected!r}, got {launcher_node(environ)!r}"
    with pytest.raises(ValueError, match="GROUP_RANK='x' is not a whole number"):
        launcher_node({"GROUP_RANK": "x"})


def test_one_host_needs_one_node_and_one_kernel() -> None:
    """Two launcher nodes on one kernel (network namespaces) are two hosts; one node on two kernels too; ranks
    without a launcher on one kernel are one host, as before."""
    here = local_host()
    node0, node1 = dataclasses.replace(here, node="0"), dataclasses.replace(here, node="1")
    elsewhere = dataclasses.replace(node0, boot_id="another boot")
    assert one_host([here, here]) and one_host([node0, node0]), "equal hosts must be one host"
    assert not one_host([node0, node1]), "two launcher nodes on one kernel must be two hosts"
    assert not one_host([node0, elsewhere]), "one launcher node on two kernels must be two hosts"
    assert here.source == "hostname" and node0.source == "launcher", (here.source, node0.source)


def test_runtime_options_read_the_launcher_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime_options (the front door) sets the host from os.environ; a given host is kept; options that skipped
    the front door are refused with what to do."""
    monkeypatch.setenv("GROUP_RANK", "3")
    assert runtime_options(None).host == this_host({"GROUP_RANK": "3"}), runtime_options(None).host
    given = Host("7", "h", "b", "x86_64")
    assert runtime_options(RuntimeOptions(host=given)).host == given
    with pytest.raises(ValueError, match="runtime_options"):
        runtime_host(RuntimeOptions())
    with pytest.raises(TypeError, match="autotp.runtime.collectives.hosts.Host"):
        RuntimeOptions(host="node0")  # type: ignore[arg-type]


def test_launched_reads_the_launchers_group() -> None:
    """2 nodes x 2 ranks as torchrun sets them: rank 3 is local rank 1 of node 1; no variables, no launch; some
    but not all, or a world that is not whole nodes, raise naming what to set."""
    from autotp.runtime.collectives.hosts import Launch, launched

    assert launched({}) is None
    launch = launched({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"})
    assert isinstance(launch, Launch) and (launch.rank, launch.local_rank, launch.nodes) == (3, 1, 2), launch
    assert launch.host.node == "1", f"expected node '1' from GROUP_RANK, got {launch.host.node!r}"
    with pytest.raises(ValueError, match="not LOCAL_RANK, LOCAL_WORLD_SIZE"):
        launched({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="whole number of nodes"):
        launched({"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"})
