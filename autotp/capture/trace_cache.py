"""The trace cache: ``torch.export``'s program for a model, kept on disk so the next load skips tracing.

Tracing a large model with dynamic batch and sequence dims is most of a load's time (about 80 % of
``autotp.from_pretrained`` on a 16-layer Llama). The program ``torch.export`` returns depends only
on the model's code and structure, the example inputs' specs and the export options, not on the
weights, so it can be stored once and reused by every later load of the same model, on every rank.

What is stored: the program *without weights* (``torch.export``'s own serialized form, the
``torch._export.serde`` schema, pickled; functionalized where it writes in place, as
:mod:`autotp.capture.tracing` hands it on), the names, shapes and dtypes of the parameters and buffers it
was traced with, and the values of lifted constants that are real tensors. For a decoder whose
program was stamped from a few traced layers (:mod:`autotp.capture.stamping`) that is the traced layers'
program, stamped out again on a hit (quicker to rebuild than all the layers). On a hit the weights
are bound back from the model (real tensors), or presented as fake tensors on the trace device (a
model on ``meta``, as :func:`autotp.capture.tracing.as_if_on` does), so the result is the program export
would have returned.

The key (a SHA-256) covers everything the program depends on: the model's class, every
submodule's class, source file contents and plain attributes (``eps``, ``num_heads``, a
transformers config), every parameter's and buffer's name, shape and dtype, the example inputs'
structure, shapes, dtypes and non-tensor values, the dynamic-shape request, the trace device,
train/eval mode, ``training``, and the versions of torch, autotp's capture code and the model's
library. An entry is also checked when read: a SHA-256 of its bytes (a truncated or altered file),
and its parameter names, shapes and dtypes against the model's. A stale, corrupt or unreadable
entry is never used: it is ignored with a warning naming the file and why, the model is traced
again and the entry rewritten.

**Plans.** The plan made for a traced graph is kept beside it (``plans/<key>.json``, the plan's own
JSON), keyed by the graph's fingerprint, the plan options and the contents of autotp's source
files; the first rank reuses it after checking it against the graph as a given ``plan=`` is
(:mod:`autotp.planning.plan_cache`, :func:`autotp.runtime.agreement.group.plan_on_first_rank`).

**Why torch's private schema, not ``torch.export.save``.** ``torch.export.save`` / ``load`` write and
read the same ``torch._export.serde`` schema with the weights. Measured with
``benchmarks/trace_cache_io.py`` (a 16-layer Llama of hidden 1024 on the meta device, one process, medians
of 3; docs/benchmarks/loading.md): a round trip through them took 36 s (BytesIO) and 45 s (a file)
against this module's 0.97 s, 37-47x (they carry all 16 layers, this form the stamped twin's 3, and they
check and canonicalize the program again), and ``torch.export.load`` gave real storage (125 MiB) where the
meta model has fake weights, which tracing on ``meta`` exists to avoid. So the entry is the schema without weights, made and
read by :func:`_serialize` and :func:`_deserialize`, the only code here that touches ``torch._export``.
They are tested on the torch releases of :data:`autotp.adapters.torch_internals.RELEASES`, which reads
``torch._export.serde`` for them (:func:`~autotp.adapters.torch_internals.export_serde`); on another release (or one that
lacks a name they use) the cache is off and every rank of a group traces its own program, with one
warning naming the tested releases (:func:`serde_unsupported`), so a changed schema never gives a
wrong program.

Where: ``trace_cache=True`` uses ``$AUTOTP_CACHE_DIR`` (default ``~/.cache/autotp``) unless
``$AUTOTP_CACHE=0``; a path uses that directory (always); ``False``/``None`` turns it off. A
checkpoint directory is never written to: a cache directory inside it is refused with a warning
(no cache). Entries are written atomically (a temporary file renamed), so ranks sharing a
directory never read a half-written entry. The files are Python pickles: keep the cache
directory private (it is created with mode 0700), as for any compiler cache.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import inspect
import json
import operator
import os
import pickle
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from autotp.adapters import torch_internals, torchao
from autotp.adapters.torch_internals import FakeTensor, FakeTensorMode, serde_unsupported

__all__ = ["FORMAT", "TraceCache", "default_cache_dir", "file_digest", "open_trace_cache",
           "serde_unsupported"]

_MAGIC = b"autotp-trace-cache 1\n"
FORMAT = 1
_STALE_LOCK_S = 600.0


def default_cache_dir() -> Path:
    """``$AUTOTP_CACHE_DIR``, else ``~/.cache/autotp`` (``$XDG_CACHE_HOME/autotp`` when that is set)."""
    given = os.environ.get("AUTOTP_CACHE_DIR")
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autotp"


def open_trace_cache(setting: bool | str | os.PathLike[str] | None,
                     checkpoint: str | os.PathLike[str] | None = None) -> TraceCache | None:
    """The cache that ``setting`` asks for, or None (off).

    ``True``: the default directory (:func:`default_cache_dir`), unless ``$AUTOTP_CACHE`` is ``0``
    (or ``false``/``off``/``no``); a path: that directory; ``False``/``None``: off. A directory
    inside ``checkpoint`` (which is only ever read) is refused with a warning.
    """
    if setting is None or setting is False:
        return None
    if (why := serde_unsupported()) is not None:
        warnings.warn(f"autotp: tracing without the trace cache: {why}; every load traces the model "
                      f"(install torch {torch_internals.RELEASES} for the cache)", stacklevel=3)
        return None
    if setting is True:
        if os.environ.get("AUTOTP_CACHE", "1").strip().lower() in ("0", "false", "off", "no"):
            return None
        directory = default_cache_dir()
    else:
        directory = Path(setting).expanduser()
    if checkpoint is not None:
        root = Path(checkpoint).expanduser().resolve()
        root = root.parent if root.is_file() else root
        resolved = directory.resolve()
        if resolved == root or root in resolved.parents:
            warnings.warn(f"autotp: the trace cache directory {directory} is inside the checkpoint directory {root}, "
                          "which autotp never writes to; tracing without the cache. Set AUTOTP_CACHE_DIR (or "
                          "trace_cache=) to a directory outside the checkpoint.", stacklevel=3)
            return None
    return TraceCache(directory)


def file_digest(path: str, memo: dict[str, str]) -> str:
    """The first 16 hex digits of the SHA-256 of a file's bytes (memoised in ``memo``), or ``unreadable``."""
    if path not in memo:
        try:
            memo[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
        except OSError:
            memo[path] = "unreadable"
    return memo[path]


def _plain(value: Any) -> Any:
    """A JSON-able description of a plain attribute value, or None when it is not plain."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (tuple, list)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    return None


def _model_description(model: torch.nn.Module, memo: dict[str, str]) -> list[Any]:
    """Every submodule: name, class, its source file's hash, plain attributes and config."""
    described = []
    configs_seen: set[int] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        cls = type(module)
        try:
            source = inspect.getsourcefile(cls) or ""
        except TypeError:
            source = ""
        attributes = {}
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("_") and attr not in ("_is_hf_initialized",):
                continue
            plain = _plain(value)
            if plain is not None:
                attributes[attr] = plain
            elif hasattr(value, "to_json_string") and id(value) not in configs_seen:  # a transformers config
                configs_seen.add(id(value))
                try:
                    attributes[attr] = value.to_json_string(use_diff=False)
                except Exception:  # noqa: BLE001 - any config that cannot say itself: its repr
                    attributes[attr] = repr(value)
        described.append([name, f"{cls.__module__}.{cls.__qualname__}", file_digest(source, memo) if source else "",
                          attributes])
    return described


def _tensor_spec(tensor: torch.Tensor, device: torch.device) -> list[Any]:
    shown = device if tensor.device.type == "meta" else tensor.device
    spec = [list(tensor.shape), list(tensor.stride()), str(tensor.dtype), str(shown), bool(tensor.requires_grad)]
    if torchao.is_subclass_weight(tensor):  # a quantized weight: its scheme and parts make another program
        spec += [type(tensor).__qualname__, [_tensor_spec(part, device) for part in torchao.inner_tensors(tensor).values()]]
    return spec


def _state_spec(model: torch.nn.Module, device: torch.device) -> dict[str, list[Any]]:
    spec = {f"p:{n}": _tensor_spec(p, device) for n, p in model.named_parameters(remove_duplicate=False)}
    spec.update({f"b:{n}": _tensor_spec(b, device) for n, b in model.named_buffers(remove_duplicate=False)})
    return spec


def _library_version(model: torch.nn.Module) -> str:
    package = type(model).__module__.split(".")[0]
    try:
        return f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        return package


_CAPTURE_SOURCES = (os.path.join("capture", "tracing.py"), os.path.join("capture", "stamping.py"),
                    os.path.join("capture", "trace_cache.py"), os.path.join("adapters", "hf_transformers.py"),
                    os.path.join("adapters", "torchao.py"), os.path.join("runtime", "generation", "kv_cache.py"))
"""autotp's files (under its package) whose code shapes a traced program beyond the model's own: the tracing, the
calls into transformers and torchao, and the KV-cache wrapper."""


def trace_key(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_shapes: Any,
              *, device: torch.device, training: bool, purpose: str = "capture") -> str:
    """The SHA-256 naming the program ``torch.export`` makes of ``model(*args, **kwargs)`` (see the module docstring).

    ``purpose`` names what the program is made for, when two callers trace the same model and inputs into
    different programs: ``"capture"`` (:mod:`autotp.capture.tracing`: functionalized where it writes in place),
    ``"pipeline stages"`` (:func:`autotp.runtime.mesh.mesh_module.split_stages`: ``torch.export``'s program as
    it is)."""
    memo: dict[str, str] = {}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the autotp package folder
    leaves, spec = pytree.tree_flatten((args, kwargs))
    inputs = [_tensor_spec(leaf, device)[:4] if isinstance(leaf, torch.Tensor) else [type(leaf).__name__, repr(leaf)]
              for leaf in leaves]
    description = {
        "format": FORMAT,
        "purpose": purpose,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "autotp capture": [file_digest(os.path.join(here, f), memo) for f in _CAPTURE_SOURCES],
        "library": _library_version(model),
        "model": _model_description(model, memo),
        "state": _state_spec(model, device),
        "inputs": [str(spec), inputs],
        "dynamic_shapes": repr(dynamic_shapes),
        "device": str(device),
        "training": training,
        "default dtype": str(torch.get_default_dtype()),
    }
    text = json.dumps(description, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class _Entry:
    """What one cache file holds (pickled after :data:`_MAGIC` and the payload's SHA-256)."""

    key: str
    program: Any  # torch._export.serde.schema.ExportedProgram, without weights
    state: dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype, bool, bool]]
    """State-dict FQN -> (shape, stride, dtype, is a Parameter, requires_grad) as traced."""
    constants: dict[str, Any]
    """Constant FQN -> a real tensor (stored), or (shape, stride, dtype) of a fake one."""
    stamp: tuple[str, int] | None = None
    """For a stamped program (:mod:`autotp.capture.stamping`): the list of layers (FQN, length); ``program`` is
    then the twin's (a few layers), stamped out again when read."""


class TraceCache:
    """A directory of traced programs (see the module docstring); :meth:`get` and :meth:`put` by key."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, key: str) -> Path:
        return self.directory / "traces" / f"{key}.pt2c"

    def get(self, key: str, model: torch.nn.Module, device: torch.device) -> ExportedProgram | None:
        """The cached program for ``key``, its weights bound to ``model``'s; None (a miss) when there is
        none, or with a warning when the entry is corrupt, unreadable or does not fit ``model``."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            exported, problem = _bind(_read_entry(path, key), model, device)
            if exported is not None:
                return exported
        except Exception as exc:  # noqa: BLE001 - any failure to read means: trace again
            problem = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        warnings.warn(f"autotp: ignoring the trace cache entry {path} ({problem}); tracing the model again",
                      stacklevel=3)
        return None

    def get_or_export(self, key: str, model: torch.nn.Module, device: torch.device,
                      export: Callable[[], ExportedProgram]) -> tuple[ExportedProgram, bool, Callable[[], None] | None]:
        """The cached program for ``key`` (:meth:`get`), else ``export()``'s; whether it came from the cache, and
        the write of a new one (:meth:`put`, left to the caller: after sharing it, ``Traced.store``)."""
        exported = self.get(key, model, device)
        if exported is not None:
            return exported, True, None
        exported = export()
        return exported, False, functools.partial(self.put, key, exported)

    def put(self, key: str, exported: ExportedProgram, *, payload: bytes | None = None) -> None:
        """Store ``exported`` (as ``torch.export`` returned it) under ``key``; a failure to write only warns.

        ``payload``: ``exported`` already serialized by :func:`program_bytes` for the same ``key`` (rank 0
        made it to send to its group), written as it is instead of serializing the program again.

        Of several processes storing the same key at once (the ranks of one load), the one that
        creates ``<key>.lock`` first writes; the others skip (a lock older than ten minutes is stale).
        """
        path = self.path(key)
        lock = path.with_suffix(".lock")
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
                    lock.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
            try:
                os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                return  # another process is writing this entry
            try:
                if payload is None or key.encode() not in payload:  # (the key is pickled as it is, in the entry)
                    payload = pickle.dumps(_entry(key, exported), protocol=pickle.HIGHEST_PROTOCOL)
                _write_payload(path, payload)
            finally:
                lock.unlink(missing_ok=True)
        except Exception as exc:  # noqa: BLE001 - the cache is an optimisation: loading goes on
            warnings.warn(f"autotp: could not write the trace cache entry {path} "
                          f"({type(exc).__name__}: {exc}); the next load traces again", stacklevel=3)


    def plan_path(self, key: str) -> Path:
        """Where the plan stored under ``key`` lives (:mod:`autotp.planning.plan_cache` reads and writes it)."""
        return self.directory / "plans" / f"{key}.json"

    def write_plan_text(self, key: str, text: str) -> None:
        """Store a plan's JSON ``text`` under ``key`` (atomically); a failure to write only warns."""
        path = self.plan_path(key)
        try:
            _write_atomically(path, text.encode())
        except Exception as exc:  # noqa: BLE001 - the cache is an optimisation
            warnings.warn(f"autotp: could not write the cached plan {path} ({type(exc).__name__}: {exc})", stacklevel=4)


def program_bytes(key: str, exported: ExportedProgram) -> bytes:
    """``exported`` without its weights, as bytes (what a cache entry holds), for another process
    to rebuild with :func:`program_from_bytes` (one rank traces for its group:
    :mod:`autotp.runtime.agreement.shared_trace`). ``TypeError`` when the installed torch cannot (:func:`serde_unsupported`)."""
    if (why := serde_unsupported()) is not None:
        raise TypeError(f"cannot send a traced program: {why}")
    return pickle.dumps(_entry(key, exported), protocol=pickle.HIGHEST_PROTOCOL)


def program_from_bytes(data: bytes, key: str, model: torch.nn.Module, device: torch.device) -> ExportedProgram | None:
    """The program of :func:`program_bytes` with ``model``'s weights bound, or None when it was made
    for another key or its parameters do not fit ``model``."""
    entry = pickle.loads(data)
    if not isinstance(entry, _Entry) or entry.key != key:
        return None
    return _bind(entry, model, device)[0]


def _bind(entry: _Entry, model: torch.nn.Module, device: torch.device) -> tuple[ExportedProgram | None, str | None]:
    """The program of ``entry`` with ``model``'s weights bound (stamped out to all its layers when the entry
    holds a twin's), or None and why it does not fit ``model``."""
    from autotp.capture import stamping

    if entry.stamp is None:
        problem = _mismatch(entry, model)
        return (_rebuild(entry, model, device), None) if problem is None else (None, problem)
    path, count = entry.stamp
    twin = stamping.twin(model, path, count)
    if twin is None:
        return None, f"it was stamped from {path} of {count} layers, which the model does not have"
    problem = _mismatch(entry, twin)
    if problem is not None:
        return None, problem
    try:
        return stamping.restamp(_rebuild(entry, twin, device), model, path, count), None
    except stamping.StampError as exc:
        return None, f"its program does not stamp out to the model's layers: {exc}"


def _entry(key: str, exported: ExportedProgram) -> _Entry:
    from autotp.capture.stamping import stamped_from

    stamped = stamped_from(exported)
    if stamped is not None:  # the twin's program: a few layers, stamped out again when read
        return dataclasses.replace(_entry(key, stamped.traced), stamp=(stamped.path, stamped.count))

    program = _serialize(exported)
    state = {fqn: (tuple(t.shape), tuple(t.stride()), t.dtype, isinstance(t, torch.nn.Parameter), bool(t.requires_grad))
             for fqn, t in exported.state_dict.items()}
    constants: dict[str, Any] = {}
    # the model's non-persistent buffers (a KV cache, RoPE's inv_freq) are bound from the model on rebuild
    buffers = {spec.target for spec in exported.graph_signature.input_specs if spec.kind == InputKind.BUFFER}
    for fqn, value in exported.constants.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"constant {fqn} is a {type(value).__name__}, not a tensor")
        if isinstance(value, FakeTensor) or value.device.type == "meta" or fqn in buffers:
            constants[fqn] = (tuple(value.shape), tuple(value.stride()), value.dtype)
        else:
            constants[fqn] = value.detach().cpu() if value.device.type != "cpu" else value.detach()
    return _Entry(key, program, state, constants)


def _symbolic_key(value: Any) -> Any:
    """A hashable stand-in for an int or a SymInt: the int, or the SymInt's sympy expression."""
    return value.node.expr if isinstance(value, torch.SymInt) else int(value)


def _serialize(exported: ExportedProgram) -> Any:
    """``torch._export.serde``'s schema form of ``exported``'s program, without weights (not
    ``torch.export.save``: see the module docstring for the measured reason).

    ``ExportedProgramSerializer.serialize`` less its checks of the program (``validate``, and
    ``canonicalize``, which only tests that a canonical form exists and is two thirds of its time):
    the program comes straight from ``torch.export``. Two more savings, same schema: the tensor
    metadata of equal shapes (the same sizes, strides and dtype in every layer) is made once and
    shared, so it is also pickled and read once; and the graph is not formatted for torch's debug
    log line when that log is off (torch formats it before the logger decides).
    """
    import logging

    schema, serde = torch_internals.export_serde()

    graph_serializer = serde.GraphModuleSerializer(exported.graph_signature, exported.module_call_graph)
    tensor_values = graph_serializer.graph_state.tensor_values
    metas: dict[tuple[Any, ...], Any] = {}

    def tensor_output(name: str, value: torch.Tensor) -> Any:  # GraphModuleSerializer.serialize_tensor_output, shared
        if name in tensor_values:
            raise AssertionError(f"name {name!r} already in tensor_values")
        key = (tuple(map(_symbolic_key, value.shape)), tuple(map(_symbolic_key, value.stride())),
               _symbolic_key(value.storage_offset()), value.dtype, value.requires_grad, value.device, value.layout)
        meta = metas.get(key)
        if meta is None:
            meta = metas[key] = serde.serialize_tensor_meta(value)
        tensor_values[name] = meta
        return schema.TensorArgument(name=name)

    graph_serializer.serialize_tensor_output = tensor_output  # type: ignore[method-assign,assignment]  # this instance only
    program_module = exported.graph_module
    quiet = not serde.log.isEnabledFor(logging.DEBUG)
    if quiet:  # serialize_graph calls print_readable() for a debug line: this module's own, for this call only
        program_module.print_readable = lambda *args, **kwargs: ""  # type: ignore[method-assign]
    try:
        graph_module = graph_serializer.serialize(program_module)
    finally:
        if quiet:
            del program_module.print_readable
    if graph_serializer.custom_objs:
        raise TypeError(f"the program holds script objects ({', '.join(graph_serializer.custom_objs)})")
    return schema.ExportedProgram(
        graph_module=graph_module,
        opset_version={"aten": torch_internals.max_operator_version()},
        range_constraints=serde.serialize_range_constraints(exported.range_constraints),
        schema_version=schema.SchemaVersion(major=serde.SCHEMA_VERSION[0], minor=serde.SCHEMA_VERSION[1]),
        verifiers=[v.dialect for v in exported.verifiers],
        torch_version=torch.__version__,
        guards_code=exported._guards_code,
    )


def _write_entry(path: Path, entry: _Entry) -> None:
    _write_payload(path, pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL))


def _write_payload(path: Path, payload: bytes) -> None:
    """A cache file of ``payload`` (a pickled :class:`_Entry`): magic, checksum, payload, written atomically."""
    digest = hashlib.sha256(payload).hexdigest().encode()
    _write_atomically(path, _MAGIC + digest + b"\n" + payload)


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it: readers see all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.stem, suffix=".tmp", delete=False) as file:
        file.write(data)
        temporary = file.name
    os.replace(temporary, path)


def _read_entry(path: Path, key: str) -> _Entry:
    data = path.read_bytes()
    if not data.startswith(_MAGIC):
        raise ValueError("not a trace cache file of this format")
    digest, _, payload = data[len(_MAGIC):].partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise ValueError("its checksum does not match its contents: truncated or altered")
    entry = pickle.loads(payload)
    if not isinstance(entry, _Entry) or entry.key != key:
        raise ValueError("it holds another key")
    return entry


def _mismatch(entry: _Entry, model: torch.nn.Module) -> str | None:
    """Why ``entry`` does not fit ``model`` (parameter and buffer names, shapes, dtypes), or None."""
    parameters, buffers = torchao.as_exported(model)  # a quantized weight as its parts, as the program has it
    tensors = {**parameters, **buffers}
    cached_parameters = {fqn for fqn, (*_, is_parameter, _) in entry.state.items() if is_parameter}
    if cached_parameters != set(parameters):
        different = sorted(cached_parameters ^ set(parameters))
        return f"its parameters differ from the model's: {', '.join(different[:3])}"
    for fqn, (shape, _, dtype, _, _) in entry.state.items():
        tensor = tensors.get(fqn)
        if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            shown = "missing" if tensor is None else f"{tuple(tensor.shape)} {tensor.dtype}"
            return f"{fqn} was traced as {shape} {dtype}, the model has {shown}"
    return None


def _rebuild(entry: _Entry, model: torch.nn.Module, device: torch.device) -> ExportedProgram:
    """The program of ``entry`` with the model's weights bound (fake ones on ``device`` for a meta model)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with mode:
            return torch.empty_strided(shape, stride, dtype=dtype, device=device)

    parameters, buffers = torchao.as_exported(model)
    tensors = {**parameters, **buffers}
    on_meta = any(t.device.type == "meta" for t in tensors.values())  # traced with fake tensors (capture.as_if_on)
    state: dict[str, torch.Tensor] = {}
    for fqn, (shape, stride, dtype, is_parameter, requires_grad) in entry.state.items():
        tensor = fake(shape, stride, dtype) if on_meta else tensors[fqn]
        if is_parameter and not isinstance(tensor, torch.nn.Parameter):  # faked, or a quantized weight's part
            tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
        state[fqn] = tensor
    constants: dict[str, Any] = {}
    for fqn, value in entry.constants.items():
        spec = (tuple(value.shape), tuple(value.stride()), value.dtype) if isinstance(value, torch.Tensor) else value
        if fqn in tensors:  # a buffer of the model (not persistent): its value now, never the stored one
            constants[fqn] = fake(*spec) if on_meta else tensors[fqn]
        elif isinstance(value, torch.Tensor):  # a tensor the forward made (its code is in the key)
            constants[fqn] = value
        else:
            constants[fqn] = fake(*spec)
    return _deserialize(entry.program, state, constants)


def _deserialize(program: Any, state: dict[str, torch.Tensor], constants: dict[str, Any]) -> ExportedProgram:
    """``torch._export.serde``'s ``ExportedProgramDeserializer.deserialize``, with each symbolic
    expression parsed once (sympy's parser is most of its time; the same few expressions recur)."""
    from torch.export import exported_program as ep

    from autotp.adapters.torch_internals import in_kernel_invocation_manager

    _, serde = torch_internals.export_serde()
    symbolic_shapes, int_oo = torch_internals.symbolic_shapes(), torch_internals.int_oo()

    deserializer = serde.GraphModuleDeserializer()
    parse = deserializer._parse_sym_expr
    parsed: dict[Any, Any] = {}

    def parse_once(expr: Any, hint: Any = None) -> Any:
        sym = parsed.get(expr)
        if sym is None:
            sym = parsed[expr] = parse(expr, hint)
        elif hint is not None and sym not in deserializer.shape_env.backed_var_to_val:
            deserializer.shape_env.add_backed_var_to_val(sym, hint)
        return sym

    sizes_and_strides: dict[int, tuple[tuple[Any, ...], tuple[Any, ...]]] = {}  # id(meta): metas are shared (_serialize)

    def tensor_meta(meta: Any) -> torch.Tensor:
        # what FakeTensorMode does for empty_strided, without its dispatch cache (keyed on every size)
        mode = deserializer.fake_tensor_mode
        if id(meta) not in sizes_and_strides:
            sizes_and_strides[id(meta)] = (tuple(deserializer.deserialize_sym_int(v) for v in meta.sizes),
                                           tuple(deserializer.deserialize_sym_int(v) for v in meta.strides))
        sizes, strides = sizes_and_strides[id(meta)]
        with in_kernel_invocation_manager(mode), deserializer.shape_env.suppress_guards():
            empty = torch.empty_strided(sizes, strides, dtype=serde._SERIALIZE_TO_TORCH_DTYPE[meta.dtype], device="meta",
                                        requires_grad=meta.requires_grad)
        return FakeTensor(mode, empty, serde.deserialize_device(meta.device))

    deserializer._parse_sym_expr = parse_once  # type: ignore[method-assign,assignment]  # this instance only
    deserializer.deserialize_tensor_meta = tensor_meta  # type: ignore[method-assign,assignment]
    ranges = {name: symbolic_shapes.ValueRanges(serde._int_to_sympy_int(r.min_val, -int_oo),
                                                serde._int_to_sympy_int(r.max_val, int_oo))
              for name, r in program.range_constraints.items()}
    result = deserializer.deserialize(program.graph_module, state, constants, None, ranges)
    _erase_invented_getitems(result.graph_module)
    range_constraints = serde.ExportedProgramDeserializer().deserialize_range_constraints(ranges, result.names_to_symbols)
    exported = ep.ExportedProgram(
        root=result.graph_module, graph=result.graph_module.graph, graph_signature=result.signature,
        state_dict=result.state_dict, range_constraints=range_constraints, module_call_graph=result.module_call_graph,
        example_inputs=None, constants=result.constants,
        verifiers=[serde.load_verifier(v) for v in program.verifiers])
    exported._guards_code = program.guards_code
    return exported


def _erase_invented_getitems(gm: torch.fx.GraphModule) -> None:
    """Erase the ``getitem`` nodes that the serialized form invents, so the rebuilt graph is the traced one.

    A traced graph has no ``getitem`` for an unused output of a multi-output op (``topk``'s indices,
    eval-mode ``batch_norm``'s saved statistics); the schema needs a name for every output, so
    ``torch._export.serde`` names it ``<op node>_unused_<index>`` (``_handle_getitem_users``), and the
    deserializer makes a ``getitem`` of it. Such a node has no users; erased, the graph is node for node
    the one rank 0 traced (its fingerprint included, which the ranks' agreement compares).
    """
    invented = [node for node in gm.graph.nodes
                if node.op == "call_function" and node.target is operator.getitem and not node.users
                and isinstance(node.args[0], torch.fx.Node)
                and node.name.startswith(f"{node.args[0].name}_unused_")]
    for node in invented:
        gm.graph.erase_node(node)
    if invented:
        gm.recompile()

