"""What autotp needs from inside ``transformers``, in one place, with the releases it is tested on.

transformers changes the details autotp relies on between releases: the forward keyword that takes
a cache (``past_key_values=`` up to 5.23, ``cache=`` from 5.24), whether the model's forward takes
``cache_position``, the signatures of ``StaticLayer.lazy_initialization`` and ``get_mask_sizes``,
where the helper that gives a config's head shapes lives. Each detail is read here, from the
installed release's own signatures, and a detail that is not found raises :class:`UnsupportedReleaseError`
naming the releases CI tests. An upgrade of transformers touches this file only.

The releases CI runs (``.ci/run``, the ``compat`` tier): :data:`FORWARD_RELEASES` for a plain forward
(capture and equivalence), :data:`GENERATION_RELEASES` for ``generate`` with the KV cache as graph
state. A release outside them is refused when a model is compiled (:func:`check_release`), so
autotp never runs a graph traced through code it was not tested on.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import sys
from collections.abc import Callable
from typing import Any

import torch

from autotp.base.errors import UnsupportedReleaseError

__all__ = [
    "FORWARD_RELEASES",
    "GENERATION_RELEASES",
    "ReleaseRange",
    "cache_call_kwargs",
    "check_release",
    "head_shapes",
    "initialize_static_layer",
    "installed_release",
    "is_transformers_model",
    "mask_query_length",
    "static_cache_classes",
]


@dataclasses.dataclass(frozen=True)
class ReleaseRange:
    """Releases from ``oldest`` (an exact release) to any patch of the ``newest`` minor; CI tests both ends."""

    oldest: str
    newest: str

    def admits(self, release: str) -> bool:
        return _release(self.oldest) <= _release(release) and _release(release)[:2] <= _release(self.newest)[:2]

    def __str__(self) -> str:
        return f"{self.oldest} to {self.newest}"

    def pip_spec(self) -> str:
        major, minor = _release(self.newest)[:2]
        return f"transformers>={self.oldest},<{major}.{minor + 1}"


FORWARD_RELEASES = ReleaseRange("4.57.6", "5.24")
"""transformers releases on which a captured forward is tested equal to the model's (CI: oldest and newest)."""

GENERATION_RELEASES = ReleaseRange("5.10.4", "5.24")
"""transformers releases on which ``generate`` is tested equal to HF's greedy ``generate`` (CI: oldest and newest)."""


def _release(release: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a release string (``"5.24.0"``, ``"5.10"``, ``"5.25.0.dev0"``)."""
    numbers = []
    for part in release.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
    if len(numbers) < 2:
        raise UnsupportedReleaseError(f"cannot read the transformers release {release!r}")
    return (*numbers, 0, 0)[:3]  # type: ignore[return-value]


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


def head_shapes(config: Any) -> tuple[int, int]:
    """``(kv heads, head dim)`` of a text config: the width of one layer's cache rows.

    transformers >= 5.1 has ``integrations.executorch.get_head_shapes`` (which also knows configs with
    a per-layer head shape); older releases derive it from the config's fields as their own
    ``StaticCache.early_initialization`` callers do (so does a field the helper leaves None)."""
    try:
        from transformers.integrations.executorch import get_head_shapes
    except ImportError:
        get_head_shapes = None
    kv_heads, head_dim = get_head_shapes(config) if get_head_shapes is not None else (None, None)
    # a config may leave a field None (Mixtral's head_dim up to 5.10): derived as the cache's callers derive it
    heads = config.num_attention_heads
    kv_heads = kv_heads or getattr(config, "num_key_value_heads", None) or heads
    head_dim = head_dim or getattr(config, "head_dim", None) or config.hidden_size // heads
    if not (isinstance(kv_heads, int) and isinstance(head_dim, int)):
        raise UnsupportedReleaseError(
            f"{type(config).__name__} gives a head shape per layer ({kv_heads!r}, {head_dim!r}); autotp's KV cache "
            "takes one shape for every layer"
        )
    return kv_heads, head_dim


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


def _parameters(function: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(inspect.unwrap(function)).parameters)


def _missing(what: str, cause: BaseException | None = None) -> UnsupportedReleaseError:
    """The error for a detail of transformers that this release does not have."""
    detail = f" ({cause})" if cause is not None else ""
    return UnsupportedReleaseError(
        f"transformers {installed_release()} has no {what}{detail}; autotp is tested with transformers "
        f"{GENERATION_RELEASES} for generation and {FORWARD_RELEASES} for a forward"
    )
