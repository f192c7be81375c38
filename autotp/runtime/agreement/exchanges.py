"""Ranks agree or fail together: small exchanges that every rank makes at the same points.

Tensor parallelism runs one process per rank, and the rewritten graphs are only right when every
rank traced the same model with the same weights, options and input shapes. When one rank
differs (another config, no common seed, a typo'd flag), the ranks would otherwise give
silently wrong outputs, hang in a collective or abort inside gloo. Here every such difference
becomes the *same* clear error on every rank, naming the ranks and what differs:

- **Before planning** (``autotp.compile``, and the ``torch.compile`` backend once per graph and
  input size), inside :func:`ranks_agree`: every rank sends a :class:`CompileRecord` (did capture
  succeed, else its error; the graph fingerprint; the options; parameter names and shapes; input
  shapes; a checksum per weight unless ``check_weights=False``) and every rank compares them all
  (:func:`disagreement`). A rank whose trace failed still takes part, so the others can name it.
  Rank 0 then plans and sends the plan (:func:`share_from_first`), so agreeing before planning
  is also agreeing before applying: every rank applies one plan.
- **At every call** of a :class:`~autotp.runtime.execution.module.TensorParallelModule`, :class:`InputGuard`:
  non-tensor arguments must equal the values baked into the graph (checked locally); tensor
  inputs must have the same shapes and dtypes on every rank, checked with one exchange per new
  shape signature. Signatures already checked are cached, so steady-state calls pay a tuple
  and a set lookup.

How ranks exchange (:func:`exchange`): through the process group's key-value store (the store
``init_process_group`` made), not through collectives. Every wait is bounded by
``agreement_timeout_s``; when it runs out, each rank that waited raises
:class:`~autotp.base.errors.RankTimeoutError` naming the ranks that did not arrive, on any backend,
and the group's collectives are left untouched. The n-th exchange of a rank meets the n-th
exchange of every other rank (a counter per rank in the store); a rank that arrives after the
others gave up finds their note and fails at once instead of going on alone.

No rank leaves an exchange before every rank has read it (invariant 6): world rank 0, which hosts the
store when ``init_process_group`` made it (``env://`` or ``tcp://``, e.g. ``multiprocessing`` with
``MASTER_ADDR``), returns or raises only after every rank of the group has acknowledged reading, and
each other rank's last message is that acknowledgement, which needs no reply. So a process that exits
right after its error takes the store from nobody, under any launcher. One exchange costs a rank one
``add``, two ``set``, one ``wait`` (two on world rank 0), one ``multi_get`` and two ``delete_key`` (of its
keys of the exchange before, which every rank has read by then). A fake process group (tests) and a
group of one rank exchange nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import pickle
import zlib
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.export.graph_signature import ConstantArgument, InputKind, TensorArgument

from autotp.adapters.torchao import inner_tensors, is_subclass_weight
from autotp.base.errors import AgreementError, RankTimeoutError, TracedValueError
from autotp.base.shapes import concrete_shape
from autotp.capture.tracing import CapturedGraph
from autotp.planning.plan import graph_fingerprint, graph_lines

if TYPE_CHECKING:
    from autotp.planning.options import PlanOptions

__all__ = [
    "DEFAULT_AGREEMENT_TIMEOUT_S",
    "agreed_options",
    "CompileRecord",
    "InputGuard",
    "check_timeout",
    "compile_record",
    "options_record",
    "constraints_text",
    "disagreement",
    "exchange",
    "group_store",
    "hardware_text",
    "plan_text",
    "ranks_agree",
    "share_from_first",
    "weight_checksum",
]

DEFAULT_AGREEMENT_TIMEOUT_S = 300.0
"""Seconds a rank waits for the others at an autotp exchange before it names the missing ranks."""

_KEY_PREFIX = "autotp"
_SAMPLE_ELEMENTS = 1024  # elements of each weight hashed exactly, evenly spaced
_CHUNK_ELEMENTS = 1 << 22  # float64 sums in chunks: a transient copy of at most 32 MiB
_SUM_RTOL = 1e-10  # float64 sums of the same values on two ranks differ by summation order only (~1e-15)
_MAX_LISTED = 8


# --------------------------------------------------------------------------- exchanging

def check_timeout(timeout_s: object) -> float:
    """``agreement_timeout_s`` as a float; ValueError says what to pass."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"agreement_timeout_s must be a positive number of seconds, got {timeout_s!r}; "
                         f"e.g. agreement_timeout_s={DEFAULT_AGREEMENT_TIMEOUT_S:g}")
    return float(timeout_s)


def exchanges_with_others(group: dist.ProcessGroup | None) -> bool:
    """False where there is nothing to exchange: no process group, one rank, or a fake group (one process)."""
    if not dist.is_available() or not dist.is_initialized():
        return False
    return dist.get_world_size(group) > 1 and dist.get_backend(group) != "fake"


def group_store(group: dist.ProcessGroup | None) -> dist.Store:
    """The key-value store of ``group`` (prefixed with the group's name by torch).

    c10d keeps each group's store but offers no public accessor: read through
    :func:`autotp.adapters.torch_internals.process_group_store`.
    """
    from autotp.adapters.torch_internals import process_group_store

    return process_group_store(group)


def _ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def exchange(value: Any, *, group: dist.ProcessGroup | None, timeout_s: float, what: str) -> list[Any]:
    """Every rank of ``group`` gives ``value``; returns every rank's value, by group rank.

    Waits at most ``timeout_s`` seconds for the others, then raises
    :class:`~autotp.base.errors.RankTimeoutError` naming the ranks that did not arrive. ``what``
    names the point in the program (``"autotp.compile"``); ranks at different points raise
    :class:`~autotp.base.errors.AgreementError`. ``value`` travels by pickle. The process that hosts
    the store (world rank 0) returns or raises only once every rank has read every value.
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if world_size == 1:
        return [value]
    try:
        return _exchange(group_store(group), value, world_size=world_size, rank=rank, timeout_s=timeout_s, what=what)
    except dist.DistNetworkError as exc:
        raise RankTimeoutError(
            f"{what}: rank {rank} lost its connection to the process group's key-value store ({exc}). The process "
            "that hosts it (rank 0, when MASTER_ADDR/MASTER_PORT or tcp:// point at it) has exited: it failed, or "
            "stopped waiting for this rank (agreement_timeout_s); its own error says which."
        ) from None


def _exchange(store: dist.Store, value: Any, *, world_size: int, rank: int, timeout_s: float, what: str) -> list[Any]:
    """:func:`exchange` over ``store``: set, wait for every rank, read, acknowledge; see the module docstring."""
    sequence = store.add(f"{_KEY_PREFIX}/sequence/{rank}", 1)
    base = f"{_KEY_PREFIX}/exchange/{sequence}"
    keys = [f"{base}/{r}" for r in range(world_size)]
    acks = [f"{base}/read/{r}" for r in range(world_size)]
    abandoned = f"{base}/abandoned"
    store.set(keys[rank], pickle.dumps((what, value)))  # type: ignore[arg-type]  # Store.set takes bytes too
    if store.check([abandoned]):
        raise RankTimeoutError(
            f"rank {rank} reached {what} after the other ranks had stopped waiting for it "
            f"({store.get(abandoned).decode()}); start every rank at the same time and give slow ranks "
            "more time with agreement_timeout_s="
        )
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except dist.DistStoreError:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        note = f"{_ranks(missing)} did not arrive within {timeout_s:g} s"
        store.set(abandoned, note)
        raise RankTimeoutError(
            f"{what}: {note} of {world_size} (rank {rank} waited). Those processes crashed, hang, or run "
            "other code (every rank must call autotp at the same points); if they are only slow (a large "
            f"model), pass a larger agreement_timeout_s= (now {timeout_s:g})."
        ) from None
    if sequence > 1:  # every rank set its value here after it had read the previous exchange: its keys can go
        previous = f"{_KEY_PREFIX}/exchange/{sequence - 1}"
        store.delete_key(f"{previous}/{rank}")
        store.delete_key(f"{previous}/read/{rank}")
    sent = store.multi_get(keys)
    # A rank that leaves the exchange (returns, raises, exits) while another still reads would take the store
    # with it if it hosts it: init_process_group's rendezvous (env://, tcp://) has world rank 0 host it. So
    # each rank acknowledges what it read, the host waits for every acknowledgement, and the others leave
    # after one set (no reply to wait for). Under torchrun the agent hosts the store and rank 0 only waits.
    store.set(acks[rank], b"")  # type: ignore[arg-type]
    if dist.get_rank() == 0:
        try:
            store.wait(acks, timedelta(seconds=timeout_s))
        except dist.DistStoreError:
            missing = [r for r, key in enumerate(acks) if not store.check([key])]
            raise RankTimeoutError(
                f"{what}: {_ranks(missing)} arrived but did not confirm reading the others' values within "
                f"{timeout_s:g} s (rank {rank} waited): those processes died or hang after the exchange."
            ) from None
    values = []
    places: dict[str, list[int]] = {}
    for r, payload in enumerate(sent):
        their_what, their_value = pickle.loads(payload)
        places.setdefault(their_what, []).append(r)
        values.append(their_value)
    if len(places) > 1:
        failed_at = [place for place, ranks in places.items()
                     if any(isinstance(values[r], CompileRecord) and values[r].error for r in ranks)]
        if failed_at:  # some ranks failed and went to agree on it while the others went on: say why, everywhere
            records = [value if isinstance(value, CompileRecord) else CompileRecord() for value in values]
            raise AgreementError(_disagreement_message(disagreement(records) or ([], ""), len(records), failed_at[0]))
        where = "; ".join(f"{_ranks(ranks)} at {place}" for place, ranks in places.items())
        raise AgreementError(f"the ranks are at different points of the program: {where}. Every rank must make "
                             "the same autotp calls in the same order (run the same script on every rank). If an "
                             "earlier autotp call failed on some ranks of these same processes, their exchanges are "
                             "out of step since: start every rank anew.")
    return values


def share_from_first(value: Any, *, group: dist.ProcessGroup | None, timeout_s: float, what: str) -> Any:
    """Rank 0 of ``group`` gives ``value`` (the others pass ``None``); every rank gets rank 0's.

    Bounded as :func:`exchange`, which it is (the other ranks send nothing but their presence).
    """
    return exchange(value if dist.get_rank(group) == 0 else None, group=group, timeout_s=timeout_s, what=what)[0]


# --------------------------------------------------------------------------- what ranks compare

@dataclasses.dataclass(frozen=True)
class WeightChecksum:
    """A cheap fingerprint of one tensor's values.

    ``sample``: hash of the bytes of up to 1024 evenly spaced elements (exact); ``total`` and
    ``total_sq``: float64 sum and sum of squares of every element, compared with a relative
    tolerance of 1e-10 of the sum of magnitudes (ranks may sum in another order).
    """

    shape: tuple[int, ...]
    dtype: str
    sample: str
    total: float
    total_sq: float

    def matches(self, other: WeightChecksum) -> bool:
        if (self.shape, self.dtype, self.sample) != (other.shape, other.dtype, other.sample):
            return False
        scale_sq = max(self.total_sq, other.total_sq)
        numel = math.prod(self.shape)
        return (abs(self.total - other.total) <= _SUM_RTOL * math.sqrt(numel * scale_sq) + 1e-300
                and abs(self.total_sq - other.total_sq) <= _SUM_RTOL * scale_sq + 1e-300)


def weight_checksum(tensor: torch.Tensor) -> WeightChecksum:
    """:class:`WeightChecksum` of ``tensor`` (one read of its values; float64 in bounded chunks).

    A tensor subclass (a quantized weight) is summed over its parts (data, scales...), which are
    what the ranks hold; its dtype reads ``Int8Tensor(int8, float32, ...)``.
    """
    if is_subclass_weight(tensor):
        parts = [weight_checksum(part) for part in inner_tensors(tensor).values()]
        samples = "".join(part.sample for part in parts).encode()
        return WeightChecksum(tuple(tensor.shape),
                              f"{type(tensor).__name__}({', '.join(p.dtype.removeprefix('torch.') for p in parts)})",
                              hashlib.sha256(samples).hexdigest()[:16],
                              sum(p.total for p in parts), sum(p.total_sq for p in parts))
    flat = tensor.detach().reshape(-1)
    numel = flat.numel()
    if numel == 0:
        return WeightChecksum(tuple(tensor.shape), str(tensor.dtype), "", 0.0, 0.0)
    step = max(1, numel // _SAMPLE_ELEMENTS)
    # a copy: numpy() of a view would pin the weight's storage (release_full_weights resizes it later)
    sample = flat[::step][:_SAMPLE_ELEMENTS].to("cpu", copy=True).contiguous()
    sample_bytes = sample.view(torch.uint8).numpy().tobytes() if sample.element_size() else b""
    total = total_sq = 0.0
    for start in range(0, numel, _CHUNK_ELEMENTS):
        chunk = flat[start:start + _CHUNK_ELEMENTS].to(torch.float64)
        total += chunk.sum().item()
        total_sq += chunk.square().sum().item()
    return WeightChecksum(tuple(tensor.shape), str(tensor.dtype), hashlib.sha256(sample_bytes).hexdigest()[:16],
                          total, total_sq)


@dataclasses.dataclass(frozen=True)
class CompileRecord:
    """What one rank tells the others before planning (small: names, shapes, hashes).

    ``error``: ``"Type: message"`` when this rank failed before it could plan (its other fields
    are then empty). ``options``: option name -> printed value. ``parameters``: FQN -> shape
    and dtype of every parameter and buffer of the graph. ``inputs``: argument -> shape and
    dtype (tensors) or value. ``weights``: FQN -> checksum, ``None`` when skipped.
    """

    error: str = ""
    fingerprint: str = ""
    options: tuple[tuple[str, str], ...] = ()
    parameters: tuple[tuple[str, str], ...] = ()
    inputs: tuple[tuple[str, str], ...] = ()
    weights: tuple[tuple[str, WeightChecksum], ...] | None = None
    torch_version: str = torch.__version__
    arguments: tuple[tuple[str, str, str], ...] = ()
    """(node, op, hash of its constant arguments) of every call: the graph fingerprint has names,
    ops and shapes only, so a setting that is not a weight (GELU's ``approximate``, an eps) shows here."""
    graph: bytes = b""
    """The graph's lines (:func:`autotp.planning.plan.graph_lines`), compressed: where fingerprints differ, the
    first node that differs is named (the lines of a decoder's layers repeat, so they compress well)."""


def _leaf_labels(in_spec: pytree.TreeSpec) -> list[str]:
    """A readable name of each flat input: ``input_ids (argument 0)``, ``use_cache``, ``batch['x']``."""
    positions = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    labels = [""] * in_spec.num_leaves
    for path, index in pytree.tree_flatten_with_path(positions)[0]:
        head, rest = path[0], path[1:]
        if getattr(head, "idx", None) == 0 and rest:  # positional arguments
            label = f"argument {rest[0].idx}" + pytree.keystr(rest[1:])  # type: ignore[attr-defined]
        elif rest:
            label = pytree.keystr(rest).removeprefix("['").removesuffix("']") if len(rest) == 1 else pytree.keystr(rest)
        else:
            label = pytree.keystr(path)
        labels[index] = label
    return labels


def _user_specs(captured: CapturedGraph) -> list[tuple[int, Any]]:
    """``(flat input index, export argument)`` of every user input of ``captured``."""
    specs = captured.exported.graph_signature.input_specs
    return [(int(slot.target), spec.arg) for slot, spec in zip(captured.inputs, specs)
            if slot.kind == "user" and spec.kind == InputKind.USER_INPUT]


def _tensor_text(value: Any) -> str:
    return f"{concrete_shape(value)} {str(value.dtype).removeprefix('torch.')}"


def options_record(options: Mapping[str, object], *, weights: Mapping[str, torch.Tensor] | None) -> CompileRecord:
    """A :class:`CompileRecord` of options and weight checksums only, for callers that capture later
    (generation builds its decode and prefill graphs after the ranks agree)."""
    summed = None if weights is None else tuple((fqn, weight_checksum(t)) for fqn, t in sorted(weights.items()))
    return CompileRecord(options=tuple((name, str(value)) for name, value in options.items()), weights=summed)


def compile_record(captured: CapturedGraph, *, options: Mapping[str, object],
                   weights: Mapping[str, torch.Tensor] | None,
                   checksums: Any = None) -> CompileRecord:
    """This rank's :class:`CompileRecord`; ``weights`` (FQN -> full tensor) is checksummed unless ``None``.

    ``checksums`` (optional, a ``WeakIdKeyDictionary``) caches checksums by tensor, for callers
    that record the same weights many times (the ``torch.compile`` backend, once per input size).
    """
    placeholders = {n.name: n for n in captured.graph_module.graph.nodes if n.op == "placeholder"}
    held = [(str(slot.target), _tensor_text(placeholders[slot.name].meta["val"]))
            for slot in captured.inputs if slot.kind in ("parameter", "buffer")]
    labels = _leaf_labels(captured.in_spec)
    inputs = []
    for index, arg in _user_specs(captured):
        if isinstance(arg, ConstantArgument):
            inputs.append((labels[index], repr(arg.value)))
        else:
            value = placeholders[arg.name].meta.get("val") if arg.name in placeholders else None
            inputs.append((labels[index], _tensor_text(value) if isinstance(value, torch.Tensor) else repr(value)))
    summed: list[tuple[str, WeightChecksum]] = []
    if weights is not None:
        for fqn, tensor in sorted(weights.items()):
            found = checksums.get(tensor) if checksums is not None else None
            if found is None:
                if not is_subclass_weight(tensor) and tensor.numel() and tensor.untyped_storage().nbytes() == 0:
                    continue  # released by AutoTPBackend.release_full_weights before it was ever checked
                found = weight_checksum(tensor)
                if checksums is not None:
                    checksums[tensor] = found
            summed.append((fqn, found))
    return CompileRecord(
        fingerprint=graph_fingerprint(captured.graph_module),
        graph=zlib.compress("\n".join(graph_lines(captured.graph_module)).encode()),
        arguments=constant_arguments(captured.graph_module),
        options=tuple((name, str(value)) for name, value in options.items()),
        parameters=tuple(held),
        inputs=tuple(inputs),
        weights=tuple(summed) if weights is not None else None,
    )


def constant_arguments(gm: torch.fx.GraphModule) -> tuple[tuple[str, str, str], ...]:
    """:attr:`CompileRecord.arguments` of ``gm``. Devices count by type only (ranks trace on their own GPU)."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        leaves = [leaf.type if isinstance(leaf, torch.device) else leaf
                  for leaf in pytree.tree_leaves((node.args, node.kwargs)) if not isinstance(leaf, torch.fx.Node)]
        found.append((node.name, str(node.target), hashlib.sha256(repr(leaves).encode()).hexdigest()[:8]))
    return tuple(found)


def _grouped(values: Sequence[object]) -> dict[object, list[int]]:
    groups: dict[object, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return groups


def _differs(name: str, values: Sequence[object]) -> str | None:
    """``"name: rank 0 X; rank 1 Y"`` when the ranks' values differ (``None``: missing)."""
    groups = _grouped(values)
    if len(groups) == 1:
        return None
    shown = "; ".join(f"{_ranks(ranks)} {'(missing)' if value is None else value}" for value, ranks in groups.items())
    return f"{name}: {shown}"


def _listed(lines: list[str], what: str) -> list[str]:
    if len(lines) <= _MAX_LISTED:
        return lines
    return [*lines[:_MAX_LISTED], f"... and {len(lines) - _MAX_LISTED} more {what}"]


def _field_differences(records: Sequence[CompileRecord], field: str, what: str) -> list[str]:
    tables = [dict(getattr(r, field)) for r in records]
    names = list(dict.fromkeys(name for table in tables for name in table))
    lines = [line for name in names if (line := _differs(f"{what} {name}", [t.get(name) for t in tables]))]
    return _listed(lines, f"{what}s")


_SAME_MODEL = ("Every rank must build the same model (same config, same layers) and pass example inputs of the same "
               "shapes and dtypes.")


def _first_differing_node(records: Sequence[CompileRecord]) -> str | None:
    """``"first differing node (#i): rank 0 <name:op:shape>; rank 1 ..."`` from the records' graph lines."""
    if any(not r.graph for r in records):
        return None
    graphs = [zlib.decompress(r.graph).decode().split("\n") for r in records]
    for index in range(max(map(len, graphs))):
        row = [g[index] if index < len(g) else "(no more nodes)" for g in graphs]
        if len(set(row)) > 1:
            return _differs(f"first differing node (#{index}, name:op:shape)", row)
    return None


def disagreement(records: Sequence[CompileRecord]) -> tuple[list[str], str] | None:
    """What differs between the ranks' records (one line each) and how to fix it; ``None`` when they agree."""
    failed = {rank: r.error for rank, r in enumerate(records) if r.error}
    if failed:
        lines = [f"{_ranks([rank])} failed: {error}" for rank, error in failed.items()]
        succeeded = [rank for rank in range(len(records)) if rank not in failed]
        if succeeded:
            lines.append(f"{_ranks(succeeded)} succeeded and waited for the others")
        return lines, "Fix the error on the failing rank(s): every rank must trace the model and accept the options."
    lines = _field_differences(records, "options", "option")
    if lines:
        return lines, "Pass the same options on every rank (run the same script with the same arguments)."
    if len({r.fingerprint for r in records}) > 1:
        lines = _field_differences(records, "parameters", "parameter") + _field_differences(records, "inputs", "input")
        if not lines:
            versions = _differs("torch version", [r.torch_version for r in records])
            lines = [versions] if versions else []
            lines.append("the traced graphs differ although their parameters and input shapes agree "
                         f"(fingerprints: {_differs('graph', [r.fingerprint for r in records])})")
            first = _first_differing_node(records)
            if first is not None:
                lines.append(first)
        return lines, _SAME_MODEL
    if len({r.arguments for r in records}) > 1:  # same structure, other settings (an activation's variant, an eps)
        name, op, _ = next(row[0] for row in zip(*(r.arguments for r in records)) if len(set(row)) > 1)
        hashes = [dict((n, h) for n, _, h in r.arguments).get(name) for r in records]
        line = _differs(f"constant arguments of node {name} ({op}), a setting that is not a weight", hashes)
        assert line is not None  # the ranks' hashes differ at this node
        return [line], _SAME_MODEL
    if any(r.weights is None for r in records):
        return None  # check_weights=False everywhere (a difference in it is an option difference above)
    tables = [dict(r.weights or ()) for r in records]
    reference = tables[0]
    # without a traced graph to compare (generation agrees before capturing), names and shapes come from here
    names = list(dict.fromkeys(fqn for table in tables for fqn in table))
    shaped = [line for fqn in names if (line := _differs(
        f"weight {fqn}", [f"{c.shape} {c.dtype.removeprefix('torch.')}" if c else None
                          for c in (table.get(fqn) for table in tables)]))]
    if shaped:  # other values follow from other shapes (and from drawing them in another order): not listed
        return _listed(shaped, f"weights of other shapes (of {len(names)})"), _SAME_MODEL
    lines = []
    for fqn in names:
        first = reference[fqn]
        other = [rank for rank, table in enumerate(tables) if not first.matches(table[fqn])]
        if other:
            lines.append(f"weight {fqn}: {_ranks(other)} {'holds' if len(other) == 1 else 'hold'} other values than "
                         f"rank 0 (sum {tables[other[0]][fqn].total:.6g} vs {first.total:.6g})")
    if lines:
        return (_listed(lines, f"differing weights (of {len(names)})"),
                "Every rank must hold the same full weights: seed the random number generator the same way on every "
                "rank before building the model (torch.manual_seed(0)), or load the same checkpoint. For a huge model "
                "loaded from one checkpoint, check_weights=False skips this check.")
    return None


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _agree(record: CompileRecord, failure: Exception | None, *, group: dist.ProcessGroup | None,
           timeout_s: float, what: str) -> None:
    records = exchange(record, group=group, timeout_s=timeout_s, what=what)
    errors = {r.error for r in records}
    if failure is not None and len(errors) == 1:
        raise failure  # the same error on every rank: raise it as it is (its own type and traceback)
    found = disagreement(records)
    if found is not None:
        raise AgreementError(_disagreement_message(found, len(records), what)) from failure


def _disagreement_message(found: tuple[list[str], str], ranks: int, what: str) -> str:
    """The error every rank raises when ``ranks`` records disagree as ``found`` (:func:`disagreement`) says."""
    lines, hint = found
    return (f"the {ranks} ranks disagree at {what}; every rank raises this error:\n  - "
            + "\n  - ".join(line.replace("\n", "\n      ") for line in lines) + f"\n{hint}")


class _Agreement:
    """What the body of :func:`ranks_agree` fills in: this rank's :class:`CompileRecord`."""

    record: CompileRecord | None = None
    extra_wait_s: float = 0.0
    """Seconds the ranks may wait at the exchange beyond ``timeout_s``, set alike on every rank: work some
    rank does after its record and before the exchange (rank 0 plans ahead, up to the solver's time limit)."""


@contextlib.contextmanager
def ranks_agree(group: dist.ProcessGroup | None, *, timeout_s: float, what: str) -> Iterator[_Agreement]:
    """Run the body on every rank, then make the ranks agree on its outcome.

    The body sets ``agreement.record`` (:func:`compile_record`). If it raises, this rank sends the
    error instead, so the others do not wait for it. Then every rank compares every rank's
    record: when all failed with the same error, each raises its own; otherwise any difference
    (a failure on some ranks, options, graph, weights) raises the same
    :class:`~autotp.base.errors.AgreementError` on every rank.
    """
    agreement = _Agreement()
    if not exchanges_with_others(group):
        yield agreement
        return
    try:
        yield agreement
    except AgreementError:
        raise  # raised by an exchange in the body on every rank that reached it: nobody waits for the others again
    except Exception as exc:  # noqa: BLE001 - the other ranks must learn of it, then it is raised
        _agree(CompileRecord(error=_error_text(exc)), exc, group=group, timeout_s=timeout_s, what=what)
        raise
    if agreement.record is None:
        raise AgreementError(f"internal: {what} made no record to agree on")
    _agree(agreement.record, None, group=group, timeout_s=timeout_s + agreement.extra_wait_s, what=what)


def agreed_options(options: PlanOptions, **extra: object) -> dict[str, object]:
    """The planning options every rank must share, printed as :class:`CompileRecord` holds them, plus ``extra``.

    ``outputs``, ``dropout``, ``activation_checkpointing`` and ``expert_load`` (a hash of its JSON) appear only when
    not their defaults, so records of compiles that leave them out read as before."""
    optional = {name: getattr(options, name) for name, default in
                (("outputs", "replicated"), ("dropout", "replicated"), ("activation_checkpointing", None))
                if getattr(options, name) != default}
    if options.expert_load is not None:  # measured per rank on other batches, it would price other plans
        optional["expert_load"] = hashlib.sha256(options.expert_load.to_json().encode()).hexdigest()[:8]
    return {"world_size": options.world_size, "hardware": hardware_text(options.hardware_profile),
            "memory_budget": repr(options.memory_budget), "constraints": constraints_text(options.constraints),
            "strict": options.strict, "optimizer_states": options.optimizer_states, **optional, **extra}


def hardware_text(hardware: Any) -> str:
    """A hardware option as the ranks compare it: the profile's name and a hash of all its fields."""
    from autotp.cost_model import get_hardware

    profile = get_hardware(hardware)
    return f"{profile.name} (profile {hashlib.sha256(profile.to_json().encode()).hexdigest()[:8]})"


def constraints_text(constraints: Mapping[str, Any] | None) -> str:
    """Constraints as the ranks compare them: sorted ``pattern=placement`` pairs."""
    if not constraints:
        return "none"
    return ", ".join(f"{pattern}={placement}" for pattern, placement in sorted((str(k), str(v)) for k, v in constraints.items()))


def plan_text(plan: Any) -> str:
    """A ``plan=`` option as the ranks compare it: a hash of what applying it reads (world size, every
    node's placements, every parameter's placement), not of its timings or predictions."""
    if plan is None:
        return "none (rank 0 plans)"
    applied = [plan.world_size, sorted(plan.parameters.items()),
               [(node.name, list(node.inputs), node.output) for node in plan.nodes]]
    return f"plan {hashlib.sha256(repr(applied).encode()).hexdigest()[:16]}"


# --------------------------------------------------------------------------- every call

class InputGuard:
    """Checks each call of a tensor-parallel model against the traced call and the other ranks.

    - A non-tensor argument (``scale=1.0``, ``use_cache=False``) is baked into the traced graph:
      another value raises :class:`~autotp.base.errors.TracedValueError` (never silently the traced value).
    - Tensor inputs must have the same shapes and dtypes on every rank (the rewritten graph
      reads every input whole on every rank): one :func:`exchange` per new signature, then cached.
    """

    def __init__(self, captured: CapturedGraph, *, group: dist.ProcessGroup | None, timeout_s: float) -> None:
        labels = _leaf_labels(captured.in_spec)
        self._labels = labels
        self._constants = tuple((index, labels[index], arg.value) for index, arg in _user_specs(captured)
                                if isinstance(arg, ConstantArgument))
        self._tensors = tuple(index for index, arg in _user_specs(captured) if isinstance(arg, TensorArgument))
        self._group = group
        self.timeout_s = timeout_s  # agreement_timeout_s: how long this group's ranks wait for each other
        self._exchanges = exchanges_with_others(group)
        self._checked: set[tuple] = set()

    def check(self, flat: Sequence[Any]) -> None:
        """Raise unless ``flat`` (the flattened call inputs) may run the traced graph on every rank."""
        for index, label, traced in self._constants:
            given = flat[index]
            if not _same_constant(given, traced):
                raise TracedValueError(
                    f"{label} was {traced!r} when the model was traced, and that value is part of the tensor-parallel "
                    f"graph; this call passes {given!r}. Call it with {traced!r}, or compile again with {given!r} in "
                    "example_inputs/example_kwargs (one compiled model per value); a number that changes between "
                    "calls can be passed as a tensor (torch.tensor(...)), which stays an input of the graph."
                )
        signature = []
        for index in self._tensors:
            value = flat[index]
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{self._labels[index]} was a tensor when the model was traced; this call passes "
                                f"{type(value).__name__} {value!r}. Pass a tensor, or compile again with this value.")
            signature.append((tuple(value.shape), value.dtype))
        key = tuple(signature)
        if key in self._checked:
            return
        if self._exchanges:
            seen = exchange(key, group=self._group, timeout_s=self.timeout_s, what="a call with new input shapes")
            if len(set(seen)) > 1:
                lines = []
                for position, index in enumerate(self._tensors):
                    line = _differs(self._labels[index], [
                        f"{s[position][0]} {str(s[position][1]).removeprefix('torch.')}" for s in seen])
                    if line:
                        lines.append(line)
                raise AgreementError(
                    f"the {len(seen)} ranks call the tensor-parallel model with different inputs; every rank raises "
                    "this error:\n  - " + "\n  - ".join(lines) + "\nEvery rank must pass inputs of the same shapes "
                    "and dtypes (each rank reads the whole input; the ranks split the weights, not the batch)."
                )
        self._checked.add(key)


def _same_constant(given: object, traced: object) -> bool:
    if isinstance(given, torch.Tensor) or isinstance(given, bool) != isinstance(traced, bool):
        return False
    try:
        return bool(given == traced)
    except Exception:  # noqa: BLE001 - values that cannot be compared are not the same
        return False
