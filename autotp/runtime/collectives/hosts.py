"""Which host a rank runs on: the launcher's word where it gives one, else the machine's.

The shared-memory and symmetric-memory collectives (:mod:`autotp.runtime.collectives.shared_memory`,
:mod:`autotp.runtime.collectives.symmetric_memory`) run only where every rank of a group is on one host, and the cost
model prices a group by the links it spans. Which ranks share a host is the launcher's to say: processes
in different network namespaces (or containers that share ``/dev/shm``) can map one segment, yet the
network between them is a real link, so neither the hostname nor shared memory decides.

:func:`this_host` reads the launcher's variables, once, at the front of the runtime
(:func:`autotp.runtime.execution.options.runtime_options`); the :class:`Host` it returns travels down as a value to
the host checks, where every rank of a group exchanges its own through the group's store
(:func:`autotp.runtime.agreement.exchanges.exchange`) and :func:`one_host` compares them:

* torchrun (and launchers that set the same variables) numbers its nodes: ``GROUP_RANK`` is this rank's
  node; without it, ``RANK - LOCAL_RANK`` (the first global rank on this node: torchrun gives a node's
  ranks consecutive numbers);
* without launcher variables, the node is unknown and the kernel alone decides (hostname and boot id),
  as before launchers were read.

Ranks share a host when their nodes are equal *and* they run under one kernel: a launcher that splits
one machine into several nodes (the test cluster of network namespaces, ``tests/cluster.py``) gets its
split, and no launcher variable can merge two machines into one host.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import socket
from collections.abc import Mapping, Sequence

__all__ = ["Host", "Launch", "cpu_set", "host_identity", "launched", "launcher_node", "local_host", "one_host", "this_host"]


def host_identity() -> tuple[str, str, str]:
    """(hostname, boot id, machine) of this process: processes with equal identities run under one kernel,
    so they share ``/dev/shm`` and one clock (the boot id tells apart two containers that reuse a hostname on
    different machines)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return socket.gethostname(), boot_id, platform.machine()


def cpu_set() -> tuple[int, ...]:
    """The cores this process may run on (its CPU affinity; every core where the OS cannot say). Ranks under one
    kernel with equal sets share cores; ranks bound to disjoint sets (``taskset``, ``numactl``, a cluster of
    namespaces that gives each host its own cores) do not, so calibration measures each set as a machine."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


@dataclasses.dataclass(frozen=True)
class Host:
    """Where one rank runs, as the ranks of a group compare it (module docstring).

    Attributes:
        node: the launcher's node of this rank (``"0"``, ``"1"``, ...), or None without a launcher.
        hostname, boot_id: the kernel this process runs under (:func:`host_identity`).
        machine: the CPU architecture (``platform.machine()``), which the shared-memory collective checks.
    """

    node: str | None
    hostname: str
    boot_id: str
    machine: str

    @property
    def key(self) -> tuple[str | None, str, str]:
        """What ranks on one host have in common: the launcher's node and the kernel."""
        return self.node, self.hostname, self.boot_id

    @property
    def source(self) -> str:
        """``"launcher"`` where the launcher named the node, else ``"hostname"``."""
        return "hostname" if self.node is None else "launcher"


def launcher_node(environ: Mapping[str, str]) -> str | None:
    """This rank's node as the launcher's variables in ``environ`` give it (module docstring), or None where
    they give none; ValueError naming the variable when one is not a whole number."""

    def number(name: str) -> int | None:
        value = environ.get(name)
        if value is None or value == "":
            return None
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"the launcher variable {name}={value!r} is not a whole number; set it as torchrun "
                             f"does (e.g. {name}=0) or unset it, and autotp decides hosts by hostname") from None

    group_rank = number("GROUP_RANK")
    if group_rank is not None:
        return str(group_rank)
    rank, local_rank = number("RANK"), number("LOCAL_RANK")
    if rank is not None and local_rank is not None:
        return str(rank - local_rank)
    return None


def this_host(environ: Mapping[str, str]) -> Host:
    """This process's :class:`Host`: its node from the launcher's variables in ``environ`` (``os.environ`` at
    the front of the runtime), its kernel from :func:`host_identity`."""
    hostname, boot_id, machine = host_identity()
    return Host(launcher_node(environ), hostname, boot_id, machine)


def local_host() -> Host:
    """This process's :class:`Host` with no launcher's word: for ranks that this process spawned itself on
    this machine (calibration), which share its host whatever the launcher said of it."""
    return this_host({})


def one_host(hosts: Sequence[Host]) -> bool:
    """Whether every rank whose :class:`Host` is in ``hosts`` runs on one host."""
    return len({host.key for host in hosts}) <= 1


@dataclasses.dataclass(frozen=True)
class Launch:
    """The group a launcher (torchrun, or one that sets its variables) started this rank in: its place and its
    host's ranks. Where the group meets (``MASTER_ADDR:MASTER_PORT``, or torchrun's agent store) is torch's
    ``env://`` rendezvous to read.

    Attributes:
        rank, world_size: this rank and the group's size (``RANK``, ``WORLD_SIZE``).
        local_rank, local_world_size: this rank on its node, and the node's ranks (``LOCAL_RANK``,
            ``LOCAL_WORLD_SIZE``); torchrun numbers a node's ranks consecutively.
        host: this rank's :class:`Host` (its node from :func:`launcher_node`).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    host: Host

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size or not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"RANK ({self.rank}) must be below WORLD_SIZE ({self.world_size}) and LOCAL_RANK "
                             f"({self.local_rank}) below LOCAL_WORLD_SIZE ({self.local_world_size}); start the "
                             "ranks with torchrun, which sets them")
        if self.world_size % self.local_world_size:
            raise ValueError(f"WORLD_SIZE ({self.world_size}) must be a whole number of nodes of LOCAL_WORLD_SIZE "
                             f"({self.local_world_size}) ranks; start every node with the same --nproc-per-node")

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size


_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def launched(environ: Mapping[str, str]) -> Launch | None:
    """The :class:`Launch` that the launcher's variables in ``environ`` describe, or None where it set none of
    them (a process started by hand); ValueError naming what is missing or wrong where it set only some."""
    present = [name for name in _LAUNCH_VARIABLES if environ.get(name)]
    if not present:
        return None
    missing = [name for name in _LAUNCH_VARIABLES if name not in present]
    if missing:
        raise ValueError(f"the launcher set {', '.join(present)} but not {', '.join(missing)}; start the ranks with "
                         "torchrun (or set all of them as it does)")
    numbers = {}
    for name in _LAUNCH_VARIABLES:
        try:
            numbers[name] = int(environ[name])
        except ValueError:
            raise ValueError(f"the launcher variable {name}={environ[name]!r} is not a whole number; set it as "
                             "torchrun does") from None
    return Launch(numbers["RANK"], numbers["WORLD_SIZE"], numbers["LOCAL_RANK"], numbers["LOCAL_WORLD_SIZE"],
                  this_host(environ))
