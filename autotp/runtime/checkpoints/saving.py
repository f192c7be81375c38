"""Save a tensor-parallel model with ``torch.distributed.checkpoint`` and read it back at any world size.

:func:`save_sharded` writes every split parameter as *chunks with global offsets*: each rank
contributes its block(s) (a block split such as a fused QKV weight is several chunks; uneven
cuts are described exactly, which DTensor's even ``torch.chunk`` layout could not), so the
directory describes the full tensors. Replicated parameters and buffers are plain tensors,
written once. No ``ShardedTensor`` (deprecated) and no ``DTensor``: two small DCP planners
(:class:`ChunkSavePlanner`, :class:`ChunkLoadPlanner`, extending DCP's default planners through
their documented hooks) turn ``{fqn: [(offsets, tensor), ...]}`` into DCP's write and read items,
so chunks carry no process-group ranks and the files are those a ShardedTensor save wrote.

:class:`DistributedCheckpoint` reads such a directory like a safetensors one: the metadata gives
names, shapes and dtypes; a read asks DCP for exactly the chunks this rank's new plan needs
(``no_dist=True``: no collective and no process group, so a failure on one rank cannot leave
the others waiting, and the tensor-parallel group may be any sub-group of the world), and DCP
reads the overlapping parts of whatever chunks were saved.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from autotp.base.errors import CheckpointError
from autotp.runtime.checkpoints.loading import Block, Checkpoint, ReadRequest, TensorEntry, TensorSource
from autotp.runtime.execution.rank_local import RankLocalModel

__all__ = ["ChunkLoadPlanner", "ChunkSavePlanner", "Chunks", "DistributedCheckpoint", "chunk_extents", "open_checkpoint",
           "save_sharded", "split_local"]

Chunks = list[tuple[list[int], torch.Tensor]]
"""This rank's pieces of one tensor: ``(global offsets, local tensor)`` per non-empty chunk."""


def chunk_extents(shape: tuple[int, ...], block: Block | None) -> list[tuple[list[int], list[int]]]:
    """``(offsets, sizes)`` of each non-empty chunk of ``block`` in a tensor of ``shape``."""
    if block is None:
        return [([0] * len(shape), list(shape))]
    dim, ranges = block
    chunks = []
    for start, stop in ranges:
        if stop > start:
            offsets, sizes = [0] * len(shape), list(shape)
            offsets[dim], sizes[dim] = start, stop - start
            chunks.append((offsets, sizes))
    return chunks


def _piece(chunks: Chunks, index: MetadataIndex) -> torch.Tensor:
    """The piece of ``chunks`` that DCP's ``index`` (global offsets) names."""
    offsets = list(index.offset or ())
    for start, tensor in chunks:
        if start == offsets:
            return tensor
    raise CheckpointError(f"{index.fqn}: no local chunk at offsets {offsets}")


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus one ``SHARD`` write item per local chunk of each split tensor."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], chunks: dict[str, Chunks]) -> None:
        super().__init__(flatten_state_dict=False)
        self._shapes, self._chunks = shapes, chunks

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()  # the plain (replicated) tensors of the state dict
        items = [
            WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(
                          chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.size()),
                          properties=TensorProperties.create_from_tensor(tensor), size=torch.Size(self._shapes[fqn])))
            for fqn, pieces in self._chunks.items() for offsets, tensor in pieces
        ]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self._chunks:
            return _piece(self._chunks[index.fqn], index)
        return super().lookup_object(index)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus read items filling each local chunk of each split tensor from the
    overlapping saved chunks (DCP's own resharding arithmetic, ``create_read_items_for_chunk_list``)."""

    def __init__(self, chunks: dict[str, Chunks]) -> None:
        super().__init__(flatten_state_dict=False)
        self._chunks = chunks

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()  # the whole tensors of the state dict
        assert self.metadata is not None, "DCP sets the metadata before planning"
        items = []
        for fqn, pieces in self._chunks.items():
            saved = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(saved, TensorStorageMetadata):
                raise CheckpointError(f"{fqn}: not a tensor in the torch.distributed.checkpoint metadata")
            wanted = [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.size()) for offsets, tensor in pieces]
            items += create_read_items_for_chunk_list(fqn, saved, wanted)
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self._chunks:
            return _piece(self._chunks[index.fqn], index)
        return super().lookup_tensor(index)


def split_local(tensor: torch.Tensor, block: Block) -> list[torch.Tensor]:
    """This rank's tensor (its ranges concatenated along the split dim) cut back into one piece per non-empty range."""
    dim, ranges = block
    lengths = [stop - start for start, stop in ranges]
    return [piece.contiguous() for piece, length in zip(tensor.split(lengths, dim), lengths) if length > 0]


def save_sharded(tp: RankLocalModel, directory: str | os.PathLike[str], group: Any = None) -> None:
    """Write ``tp``'s shards to ``directory`` (collective: call on every rank of ``group``, the model's
    tensor-parallel group; default: the whole world)."""
    if dist.is_initialized():
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (size, rank) != (tp.world_size, tp.rank):
            raise ValueError(
                f"tp.save: this model is rank {tp.rank} of a tensor-parallel group of {tp.world_size}, but the "
                f"group passed is {'the world' if group is None else 'a group'} of {size} with this process as rank "
                f"{rank}; pass group=<the process group the model was compiled with>"
            )
    state: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    chunks: dict[str, Chunks] = {}
    for fqn, tensor in tp.local_state().items():
        shape, blocks = tp.layout.get(fqn, (None, None))
        if shape is None and fqn in tp.plan.parameters:
            continue  # the second name of a tied weight: the graph never reads it, the first name is saved
        if blocks is None or shape is None:
            state[fqn] = tensor
        else:
            offsets = [o for o, _ in chunk_extents(shape, blocks[tp.rank])]
            shapes[fqn] = tuple(shape)
            chunks[fqn] = list(zip(offsets, split_local(tensor, blocks[tp.rank]), strict=True))
    dcp.save(state, checkpoint_id=str(directory), process_group=group, planner=ChunkSavePlanner(shapes, chunks))


class DistributedCheckpoint:
    """A directory written by :func:`save_sharded`, read like a :class:`~autotp.runtime.checkpoints.loading.Checkpoint`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            metadata = dcp.FileSystemReader(str(self.path)).read_metadata()
        except Exception as exc:  # noqa: BLE001 - DCP raises pickle/OS errors; name the directory
            raise CheckpointError(f"{self.path}: cannot read the torch.distributed.checkpoint metadata "
                                  f"({type(exc).__name__}: {exc})") from None
        self.entries = {
            key: TensorEntry(key, self.path, tuple(int(d) for d in meta.size), meta.properties.dtype)
            for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)
        }

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __getitem__(self, key: str) -> TensorEntry:
        return self.entries[key]

    def describe(self) -> str:
        return f"{self.path} (torch.distributed.checkpoint, {len(self.entries)} tensors)"

    def read(self, requests: list[ReadRequest]) -> list[torch.Tensor]:
        """Every request's block in one ``dcp.load`` (no collective, no process group), cast and placed as asked."""
        state: dict[str, Any] = {}
        chunks: dict[str, Chunks] = {}
        for request in requests:
            entry, block = request.entry, request.block
            if request.blocks is None:
                state[entry.key] = torch.empty(entry.shape, dtype=entry.dtype, device=request.device)
                continue
            chunks[entry.key] = [(offsets, torch.empty(sizes, dtype=entry.dtype, device=request.device))
                                 for offsets, sizes in chunk_extents(entry.shape, block)]
        try:
            dcp.load(state, checkpoint_id=str(self.path), no_dist=True, planner=ChunkLoadPlanner(chunks))
        except Exception as exc:  # noqa: BLE001 - name the directory and the cause
            raise CheckpointError(f"could not read {self.path} with torch.distributed.checkpoint: "
                                  f"{type(exc).__name__}: {exc}") from None
        out = []
        for request in requests:
            entry = request.entry
            if request.blocks is None:
                value = state[entry.key]
            else:
                dim = request.block[0] if request.block is not None else 0
                parts = [tensor for _, tensor in chunks[entry.key]]
                if parts:
                    value = torch.cat(parts, dim) if len(parts) > 1 else parts[0]
                else:
                    shape = list(entry.shape)
                    shape[dim] = 0
                    value = torch.empty(shape, dtype=entry.dtype, device=request.device)
            out.append(value.to(dtype=request.dtype))
        return out


def open_checkpoint(path: str | os.PathLike[str]) -> TensorSource:
    """A safetensors checkpoint, or a ``torch.distributed.checkpoint`` directory (one with ``.metadata``)
    written by :meth:`TensorParallelModule.save`; both read only this rank's blocks."""
    if (Path(path) / ".metadata").is_file():
        return DistributedCheckpoint(path)
    return Checkpoint(path)
