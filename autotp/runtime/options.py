"""Runtime options: how the ranks agree and where a traced program is kept; one frozen value.

:class:`RuntimeOptions` holds what ``autotp.compile`` and its siblings need besides planning
(:class:`~autotp.planning.options.PlanOptions`): whether the ranks compare weight checksums, how
long a rank waits for the others at any exchange, the trace cache, and how the rank-local graphs run
(``runtime_mode``: node by node, compiled by Inductor, or compiled and captured as a CUDA graph; see
:mod:`autotp.runtime.runtime_modes`). Validated where built.
"""

from __future__ import annotations

import dataclasses
import os

from autotp.runtime.agreement import DEFAULT_AGREEMENT_TIMEOUT_S, check_timeout

__all__ = ["RUNTIME_MODE_CHOICES", "RuntimeOptions", "runtime_options"]

RUNTIME_MODE_CHOICES = ("auto", "eager", "compiled", "cuda_graph")
"""What ``RuntimeOptions(runtime_mode=...)`` takes: ``"auto"`` (``cuda_graph`` on CUDA, ``eager`` on the CPU)
or one of :data:`autotp.cost_model.hardware.RUNTIME_MODES`."""


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    """How the ranks build and agree (see :func:`autotp.compile`).

    Attributes:
        check_weights: the ranks compare a float64 sum and a sampled hash of every full weight before
            a plan is used; ``False`` skips it for huge models loaded from one checkpoint (it is skipped
            with ``checkpoint=`` anyway).
        agreement_timeout_s: the most seconds a rank waits for the others at any exchange (> 0);
            :class:`~autotp.RankTimeoutError` names the ranks that did not arrive.
        trace_cache: reuse the program ``torch.export`` made of this model and these inputs' specs
            (:mod:`autotp.trace_cache`): ``True`` for ``$AUTOTP_CACHE_DIR``, a directory, ``False`` for
            off, or ``None`` for the entry point's default (off for ``autotp.compile``, on for
            ``autotp.from_pretrained`` and ``autotp.load``).
        runtime_mode: how every rank-local graph runs: ``"eager"`` (node by node), ``"compiled"``
            (Inductor, collectives included, compiled once per graph at its first call), ``"cuda_graph"``
            (compiled, the decode step captured once and replayed per token; CUDA only), or ``"auto"``
            (``cuda_graph`` on CUDA devices, ``eager`` on the CPU). The plan is priced in the mode that
            runs (``Hardware.runtime_mode``). See docs/generation.md.
    """

    check_weights: bool = True
    agreement_timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S
    trace_cache: bool | str | os.PathLike[str] | None = None
    runtime_mode: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.check_weights, bool):
            raise TypeError(f"check_weights must be True or False, got {self.check_weights!r}")
        object.__setattr__(self, "agreement_timeout_s", check_timeout(self.agreement_timeout_s))
        cache = self.trace_cache
        if cache is not None and not isinstance(cache, (bool, str, os.PathLike)):
            raise TypeError(f"trace_cache must be True, False, None or a directory, got {type(cache).__name__}; "
                            "e.g. trace_cache=True")
        if self.runtime_mode not in RUNTIME_MODE_CHOICES:
            raise ValueError(f"runtime_mode must be one of {', '.join(map(repr, RUNTIME_MODE_CHOICES))}, got "
                             f"{self.runtime_mode!r}; e.g. autotp.RuntimeOptions(runtime_mode='compiled')")


def runtime_options(options: RuntimeOptions | None, *, trace_cache: bool = False) -> RuntimeOptions:
    """``options`` (default ``RuntimeOptions()``) with ``trace_cache=None`` resolved to the entry point's
    default ``trace_cache``; a TypeError saying what to pass for anything else."""
    if options is None:
        options = RuntimeOptions()
    elif not isinstance(options, RuntimeOptions):
        raise TypeError(f"runtime= takes an autotp.RuntimeOptions, got {type(options).__name__}; e.g. "
                        "runtime=autotp.RuntimeOptions(agreement_timeout_s=600)")
    if options.trace_cache is None:
        options = dataclasses.replace(options, trace_cache=trace_cache)
    return options
