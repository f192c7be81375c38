"""Host and runtime terms: what running a node costs beyond its kernel, per runtime mode.

A rank-local graph runs in one of three ways (``Hardware.runtime_mode``,
:data:`~.hardware.RUNTIME_MODES`), and each pays the host differently:

=============  ===============================================  ==================================
mode           per kernel node                                  per view node / per call
=============  ===============================================  ==================================
``eager``      ``host_dispatch_s`` (FX call + ATen dispatch +   ``view_op_s`` / ``graph_launch_s``
               launch of one op)
``compiled``   0 on the host: Inductor's generated code calls   0 (views become indexing) /
               its kernels directly; the kernel floor remains   ``graph_launch_s``
``cuda_graph`` 0 on the host: the kernels were captured and     0 / ``graph_launch_s`` (one
               replay back to back on the device                replay of the captured graph)
=============  ===============================================  ==================================

An op that runs a Python loop inside its one call (``compute.HOST_CALLS``) pays the kernels and views the loop
dispatches in ``eager`` and in ``compiled`` mode alike, since Inductor calls such an op as it is
(:func:`python_loop_host_s`); a replayed CUDA graph pays none.

A model's call adds its own host work to its graph's call in every mode (``model_call_s``: its inputs flattened
and checked, its weights gathered, its outputs built), and ranks that share cores lose some of its start to each
other (``core_share_call_s``).

How a kernel node's host time meets its device time (:func:`node_time_s`): on a CPU the host is
the device (``Hardware.host_is_device``), so the two add up; on a GPU the host runs ahead of the
device, which executes kernels while the host dispatches the next ones, so a node takes the
longer of the two (a host-bound decode step is paced by dispatch, a large GEMM by its kernel).

Sources: CUDA graphs remove the per-kernel host launch and replay a whole graph from one launch
(NVIDIA Technical Blog, "Getting Started with CUDA Graphs", https://developer.nvidia.com/blog/cuda-graphs/ ;
CUDA C++ Programming Guide, "CUDA Graphs"); Inductor emits one wrapper that calls its kernels
without going through the ATen dispatcher (PyTorch 2 paper, Ansel et al., ASPLOS 2024,
https://doi.org/10.1145/3620665.3640366).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from .hardware import RUNTIME_MODES, Hardware

__all__ = [
    "HostTime",
    "graph_host_s",
    "host_time_per_call",
    "node_host_s",
    "node_time_s",
    "python_loop_host_s",
    "view_time_s",
]


def node_host_s(hardware: Hardware, *, runtime_mode: str | None = None) -> float:
    """Host seconds one kernel node pays under ``runtime_mode`` (default: the profile's)."""
    mode = runtime_mode or hardware.runtime_mode
    return hardware.host_dispatch_s if mode == "eager" else 0.0


def view_time_s(hardware: Hardware, *, runtime_mode: str | None = None) -> float:
    """Seconds of a node that launches no kernel (a view): its dispatch in eager mode, else 0."""
    mode = runtime_mode or hardware.runtime_mode
    return hardware.view_op_s if mode == "eager" else 0.0


def python_loop_host_s(hardware: Hardware, kernels: float, views: float) -> float:
    """Host seconds of the ``kernels`` kernel calls and ``views`` view calls a Python loop inside one op makes:
    at the eager dispatch of each (``host_dispatch_s``, ``view_op_s``) in ``eager`` and ``compiled`` mode, where
    the loop runs in Python either way; 0 in ``cuda_graph`` mode, where a replay runs the captured kernels."""
    if hardware.runtime_mode == "cuda_graph":
        return 0.0
    return kernels * hardware.host_dispatch_s + views * hardware.view_op_s


def graph_host_s(hardware: Hardware) -> float:
    """Host seconds per call of a compiled model: its rank-local graph's call (the Python call; the replay launch
    in cuda_graph), what the model's call adds to it (``Hardware.model_call_s``) and what it loses to ranks that
    start it together on shared cores (``Hardware.core_share_call_s``)."""
    return hardware.graph_launch_s + hardware.model_call_s + hardware.core_share_call_s


def node_time_s(device_s: Any, hardware: Hardware, *, max_fn: Callable[[Any, Any], Any] = max,
                inner_host_s: Any = 0) -> Any:
    """Seconds of one kernel node whose kernel takes ``device_s``: with its host dispatch added
    (the host is the device) or overlapped (the host runs ahead of a GPU), see module docstring.
    ``inner_host_s``: the host calls the op makes inside its one call, beyond its own dispatch (a Python-level
    loop of kernels). Works on numbers and, with ``max_fn=sympy.Max``, on expressions."""
    host_s = node_host_s(hardware) + inner_host_s
    if host_s == 0:
        return device_s
    return device_s + host_s if hardware.host_is_device else max_fn(device_s, host_s)


@dataclasses.dataclass(frozen=True)
class HostTime:
    """Host seconds of one call of a graph with ``kernels`` kernel nodes and ``views`` view
    nodes, under each runtime mode of one profile (:attr:`by_mode` maps mode -> seconds)."""

    kernels: int
    views: int
    eager_s: float
    compiled_s: float
    cuda_graph_s: float

    @property
    def by_mode(self) -> Mapping[str, float]:
        return MappingProxyType({mode: getattr(self, f"{mode}_s") for mode in RUNTIME_MODES})


def host_time_per_call(hardware: Hardware, kernels: int, views: int) -> HostTime:
    """Host (dispatch) seconds per call of a graph of ``kernels`` kernel and ``views`` view nodes,
    for every runtime mode: eager pays every node, compiled and cuda_graph only the call."""
    by_mode = {
        mode: kernels * node_host_s(hardware, runtime_mode=mode)
        + views * view_time_s(hardware, runtime_mode=mode)
        + graph_host_s(hardware)
        for mode in RUNTIME_MODES
    }
    return HostTime(kernels, views, by_mode["eager"], by_mode["compiled"], by_mode["cuda_graph"])
