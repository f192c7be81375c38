"""Shards: where each rank's block of a split tensor lies, its shape, and the slice itself.

One place for the arithmetic that slicing in memory (:func:`shard_tensor`), reading from a checkpoint
(:mod:`autotp.runtime.checkpoints.loading`), saving (:mod:`autotp.runtime.checkpoints.saving`) and the rank-local graph all
share, so each holds exactly the block the rewritten graph expects.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from autotp.base.errors import AutoTPError
from autotp.base.placements import placement_from_str, split_of
from autotp.base.shapes import concrete_shape
from autotp.capture.tracing import CapturedGraph
from autotp.passes.uneven import Partitions
from autotp.planning.plan import Plan

__all__ = ["ShardCache", "local_block", "local_shape", "parameter_layout", "shard_tensor"]


def local_block(shape: tuple[int, ...] | torch.Size, placement_text: str, parts: Partitions, name: str,
                rank: int) -> tuple[int, list[tuple[int, int]]] | None:
    """Where rank ``rank``'s block of a tensor of ``shape`` placed as ``placement_text`` lies in the full tensor.

    ``None`` when the tensor is not split (the rank holds it whole); else ``(dim, [(start, stop), ...])``:
    the ranges of ``dim`` the rank holds, one per block (several for a block split such as a fused
    QKV weight), concatenated in that order. The cuts come from ``parts`` (uneven splits: see
    :mod:`autotp.passes.uneven`), so slicing in memory (:func:`shard_tensor`) and reading from a
    checkpoint (:mod:`autotp.runtime.checkpoints.loading`) hold exactly the block the rewritten graph expects.
    """
    split = split_of(placement_from_str(placement_text))
    if split is None:
        return None
    dim, blocks = split
    offset, length = parts.local(name, dim, rank, blocks)
    block = int(shape[dim]) // blocks
    return dim, [(b * block + offset, b * block + offset + length) for b in range(blocks)]


def local_shape(shape: tuple[int, ...] | torch.Size, placement_text: str, parts: Partitions, name: str,
                rank: int) -> tuple[int, ...]:
    """The shape of rank ``rank``'s block (:func:`local_block`) of a tensor of ``shape``, without slicing it."""
    local = [int(size) for size in shape]
    where = local_block(shape, placement_text, parts, name, rank)
    if where is not None:
        dim, ranges = where
        local[dim] = sum(stop - start for start, stop in ranges)
    return tuple(local)


def parameter_layout(captured: CapturedGraph, plan: Plan, parts: Partitions) -> dict[str, tuple[tuple[int, ...], list[Any] | None]]:
    """FQN -> (full shape, every rank's :func:`local_block`, or None when not split), for each parameter the graph reads.

    What a rank reads from a checkpoint and what it writes to one (with its global offsets) both come from here.
    """
    layout = {}
    for node in captured.graph_module.graph.nodes:
        fqn = captured.parameter_fqns().get(node.name) if node.op == "placeholder" else None
        if fqn is None or not node.users:
            continue
        shape = concrete_shape(node.meta["val"])
        blocks = [local_block(shape, plan.parameters[fqn], parts, node.name, r) for r in range(plan.world_size)]
        layout[fqn] = (shape, None if blocks[0] is None else blocks)
    return layout


def shard_tensor(full: torch.Tensor, placement_text: str, parts: Partitions, name: str, rank: int) -> torch.Tensor:
    """This rank's block of ``full`` under ``placement_text`` (a contiguous copy, so ``full`` can be freed)."""
    where = local_block(full.shape, placement_text, parts, name, rank)
    if where is None:
        return full.detach()
    dim, ranges = where
    pieces = [full.detach().narrow(dim, start, stop - start) for start, stop in ranges]
    return torch.cat(pieces, dim).clone() if len(pieces) > 1 else pieces[0].clone()


class ShardCache:
    """This rank's shards, keyed weakly by the full parameter, so each is sliced once.

    The ``torch.compile`` backend gives one to :func:`autotp.runtime.execution.applying.apply_plan` for every graph it
    applies: several graphs (graph breaks, recompiles, new input sizes) that split a parameter the same way
    share one shard. The key of a shard is its placement and the shape of every rank's block (which fixes the
    offsets), so a hit needs no access to the full weight's data.
    """

    def __init__(self) -> None:
        self._shards: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._replicated: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._released: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def get(self, full: torch.Tensor, placement: str, parts: Partitions, name: str, rank: int, fqn: str) -> torch.Tensor:
        """:func:`shard_tensor` of ``full``, sliced at the first request of this split and held after."""
        if placement == "R":
            self._replicated[full] = True
            return full.detach()
        meta = torch.empty(full.shape, dtype=full.dtype, device="meta")
        blocks = tuple(tuple(shard_tensor(meta, placement, parts, name, r).shape) for r in range(parts.world_size))
        per_param = self._shards.setdefault(full, {})
        key = (placement, blocks)
        if key not in per_param:
            if full in self._released:
                raise AutoTPError(
                    f"parameter {fqn} needs a new split ({placement}) but its full weight was released by "
                    "release_full_weights(); call torch._dynamo.reset() and compile again from a model with its weights"
                )
            per_param[key] = shard_tensor(full, placement, parts, name, rank)
        return per_param[key]

    def parameter_bytes(self) -> tuple[int, int]:
        """``(held, full)``: bytes of the shards and replicated parameters held, and of those parameters unsplit."""
        held = full = 0
        for tensor, per_param in self._shards.items():
            held += sum(s.numel() * s.element_size() for s in per_param.values())
            full += tensor.numel() * tensor.element_size()
        for tensor in self._replicated:
            if tensor not in self._shards:
                held += tensor.numel() * tensor.element_size()
                full += tensor.numel() * tensor.element_size()
        return held, full

    def release(self) -> int:
        """Free the storage of every split parameter's full weight; returns the bytes freed."""
        freed = 0
        for tensor in list(self._shards.keys()):
            if tensor in self._released or tensor in self._replicated:
                continue  # a replicated use still reads the full weight
            storage = tensor.untyped_storage()
            freed += storage.nbytes()
            storage.resize_(0)
            self._released[tensor] = True
        return freed
