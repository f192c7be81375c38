"""A cluster of hosts on one machine, for tests and benchmarks: network namespaces on a bridge, links shaped by tc.

Each host is a network namespace with one veth (``autotp0``, address ``10.77.0.<host + 1>/24``) whose other end
is a port of a bridge in a namespace of its own (the switch). A shaped :class:`Link` puts a token bucket
(``tc qdisc ... tbf``: rate, burst, queue latency) on both ends of every host's veth, so each host has a NIC of
that rate in each direction; ranks of one host talk over its loopback, unshaped. ``netem`` is not in every
kernel (not in this project's), so a link has no added delay.

:meth:`Cluster.run` starts ranks as torchrun does (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``MASTER_ADDR`` = host 0's address,
``MASTER_PORT``), with ``GLOO_SOCKET_IFNAME=autotp0`` so gloo goes over the shaped links, each in its host's
namespace (``ip netns exec``) and process group of its own. :meth:`Cluster.run_function` runs a Python
function on every rank in an initialised gloo group and returns what each rank returned (JSON, one file per
rank). Processes in different namespaces still share ``/dev/shm`` and the hostname: only the launcher's
variables tell the hosts apart (:mod:`autotp.runtime.collectives.hosts`).

With ``cores=True`` each host also gets cores of its own: the machine's cores (this process's CPU affinity) are
split into ``hosts`` contiguous equal sets, and every rank of host h is started bound to set h, so a host's
ranks compete for its cores only, as on separate machines; a machine with fewer cores than hosts refuses. The
ranks of one host then share a CPU set, which is how calibration tells the ranks that share cores
(:func:`autotp.runtime.collectives.hosts.cpu_set`).

Everything is torn down on exit, after a failure or a timeout too: the ranks' process groups are killed and
the namespaces deleted (their veths and the bridge go with them). Names carry this process's id and a random
token, so parallel test workers never collide; namespaces left by a process that was killed outright are
deleted by the next cluster. Needs root (or CAP_NET_ADMIN) and iproute2: :func:`cluster_unavailable` says why
not, for tests to skip with. ``python tests/cluster.py --measure`` prints the link measurement of
docs/hosts.md, ``--measure-groups`` the collectives across hosts of docs/benchmarks/layouts.md and
``--measure-output`` the mesh runtime's output to every rank there, by its parts, and ``--measure-sends`` one-way sends
inside a host and across at several sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["INTERFACE", "MASTER_PORT", "Cluster", "ClusterError", "Link", "cluster_unavailable"]

INTERFACE = "autotp0"
"""The name of every host's veth inside its namespace (what ``GLOO_SOCKET_IFNAME`` names)."""
MASTER_PORT = 29500
"""torchrun's default; each cluster's host 0 is a namespace of its own, so clusters never share a port."""
_PREFIX = "autotp-cluster"
_MIN_BURST_BYTES = 64 * 1024
_SUBNET = "10.77.0"
_TESTS = Path(__file__).resolve().parent


class ClusterError(RuntimeError):
    """The cluster could not be built, or a rank failed or ran past its time (the message holds its output)."""


@dataclasses.dataclass(frozen=True)
class Link:
    """The shape of every host's link to the switch, in each direction (``tc qdisc add ... tbf``).

    Attributes:
        rate_mbit: the token rate in Mbit/s (10**6 bits per second).
        burst_bytes: the bucket: bytes that may leave at once at line rate; None for 2 ms at the rate, at least
            64 KiB (a veth's largest segment). Smaller buckets slow a gigabit link below its rate on a busy machine
            (the bucket refills between timer ticks); larger ones let a short message through faster than the rate.
        latency_ms: how long a packet may wait in the queue before it is dropped (tbf's ``latency``).
    """

    rate_mbit: float
    burst_bytes: int | None = None
    latency_ms: float = 200.0

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {self.rate_mbit!r}; e.g. Link(rate_mbit=100)")
        if self.burst_bytes is not None and self.burst_bytes < _MIN_BURST_BYTES:
            raise ValueError(f"burst_bytes must be at least {_MIN_BURST_BYTES} (a veth's largest segment), got "
                             f"{self.burst_bytes}; or None for 2 ms at the rate")

    @property
    def bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    @property
    def bucket_bytes(self) -> int:
        """The burst tbf is given: ``burst_bytes``, or 2 ms at the rate (at least 64 KiB)."""
        if self.burst_bytes is not None:
            return self.burst_bytes
        return max(_MIN_BURST_BYTES, round(self.bytes_per_s * 2e-3))

    def tbf(self) -> list[str]:
        """The arguments of ``tc qdisc add dev DEV root`` for this link."""
        return ["tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", str(self.bucket_bytes),
                "latency", f"{self.latency_ms:g}ms"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


@functools.lru_cache(maxsize=1)
def cluster_unavailable() -> str | None:
    """Why this machine cannot build a :class:`Cluster` (a sentence for ``pytest.skip``), or None where it can:
    tried once per process by adding and deleting a namespace."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed; install iproute2 to run the cluster tests"
    probe = f"{_PREFIX}-{os.getpid()}-probe"
    try:
        done = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns add` could not run: {exc}"
    if done.returncode:
        return (f"cannot create a network namespace (`ip netns add`: {done.stderr.strip()}); the cluster tests "
                "need root or CAP_NET_ADMIN")
    _ip("netns", "delete", probe, check=False)
    return None


def _delete_stale_namespaces() -> None:
    """Delete the namespaces of clusters whose process is gone (killed before it could tear down)."""
    listed = _ip("netns", "list", check=False).stdout.split()
    for name in listed:
        if not name.startswith(f"{_PREFIX}-"):
            continue
        pid = name[len(_PREFIX) + 1:].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _ip("netns", "delete", name, check=False)


class Cluster:
    """``hosts`` hosts as network namespaces on one bridge, their links shaped as ``link`` (None: unshaped).

    A context manager: built on enter, torn down on exit (module docstring)::

        with Cluster(2, Link(rate_mbit=100)) as cluster:
            results = cluster.run_function("my_module:fn", ranks_per_host=2, kwargs={"size": 8})
    """

    def __init__(self, hosts: int, link: Link | None = None, *, cores: bool = False) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be between 1 and 200, got {hosts}")
        self.hosts, self.link = hosts, link
        self.host_cores = _split_cores(hosts) if cores else None
        self.name = f"{_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.name}-sw"
        self.namespaces = [f"{self.name}-h{host}" for host in range(hosts)]
        self._processes: list[subprocess.Popen[bytes]] = []
        self._made: list[str] = []

    def address(self, host: int) -> str:
        """Host ``host``'s address on the bridge."""
        return f"{_SUBNET}.{host + 1}"

    def __enter__(self) -> Cluster:
        reason = cluster_unavailable()
        if reason is not None:
            raise ClusterError(reason)
        _delete_stale_namespaces()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "bridge0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "bridge0", "up")
        for host, namespace in enumerate(self.namespaces):
            _ip("netns", "add", namespace)
            self._made.append(namespace)
            port = f"port{host}"
            _ip("link", "add", INTERFACE, "netns", namespace, "type", "veth", "peer", "name", port,
                "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "bridge0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", INTERFACE)
            _ip("-n", namespace, "link", "set", INTERFACE, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            if self.link is not None:  # each direction: the host's uplink and the switch port toward it
                for where, device in ((namespace, INTERFACE), (self.switch, port)):
                    done = subprocess.run(["tc", "-n", where, "qdisc", "add", "dev", device, "root", *self.link.tbf()],
                                          capture_output=True, text=True, timeout=30)
                    if done.returncode:
                        raise ClusterError(f"`tc qdisc add dev {device} root {' '.join(self.link.tbf())}` failed in "
                                           f"{where}: {done.stderr.strip()} (the kernel needs the tbf qdisc)")

    def close(self) -> None:
        """Kill every rank this cluster started (its whole process group) and delete the namespaces."""
        _kill(self._processes)
        self._processes.clear()
        for namespace in reversed(self._made):
            _ip("netns", "delete", namespace, check=False)
        self._made.clear()

    def rank_environment(self, host: int, local_rank: int, ranks_per_host: int) -> dict[str, str]:
        """The variables torchrun sets for local rank ``local_rank`` of host ``host`` (hosts of equal size)."""
        world_size = self.hosts * ranks_per_host
        rank = host * ranks_per_host + local_rank
        return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(ranks_per_host), "GROUP_RANK": str(host),
                "GROUP_WORLD_SIZE": str(self.hosts), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size),
                "ROLE_NAME": "default", "MASTER_ADDR": self.address(0), "MASTER_PORT": str(MASTER_PORT),
                "TORCHELASTIC_RUN_ID": self.name, "GLOO_SOCKET_IFNAME": INTERFACE}

    def run(self, argv: Sequence[str], *, ranks_per_host: int = 1, timeout_s: float = 120.0,
            env: Mapping[str, str] | None = None) -> list[str]:
        """Run ``argv`` as every rank (``ranks_per_host`` on each host, torchrun's variables set, ``env`` added)
        and return each rank's output (stdout and stderr), by rank; ClusterError naming the ranks that failed,
        with their output, or those still running after ``timeout_s`` (then every rank is killed)."""
        if ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1, got {ranks_per_host}")
        logs = Path(tempfile.mkdtemp(prefix=f"{self.name}-logs-"))
        try:
            started = []
            for host, namespace in enumerate(self.namespaces):
                for local_rank in range(ranks_per_host):
                    variables = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
                                 **self.rank_environment(host, local_rank, ranks_per_host)}
                    log = logs / f"rank{len(started)}.log"
                    bind = None
                    if self.host_cores is not None:
                        bind = functools.partial(os.sched_setaffinity, 0, self.host_cores[host])
                    with open(log, "wb") as out:
                        process = subprocess.Popen(["ip", "netns", "exec", namespace, *argv], env=variables,
                                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                                   preexec_fn=bind)
                    self._processes.append(process)
                    started.append((process, log))
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                codes = [p.poll() for p, _ in started]
                if None not in codes or any(codes):  # all ended, or one failed: the others would wait for it
                    break
                time.sleep(0.05)
            late = [rank for rank, (p, _) in enumerate(started) if p.poll() is None]
            failed = [rank for rank, (p, _) in enumerate(started) if p.returncode]
            _kill([p for p, _ in started])  # the ranks still running, and whatever they started
            self._processes = [p for p in self._processes if p.poll() is None]
            outputs = [log.read_text(errors="replace") for _, log in started]
            if failed:
                raise ClusterError(f"rank(s) {failed} failed" + (f"; rank(s) {late} killed" if late else "")
                                   + f"; output of rank {failed[0]}:\n{outputs[failed[0]][-4000:]}")
            if late:
                raise ClusterError(f"rank(s) {late} still running after {timeout_s:g} s, killed; output of rank "
                                   f"{late[0]}:\n{outputs[late[0]][-4000:]}")
            return outputs
        finally:
            shutil.rmtree(logs, ignore_errors=True)

    def run_function(self, target: str, *, ranks_per_host: int = 1, kwargs: Mapping[str, Any] | None = None,
                     timeout_s: float = 120.0) -> list[Any]:
        """``module:function`` called as ``function(rank, world_size, **kwargs)`` on every rank, in a gloo group
        initialised from torchrun's variables (``env://``); what each returned (JSON), by rank. ``module`` is
        imported with ``tests/`` first on the path."""
        results = Path(tempfile.mkdtemp(prefix=f"{self.name}-results-"))
        try:
            argv = [sys.executable, str(Path(__file__).resolve()), target, str(results), json.dumps(dict(kwargs or {}))]
            path = os.pathsep.join(p for p in (str(_TESTS), os.environ.get("PYTHONPATH", "")) if p)
            self.run(argv, ranks_per_host=ranks_per_host, timeout_s=timeout_s, env={"PYTHONPATH": path})
            world_size = self.hosts * ranks_per_host
            return [json.loads((results / f"rank{rank}.json").read_text()) for rank in range(world_size)]
        finally:
            shutil.rmtree(results, ignore_errors=True)


def _split_cores(hosts: int) -> list[set[int]]:
    """This process's cores in ``hosts`` contiguous equal sets (module docstring); ClusterError if too few."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < hosts:
        raise ClusterError(f"cores=True gives each host cores of its own, but this process may run on {len(cores)} "
                           f"core(s) for {hosts} hosts; use fewer hosts or cores=False (hosts then share cores)")
    each = len(cores) // hosts
    return [set(cores[host * each:(host + 1) * each]) for host in range(hosts)]


def _kill(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGKILL the process group of each of ``processes`` (a rank and whatever it started) and reap them."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # its group, even where the rank itself has ended
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)


def _rank_main(target: str, results: str, kwargs: str) -> None:
    """One rank of :meth:`Cluster.run_function`: join the gloo group, call the function, write its result."""
    import torch.distributed as dist

    module_name, _, function_name = target.partition(":")
    function: Callable[..., Any] = getattr(importlib.import_module(module_name), function_name)
    dist.init_process_group("gloo", init_method="env://")
    try:
        result = function(dist.get_rank(), dist.get_world_size(), **json.loads(kwargs))
        Path(results, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_link(rank: int, world_size: int, nbytes: int, repeats: int) -> dict[str, float]:
    """Rank 0 sends ``nbytes`` to the last rank, and every rank all-reduces ``nbytes``: the fastest of
    ``repeats`` of each, in seconds (2 ranks: gloo's ring all-reduce sends ``nbytes`` each way)."""
    import torch
    import torch.distributed as dist

    tensor = torch.ones(nbytes // 4)
    send, reduce = [], []
    dist.all_reduce(torch.ones(1))  # connections made
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, world_size - 1)
        elif rank == world_size - 1:
            dist.recv(tensor, 0)
            dist.send(torch.ones(1), 0)  # the receiver says it has all
        if rank == 0:
            dist.recv(torch.ones(1), world_size - 1)
        send.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        reduce.append(time.perf_counter() - start)
    return {"send_s": min(send), "all_reduce_s": min(reduce)}


def measure_groups(rank: int, world_size: int, nbytes: int, repeats: int) -> dict[str, float]:
    """On 2 hosts x 2 ranks: the collectives whose shape on the network a planner must price, each the median of
    ``repeats`` in seconds (the slowest rank's): an all-reduce over the 4 ranks (gloo's ring crosses the link),
    a broadcast from rank 3 over the 4 (gloo's binomial tree: two of the root's sends cross at once), one over
    ranks 0 and 2 alone (one crossing send), an all-gather in the pair {0, 2} alone (a send each way) and in both
    pairs {0, 2}, {1, 3} at once (two ranks of a host send across together)."""
    import torch
    import torch.distributed as dist

    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = pairs[rank % 2]
    tensor = torch.ones(nbytes // 4)
    gathered = [torch.empty_like(tensor) for _ in range(2)]
    probes = {"all_reduce_4_ranks": lambda: dist.all_reduce(tensor),
              "broadcast_4_ranks_from_3": lambda: dist.broadcast(tensor, src=3),
              "broadcast_pair_0_2": lambda: dist.broadcast(tensor, src=2, group=pairs[0]) if rank in (0, 2) else None,
              "all_gather_pair_0_2": lambda: dist.all_gather(gathered, tensor, group=mine) if rank in (0, 2) else None,
              "all_gather_both_pairs": lambda: dist.all_gather(gathered, tensor, group=mine)}
    dist.all_reduce(torch.ones(1))  # connections made
    return _slowest_medians(probes, repeats)


def measure_output_gather(rank: int, world_size: int, repeats: int) -> dict[str, float]:
    """On 2 hosts x 2 ranks: the mesh runtime's output to every rank for a 2 x 2 x 1 mesh (replica 0 on host 0,
    stage 1 on ranks 1 and 3) of one request's logits each (32 x 4096 float32, 512 KiB), each part the median of
    ``repeats`` in seconds (the slowest rank's, the ranks in step after a barrier): the sources' gather
    (``autotp.runtime.mesh.mesh_module.gather_batch`` over the pair {1, 3}: an all-gather of the shapes, then of the
    logits), its logits all-gather alone, the hand-out of the batch inside each host (``hand_out``: 1 -> 0, 3 -> 2),
    and for comparison the gather in both pairs {0, 2} and {1, 3} at once (what every rank did before)."""
    import torch
    import torch.distributed as dist
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from autotp.runtime.mesh.mesh_module import gather_batch, hand_out

    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = pairs[rank % 2]
    output = CausalLMOutputWithPast(logits=torch.randn(1, 32, 4096))
    batch = [torch.randn(2, 32, 4096)]
    parts = [torch.empty_like(output.logits) for _ in range(2)]
    source = 1 if rank < 2 else 3
    probes = {"gather_batch, sources {1, 3}": lambda: gather_batch(output, [1, 1], mine) if rank % 2 else None,
              "its logits all-gather": lambda: dist.all_gather(parts, output.logits, group=mine) if rank % 2 else None,
              "hand-out inside each host": lambda: hand_out(batch if rank == source else None, source,
                                                            {source: [source - 1], source - 1: []}, torch.device("cpu")),
              "gather_batch, both pairs at once": lambda: gather_batch(output, [1, 1], mine)}
    for probe in probes.values():
        probe()  # connections made
    return _slowest_medians(probes, repeats)


SEND_PROBE_BYTES = (4 * 2**10, 64 * 2**10, 256 * 2**10, 2**20, 4 * 2**20)
"""The sizes :func:`measure_sends` times: a small message, a stage boundary of docs/benchmarks/layouts.md at batch 1
(64 KiB), and on to the sizes where a shaped link's rate sets the time."""
SEND_PROBE_PAIRS = {"inside a host": (0, 1), "across": (1, 2)}
"""Where :func:`measure_sends` sends: (sender, receiver) of 2 hosts x 2 ranks."""


def _send_name(where: str, nbytes: int) -> str:
    return f"{where}, {nbytes / 2**10:g} KiB"


def measure_sends(rank: int, world_size: int, repeats: int) -> dict[str, float]:
    """On 2 hosts x 2 ranks: one message at a time from one rank to another, the other ranks waiting (a pipeline's
    stage send at batch 1), inside host 0 (rank 0 to rank 1, one core) and across (rank 1 to rank 2), at each of
    :data:`SEND_PROBE_BYTES`, as ``autotp calibrate`` times the sends between hosts
    (:func:`autotp.calibration.calibrate.measure_sends`: the median of ``repeats``, each after a barrier and the
    link's idle, of the receiver's time), in seconds."""
    import torch.distributed as dist

    from autotp.calibration.calibrate import CalibrationConfig
    from autotp.calibration.calibrate import measure_sends as calibration_sends

    config = CalibrationConfig(repeats=repeats)
    groups = {where: dist.new_group(list(pair)) for where, pair in SEND_PROBE_PAIRS.items()}  # every rank, in order
    medians = {}
    for where, pair in SEND_PROBE_PAIRS.items():
        if rank in pair:
            for sample in calibration_sends(pair.index(rank), config, group=groups[where], sizes=SEND_PROBE_BYTES):
                medians[_send_name(where, sample.nbytes)] = sample.seconds
        dist.barrier()
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, medians)
    return {name: seconds for measured in everyone for name, seconds in measured.items()}


def _slowest_medians(probes: Mapping[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Each probe's median over ``repeats`` of the slowest rank's seconds, every call after a barrier."""
    import torch
    import torch.distributed as dist

    medians = {}
    for name, probe in probes.items():
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            probe()
            slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times.append(float(slowest))
        medians[name] = sorted(times)[len(times) // 2]
    return medians


def _measure(rates_mbit: Sequence[float | None], nbytes: int, repeats: int) -> None:
    """Print, per link rate, the time of a send and an all-reduce of ``nbytes`` between 2 hosts against
    ``nbytes / rate``."""
    print(f"2 hosts x 1 rank, {nbytes / 2**20:g} MiB, fastest of {repeats}")
    print(f"{'link':>12} {'bytes/rate ms':>14} {'send ms':>9} {'all_reduce ms':>14} {'send Mbit/s':>12}")
    for rate in rates_mbit:
        link = None if rate is None else Link(rate_mbit=rate)
        with Cluster(2, link) as cluster:
            measured = cluster.run_function("cluster:measure_link", kwargs={"nbytes": nbytes, "repeats": repeats})[0]
        ideal = "-" if link is None else f"{nbytes / link.bytes_per_s * 1e3:.1f}"
        print(f"{'unshaped' if rate is None else f'{rate:g} Mbit/s':>12} {ideal:>14} {measured['send_s'] * 1e3:>9.1f} "
              f"{measured['all_reduce_s'] * 1e3:>14.1f} {nbytes * 8 / measured['send_s'] / 1e6:>12.1f}")


def _measure_groups(rate_mbit: float, nbytes: int, repeats: int) -> None:
    """Print :func:`measure_groups` on 2 hosts x 2 ranks (a core per host) at ``rate_mbit``, beside ``nbytes / rate``."""
    link = Link(rate_mbit=rate_mbit)
    with Cluster(2, link, cores=True) as cluster:
        measured = cluster.run_function("cluster:measure_groups", ranks_per_host=2,
                                        kwargs={"nbytes": nbytes, "repeats": repeats}, timeout_s=600.0)[0]
    print(f"2 hosts x 2 ranks at {rate_mbit:g} Mbit/s, {nbytes / 2**20:g} MiB (bytes / rate: "
          f"{nbytes / link.bytes_per_s * 1e3:.1f} ms), median of {repeats}")
    for name, seconds in measured.items():
        print(f"  {name:<26} {seconds * 1e3:9.1f} ms")


def _measure_sends(rates_mbit: Sequence[float | None], repeats: int) -> None:
    """Print :func:`measure_sends` on 2 hosts x 2 ranks (a core per host) at each link rate."""
    for rate in rates_mbit:
        link = None if rate is None else Link(rate_mbit=rate)
        with Cluster(2, link, cores=True) as cluster:
            measured = cluster.run_function("cluster:measure_sends", ranks_per_host=2,
                                            kwargs={"repeats": repeats}, timeout_s=600.0)[0]
        print(f"2 hosts x 2 ranks, {'unshaped' if rate is None else f'{rate:g} Mbit/s'}, one send at a time, "
              f"median of {repeats}")
        for where in SEND_PROBE_PAIRS:
            for nbytes in SEND_PROBE_BYTES:
                name = _send_name(where, nbytes)
                rate_note = "" if link is None or where != "across" else \
                    f" (bytes / rate {nbytes / link.bytes_per_s * 1e3:.2f} ms)"
                print(f"  {name:<26} {measured[name] * 1e3:9.2f} ms{rate_note}")


def _measure_output_gather(rates_mbit: Sequence[float | None], repeats: int) -> None:
    """Print :func:`measure_output_gather` on 2 hosts x 2 ranks (a core per host) at each link rate."""
    for rate in rates_mbit:
        with Cluster(2, None if rate is None else Link(rate_mbit=rate), cores=True) as cluster:
            measured = cluster.run_function("cluster:measure_output_gather", ranks_per_host=2,
                                            kwargs={"repeats": repeats}, timeout_s=600.0)[0]
        print(f"2 hosts x 2 ranks, {'unshaped' if rate is None else f'{rate:g} Mbit/s'}, median of {repeats}")
        for name, seconds in measured.items():
            print(f"  {name:<38} {seconds * 1e3:9.1f} ms")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--measure"]:
        _measure([None, 1000, 200, 50], nbytes=4 * 2**20, repeats=3)
    elif sys.argv[1:2] == ["--measure-output"]:
        _measure_output_gather([None, 200], repeats=9)
    elif sys.argv[1:2] == ["--measure-sends"]:
        _measure_sends([None, 200], repeats=9)
    elif sys.argv[1:2] == ["--measure-groups"]:
        _measure_groups(200, nbytes=4 * 2**20, repeats=5)
        _measure_groups(200, nbytes=2**19, repeats=7)
    else:
        try:
            _rank_main(*sys.argv[1:4])
        except BaseException:
            traceback.print_exc()
            raise
