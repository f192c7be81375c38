"""The GEMM rate by shape on this CPU: what the calibration's curve should describe, and what it did.

    python benchmarks/gemm_rate.py [--tokens 2 4 8 16 32 64 128 256] [--dims 32 64 128 256 512 1024]
                                   [--profile PROFILE.json] [--curve GFLOPS HALF_DIM]

Times ``aten.linear`` (float32, one thread, the work clock, medians of 5) over a grid of shapes: ``m`` tokens, an
``(n, k)`` weight, the same weight at every call (in cache, as the GEMMs of a model whose weights fit in the cache
run in its graph). Fits the curve the cost model uses (``autotp.cost_model.compute.gemm_efficiency``: a GEMM whose
smallest dim is ``d`` runs at ``d / (d + half_dim)`` of a peak), plus a fixed cost per call (what the cost model's
kernel floor and dispatch price), to the grid, and prints its median and 90th-percentile absolute error over the
grid next to the same for a profile's curve (``--profile``, e.g. one ``autotp calibrate`` wrote) or a curve given as
its peak and half dim (``--curve 104 16``), each with the fitted fixed cost.

Then, for two square weights, each ``m`` with the weight in cache and cycled through 64 MiB of weights (each call
reads its weight from memory): what reading a weight from memory adds to a GEMM, against the weight's bytes at the
profile's bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
from collections.abc import Iterator

import numpy as np
import torch
from scipy.optimize import least_squares

from autotp.calibration.graphs import median_work_s
from autotp.cost_model.graph_calibration import COLD_WEIGHT_BYTES

aten = torch.ops.aten


def _linear_on_next(x: torch.Tensor, weights: Iterator[torch.Tensor], bias: torch.Tensor) -> torch.Tensor:
    return aten.linear.default(x, next(weights), bias)


def seconds_per_call(m: int, n: int, k: int, *, cold: bool = False) -> float:
    """Median over 5 repeats of one ``aten.linear`` call's work-clock seconds (each repeat at least 20 ms;
    ``autotp.calibration.graphs.median_work_s``); ``cold``: each call on the next of :data:`COLD_WEIGHT_BYTES` of
    weights, read from memory."""
    copies = max(1, COLD_WEIGHT_BYTES // (n * k * 4)) if cold else 1
    weights = itertools.cycle(torch.full((copies, n, k), 1.0 / k).unbind(0))
    x, bias = torch.randn(m, k), torch.randn(n)
    return median_work_s(functools.partial(_linear_on_next, x, weights, bias), 2e-2, 5)


def curve_s(shapes: np.ndarray, peak: float, half: float, floor: float = 0.0) -> np.ndarray:
    """Seconds of each ``(m, n, k)`` at ``peak`` FLOP/s times ``d / (d + half)`` of its smallest dim ``d``."""
    smallest = shapes.min(axis=1)
    return 2 * shapes.prod(axis=1) / (peak * smallest / (smallest + half)) + floor


def errors(predicted: np.ndarray, measured: np.ndarray) -> str:
    """Median and 90th percentile of ``|predicted / measured - 1|``, as text."""
    off = np.abs(predicted / measured - 1)
    return f"median |error| {np.median(off):6.1%}, 90th percentile {np.percentile(off, 90):6.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--dims", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024])
    parser.add_argument("--profile", default=None, help="a hardware profile JSON whose GEMM curve to price the grid with")
    parser.add_argument("--curve", type=float, nargs=2, default=None, metavar=("GFLOPS", "HALF_DIM"),
                        help="a GEMM curve to price the grid with: its peak and the dim at which it reaches half of it")
    options = parser.parse_args()
    torch.set_num_threads(1)
    shapes = np.array([(m, n, k) for m in options.tokens for n in options.dims for k in options.dims], dtype=float)
    measured = np.array([seconds_per_call(*map(int, shape)) for shape in shapes])
    fit = least_squares(lambda p: np.log(curve_s(shapes, *np.exp(p)) / measured),
                        [math.log(1e11), math.log(8.0), math.log(2e-6)], loss="soft_l1")
    peak, half, floor = np.exp(fit.x)
    print(f"{len(shapes)} shapes (m in {options.tokens}, n and k in {options.dims}), weight in cache")
    print(f"  curve fitted to them: peak {peak / 1e9:.1f} GFLOP/s, half rate at dim {half:.1f}, {floor * 1e6:.1f} us per "
          f"call: {errors(curve_s(shapes, peak, half, floor), measured)}")
    bandwidth = None
    if options.profile:
        from autotp.cost_model import get_hardware

        profile = get_hardware(options.profile)
        bandwidth = profile.memory_bandwidth_gbps * 1e9
        rate = profile.peak_tflops["float32"] * 1e12 * profile.achievable_fraction_compute
        print(f"  {profile.name}: peak {rate / 1e9:.1f} GFLOP/s, half rate at dim "
              f"{profile.gemm_half_efficiency_dim:.1f}: "
              f"{errors(curve_s(shapes, rate, profile.gemm_half_efficiency_dim, floor), measured)}")
    if options.curve:
        given, given_half = options.curve
        print(f"  the curve given: peak {given:.1f} GFLOP/s, half rate at dim {given_half:.1f}: "
              f"{errors(curve_s(shapes, given * 1e9, given_half, floor), measured)}")
    print("weight read from memory (64 MiB of weights cycled) against in cache, us per call:")
    for width in (256, 1024):
        for m in (1, 8, 32, 128):
            warm, cold = seconds_per_call(m, width, width), seconds_per_call(m, width, width, cold=True)
            line = f"  {width} x {width}, m {m:>3}: in cache {warm * 1e6:8.1f}, from memory {cold * 1e6:8.1f} (+{(cold - warm) * 1e6:6.1f})"
            if bandwidth:
                line += f"; the weight's bytes at the profile's bandwidth {width * width * 4 / bandwidth * 1e6:6.1f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
