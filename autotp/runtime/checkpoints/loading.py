"""Read each rank's shards straight from a safetensors checkpoint (no rank holds the whole model).

A :class:`Checkpoint` is one ``.safetensors`` file, a directory holding one, or a directory with
several files and an index (``model.safetensors.index.json``, as transformers writes them). Its
headers (names, shapes, dtypes, byte ranges) are parsed once, without mapping any data, so every
problem with the files is found *before* anything is read. :func:`read_local_values` then reads,
for each parameter, only the block this rank holds — the block :func:`autotp.runtime.execution.shards.local_block`
computes from the plan and the uneven-split cuts, the same one the rewritten graph expects — with
``safetensors.safe_open(...).get_slice(...)`` (memory-mapped). Each file is opened for one tensor
at a time, so the pages a column slice touches are unmapped again before the next tensor: the
resident memory of a rank stays its shards plus one tensor's pages.

Names: a model's parameter FQNs are matched to the checkpoint's keys through one prefix rule for
the whole model (e.g. the checkpoint of ``LlamaForCausalLM`` has ``model.layers...`` while a
``LlamaModel`` has ``layers...``; GPT-2 files have ``transformer.`` or not), and tied weights
through every name of the shared tensor (transformers saves a tied weight once, under one of
them). The checkpoint is only ever read.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from autotp.adapters import hf_transformers, torchao
from autotp.base.errors import CheckpointError
from autotp.capture.tracing import CapturedGraph
from autotp.passes.uneven import Partitions
from autotp.planning.plan import Plan
from autotp.runtime.agreement.exchanges import DEFAULT_AGREEMENT_TIMEOUT_S, exchange, exchanges_with_others
from autotp.runtime.execution.shards import local_shape, parameter_layout

__all__ = ["Checkpoint", "ReadRequest", "TensorSource", "agree_on_success", "TensorEntry", "match_keys", "materialize_hf_buffers", "quantize_on_read", "read_block", "read_local_values", "tensor_aliases"]

INDEX_NAME = "model.safetensors.index.json"
_MAX_LISTED = 8
T = TypeVar("T")

# safetensors dtype names (https://github.com/huggingface/safetensors, format spec) -> torch dtypes
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPES.update({"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2})


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint, as its file's header describes it."""

    key: str
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


Block = tuple[int, list[tuple[int, int]]]
"""``(dim, [(start, stop), ...])``: the ranges of one dim a rank holds (see :func:`autotp.runtime.execution.shards.local_block`)."""


@dataclass(frozen=True)
class ReadRequest:
    """Read ``rank``'s block of ``entry`` (``blocks`` lists every rank's; ``None``: the whole tensor), as ``dtype`` on ``device``."""

    entry: TensorEntry
    blocks: list[Block | None] | None
    rank: int
    dtype: torch.dtype
    device: torch.device

    @property
    def block(self) -> Block | None:
        return None if self.blocks is None else self.blocks[self.rank]


class TensorSource(Protocol):
    """What the loader reads from: a safetensors :class:`Checkpoint` or a
    :class:`~autotp.runtime.checkpoints.saving.DistributedCheckpoint` (:func:`autotp.runtime.checkpoints.saving.open_checkpoint` opens either)."""

    path: Path
    entries: dict[str, TensorEntry]

    def __contains__(self, key: str) -> bool: ...

    def __getitem__(self, key: str) -> TensorEntry: ...

    def describe(self) -> str: ...

    def read(self, requests: list[ReadRequest]) -> list[torch.Tensor]: ...


def _read_header(file: Path) -> dict[str, TensorEntry]:
    """Parse a safetensors header (8-byte little-endian length, then JSON) and check the file is whole."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: {size} bytes, too short for a safetensors file (truncated?)")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise CheckpointError(f"{file}: header says {length} bytes but the file has {size}; the file is truncated "
                                      "(download or copy it again)")
            header = json.loads(handle.read(length))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    entries = {}
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{file}: tensor {key!r} has dtype {info.get('dtype')!r}, which autotp cannot read")
        entries[key] = TensorEntry(key, file, tuple(int(d) for d in info["shape"]), dtype)
        end = max(end, int(info["data_offsets"][1]))
    if 8 + length + end > size:
        raise CheckpointError(f"{file}: the header describes {8 + length + end} bytes but the file has {size}; the file is "
                              "truncated (download or copy it again)")
    return entries


class Checkpoint:
    """The tensors of a safetensors checkpoint: a file, or a directory with one file or an index of several.

    Building one reads only the headers and checks that every file the index names exists and is
    whole; no tensor data is read and nothing is written.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        root = Path(path)
        if root.is_dir():
            index = root / INDEX_NAME
            if index.is_file():
                files = self._files_from_index(index)
            else:
                files = sorted(root.glob("*.safetensors"))
                if not files:
                    raise CheckpointError(f"{root}: no *.safetensors file and no {INDEX_NAME}; pass the directory of a "
                                          "safetensors checkpoint or one .safetensors file")
        elif root.is_file():
            files = [root]
        else:
            raise CheckpointError(f"checkpoint {root} does not exist; pass a .safetensors file or a directory of them")
        self.path = root
        self.entries: dict[str, TensorEntry] = {}
        for file in files:
            self.entries.update(_read_header(file))

    @staticmethod
    def _files_from_index(index: Path) -> list[Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({type(exc).__name__}: {exc})") from None
        files = sorted({index.parent / name for name in weight_map.values()})
        missing = [f for f in files if not f.is_file()]
        if missing:
            named = {f.name: [k for k, v in weight_map.items() if v == f.name] for f in missing}
            detail = "; ".join(f"{name} (holds {len(keys)} tensors, e.g. {keys[0]!r})" for name, keys in named.items())
            raise CheckpointError(f"{index} names file(s) that do not exist: {detail}; copy the missing file(s) into "
                                  f"{index.parent}")
        return files

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __getitem__(self, key: str) -> TensorEntry:
        return self.entries[key]

    def read(self, requests: list[ReadRequest]) -> list[torch.Tensor]:
        """The tensors ``requests`` ask for, in order (one file mapping per tensor)."""
        return [read_block(r.entry, r.block, r.dtype, r.device) for r in requests]

    def describe(self) -> str:
        files = sorted({e.file.name for e in self.entries.values()})
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        return f"{self.path} ({len(self.entries)} tensors in {shown})"


def _transforms(model_keys: Iterable[str], checkpoint_keys: Iterable[str]) -> list[tuple[str, str]]:
    """Candidate renamings ``(strip, add)``: drop prefix ``strip`` from a model key, then prepend ``add``."""
    heads = {k.split(".", 1)[0] + "." for k in checkpoint_keys if "." in k}
    model_heads = {k.split(".", 1)[0] + "." for k in model_keys if "." in k}
    candidates = [("", "")] + [("", h) for h in heads] + [(h, "") for h in model_heads]
    candidates += [(m, h) for m in model_heads for h in heads if m != h]
    return candidates


def match_keys(aliases: Mapping[str, tuple[str, ...]], checkpoint: TensorSource) -> dict[str, str]:
    """Model FQN -> checkpoint key, for every FQN that has one.

    ``aliases`` gives, per FQN, every name of the same tensor (tied weights have several). One
    renaming of prefixes is chosen for the whole model: the one that finds the most tensors.
    """
    best: dict[str, str] = {}
    for strip, add in _transforms(aliases, checkpoint.entries):
        found = {}
        for fqn, names in aliases.items():
            for name in names:
                if name.startswith(strip) and add + name[len(strip):] in checkpoint:
                    found[fqn] = add + name[len(strip):]
                    break
        if len(found) > len(best):
            best = found
        if len(best) == len(aliases):
            break
    return best


def _kind(dtype: torch.dtype) -> str:
    return "floating point" if dtype.is_floating_point else "bool" if dtype == torch.bool else "integer"


def check_entry(fqn: str, entry: TensorEntry, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
    """Why ``entry`` cannot fill the model's tensor ``fqn`` of ``shape``/``dtype`` (None when it can).

    Floating-point values are cast on read (e.g. a bfloat16 file into a float32 model); integer and
    bool tensors must match exactly.
    """
    where = f"{entry.key!r} in {entry.file}"
    if entry.shape != shape:
        return (f"{fqn}: the model expects shape {list(shape)} but {where} has {list(entry.shape)} "
                "(a checkpoint of another model or configuration?)")
    if entry.dtype != dtype and not (entry.dtype.is_floating_point and dtype.is_floating_point):
        return f"{fqn}: the model expects {dtype} but {where} holds {entry.dtype}; {_kind(entry.dtype)} values cannot be cast to it"
    return None


def read_block(entry: TensorEntry, block: Block | None, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """Read ``entry`` whole (``block`` None) or the ranges ``block = (dim, [(start, stop), ...])`` of one dim,
    concatenated, cast to ``dtype`` on ``device``. The file is mapped only while this tensor is read."""
    from safetensors import safe_open

    try:
        with safe_open(str(entry.file), framework="pt", device=str(device)) as handle:
            if block is None:
                value = handle.get_tensor(entry.key)
            else:
                dim, ranges = block
                view = handle.get_slice(entry.key)
                pieces = []
                for start, stop in ranges:
                    if stop > start:
                        pieces.append(view[(slice(None),) * dim + (slice(start, stop),)])
                if not pieces:
                    shape = list(entry.shape)
                    shape[dim] = 0
                    value = torch.empty(shape, dtype=entry.dtype, device=device)
                else:
                    value = torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own types; name the tensor and file
        raise CheckpointError(f"could not read tensor {entry.key!r} from {entry.file}: {type(exc).__name__}: {exc}") from None
    return value.to(dtype=dtype).contiguous()


def tensor_aliases(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """FQN -> every FQN of the same tensor in ``model`` (tied weights share one parameter object)."""
    names: dict[int, list[str]] = {}
    for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(tensor), []).append(name)
    return {name: (name, *[n for n in group if n != name]) for group in names.values() for name in group}


def materialize_hf_buffers(model: torch.nn.Module, fqns: list[str], device: torch.device) -> None:
    """Give storage on ``device`` to buffers a transformers model derives from its config (rotary ``inv_freq``)
    for a model built on meta, and fill them as transformers does after loading
    (:func:`autotp.adapters.hf_transformers.derive_config_buffers`). Only modules holding no parameters of
    their own are touched."""
    owners: dict[str, torch.nn.Module] = {}
    for fqn in fqns:
        path, _, leaf = fqn.rpartition(".")
        module = model.get_submodule(path)
        if next(module.parameters(recurse=False), None) is None:
            buffer = module._buffers[leaf]
            # NaN until derived: a buffer the release does not derive is caught, never read as it was
            fill = float("nan") if buffer.is_floating_point() else 0
            module._buffers[leaf] = torch.full_like(buffer, fill, device=device)
            owners[path] = module
    if owners:
        hf_transformers.derive_config_buffers(model, owners)


def read_local_values(captured: CapturedGraph, plan: Plan, parts: Partitions, rank: int, checkpoint: TensorSource,
                      model: torch.nn.Module, device: torch.device,
                      created: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """This rank's value of every parameter, buffer and constant placeholder of ``captured``, read from ``checkpoint``.

    ``created``: FQNs of state buffers that are made here, zero, in this rank's block, never read (a KV cache:
    the graph writes each slot before it reads it).

    Parameters come from the checkpoint only (this rank's block of split ones); buffers from the
    checkpoint when it has them, else from the model (a real buffer, or one transformers derives
    from the config). Every name, shape and dtype is checked against the headers before any data
    is read; all problems are reported at once, each naming the tensor and the file.
    """
    exported = captured.exported
    layout = parameter_layout(captured, plan, parts)
    aliases = tensor_aliases(model)
    nodes = {n.name: n for n in captured.graph_module.graph.nodes if n.op == "placeholder"}
    slots = [s for s in captured.inputs if s.kind != "user"]
    model_quantized = torchao.quantized_weights(model)
    for held in model_quantized.values():  # a part is also found as transformers saves it (q_proj._weight_qdata)
        for index, (part_name, _, _) in enumerate(held.parts):
            name = torchao.exported_name(held.fqn, index)
            aliases[name] = (name, torchao.flattened_name(held.fqn, part_name))
    for slot in slots:
        aliases.setdefault(str(slot.target), (str(slot.target),))
    keys = match_keys(aliases, checkpoint)
    unread = {name for name, node in nodes.items() if not node.users}
    problems: list[str] = []
    derived: list[str] = []
    # a quantized weight's part the checkpoint lacks, where it holds the float weight: quantized on read
    float_weights = {name: weight for name, weight in _parts_of_float_weights(slots, keys).items() if name not in unread}
    quantized = model_quantized
    config = torchao.config_of(model)  # one walk of the modules for every weight quantized on read
    for slot in slots:
        fqn = str(slot.target)
        if (slot.kind == "parameter" and slot.name in unread) or fqn in created:
            continue  # the second name of a tied weight (the graph reads the first), or a cache made below
        val = nodes[slot.name].meta["val"]
        if slot.name in float_weights:
            weight = float_weights[slot.name]
            problem = _check_float_weight(weight, checkpoint[keys[weight]], quantized, config)
            if problem and problem not in problems:
                problems.append(problem)
        elif fqn in keys:
            problem = check_entry(fqn, checkpoint[keys[fqn]], tuple(int(d) for d in val.shape), val.dtype)
            exported_part = torchao.weight_of(fqn)
            if problem is None and exported_part is not None and keys[fqn] != fqn:  # saved flattened, by transformers
                problem = _check_saved_scheme(checkpoint[keys[fqn]], model_quantized.get(exported_part[0]))
            if problem:
                problems.append(problem)
        elif slot.kind == "parameter":
            problems.append(f"{fqn}: no tensor of that name (nor {', '.join(map(repr, aliases[fqn][1:])) or 'an alias'}) in "
                            f"{checkpoint.describe()}")
        elif _model_tensor(model, fqn, exported) is None:
            derived.append(fqn)
    if problems:
        found = sum(1 for s in slots if s.kind == "parameter" and str(s.target) in keys)
        wanted = sum(1 for s in slots if s.kind == "parameter" and s.name not in unread)
        hint = (" Most tensors are missing or differ: is this the checkpoint of another architecture?"
                if found < wanted / 2 or len(problems) > wanted / 2 else "")
        listed = problems[:_MAX_LISTED] + ([f"... and {len(problems) - _MAX_LISTED} more"] if len(problems) > _MAX_LISTED else [])
        raise CheckpointError(f"the checkpoint {checkpoint.path} does not fit {type(model).__name__} "
                              f"({found} of {wanted} parameters found).{hint}\n  - " + "\n  - ".join(listed))
    if derived:
        materialize_hf_buffers(model, derived, device)
        still = [fqn for fqn in derived if _model_tensor(model, fqn, exported) is None]
        if still:
            raise CheckpointError(
                f"buffer(s) {', '.join(still)} are neither in {checkpoint.describe()} nor computed by the model (it was built "
                "on the meta device); build the model with its buffers on a real device (parameters on meta), "
                "or save the buffers in the checkpoint")
    values: dict[str, torch.Tensor] = {}
    requests: dict[str, ReadRequest] = {}
    for slot in slots:
        fqn = str(slot.target)
        val = nodes[slot.name].meta["val"]
        if slot.kind == "parameter" and slot.name in unread:
            values[slot.name] = torch.empty(0, dtype=val.dtype, device=device)
        elif fqn in created:
            shape = local_shape(val.shape, plan.parameters[fqn], parts, slot.name, rank)
            values[slot.name] = torch.zeros(shape, dtype=val.dtype, device=device)
        elif slot.name in float_weights:
            continue  # below: all parts of the weight at once
        elif slot.kind == "parameter":
            requests[slot.name] = ReadRequest(checkpoint[keys[fqn]], layout[fqn][1], rank, val.dtype, device)
        elif fqn in keys:
            requests[slot.name] = ReadRequest(checkpoint[keys[fqn]], None, rank, val.dtype, device)
        else:
            tensor = _model_tensor(model, fqn, exported)
            assert tensor is not None, f"buffer {fqn} was checked above"
            values[slot.name] = tensor.detach().to(device=device, dtype=val.dtype)
    values.update(zip(requests, checkpoint.read(list(requests.values()))))
    by_weight: dict[str, dict[int, tuple[str, Block | None]]] = {}
    for slot in slots:
        if slot.name in float_weights:
            part_of = torchao.weight_of(str(slot.target))
            assert part_of is not None, f"{slot.target} names a quantized weight's part"
            blocks = layout[str(slot.target)][1]
            by_weight.setdefault(float_weights[slot.name], {})[part_of[1]] = (slot.name, None if blocks is None else blocks[rank])
    for weight_fqn, by_index in by_weight.items():
        local = quantize_on_read(checkpoint, checkpoint[keys[weight_fqn]], quantized[weight_fqn],
                                 {index: block for index, (_, block) in by_index.items()}, config,
                                 rank, device)
        values.update({by_index[index][0]: value for index, value in local.items()})
    return {slot.name: values[slot.name] for slot in slots}


def _check_saved_scheme(entry: TensorEntry, weight: torchao.QuantizedWeight | None) -> str | None:
    """Why a part saved flattened (by transformers) cannot fill the model's ``weight``: another torchao class."""
    if weight is None or entry.file.suffix != ".safetensors":
        return None
    from safetensors import safe_open

    key = entry.key.rsplit("._", 1)[0] + "." + weight.fqn.rpartition(".")[2]  # ``a._weight_qdata`` -> ``a.weight``
    with safe_open(str(entry.file), framework="pt") as handle:
        saved = torchao.saved_scheme(handle.metadata() or {}, key)
    if saved != weight.scheme:
        return (f"{weight.fqn}: the model's weight is {weight.scheme} but {entry.file} saved {key} as {saved or 'no torchao class'}; "
                "quantize the model with the config the checkpoint was saved with (its config.json quantization_config)")
    return None


def _parts_of_float_weights(slots: list[Any], keys: dict[str, str]) -> dict[str, str]:
    """Slot name -> weight FQN, for each part of a quantized weight that the checkpoint holds as the float weight."""
    found = {}
    for slot in slots:
        fqn = str(slot.target)
        part = torchao.weight_of(fqn) if slot.kind == "parameter" and fqn not in keys else None
        if part is not None and part[0] in keys:
            found[slot.name] = part[0]
    return found


def _check_float_weight(weight: str, entry: TensorEntry, quantized: Mapping[str, torchao.QuantizedWeight],
                        config: object) -> str | None:
    """Why the float ``entry`` cannot be quantized into the model's quantized ``weight`` (None when it can)."""
    found = quantized.get(weight)
    if found is None:
        return f"{weight}: the graph reads its quantized parts, but the model holds no torchao weight of that name"
    if config is None:
        return (f"{weight}: {entry.key!r} in {entry.file} is a float weight and the model's is quantized ({found.scheme}), "
                "but the model does not say with which config; pass quantization_config=TorchAoConfig(...) to "
                "autotp.from_pretrained, or load a checkpoint of the quantized model (written by tp.save)")
    if entry.shape != found.shape or not entry.dtype.is_floating_point or len(found.shape) != 2:
        return (f"{weight}: the model's quantized weight is {list(found.shape)} but {entry.key!r} in {entry.file} is "
                f"{list(entry.shape)} {entry.dtype} (quantized on read: a float (out, in) weight of the same shape)")
    return None


def _quantization_block(weight: torchao.QuantizedWeight, dim: int) -> int:
    """How many elements along ``dim`` of the data one scale (zero point...) covers: the data's whole length for
    a part that spans the dim (a per-row scale along the input dim, a per-tensor scale)."""
    data_shape = weight.parts[0][1]
    block = 1
    for _, shape, _ in weight.parts[1:]:
        cover = data_shape[dim] if len(shape) != len(data_shape) or shape[dim] <= 1 else data_shape[dim] // shape[dim]
        block = max(block, cover)
    return block


def _widened(block: Block | None, length: int, unit: int) -> list[tuple[int, int]]:
    """The ranges of ``block`` widened to whole quantization blocks of ``unit`` elements (merged, in order)."""
    if block is None:
        return [(0, length)]
    widened: list[tuple[int, int]] = []
    for start, stop in block[1]:
        if stop > start:
            low, high = start // unit * unit, min(-(-stop // unit) * unit, length)
            if widened and low <= widened[-1][1]:
                widened[-1] = (widened[-1][0], max(widened[-1][1], high))
            else:
                widened.append((low, high))
    return widened


def quantize_on_read(checkpoint: TensorSource, entry: TensorEntry, weight: torchao.QuantizedWeight,
                     blocks: dict[int, Block | None], config: object, rank: int,
                     device: torch.device) -> dict[int, torch.Tensor]:
    """This rank's block of each part of ``weight`` (part index -> its block), quantized from the float ``entry``.

    A scale depends on the whole block of data it covers, so the rank reads the float rows or columns of its
    data block widened to whole quantization blocks: its rows under a column split (``S(0)``); whole rows
    under a row split (``S(1)``) with per-row scales; its whole groups under a row split with group-wise
    scales (the cuts fall between groups). It quantizes them and keeps its block of every part.
    """
    data_block = blocks.get(0)
    dim = data_block[0] if data_block is not None else 0
    length = weight.shape[dim]
    widened = _widened(data_block, length, _quantization_block(weight, dim))
    float_blocks: list[Block | None] = [None] * (rank + 1)
    float_blocks[rank] = None if widened == [(0, length)] else (dim, widened)
    (piece,) = checkpoint.read([ReadRequest(entry, float_blocks, rank, weight.dtype, device)])
    parts = list(torchao.quantize_weight(piece, config).values())
    out: dict[int, torch.Tensor] = {}
    for index, block in blocks.items():
        name, shape, dtype = weight.parts[index]
        part = parts[index]
        if part.dtype != dtype:
            raise CheckpointError(f"{weight.fqn}: quantizing {entry.key!r} gave its {name} in {part.dtype}; the model's is {dtype}")
        if block is None:
            if tuple(part.shape) != shape:
                raise CheckpointError(f"{weight.fqn}: {name} is kept whole, but this rank quantized {list(part.shape)} of "
                                      f"its {list(shape)} (the data is split along dim {dim})")
            out[index] = part.contiguous()
            continue
        part_dim, ranges = block
        ratio = length // shape[part_dim] if part_dim == dim and shape[part_dim] else 0
        spans, offset = [], 0  # each widened range in the part's units, and where it starts in ``part``
        for low, high in widened:
            if ratio:
                spans.append((low // ratio, high // ratio, offset))
                offset += (high - low) // ratio
        pieces = []
        for start, stop in ranges:
            if stop <= start:
                continue
            span = next((s for s in spans if s[0] <= start and stop <= s[1]), None)
            if span is None:
                raise CheckpointError(f"{weight.fqn}: the block {start}:{stop} of dim {part_dim} of its {name} lies outside "
                                      f"the data this rank quantized ({widened} of dim {dim})")
            pieces.append(part.narrow(part_dim, span[2] + start - span[0], stop - start))
        if not pieces:
            empty = list(shape)
            empty[part_dim] = 0
            out[index] = torch.empty(empty, dtype=dtype, device=device)
        else:
            out[index] = (torch.cat(pieces, part_dim) if len(pieces) > 1 else pieces[0]).contiguous()
    return out


def _model_tensor(model: torch.nn.Module, fqn: str, exported: torch.export.ExportedProgram) -> torch.Tensor | None:
    """A real (not meta, not fake) value of buffer or constant ``fqn`` held by the model, or None."""
    from autotp.adapters.torch_internals import FakeTensor

    try:
        tensor = model.get_buffer(fqn)
    except AttributeError:
        tensor = exported.constants.get(fqn)
    if tensor is None or tensor.device.type == "meta" or isinstance(tensor, FakeTensor):
        return None
    return tensor


def agree_on_success(group: object, load: Callable[[], T], *,
                     timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S) -> T:
    """Run ``load`` on every rank of ``group`` and raise on *every* rank when it failed on any.

    One small exchange after loading (:func:`autotp.runtime.agreement.exchanges.exchange`, bounded by
    ``timeout_s``): a rank whose file is bad must not leave the others waiting in the first
    collective of the forward pass. (A fake process group cannot carry objects; there each rank
    raises its own error.)
    """

    try:
        result, error = load(), None
    except CheckpointError as exc:
        result, error = None, str(exc)
    if exchanges_with_others(group):
        errors: list[str | None] = exchange(error, group=group, timeout_s=timeout_s,  # type: ignore[arg-type]
                                            what="loading the checkpoint")
    else:
        errors = [error]
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        if error is not None:
            raise CheckpointError(error)
        rank, first = failed[0]
        raise CheckpointError(f"loading failed on rank {rank} (and {len(failed) - 1} other rank(s)): {first}")
    return result  # type: ignore[return-value]
