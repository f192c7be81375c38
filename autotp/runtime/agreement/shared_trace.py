"""One trace per group: the group's first rank runs ``torch.export``, the others rebuild its program.

Every rank of a tensor-parallel group traces the same model at the same inputs, and tracing is
most of what a compile costs (a dynamic-shape export of a 2-layer Llama: ~3 s, its rebuild from
the serialized program: ~0.3 s). Ranks that share a host's cores, or a CI machine's, paid it
``world_size`` times. With :class:`FirstRankTrace` passed to :func:`autotp.capture.tracing.capture`,
rank 0 traces (through the trace cache when there is one) and sends the program without weights
(:mod:`autotp.capture.trace_cache`'s serialized form) to the group; every other rank binds its own
weights to it. A program that writes in place (a KV cache) is sent functionalized, so that only
rank 0 traces it a second time for that (``benchmarks/generation_compile.py``). For a stamped
program (:mod:`autotp.capture.stamping`) that is the program of the few layers rank 0 traced, which every
other rank stamps out again (a 16-layer Llama: 0.41x the time to rebuild all 16 layers,
``benchmarks/trace_stamp.py``).

A rank uses rank 0's program only where a trace cache would: when its trace key — the model's
classes and their source, its config, parameter and buffer specs, the input specs, dynamic dims,
device and library versions (:func:`autotp.capture.trace_cache.trace_key`) — equals rank 0's, and the
program's parameters fit its model. Otherwise it traces its own model, as before; the ranks'
agreement records (:mod:`autotp.runtime.agreement.exchanges`) then compare the graphs and name what differs.
Weights are never shared: each rank's program holds its own, so a rank with other weights is
still caught by the agreement on weights.

Rank 0's failure to trace reaches every rank as a :class:`~autotp.base.errors.CaptureError` (the
same error where the ranks' keys agree, so an untraceable model gives every rank the usual error,
a ``CaptureError`` or the pipeline split's ``ValueError``; naming rank 0 otherwise); no rank is left
waiting (the exchange is bounded by ``timeout_s``).

The pipeline split of :func:`autotp.compile_mesh` (:func:`autotp.runtime.mesh.mesh_module.split_stages`) shares its
whole-model trace over the mesh's ranks the same way, under a key of its own purpose (its program is
``torch.export``'s as it is, not functionalized).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.distributed as dist

from autotp.base.errors import CaptureError
from autotp.capture.tracing import Traced, trace_device
from autotp.runtime.agreement.exchanges import exchanges_with_others, share_from_first

_STORE_MESSAGE_BYTES = 4 << 20
"""Programs larger than this go by a broadcast over the group instead of the key-value store
(a TCPStore message is capped at 8 MiB)."""


_SAME_ERRORS: dict[str, type[Exception]] = {"CaptureError": CaptureError, "ValueError": ValueError}
"""Rank 0's errors that the other ranks raise as they are where their keys agree (a model that cannot be traced:
:func:`autotp.capture.tracing.capture`'s ``CaptureError``, the pipeline split's ``ValueError``)."""


class FirstRankTrace:
    """``capture(..., share=FirstRankTrace(group, timeout_s=...))``: see the module docstring."""

    def __init__(self, group: dist.ProcessGroup | None, *, timeout_s: float, purpose: str = "capture") -> None:
        self.group = group
        self.timeout_s = timeout_s
        self.purpose = purpose
        """The trace key's ``purpose`` (:func:`autotp.capture.trace_cache.trace_key`): what the program is for."""

    def __call__(self, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_shapes: Any,
                 training: bool, trace: Any) -> Traced:
        if not exchanges_with_others(self.group):
            return trace()
        from autotp.capture.trace_cache import program_bytes, program_from_bytes, trace_key

        device = trace_device(args, kwargs)
        try:
            key: str | None = trace_key(model, args, kwargs, dynamic_shapes, device=device, training=training,
                                        purpose=self.purpose)
        except Exception:  # noqa: BLE001 - a model the key cannot describe is traced on every rank
            key = None
        if dist.get_rank(self.group) == 0:
            return self._trace_and_send(key, trace, program_bytes)
        sent = share_from_first(None, group=self.group, timeout_s=self.timeout_s,
                                what="the traced program from rank 0")
        if sent.get("failure") is not None:
            kind, text = sent["failure"]
            same_error = _SAME_ERRORS.get(kind)
            if same_error is not None and sent.get("key") == key:  # the same model: the same error as rank 0's
                raise same_error(text)
            raise CaptureError(f"tracing failed on rank 0 of the group: {kind}: {text}")
        if sent.get("large"):
            sent["entry"] = self._broadcast(None)
        exported = (program_from_bytes(sent["entry"], key, model, device)
                    if key is not None and sent.get("key") == key else None)
        if exported is None:
            return trace()  # another model (or inputs) than rank 0's: the agreement on graphs says where
        if sent["fallback_warning"] is not None:
            warnings.warn(sent["fallback_warning"], stacklevel=3)
        return Traced(exported, sent["mode"],
                      None if sent["mode"] == "static-fallback" else dynamic_shapes,
                      from_cache=sent["from_cache"], fallback_warning=sent["fallback_warning"])

    def _broadcast(self, entry: bytes | None) -> bytes:
        """Rank 0's ``entry`` on every rank, by a broadcast over the group (every rank has learned from the
        exchange that one follows, so none waits for a broadcast that does not come)."""
        box = [entry]
        dist.broadcast_object_list(box, group_src=0, group=self.group)
        return box[0]

    def _trace_and_send(self, key: str | None, trace: Any, to_bytes: Any) -> Traced:
        """Rank 0: trace, send the program (or the failure) to the group, return the trace."""
        message: dict[str, Any] = {"key": key}
        traced: Traced | None = None
        failure: Exception | None = None
        try:
            traced = trace()
        except Exception as exc:  # noqa: BLE001 - the other ranks must not wait for a program that never comes
            failure = exc
            message["failure"] = (type(exc).__name__, str(exc))
        if traced is not None and key is not None:
            try:
                message["entry"] = to_bytes(key, traced.exported)
            except Exception:  # noqa: BLE001 - a program that cannot be serialized: each rank traces its own
                message["key"] = None
            else:
                if traced.store is not None:  # the cache entry is these bytes: written without serializing again
                    traced.store = functools.partial(traced.store, payload=message["entry"])
            message.update(mode=traced.mode, from_cache=traced.from_cache, fallback_warning=traced.fallback_warning)
        large = message.get("entry") is not None and len(message["entry"]) > _STORE_MESSAGE_BYTES
        entry = message.pop("entry", None) if large else None
        share_from_first({**message, "large": large}, group=self.group, timeout_s=self.timeout_s,
                         what="the traced program from rank 0")
        if large:
            self._broadcast(entry)
        if failure is not None:
            raise failure
        assert traced is not None
        return traced
