"""How a Hugging Face model is called: the one place that knows HF's ``use_cache`` convention.

A transformers model's forward takes ``use_cache``; left out, it falls back to ``config.use_cache``
(True for most causal LMs) and the output then carries a ``DynamicCache``, an object that is not a
tensor, which ``torch.export`` cannot return and autotp does not keep between plain forward calls
(generation keeps its own KV cache as graph state: ``max_cache_len=`` or ``tp.generate``).

So a plain forward of a HF model is always traced with ``use_cache=False`` (:func:`traced_kwargs`,
called by :func:`autotp.capture.capture`, whatever the example kwargs said), and the compiled model
takes a call with ``use_cache`` left out, ``None``, ``False`` or ``True`` (:func:`call_kwargs`):
every one runs the traced graph, whose output is the model's without the cache part
(``out.past_key_values`` is ``None``, never some other object).

A model counts as a HF model when it has a ``config`` with a ``use_cache`` attribute and its forward
takes ``use_cache`` by name: other modules with a ``use_cache`` argument are traced and called as given.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["USE_CACHE", "call_kwargs", "takes_use_cache", "traced_kwargs"]

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
