"""How much one calibration's in-graph scale moves from one calibration to the next, and with the machine's speed.

    OMP_NUM_THREADS=1 python benchmarks/calibration_repeat.py [--calibrations 15]

Runs ``--calibrations`` quick calibrations of one rank in a row (``autotp.calibration.calibrate.measure_rank``,
world size 1, one thread; about 4 s each on this project's 2-core VM). For each it prints the in-graph scale (the
graphs' work over what their single ops price, before the profile's floor at 1:
``autotp.cost_model.graph_calibration.fit_in_graph_scale``) and the GEMM samples timed again right after the
graphs, over their first timing (median and range over the sample shapes): the calibration times its single ops
first and its graphs last, and a change of the machine's speed in between lands in the scale, which multiplies
every single-op price of the profile. A last line gives the spread of both.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrations", type=int, default=15)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from autotp.calibration.calibrate import CalibrationConfig, measure_rank
    from autotp.calibration.graphs import measure_gemm_samples
    from autotp.cost_model.graph_calibration import priced_work_s

    config = CalibrationConfig.quick(threads=1)
    scales, paces = [], []
    for index in range(args.calibrations):
        started = time.perf_counter()
        measured = measure_rank(0, 1, config, collectives=False)
        again = measure_gemm_samples(config.gemm_width, config.gemm_tokens, config.min_time_s, config.repeats)
        ratios = [late.seconds / early.seconds for late, early in zip(again, measured.gemm_samples)]
        work = sum(sample.compute_work_s for sample in measured.graphs)
        priced = sum(priced_work_s(sample, measured.view_op_s, measured.kernel_floor_s) for sample in measured.graphs)
        scales.append(work / priced)
        paces.append(statistics.median(ratios))
        print(f"calibration {index + 1}: {time.perf_counter() - started:.1f} s, in-graph scale {scales[-1]:.3f}, "
              f"GEMMs after the graphs / before {paces[-1]:.3f} ({min(ratios):.2f}-{max(ratios):.2f})", flush=True)
    print(f"in-graph scale {min(scales):.3f}-{max(scales):.3f} (median {statistics.median(scales):.3f}); GEMMs after "
          f"/ before {min(paces):.3f}-{max(paces):.3f} (median {statistics.median(paces):.3f})")


if __name__ == "__main__":
    main()
