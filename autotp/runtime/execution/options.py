"""Runtime options: how the ranks agree and where a traced program is kept; one frozen value.

:class:`RuntimeOptions` holds what ``autotp.compile`` and its siblings need besides planning
(:class:`~autotp.planning.options.PlanOptions`): whether the ranks compare weight checksums, how
long a rank waits for the others at any exchange, the trace cache, how the rank-local graphs run
(``runtime_mode``: node by node, compiled by Inductor, or compiled and captured as a CUDA graph; see
:mod:`autotp.runtime.execution.runtime_modes`), and which host this rank runs on (``host``, from the launcher's
variables: :func:`runtime_options` is the one place the runtime reads them). Validated where built.
"""

from __future__ import annotations

import dataclasses
import os

from autotp.runtime.agreement.exchanges import DEFAULT_AGREEMENT_TIMEOUT_S, check_timeout
from autotp.runtime.collectives.hosts import Host, this_host

__all__ = ["RUNTIME_MODE_CHOICES", "RuntimeOptions", "runtime_host", "runtime_options"]

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
            (:mod:`autotp.capture.trace_cache`): ``True`` for ``$AUTOTP_CACHE_DIR``, a directory, ``False`` for
            off, or ``None`` for the entry point's default (off for ``autotp.compile``, on for
            ``autotp.from_pretrained`` and ``autotp.load``).
        runtime_mode: how every rank-local graph runs: ``"eager"`` (node by node), ``"compiled"``
            (Inductor, collectives included, compiled once per graph at its first call), ``"cuda_graph"``
            (compiled, the decode step captured once and replayed per token; CUDA only), or ``"auto"``
            (``cuda_graph`` on CUDA devices, ``eager`` on the CPU). The plan is priced in the mode that
            runs (``Hardware.runtime_mode``). See docs/generation.md.
        host: which host this rank runs on (:class:`autotp.runtime.collectives.hosts.Host`), which decides where the
            shared-memory collectives run; ``None`` for the launcher's word (torchrun's ``GROUP_RANK``, or
            ``RANK - LOCAL_RANK``), else the hostname (docs/hosts.md).
    """

    check_weights: bool = True
    agreement_timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S
    trace_cache: bool | str | os.PathLike[str] | None = None
    runtime_mode: str = "auto"
    host: Host | None = None

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
        if self.host is not None and not isinstance(self.host, Host):
            raise TypeError(f"host must be an autotp.runtime.collectives.hosts.Host or None, got {type(self.host).__name__}; "
                            "leave it None to read the launcher's variables (torchrun's GROUP_RANK, LOCAL_RANK)")


def runtime_options(options: RuntimeOptions | None, *, trace_cache: bool = False) -> RuntimeOptions:
    """``options`` (default ``RuntimeOptions()``) with ``trace_cache=None`` resolved to the entry point's
    default ``trace_cache`` and ``host=None`` to this rank's host from the launcher's variables in
    ``os.environ`` (the one place the runtime reads them); a TypeError saying what to pass for anything else."""
    if options is None:
        options = RuntimeOptions()
    elif not isinstance(options, RuntimeOptions):
        raise TypeError(f"runtime= takes an autotp.RuntimeOptions, got {type(options).__name__}; e.g. "
                        "runtime=autotp.RuntimeOptions(agreement_timeout_s=600)")
    if options.trace_cache is None:
        options = dataclasses.replace(options, trace_cache=trace_cache)
    if options.host is None:
        options = dataclasses.replace(options, host=this_host(os.environ))
    return options


def runtime_host(options: RuntimeOptions) -> Host:
    """``options.host``, which :func:`runtime_options` sets at the front door; a ValueError that says so where
    the options did not pass through it (the runtime never reads the launcher's variables below the front)."""
    if options.host is None:
        raise ValueError("the runtime options reached the runtime without a host; pass them through "
                         "autotp.runtime.execution.options.runtime_options(...) at the front door (it reads the launcher's "
                         "variables), or give RuntimeOptions(host=autotp.runtime.collectives.hosts.this_host(os.environ))")
    return options.host
