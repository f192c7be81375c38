"""Save a tensor-parallel model with ``torch.distributed.checkpoint`` and read it back at any world size.

:func:`save_sharded` writes every split parameter as a ``ShardedTensor``: each rank contributes its
block(s) with their global offsets (a block split such as a fused QKV weight is several chunks;
uneven cuts are described exactly, which DTensor's even ``torch.chunk`` layout could not), so
the directory describes the full tensors. Replicated parameters and buffers are plain tensors,
written once. :class:`DistributedCheckpoint` reads such a directory like a safetensors one: the
metadata gives names, shapes and dtypes; a read asks DCP for exactly the chunks this rank's new
plan needs (``no_dist=True``: no collective, so a failure on one rank cannot leave the others
waiting), and DCP reads the overlapping parts of whatever chunks were saved.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autotp.runtime.loading import Block, CheckpointError, ReadRequest, TensorEntry

if TYPE_CHECKING:
    from autotp.runtime.module import TensorParallelModule

__all__ = ["DistributedCheckpoint", "save_sharded"]


def _chunks(shape: tuple[int, ...], block: Block | None) -> list[tuple[list[int], list[int]]]:
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


def _sharded(local: list[torch.Tensor], shape: tuple[int, ...], blocks: list[Block | None], rank: int,
             group: Any, dtype: torch.dtype, device: torch.device) -> ShardedTensor:
    """A ShardedTensor over ``group`` whose rank ``r`` holds the chunks of ``blocks[r]``; ``local`` are this rank's."""
    metadata, mine = [], []
    for r, block in enumerate(blocks):
        global_rank = dist.get_global_rank(group, r) if group is not None else r
        for offsets, sizes in _chunks(shape, block):
            meta = ShardMetadata(offsets, sizes, f"rank:{global_rank}/{device}")
            metadata.append(meta)
            if r == rank:
                mine.append(meta)
    shards = [Shard(tensor, meta) for tensor, meta in zip(local, mine, strict=True)]
    properties = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata(metadata, torch.Size(shape), properties), process_group=group)


def _split_local(tensor: torch.Tensor, block: Block) -> list[torch.Tensor]:
    """This rank's tensor (its ranges concatenated along the split dim) cut back into one piece per non-empty range."""
    dim, ranges = block
    lengths = [stop - start for start, stop in ranges]
    return [piece.contiguous() for piece, length in zip(tensor.split(lengths, dim), lengths) if length > 0]


def save_sharded(tp: TensorParallelModule, directory: str | os.PathLike[str], group: Any = None) -> None:
    """Write ``tp``'s shards to ``directory`` (collective: call on every rank of ``group``)."""
    state: dict[str, Any] = {}
    for fqn, tensor in tp.local_state().items():
        shape, blocks = tp.layout.get(fqn, (None, None))
        if shape is None and fqn in tp.plan.parameters:
            continue  # the second name of a tied weight: the graph never reads it, the first name is saved
        if blocks is None:
            state[fqn] = tensor
        else:
            state[fqn] = _sharded(_split_local(tensor, blocks[tp.rank]), shape, blocks, tp.rank, group, tensor.dtype,
                                 tensor.device)
    dcp.save(state, checkpoint_id=str(directory), process_group=group)


class DistributedCheckpoint:
    """A directory written by :func:`save_sharded`, read like a :class:`~autotp.runtime.loading.Checkpoint`."""

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
        """Every request's block in one ``dcp.load`` (no collective), cast and placed as asked."""
        state: dict[str, Any] = {}
        pieces: dict[str, list[torch.Tensor]] = {}
        for request in requests:
            entry, block = request.entry, request.block
            if request.blocks is None:
                state[entry.key] = torch.empty(entry.shape, dtype=entry.dtype, device=request.device)
                continue
            pieces[entry.key] = [torch.empty(sizes, dtype=entry.dtype, device=request.device)
                                 for _, sizes in _chunks(entry.shape, block)]
            state[entry.key] = _sharded(pieces[entry.key], entry.shape, request.blocks, request.rank, None, entry.dtype,
                                        request.device)
        try:
            dcp.load(state, checkpoint_id=str(self.path), no_dist=True)
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
                parts = pieces[entry.key]
                if parts:
                    value = torch.cat(parts, dim) if len(parts) > 1 else parts[0]
                else:
                    shape = list(entry.shape)
                    shape[dim] = 0
                    value = torch.empty(shape, dtype=entry.dtype, device=request.device)
            out.append(value.to(dtype=request.dtype))
        return out
