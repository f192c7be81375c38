"""What autotp needs from inside ``transformers``, in one place, with the releases it is tested on.

transformers changes the details autotp relies on between releases: the forward keyword that takes
a cache (``past_key_values=`` up to 5.23, ``cache=`` from 5.24), whether the model's forward takes
``cache_position``, the signatures of ``StaticLayer.lazy_initialization`` and ``get_mask_sizes``,
how a cache marks the layers that keep a recurrent state instead of keys and values, how such a layer holds its
convolution and recurrent states (one tensor each up to 5.10, a dict by state index from 5.24; Mamba's forward takes
it as ``cache_params=`` up to 5.23, ``cache=`` from 5.24; :func:`bind_recurrent_state`). Each detail is read here, from the
installed release's own signatures, and a detail that is not found raises :class:`UnsupportedReleaseError`
naming the releases CI tests. An upgrade of transformers touches this file only.

The releases CI runs (``.ci/run`` and its tiers in ``.ci/release_tiers``): :data:`FORWARD_RELEASES`
for a plain forward (capture and equivalence), :data:`GENERATION_RELEASES` for ``generate`` with the
KV cache as graph state. A release outside them is refused when a model is compiled (:func:`check_release`), so
autotp never runs a graph traced through code it was not tested on.

**How a Hugging Face model is called** (HF's ``use_cache`` convention). A transformers model's forward
takes ``use_cache``; left out, it falls back to ``config.use_cache`` (True for most causal LMs) and the
output then carries a ``DynamicCache``, an object that is not a tensor, which ``torch.export`` cannot
return and autotp does not keep between plain forward calls (generation keeps its own KV cache as graph
state). So a plain forward of a HF model is always traced with ``use_cache=False`` (:func:`traced_kwargs`,
called by :func:`autotp.capture.tracing.capture`, whatever the example kwargs said), and the compiled model takes
a call with ``use_cache`` left out, ``None``, ``False`` or ``True`` (:func:`call_kwargs`): every one runs
the traced graph, whose output is the model's without the cache part (``out.past_key_values`` is
``None``). A model counts as a HF model here when it has a ``config`` with a ``use_cache`` attribute and
its forward takes ``use_cache`` by name (:func:`takes_use_cache`).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from autotp.adapters.releases import ReleaseRange
from autotp.base.errors import UnsupportedReleaseError

__all__ = [
    "FORWARD_RELEASES",
    "GENERATION_RELEASES",
    "RECURRENT_LAYER_TYPES",
    "ReleaseRange",
    "USE_CACHE",
    "cache_call_kwargs",
    "call_kwargs",
    "derive_config_buffers",
    "check_release",
    "initialize_static_layer",
    "installed_release",
    "is_transformers_model",
    "mask_query_length",
    "RecurrentLayerState",
    "bind_recurrent_state",
    "recurrent_cache",
    "recurrent_cache_kwargs",
    "recurrent_layers_only",
    "recurrent_state",
    "recurrent_state_tensors",
    "static_cache_classes",
    "takes_use_cache",
    "traced_kwargs",
]


FORWARD_RELEASES = ReleaseRange("4.57.6", "5.24", "transformers")
"""transformers releases on which a captured forward is tested equal to the model's (CI: oldest and newest)."""

GENERATION_RELEASES = ReleaseRange("5.10.4", "5.24", "transformers")
"""transformers releases on which ``generate`` is tested equal to HF's greedy ``generate`` (CI: oldest and newest)."""


def installed_release() -> str:
    """The installed ``transformers`` release (``transformers.__version__``)."""
    import transformers

    return str(transformers.__version__)


def is_transformers_model(model: object) -> bool:
    """True for a ``transformers.PreTrainedModel`` (without importing transformers when nothing did)."""
    module = sys.modules.get("transformers")
    base = getattr(module, "PreTrainedModel", None) if module is not None else None
    return isinstance(base, type) and isinstance(model, base)


def check_release(use: str, releases: ReleaseRange) -> None:
    """Raise :class:`UnsupportedReleaseError` unless the installed transformers is in ``releases``.

    ``use`` names what needs it ("generation", "a forward"), for the message."""
    release = installed_release()
    if not releases.admits(release):
        raise UnsupportedReleaseError(
            f"transformers {release} is not a release autotp supports for {use}: supported are {releases} "
            f"(both tested in CI). Install one, e.g. pip install '{releases.pip_spec()}'."
        )


def static_cache_classes() -> tuple[type, type]:
    """``(StaticCache, StaticLayer)`` of the installed release."""
    try:
        from transformers.cache_utils import StaticCache, StaticLayer
    except ImportError as error:
        raise _missing("transformers.cache_utils.StaticCache / StaticLayer", error) from error
    return StaticCache, StaticLayer


RECURRENT_LAYER_TYPES = frozenset({"mamba", "recurrent", "conv", "linear_attention", "hybrid", "hybrid_sliding"})
"""``config.layer_types`` (or ``layers_block_type``) entries of layers that keep a convolution / recurrent state
(RecurrentGemma's ``"recurrent"`` blocks up to 5.10 keep it in module attributes, which no cache layer marks)."""


def recurrent_state(model: torch.nn.Module) -> str | None:
    """What ``model`` keeps between generation steps besides each attention layer's keys and values, in words;
    None when it keeps keys and values only.

    Read from the installed release: a ``DynamicCache`` built from the text config gives each layer whose state is
    a convolution and a recurrent (SSM or linear attention) state a ``LinearAttentionCacheLayerMixin`` (5.10 to
    5.24; their ``StaticCache`` gives 5.10's hybrid layers a plain one); a forward that takes no cache keyword
    (``cache=`` / ``past_key_values=``) keeps a state of its own, named by the keywords it takes instead. A layer
    whose ``config.layer_types`` entry is in :data:`RECURRENT_LAYER_TYPES` counts as recurrent too."""
    try:
        from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin
    except ImportError as error:
        raise _missing("transformers.cache_utils.DynamicCache / LinearAttentionCacheLayerMixin", error) from error
    config = model.config.get_text_config()
    layers = DynamicCache(config=config).layers
    # each layer's kind: layer_types, or layers_block_type where a config names them so (RecurrentGemma up to 5.10)
    layer_types = list(getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or ())
    recurrent = [i for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)
                 or (i < len(layer_types) and layer_types[i] in RECURRENT_LAYER_TYPES)]
    if recurrent:
        shown = ", ".join(str(i) for i in recurrent[:8]) + (", ..." if len(recurrent) > 8 else "")
        return (f"a convolution and a recurrent (SSM / linear attention) state in {len(recurrent)} of its "
                f"{len(layers)} layers ({shown}), not keys and values per attention head")
    parameters = _parameters(type(model).forward)
    if not any(name in parameters for name in ("cache", "past_key_values")):
        others = [name for name in parameters if "cache" in name and name not in (USE_CACHE, "cache_position")]
        taken = f" (it takes {', '.join(f'{name}=' for name in others)} instead)" if others else ""
        return f"a state of its own{taken}, not a cache of keys and values"
    return None


def recurrent_layers_only(model: torch.nn.Module) -> bool:
    """True where every layer of ``model``'s cache keeps a convolution and a recurrent state and nothing else (a
    ``DynamicCache`` built from the config gives each a plain ``LinearAttentionLayer``: Mamba, Mamba2), the models
    whose state :class:`~autotp.capture.kv_cache.CachedCausalLM` holds as graph state; hybrids (an attention cache
    in some layers) and models that keep state in module attributes are not."""
    try:
        from transformers.cache_utils import DynamicCache, LinearAttentionLayer
    except ImportError as error:
        raise _missing("transformers.cache_utils.DynamicCache / LinearAttentionLayer", error) from error
    config = model.config.get_text_config()
    layers = DynamicCache(config=config).layers
    return bool(layers) and all(type(layer) is LinearAttentionLayer for layer in layers) and any(
        name in _parameters(type(model).forward) for name in ("cache", "cache_params"))


def recurrent_cache(model: torch.nn.Module) -> Any:
    """A fresh ``DynamicCache`` of ``model``'s config (every layer a ``LinearAttentionLayer``, nothing held yet)."""
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=model.config.get_text_config())


@dataclasses.dataclass(frozen=True)
class RecurrentLayerState:
    """One layer's convolution state ``(batch, channels, conv_kernel)`` and recurrent state (Mamba: ``(batch,
    intermediate, state_size)``; Mamba2: ``(batch, heads, head_dim, state_size)``)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


def recurrent_state_tensors(layer: Any) -> RecurrentLayerState | None:
    """The states a ``LinearAttentionLayer`` holds after a call (None where it holds none yet): its
    ``conv_states`` / ``recurrent_states``, one tensor each up to 5.10, a dict by state index (0) from 5.24."""
    conv, recurrent = _state_attribute(layer, "conv_states"), _state_attribute(layer, "recurrent_states")
    if conv is None or recurrent is None:
        return None
    return RecurrentLayerState(conv, recurrent)


def bind_recurrent_state(layer: Any, state: RecurrentLayerState | None) -> None:
    """Point a ``LinearAttentionLayer`` at ``state`` as the previous step's (the model then takes its decode path
    and updates the tensors in place), or with ``None`` make it empty (the model takes its prefill path, from a
    zero state, and the layer allocates new tensors)."""
    for name in ("conv_states", "recurrent_states", "is_conv_states_initialized",
                 "is_recurrent_states_initialized", "has_previous_state"):
        if not hasattr(layer, name):
            raise _missing(f"LinearAttentionLayer.{name}")
    values = {"conv_states": None if state is None else state.conv,
              "recurrent_states": None if state is None else state.recurrent,
              "is_conv_states_initialized": state is not None, "is_recurrent_states_initialized": state is not None,
              "has_previous_state": state is not None}
    for name, value in values.items():
        if isinstance(getattr(layer, name), dict):  # 5.24: one entry per state index; Mamba's layers use index 0
            getattr(layer, name)[0] = value
        else:
            setattr(layer, name, value)
    if state is not None:  # what lazy initialisation sets: the decode path reads the device, rolls by the kernel
        layer.dtype, layer.device = state.conv.dtype, state.conv.device
        if isinstance(getattr(layer, "conv_kernel_size", None), dict):
            layer.conv_kernel_size[0] = int(state.conv.shape[-1])
        else:
            layer.conv_kernel_size = int(state.conv.shape[-1])


def _state_attribute(layer: Any, name: str) -> torch.Tensor | None:
    if not hasattr(layer, name):
        raise _missing(f"LinearAttentionLayer.{name}")
    value = getattr(layer, name)
    return value.get(0) if isinstance(value, dict) else value


def initialize_static_layer(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Allocate a ``StaticLayer``'s tensors shaped like ``keys`` / ``values`` (``lazy_initialization``,
    which takes ``(key_states)`` up to 4.57 and ``(key_states, value_states)`` from 5.0)."""
    parameters = _parameters(type(layer).lazy_initialization)
    if "value_states" in parameters:
        layer.lazy_initialization(keys, values)
    elif "key_states" in parameters:
        layer.lazy_initialization(keys)
    else:
        raise _missing("StaticLayer.lazy_initialization(key_states[, value_states])")


def mask_query_length(first: int | torch.Tensor) -> int:
    """The query length of a ``get_mask_sizes`` call: its first argument, the query length from 5.1, the
    chunk's ``cache_position`` tensor before."""
    return int(first.shape[0]) if isinstance(first, torch.Tensor) else int(first)


def cache_call_kwargs(model: torch.nn.Module, cache: Any, cache_position: torch.Tensor) -> dict[str, Any]:
    """The keyword arguments that hand ``cache`` (and its slots) to ``model``'s forward in this release.

    The cache's keyword is ``cache`` from 5.24, ``past_key_values`` before; models whose forward takes
    ``cache_position`` (up to 5.0) get the slots too, else they derive positions from the cache's
    ``get_seq_length``. A forward with neither keyword raises: passed as an unknown keyword the cache
    would be ignored, and every call would attend to its own tokens only."""
    parameters = _parameters(type(model).forward)
    names = [name for name in ("cache", "past_key_values") if name in parameters]
    if not names:
        raise _missing(f"a cache keyword (cache= or past_key_values=) in {type(model).__name__}.forward")
    kwargs: dict[str, Any] = {names[0]: cache}
    if "cache_position" in parameters:
        kwargs["cache_position"] = cache_position
    return kwargs


def recurrent_cache_kwargs(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """The keyword that hands a recurrent-state ``cache`` to ``model``'s forward: ``cache`` from 5.24,
    ``cache_params`` before (Mamba, Mamba2)."""
    parameters = _parameters(type(model).forward)
    names = [name for name in ("cache", "cache_params") if name in parameters]
    if not names:
        raise _missing(f"a cache keyword (cache= or cache_params=) in {type(model).__name__}.forward")
    return {names[0]: cache}


def derive_config_buffers(model: torch.nn.Module, modules: dict[str, torch.nn.Module]) -> None:
    """Fill the buffers that ``modules`` (path -> module of ``model``, built on meta) derive from the config
    (a rotary embedding's ``inv_freq``), as transformers does after loading; each buffer is already given
    storage on its device, set to NaN where it is floating point.

    From 5.0 the model's ``_init_weights`` fills them. Before (4.57), a rotary module computes them in its
    constructor only, so a module whose buffers are still NaN is built again from its ``config`` on the
    buffers' device and its buffers copied. A buffer still NaN after both raises: read as it is, it would
    make every output wrong."""
    init = getattr(model, "_init_weights", None)
    for module in modules.values():
        if callable(init):
            init(module)
    for path, module in modules.items():
        if not _has_nan_buffer(module):
            continue
        config = getattr(module, "config", None)
        buffers = dict(module.named_buffers(recurse=False))
        device = next(iter(buffers.values())).device
        try:
            with torch.device(device):
                rebuilt = type(module)(config)
        except (TypeError, AttributeError, ValueError) as error:  # not built from a config alone
            raise _missing(f"a way to derive the buffers of {path} ({type(module).__name__}) from the config",
                           error) from error
        for name, value in rebuilt.named_buffers(recurse=False):
            if name in buffers:
                module._buffers[name] = value.to(buffers[name].dtype)
        for name, value in vars(rebuilt).items():  # plain tensor attributes kept beside them (original_inv_freq)
            if isinstance(value, torch.Tensor) and name not in buffers and not name.startswith("_"):
                setattr(module, name, value)
        if _has_nan_buffer(module):
            raise _missing(f"a way to derive the buffers of {path} ({type(module).__name__}) from the config")


def _has_nan_buffer(module: torch.nn.Module) -> bool:
    return any(b.is_floating_point() and bool(torch.isnan(b).any()) for b in module.buffers(recurse=False))


def _parameters(function: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(inspect.unwrap(function)).parameters)


def _missing(what: str, cause: BaseException | None = None) -> UnsupportedReleaseError:
    """The error for a detail of transformers that this release does not have."""
    detail = f" ({cause})" if cause is not None else ""
    return UnsupportedReleaseError(
        f"transformers {installed_release()} has no {what}{detail}; autotp is tested with transformers "
        f"{GENERATION_RELEASES} for generation and {FORWARD_RELEASES} for a forward"
    )


USE_CACHE = "use_cache"
"""HF's forward keyword that asks for a cache in the output."""


def takes_use_cache(model: torch.nn.Module) -> bool:
    """True for a HF model (a ``config`` with ``use_cache``) whose forward takes ``use_cache`` by name."""
    if not hasattr(getattr(model, "config", None), USE_CACHE):
        return False
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return USE_CACHE in parameters


def traced_kwargs(model: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments to trace ``model`` with: for a HF model (:func:`takes_use_cache`) ``use_cache=False``
    whatever ``kwargs`` say (see the module docstring); any other model's ``kwargs`` as given."""
    return {**kwargs, USE_CACHE: False} if takes_use_cache(model) else kwargs


def call_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's ``kwargs`` as a graph traced by :func:`traced_kwargs` from a HF model takes them: ``use_cache``
    (left out, ``None``, ``False`` or ``True``) becomes False, the value in the graph; the output's cache part
    is then ``None``, as the model's own is with ``use_cache=False``."""
    value = kwargs.get(USE_CACHE)
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"use_cache must be True, False or None, got {type(value).__name__} {value!r}")
    return {**kwargs, USE_CACHE: False}
