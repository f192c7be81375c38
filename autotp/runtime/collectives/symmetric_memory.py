"""The sum of a small CUDA tensor over a group in symmetric memory: PyTorch's one-shot all-reduce kernel.

A decode step's all-reduces carry a few KiB, where NCCL pays its per-call base latency and a hop per rank
of its ring (about 8-15 us at tp 2-8 on NVLink, priced from NCCL's own tuning tables). PyTorch's symmetric memory
(``torch.distributed._symmetric_memory``) maps one buffer of every rank of a group into each rank's address
space (``empty`` allocates it, ``rendezvous`` exchanges the handles through the group's store); its one-shot
kernel, ``torch.ops.symm_mem.one_shot_all_reduce_copy_out``, copies this rank's tensor into its buffer,
waits on signal pads until every peer has done the same, loads the ``p`` buffers and adds them in rank order
(the same bits on every rank), and signals once more before the buffer may be written again. One kernel and
no host synchronisation, so it can run inside a captured CUDA graph. vLLM's and SGLang's custom all-reduce take
the same form for small messages inside a node.

Where (the symmetric-memory row of :data:`autotp.cost_model.collective_forms.FORM_TABLE`): every rank of the group on one
host with its tensors on a CUDA device, whatever the backend (NCCL; or gloo with CUDA tensors, which lets two
ranks share one GPU, as the one-GPU check runs them), on a torch that has the kernel. Which all-reduces: those of at
most 256 KiB of a dtype the kernel sums, float32 or bfloat16
(the row's ``FormSpec.takes``, which the cost model reads too), and a multiple
of 4 bytes (its alignment); the others take the backend's all-reduce. An all-reduce has the same size and dtype on every rank, so every rank takes the same
path.

:func:`symmetric_memory_all_reduce_for` sets up one :class:`SymmetricMemoryAllReduce` per graph and group (a
buffer of 256 KiB); the graph calls it in place of each sum all-reduce and its wait
(:func:`autotp.passes.small_collectives.through_stand_ins`), and a compiled graph calls the custom op
``autotp::symmetric_memory_all_reduce`` instead (its
:meth:`~autotp.passes.small_collectives.StandInCollective.compiler_form`), which takes the buffer as a tensor it
mutates so a compiler keeps every call in order.

Not yet run on a GPU by this project: ``benchmarks/gpu_check.sh`` (gloo with CUDA tensors at world size 2 on
one GPU) is the prepared check.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from autotp.cost_model.collective_forms import FORM_TABLE, CollectiveForm
from autotp.passes.small_collectives import StandInCollective
from autotp.runtime.agreement.exchanges import exchange, exchanges_with_others
from autotp.runtime.collectives.hosts import Host, one_host

__all__ = ["SymmetricMemoryAllReduce", "has_kernel", "sum_in_symmetric_memory",
           "symmetric_memory_all_reduce_for"]

_ALIGNMENT_BYTES = 4
"""The kernel loads vectors of at least 4 bytes: a tensor whose size is not a multiple of 4 takes the backend."""

c10d = torch.ops._c10d_functional

_SYMMETRIC_MEMORY = FORM_TABLE[CollectiveForm.SYMMETRIC_MEMORY]
_BUFFER_BYTES = int(_SYMMETRIC_MEMORY.max_bytes or 0)
"""One buffer per graph and group holds the largest all-reduce the form takes."""


def has_kernel() -> bool:
    """Whether this torch has the one-shot all-reduce kernel in symmetric memory."""
    try:
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out.default is not None
    except (AttributeError, RuntimeError):
        return False


def sum_in_symmetric_memory(x: torch.Tensor, buffer: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group_name``: the one-shot kernel in ``buffer`` (this rank's
    symmetric-memory buffer, uint8) where it takes ``x`` (module docstring), else the backend's all-reduce."""
    nbytes = x.numel() * x.element_size()
    if (nbytes == 0 or nbytes % _ALIGNMENT_BYTES or nbytes > buffer.numel()
            or not _SYMMETRIC_MEMORY.takes("all_reduce", world_size, nbytes, x.dtype)):
        return c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name))
    x = x.contiguous()
    out = torch.empty_like(x)
    slot = buffer[:nbytes].view(x.dtype).view(x.shape)
    torch.ops.symm_mem.one_shot_all_reduce_copy_out(slot, x, "sum", group_name, out)
    return out


class SymmetricMemoryAllReduce(StandInCollective):
    """Sum of a CUDA tensor over the ranks of one group in symmetric memory (module docstring).

    Called as ``op(x)`` from a graph node, on every rank of the group in the same order; returns a new
    tensor. Build it with :func:`symmetric_memory_all_reduce_for`."""

    __module__ = "autotp.runtime.collectives.symmetric_memory"
    kind = "all_reduce"

    def __init__(self, buffer: torch.Tensor, *, group_name: str, world_size: int) -> None:
        self.buffer = buffer  # this rank's symmetric-memory buffer (uint8), rendezvoused with the group
        self.group_name, self.world_size = group_name, world_size
        self.__name__ = "autotp_symmetric_memory_all_reduce"

    def __repr__(self) -> str:
        return f"SymmetricMemoryAllReduce(group={self.group_name!r}, world_size={self.world_size})"

    def __deepcopy__(self, memo: dict) -> SymmetricMemoryAllReduce:
        return self  # a copy of a graph still sums in the same buffer with the same ranks

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return sum_in_symmetric_memory(x, self.buffer, self.group_name, self.world_size)

    def compiler_form(self) -> tuple[Any, torch.Tensor, tuple[Any, ...]]:
        """``autotp::symmetric_memory_all_reduce`` on the buffer."""
        return torch.ops.autotp.symmetric_memory_all_reduce.default, self.buffer, (self.group_name, self.world_size)


def symmetric_memory_all_reduce_for(group: dist.ProcessGroup | None, *, host: Host, timeout_s: float,
                                    device: torch.device) -> SymmetricMemoryAllReduce | None:
    """A :class:`SymmetricMemoryAllReduce` on ``group``, or None where the ranks keep the backend's all-reduce.

    Collective: every rank of ``group`` calls it at the same point, with ``host`` where it runs
    (:class:`~autotp.runtime.collectives.hosts.Host`) and ``device`` the device of the tensors it would sum. None (on every rank alike) when
    the symmetric-memory row of :data:`~autotp.cost_model.collective_forms.FORM_TABLE` says no (ranks on several hosts,
    some rank's tensors not on CUDA, a torch without the kernel), or when the buffer cannot be made or mapped
    (a warning names why)."""
    if not exchanges_with_others(group):
        return None
    facts = exchange((host, device.type, has_kernel()), group=group, timeout_s=timeout_s,
                     what="the symmetric-memory all-reduce's host check")
    if not _SYMMETRIC_MEMORY.takes_group(one_host=one_host([h for h, _, _ in facts]),
                                         device_types={kind for _, kind, _ in facts},
                                         has_kernel=all(kernel for _, _, kernel in facts)):
        return None
    from autotp.adapters.torch_internals import symmetric_memory

    symm_mem = symmetric_memory()

    rank = dist.get_rank(group)
    process_group = group if group is not None else dist.group.WORLD  # the group's name is the graph's
    buffer, failure = None, ""
    try:
        buffer = symm_mem.empty(_BUFFER_BYTES, dtype=torch.uint8, device=device)
    except (RuntimeError, ValueError) as exc:
        failure = f"rank {rank} could not allocate symmetric memory on {device}: {exc}"
    failures = exchange(failure, group=group, timeout_s=timeout_s, what="the symmetric-memory buffer's allocation")
    if not any(failures):
        try:
            symm_mem.rendezvous(buffer, process_group)
        except (RuntimeError, ValueError) as exc:
            failure = f"rank {rank} could not map the group's symmetric memory: {exc}"
        failures = exchange(failure, group=group, timeout_s=timeout_s, what="the symmetric-memory rendezvous")
    problems = [f for f in failures if f]
    if problems or buffer is None:
        warnings.warn(f"autotp keeps the backend's all-reduce on this group instead of the one-shot kernel in "
                      f"symmetric memory: {problems[0] if problems else 'no buffer'}", stacklevel=2)
        return None
    return SymmetricMemoryAllReduce(buffer, group_name=process_group.group_name, world_size=dist.get_world_size(group))


_LIBRARY = torch.library.Library("autotp", "FRAGMENT")  # held for the life of the process
_LIBRARY.define("symmetric_memory_all_reduce(Tensor x, Tensor(a!) buffer, str group_name, int world_size) -> Tensor")


def _all_reduce_op(x: torch.Tensor, buffer: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """:func:`sum_in_symmetric_memory` as an op a compiler keeps opaque (``buffer`` is mutated: the calls stay
    in order)."""
    return sum_in_symmetric_memory(x, buffer, group_name, world_size)


def _all_reduce_fake(x: torch.Tensor, buffer: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_LIBRARY.impl("symmetric_memory_all_reduce", _all_reduce_op, "CUDA")
torch.library.register_fake("autotp::symmetric_memory_all_reduce", _all_reduce_fake, lib=_LIBRARY)
