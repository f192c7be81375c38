"""Time of a pipeline of stages running microbatches (GPipe / 1F1B, forward only).

With ``pp`` stages whose per-microbatch times are ``s_0 .. s_{pp-1}`` (each stage's compute and
its own tensor-parallel collectives, plus the send of its output to the next stage) and ``m``
microbatches, the first microbatch leaves the last stage after ``sum(s_i)`` and one more leaves
every ``max(s_i)`` after that (the slowest stage sets the pace):

    pipeline_time_s = sum(s_i) + (m - 1) * max(s_i)

For equal stages ``s`` this is ``(m + pp - 1) * s``: the idle share of every device, the
*bubble*, is ``(pp - 1) / (m + pp - 1)`` (:func:`bubble_fraction`). GPipe (Huang et al., "GPipe:
Efficient Training of Giant Neural Networks using Pipeline Parallelism", NeurIPS 2019, section
2.2) and 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC 2021, section 2.2.1: bubble time (p - 1) * (t_f + t_b)) have the same
forward-only time; 1F1B differs in how many microbatches' activations a stage keeps (training
only). Data-parallel replicas run side by side: they multiply throughput and leave this time (a
request's latency) unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["PIPELINE_SCHEDULES", "bubble_fraction", "pipeline_time_s"]

PIPELINE_SCHEDULES = ("gpipe", "1f1b")


def _check_microbatches(microbatches: int) -> None:
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an int >= 1, got {microbatches!r}")


def pipeline_time_s(stage_s: Sequence[float], microbatches: int) -> float:
    """Seconds for ``microbatches`` microbatches to pass all stages: sum(s) + (m - 1) * max(s)."""
    _check_microbatches(microbatches)
    if not stage_s:
        raise ValueError("a pipeline needs at least one stage")
    if any(not math.isfinite(s) or s < 0 for s in stage_s):
        raise ValueError(f"stage times must be finite and >= 0, got {list(stage_s)!r}")
    return float(sum(stage_s) + (microbatches - 1) * max(stage_s))


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of each device with equal stages: (pp - 1) / (m + pp - 1)."""
    _check_microbatches(microbatches)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    return (stages - 1) / (microbatches + stages - 1)
