"""The trace cache: ``torch.export``'s program for a model, kept on disk so the next load skips tracing.

Tracing a large model with dynamic batch and sequence dims is most of a load's time (about 80 % of
``autotp.from_pretrained`` on a 16-layer Llama). The program ``torch.export`` returns depends only
on the model's code and structure, the example inputs' specs and the export options, not on the
weights, so it can be stored once and reused by every later load of the same model, on every rank.

What is stored: the program *without weights* (``torch.export``'s own serialized form, the
``torch._export.serde`` schema, pickled), the names, shapes and dtypes of the parameters and buffers
it was traced with, and the values of lifted constants that are real tensors. On a hit the weights
are bound back from the model (real tensors), or presented as fake tensors on the trace device (a
model on ``meta``, as :func:`autotp.capture._as_if_on` does), so the result is the program export
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

Where: ``trace_cache=True`` uses ``$AUTOTP_CACHE_DIR`` (default ``~/.cache/autotp``) unless
``$AUTOTP_CACHE=0``; a path uses that directory (always); ``False``/``None`` turns it off. A
checkpoint directory is never written to: a cache directory inside it is refused with a warning
(no cache). Entries are written atomically (a temporary file renamed), so ranks sharing a
directory never read a half-written entry. The files are Python pickles: keep the cache
directory private (it is created with mode 0700), as for any compiler cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import os
import pickle
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

__all__ = ["TraceCache", "default_cache_dir", "open_trace_cache"]

_MAGIC = b"autotp-trace-cache 1\n"
_FORMAT = 1


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


def _hash_file(path: str, memo: dict[str, str]) -> str:
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
        described.append([name, f"{cls.__module__}.{cls.__qualname__}", _hash_file(source, memo) if source else "",
                          attributes])
    return described


def _tensor_spec(tensor: torch.Tensor, device: torch.device) -> list[Any]:
    shown = device if tensor.device.type == "meta" else tensor.device
    return [list(tensor.shape), list(tensor.stride()), str(tensor.dtype), str(shown), bool(tensor.requires_grad)]


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


def trace_key(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_shapes: Any,
              *, device: torch.device, training: bool) -> str:
    """The SHA-256 naming the program ``torch.export`` makes of ``model(*args, **kwargs)`` (see the module docstring)."""
    memo: dict[str, str] = {}
    here = os.path.dirname(os.path.abspath(__file__))
    leaves, spec = pytree.tree_flatten((args, kwargs))
    inputs = [_tensor_spec(leaf, device)[:4] if isinstance(leaf, torch.Tensor) else [type(leaf).__name__, repr(leaf)]
              for leaf in leaves]
    description = {
        "format": _FORMAT,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "autotp capture": [_hash_file(os.path.join(here, f), memo) for f in ("capture.py", "trace_cache.py")],
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
            entry = _read_entry(path, key)
            problem = _mismatch(entry, model)
            if problem is None:
                return _rebuild(entry, model, device)
        except Exception as exc:  # noqa: BLE001 - any failure to read means: trace again
            problem = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        warnings.warn(f"autotp: ignoring the trace cache entry {path} ({problem}); tracing the model again",
                      stacklevel=3)
        return None

    def put(self, key: str, exported: ExportedProgram) -> None:
        """Store ``exported`` (as ``torch.export`` returned it) under ``key``; a failure to write only warns."""
        try:
            _write_entry(self.path(key), _entry(key, exported))
        except Exception as exc:  # noqa: BLE001 - the cache is an optimisation: loading goes on
            warnings.warn(f"autotp: could not write the trace cache entry {self.path(key)} "
                          f"({type(exc).__name__}: {exc}); the next load traces again", stacklevel=3)


def _entry(key: str, exported: ExportedProgram) -> _Entry:
    from torch._export.serde.serialize import ExportedProgramSerializer
    from torch._subclasses.fake_tensor import FakeTensor

    serialized = ExportedProgramSerializer().serialize(exported, serialize_state_dict=False, serialize_constants=False,
                                                       serialize_example_inputs=False)
    state = {fqn: (tuple(t.shape), tuple(t.stride()), t.dtype, isinstance(t, torch.nn.Parameter), bool(t.requires_grad))
             for fqn, t in exported.state_dict.items()}
    constants: dict[str, Any] = {}
    for fqn, value in exported.constants.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"constant {fqn} is a {type(value).__name__}, not a tensor")
        if isinstance(value, FakeTensor) or value.device.type == "meta":
            constants[fqn] = (tuple(value.shape), tuple(value.stride()), value.dtype)
        else:
            constants[fqn] = value.detach().cpu() if value.device.type != "cpu" else value.detach()
    return _Entry(key, serialized.exported_program, state, constants)


def _write_entry(path: Path, entry: _Entry) -> None:
    payload = pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    digest = hashlib.sha256(payload).hexdigest().encode()
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.stem, suffix=".tmp", delete=False) as file:
        file.write(_MAGIC + digest + b"\n" + payload)
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
    tensors = dict(model.named_parameters(remove_duplicate=False))
    parameters = set(tensors)
    tensors.update(model.named_buffers(remove_duplicate=False))
    cached_parameters = {fqn for fqn, (*_, is_parameter, _) in entry.state.items() if is_parameter}
    if cached_parameters != parameters:
        different = sorted(cached_parameters ^ parameters)
        return f"its parameters differ from the model's: {', '.join(different[:3])}"
    for fqn, (shape, _, dtype, _, _) in entry.state.items():
        tensor = tensors.get(fqn)
        if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            shown = "missing" if tensor is None else f"{tuple(tensor.shape)} {tensor.dtype}"
            return f"{fqn} was traced as {shape} {dtype}, the model has {shown}"
    return None


def _rebuild(entry: _Entry, model: torch.nn.Module, device: torch.device) -> ExportedProgram:
    """The program of ``entry`` with the model's weights bound (fake ones on ``device`` for a meta model)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with mode:
            return torch.empty_strided(shape, stride, dtype=dtype, device=device)

    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    state: dict[str, torch.Tensor] = {}
    for fqn, (shape, stride, dtype, is_parameter, requires_grad) in entry.state.items():
        tensor = tensors[fqn]
        if tensor.device.type == "meta":  # traced as a fake tensor on the trace device
            tensor = fake(shape, stride, dtype)
            tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad) if is_parameter else tensor
        state[fqn] = tensor
    constants: dict[str, Any] = {}
    for fqn, value in entry.constants.items():
        if isinstance(value, torch.Tensor):
            constants[fqn] = value
        elif fqn in tensors and tensors[fqn].device.type != "meta":
            constants[fqn] = tensors[fqn]
        else:
            constants[fqn] = fake(*value)
    return _deserialize(entry.program, state, constants)


def _deserialize(program: Any, state: dict[str, torch.Tensor], constants: dict[str, Any]) -> ExportedProgram:
    """``torch._export.serde``'s ``ExportedProgramDeserializer.deserialize``, with each symbolic
    expression parsed once (sympy's parser is most of its time; the same few expressions recur)."""
    from torch._export.serde import serialize as serde
    from torch.export import exported_program as ep
    from torch.fx.experimental import symbolic_shapes
    from torch.utils._sympy.numbers import int_oo

    class Deserializer(serde.GraphModuleDeserializer):
        def _parse_sym_expr(self, expr_str: str, hint: Any = None) -> Any:
            memo = self.__dict__.setdefault("_autotp_parsed", {})
            sym = memo.get(expr_str)
            if sym is None:
                sym = memo[expr_str] = super()._parse_sym_expr(expr_str, hint)
            elif hint is not None and sym not in self.shape_env.backed_var_to_val:
                self.shape_env.add_backed_var_to_val(sym, hint)
            return sym

    ranges = {name: symbolic_shapes.ValueRanges(serde._int_to_sympy_int(r.min_val, -int_oo),
                                                serde._int_to_sympy_int(r.max_val, int_oo))
              for name, r in program.range_constraints.items()}
    result = Deserializer().deserialize(program.graph_module, state, constants, None, ranges)
    range_constraints = serde.ExportedProgramDeserializer().deserialize_range_constraints(ranges, result.names_to_symbols)
    exported = ep.ExportedProgram(
        root=result.graph_module, graph=result.graph_module.graph, graph_signature=result.signature,
        state_dict=result.state_dict, range_constraints=range_constraints, module_call_graph=result.module_call_graph,
        example_inputs=None, constants=result.constants,
        verifiers=[serde.load_verifier(v) for v in program.verifiers])
    exported._guards_code = program.guards_code
    return exported
