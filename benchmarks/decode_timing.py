"""Interleaved timing of ``generate``-like calls, shared by the decode benchmarks (``generate.py``,
``runtime_modes.py``, ``quantized_decode.py``).

Each round runs every variant once with 1 new token (the prefill) and once with ``new_tokens`` (prefill plus
``new_tokens - 1`` decode steps), so load from other jobs on the machine falls on all variants alike;
``between()`` runs before each variant (a barrier, so the ranks start together). One warm-up round first.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_interleaved(runs: dict[str, Callable[[int], torch.Tensor]], new_tokens: int, rounds: int,
                     between: Callable[[], None]) -> dict[str, tuple[torch.Tensor, float, float]]:
    """Per variant ``(tokens, prefill_ms, ms_per_decoded_token)``: medians over ``rounds`` rounds (see the module
    docstring); the tokens are those of the last ``new_tokens`` call."""
    firsts: dict[str, list[float]] = {name: [] for name in runs}
    wholes: dict[str, list[float]] = {name: [] for name in runs}
    outputs: dict[str, torch.Tensor] = {}
    for round_index in range(rounds + 1):
        for name, run in runs.items():
            between()
            started = time.perf_counter()
            run(1)
            first = time.perf_counter() - started
            started = time.perf_counter()
            outputs[name] = run(new_tokens)
            whole = time.perf_counter() - started
            if round_index:
                firsts[name].append(first)
                wholes[name].append(whole)
    result = {}
    for name in runs:
        prefill, whole = statistics.median(firsts[name]), statistics.median(wholes[name])
        result[name] = (outputs[name], prefill * 1e3, (whole - prefill) * 1e3 / (new_tokens - 1))
    return result
