"""autotp.cost_model: where time goes on real hardware, as documented formulas over cited numbers.

The planner scores every candidate sharding with these pure functions; nothing here needs a
process group, a GPU or real weights (shapes come from FakeTensors), and nothing here imports
``autotp`` or ``autotp.passes`` (dependencies point one way: autotp -> passes -> cost_model).

Pieces:

* :mod:`.hardware` — :class:`Hardware` and :class:`LinkProfile`, frozen dataclasses whose fields
  carry units (``peak_tflops``, ``memory_bandwidth_gbps``, ``latency_s``, ...) and whose values
  cite datasheets (NVIDIA H100/H200/A100/L40S) and NCCL's tuning model.
  :data:`KNOWN_HARDWARE` holds ``"h100-sxm"``, ``"h200"``, ``"a100-sxm"``, ``"pcie-gpu"`` (L40S,
  PCIe only), ``"h100-multinode"`` (8 GPUs per node, InfiniBand NDR between nodes) and
  ``"cpu-gloo"`` (placeholders until calibrated); :func:`get_hardware` resolves a name, a
  :class:`Hardware` or a JSON file.
* :mod:`.compute` — roofline time of one kernel, ``max(flops / peak, bytes / bandwidth) +
  kernel floor`` (Williams, Waterman & Patterson 2009), and FLOP counts of ATen ops that agree
  with ``torch.utils.flop_counter``.
* :mod:`.collectives` — alpha-beta time of all-reduce, all-gather, reduce-scatter, all-to-all and
  broadcast, ring and tree (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009; Sanders,
  Speck & Träff 2009; nccl-tests' bus-bandwidth definitions; NCCL's tuning model).
* :mod:`.symbolic` — the same formulas on sympy expressions of batch size and sequence length
  (``BATCH``, ``SEQ``), so a model is costed once for prefill and decode, and :func:`crossover`
  reports the size from which a split starts to pay. Import it as
  ``autotp.cost_model.symbolic``.

Units: seconds (``_s``), bytes, FLOPs; rates in decimal units as datasheets quote them — TFLOP/s
(10^12), GB/s (10^9 bytes/s); capacities in GiB (2^30 bytes). No fudge factors: every constant has
a unit and a source, or is marked as a placeholder for calibration.
"""

from .collectives import (
    COLLECTIVE_ALGORITHMS,
    COLLECTIVE_KINDS,
    collective_time_s,
    group_spans_nodes,
    link_collective_time_s,
    p2p_time_s,
)
from .compute import (
    achievable_flops_per_s,
    achievable_memory_bytes_per_s,
    aten_flops,
    aten_memory_bytes,
    compute_time_s,
    dtype_name,
    launches_no_kernel,
    tensor_bytes,
)
from .hardware import KNOWN_HARDWARE, Hardware, LinkProfile, get_hardware
from .pipeline import PIPELINE_SCHEDULES, bubble_fraction, pipeline_time_s

__all__ = [
    "COLLECTIVE_ALGORITHMS",
    "COLLECTIVE_KINDS",
    "KNOWN_HARDWARE",
    "PIPELINE_SCHEDULES",
    "Hardware",
    "LinkProfile",
    "achievable_flops_per_s",
    "achievable_memory_bytes_per_s",
    "aten_flops",
    "aten_memory_bytes",
    "bubble_fraction",
    "collective_time_s",
    "compute_time_s",
    "dtype_name",
    "get_hardware",
    "group_spans_nodes",
    "launches_no_kernel",
    "link_collective_time_s",
    "p2p_time_s",
    "pipeline_time_s",
    "tensor_bytes",
]
