"""What autotp needs from inside ``torchao``, in one place, with the releases it is tested on.

A torchao-quantized weight is one tensor subclass (``Int8Tensor``, ``Float8Tensor``...) holding plain
tensors: the quantized data, its scales and (some schemes) zero points. autotp treats it as one
weight to the user and the plan, stored as its parts:

- its parts are listed by ``__tensor_flatten__`` (:func:`inner_tensors`), the protocol torch's own
  subclass handling uses;
- ``torch.export``'s ``run_decompositions`` replaces each subclass parameter by a parametrization
  and its parts become graph placeholders named ``<module>.parametrizations.<name>.original<i>``,
  ``i`` the part's index in ``__tensor_flatten__`` order (:func:`exported_name`, :func:`weight_of`);
- the graph then dequantizes in plain ATen (per-row int8, float8) or torchao's ``dequantize_affine`` op
  (group-wise int8, ``IntxWeightOnlyConfig``'s int4), which has a sharding rule of its own
  (``passes/rules/quantized.py``);
- a scheme autotp has not been tested with (activation quantization, the packed int4 layouts of
  ``Int4WeightOnlyConfig``) raises :class:`~autotp.base.errors.UnsupportedQuantizationError` before
  tracing (:func:`check_quantized_weights`), never a dispatch error from inside the subclass.

Tested on torchao :data:`RELEASES` (the ``quant`` extra); another release is refused when a model
with torchao weights is compiled. An upgrade of torchao touches this file only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from autotp.adapters.torch_internals import is_traceable_wrapper_subclass, unwrap_tensor_subclass_parameters
from autotp.base.errors import UnsupportedQuantizationError, UnsupportedReleaseError

__all__ = [
    "PART_NAMES",
    "PIP_SPEC",
    "RELEASES",
    "SUPPORTED_SCHEMES",
    "QuantizedWeight",
    "as_exported",
    "check_quantized_weights",
    "config_of",
    "exported_name",
    "flattened_name",
    "holds_subclass_weights",
    "inner_tensors",
    "is_subclass_weight",
    "is_torchao_tensor",
    "part_label",
    "parts_as_parameters",
    "quantize_as_transformers_does",
    "quantize_weight",
    "quantized_weights",
    "saved_config",
    "saved_scheme",
    "weight_of",
]

RELEASES = "0.18"
"""The torchao minor release CI tests (any patch of 0.18; the oldest tier runs 0.18.0)."""

PIP_SPEC = "torchao>=0.18.0,<0.19"
""":data:`RELEASES` as pyproject.toml's ``quant`` extra declares it."""

SUPPORTED_SCHEMES = {
    "Int8Tensor": "Int8WeightOnlyConfig (int8 weight-only, per-row or per-group scales)",
    "Float8Tensor": "Float8WeightOnlyConfig (float8 weight-only)",
    "IntxUnpackedToInt8Tensor": "IntxWeightOnlyConfig (int1-int8 weight-only, e.g. int4 with per-group scales)",
}
"""torchao tensor class -> the config that makes it, for weights without activation quantization."""

_ACTIVATION_ATTRIBUTES = ("act_quant_kwargs", "activation_quantization", "act_pre_scale")
"""Attributes by which torchao's weight classes say their activations are quantized too (not supported)."""

_EXPORTED = re.compile(r"^(?:(?P<module>.*)\.)?parametrizations\.(?P<name>[^.]+)\.original(?P<index>\d+)$")


def is_torchao_tensor(tensor: object) -> bool:
    """True for a torchao tensor subclass (a quantized weight)."""
    return is_subclass_weight(tensor) and type(tensor).__module__.startswith("torchao.")


def is_subclass_weight(tensor: object) -> bool:
    """True for a tensor subclass made of plain tensors (``__tensor_flatten__``), as torchao's weights are."""
    return is_traceable_wrapper_subclass(tensor)


def holds_subclass_weights(state: Mapping[str, object]) -> bool:
    """True when some value of ``state`` (an exported program's state dict) is a tensor subclass: export
    then holds it whole and ``run_decompositions`` splits it into its parts."""
    return any(is_subclass_weight(value) for value in state.values())


def inner_tensors(tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A subclass weight's parts in ``__tensor_flatten__`` order (``qdata``, ``scale``, ``zero_point``...)."""
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    return {name: getattr(tensor, name) for name in names}


@contextlib.contextmanager
def parts_as_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, each subclass weight of ``model`` is held as its parts, the plain parameters
    ``<module>.parametrizations.<name>.original<i>`` that ``torch.export`` gives it (torch's own
    ``unwrap_tensor_subclass_parameters``); the weights are put back after. A model on ``meta`` is traced
    with fake parameters, and a fake tensor cannot be a part of a subclass weight when export splits it."""
    from torch.nn.utils import parametrize

    owners = [(module, name, param) for module in model.modules() for name, param in module._parameters.items()
              if param is not None and is_subclass_weight(param)]
    if not owners:
        yield
        return
    unwrap_tensor_subclass_parameters(model)
    try:
        yield
    finally:
        for module, name, param in owners:
            # torch puts a weight that needs no grad back as a *buffer* (a plain tensor); the next trace would
            # then fake it as a float tensor. The very parameter object goes back, as a parameter.
            parametrize.remove_parametrizations(module, name, leave_parametrized=True)
            delattr(module, name)
            module.register_parameter(name, param)


def exported_name(fqn: str, index: int) -> str:
    """The placeholder FQN ``torch.export`` gives part ``index`` of weight ``fqn`` (``a.weight`` ->
    ``a.parametrizations.weight.original0``)."""
    module, _, name = fqn.rpartition(".")
    return f"{module + '.' if module else ''}parametrizations.{name}.original{index}"


def as_exported(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``model``'s parameters and buffers by the FQNs a functional program of it names them: a subclass weight as
    its parts (:func:`exported_name`; ``run_decompositions`` splits a quantized weight into them), every other
    tensor as itself. What binds a traced program's state to the model."""
    parameters: dict[str, torch.Tensor] = {}
    for fqn, tensor in model.named_parameters(remove_duplicate=False):
        if is_subclass_weight(tensor):
            parameters.update({exported_name(fqn, i): part for i, part in enumerate(inner_tensors(tensor).values())})
        else:
            parameters[fqn] = tensor
    return parameters, dict(model.named_buffers(remove_duplicate=False))


PART_NAMES = ("qdata", "scale", "zero_point")
"""Part ``i``'s name in every supported scheme (:data:`SUPPORTED_SCHEMES`: ``__tensor_flatten__`` order)."""


def part_label(exported_fqn: str) -> str | None:
    """A report's name for an exported part: ``q_proj.weight (scale)`` for
    ``q_proj.parametrizations.weight.original1``; ``None`` for any other name."""
    found = weight_of(exported_fqn)
    if found is None:
        return None
    weight, index = found
    return f"{weight} ({PART_NAMES[index] if index < len(PART_NAMES) else f'part {index}'})"


def flattened_name(fqn: str, part: str) -> str:
    """The safetensors key torchao's ``flatten_tensor_state_dict`` gives part ``part`` of weight ``fqn``, as
    transformers' ``save_pretrained`` of a torchao-quantized model writes it (``a.weight``, ``qdata`` ->
    ``a._weight_qdata``); the file's metadata holds the weight's class under ``fqn`` (:func:`saved_scheme`)."""
    module, _, name = fqn.rpartition(".")
    return f"{module + '.' if module else ''}_{name}_{part}"


def saved_scheme(metadata: Mapping[str, str], fqn: str) -> str | None:
    """The torchao class a flattened safetensors file says weight ``fqn`` was (its ``_type``), or None."""
    import json

    try:
        return json.loads(metadata[fqn]).get("_type")
    except (KeyError, ValueError, AttributeError):
        return None


def weight_of(exported_fqn: str) -> tuple[str, int] | None:
    """``(weight FQN, part index)`` of an exported part's FQN; ``None`` for any other name."""
    match = _EXPORTED.match(exported_fqn)
    if match is None:
        return None
    module = match["module"]
    return f"{module + '.' if module else ''}{match['name']}", int(match["index"])


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """One quantized weight: its scheme (the torchao class), logical shape and dtype, and its parts."""

    fqn: str
    scheme: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    """(part name, shape, dtype) in ``__tensor_flatten__`` order."""

    def part_names(self) -> dict[str, str]:
        """Exported placeholder FQN -> part name (``qdata``, ``scale``...)."""
        return {exported_name(self.fqn, i): name for i, (name, _, _) in enumerate(self.parts)}


def quantized_weights(model: torch.nn.Module) -> dict[str, QuantizedWeight]:
    """FQN -> :class:`QuantizedWeight` of every torchao parameter or buffer of ``model``."""
    found: dict[str, QuantizedWeight] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for fqn, tensor in named:
        if not is_torchao_tensor(tensor):
            continue
        parts = tuple((name, tuple(t.shape), t.dtype) for name, t in inner_tensors(tensor).items())
        found[fqn] = QuantizedWeight(fqn, type(tensor).__name__, tuple(tensor.shape), tensor.dtype, parts)
    return found


def _why_unsupported(tensor: torch.Tensor) -> str | None:
    scheme = type(tensor).__name__
    if scheme not in SUPPORTED_SCHEMES:
        return f"the scheme {scheme} is not supported"
    if any(getattr(tensor, name, None) is not None for name in _ACTIVATION_ATTRIBUTES):
        return f"{scheme} with activation quantization is not supported (weight-only is)"
    return None


def installed_release() -> str | None:
    """The installed torchao release, or ``None`` when torchao is not installed."""
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_quantized_weights(model: torch.nn.Module) -> Mapping[str, QuantizedWeight]:
    """The model's torchao weights (:func:`quantized_weights`), after checking autotp supports each.

    Raises :class:`UnsupportedQuantizationError` naming the weight, its scheme and what is supported,
    and :class:`UnsupportedReleaseError` for a torchao release outside :data:`RELEASES`.
    """
    weights = quantized_weights(model)
    if not weights:
        return weights
    release = installed_release() or "unknown"
    if not release.startswith(RELEASES + "."):
        raise UnsupportedReleaseError(
            f"torchao {release} is installed; autotp's quantized weights are tested on torchao {RELEASES}.x only. "
            f'Install it with pip install "{PIP_SPEC}" (the autotp[quant] extra).')
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    refused = [(fqn, why) for fqn in weights if (why := _why_unsupported(named[fqn])) is not None]
    if refused:
        listed = "; ".join(f"{fqn}: {why}" for fqn, why in refused[:5])
        more = f" (and {len(refused) - 5} more)" if len(refused) > 5 else ""
        supported = "; ".join(f"{cls} from {config}" for cls, config in SUPPORTED_SCHEMES.items())
        raise UnsupportedQuantizationError(
            f"autotp cannot split these torchao weights: {listed}{more}. Supported: {supported}. "
            "Quantize with one of those configs, or leave these layers unquantized "
            "(quantize_(model, config, filter_fn=...)).")
    return weights


def quantize_as_transformers_does(model: torch.nn.Module, quantization_config: Any) -> None:
    """Quantize ``model`` in place (on ``meta`` too) with a transformers ``TorchAoConfig``: the weights transformers'
    own torchao quantizer picks (``param_needs_quantization``: the Linear weights, not the output embedding unless
    asked), and the config kept on ``model.config.quantization_config`` as transformers keeps it."""
    from torchao.quantization import quantize_  # type: ignore[import-untyped]
    from transformers.quantizers.auto import AutoHfQuantizer

    if getattr(quantization_config, "quant_method", None) != "torchao" or not hasattr(quantization_config, "quant_type"):
        raise TypeError(f"quantization_config must be a transformers.TorchAoConfig, got {type(quantization_config).__name__}; "
                        "pass TorchAoConfig(Int8WeightOnlyConfig()) (a torchao config object: the string forms are gone "
                        "from transformers 5)")
    quantizer = AutoHfQuantizer.from_config(quantization_config, pre_quantized=False)
    quantizer.preprocess_model(model)  # decides which modules stay unquantized
    chosen = {fqn for fqn, _ in model.named_parameters() if quantizer.param_needs_quantization(model, fqn)}
    quantize_(model, quantization_config.quant_type, filter_fn=lambda module, fqn: f"{fqn}.weight" in chosen)
    model.config.quantization_config = quantization_config  # type: ignore[union-attr]


def config_of(model: torch.nn.Module) -> Any:
    """The torchao config ``model`` was quantized with, where it says (``model.config.quantization_config``, a
    transformers ``TorchAoConfig``, as :func:`quantize_as_transformers_does` and transformers leave it), else None.
    A wrapper (the generation cache's, a pipeline stage's) says it through the transformers model it holds."""
    for module in model.modules():
        config = getattr(getattr(module, "config", None), "quantization_config", None)
        if getattr(config, "quant_method", None) == "torchao":
            return getattr(config, "quant_type", None)
    return None


def quantize_weight(weight: torch.Tensor, config: Any) -> dict[str, torch.Tensor]:
    """The parts (:func:`inner_tensors`) of a float ``(out, in)`` Linear weight quantized with torchao ``config``:
    what ``quantize_`` makes of a Linear holding it. Quantized by blocks, so a block of whole quantization
    groups (rows for per-row scales) quantizes as it does inside the whole weight."""
    from torchao.quantization import quantize_  # type: ignore[import-untyped]

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    quantize_(linear, config)
    return inner_tensors(linear.weight)


def saved_config(quantization_config: Any) -> Any:
    """The ``TorchAoConfig`` of a checkpoint's ``config.json`` (``quantization_config``, a dict or the config
    transformers built from it); another quantization method raises :class:`UnsupportedQuantizationError`."""
    from transformers import TorchAoConfig

    if isinstance(quantization_config, TorchAoConfig):
        return quantization_config
    method = quantization_config.get("quant_method") if isinstance(quantization_config, dict) else getattr(
        quantization_config, "quant_method", None)
    if method != "torchao" or not isinstance(quantization_config, dict):
        raise UnsupportedQuantizationError(
            f"the checkpoint's config.json says it is quantized with {method!r}; autotp reads torchao checkpoints "
            "only (transformers' TorchAoConfig). Load a float checkpoint, or one saved from a TorchAoConfig model.")
    return TorchAoConfig.from_dict(quantization_config)
