"""Two forms of the core share, compared on the kept accuracy runs: where the compute of ranks sharing cores goes.

    python benchmarks/cost_model_share_form.py [RUN.json.xz ...]   (default: benchmarks/runs/*.json.xz)

The kept runs' profiles priced a rank's compute on shared cores as its work over one share of a core (the
calibration graphs' work over their wall time; profiles now fit a line with a loss per call and a range,
``graph_calibration.fit_core_share``, judged by ``cost_model_heldout.py --refit``). The long forwards of the wide models
ran near the fair share (0.46-0.48 at four ranks on two cores) and the small families' well below it (0.27-0.42),
so one share fitted on short graphs prices the long ones high. The other form: the work over the fair share
(``autotp.calibration.graphs.fair_core_share`` of the cores and threads the run recorded) plus a fixed loss per call, the median over the same calibration graphs of their wall
time beyond that (as many numbers as before: one per world size).

For every run and world size above 1 it prints the loss, the range of the calibration graphs' work, and the median
absolute error of the compute form's wall time (the run's measured ``measured_compute_s``) as the run priced it and
in the other form, from the same predicted work (the run's ``predicted_compute_s`` times the profile's share), with
a few models' signed errors. A diagnostic of the predictions the runs recorded; the cost model does not use the
second form.
"""

from __future__ import annotations

import argparse
import base64
import pickle
import statistics
import warnings
from pathlib import Path

from cost_model_heldout import read_run, run_threads

from autotp.calibration.graphs import fair_core_share

SHOWN = ("mlp", "tied_lm", "llama", "llama_wide", "gpt2_wide")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="*",
                        default=sorted((Path(__file__).resolve().parent / "runs").glob("*.json.xz")))
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    for path in args.runs:
        data = read_run(path)
        cores = data["cores"]
        fits = {}
        for calibration in data["calibrations"]:
            ranks, _ = pickle.loads(base64.b64decode(calibration["measurements"]))
            graphs = [graph for rank in ranks for graph in rank.graphs]
            fair = fair_core_share(cores, calibration["world_size"], run_threads(data))
            fits[calibration["world_size"]] = (fair, statistics.median(g.compute_s - g.compute_work_s / fair for g in graphs),
                                               [g.compute_work_s for g in graphs])
        errors: dict[int, list[tuple[str, float, float]]] = {}
        for row in data["rows"]:
            world_size = row["world_size"]
            if world_size == 1:
                continue
            fair, loss, _ = fits[world_size]
            work_s = (row["predicted_compute_s"] + row.get("fair_share_saving_s", 0.0)) * row["profile_share"]
            measured_s = row["measured_compute_s"]
            errors.setdefault(world_size, []).append(
                (row["model"], row["predicted_compute_s"] / measured_s - 1, (work_s / fair + loss) / measured_s - 1))
        for world_size, rows in sorted(errors.items()):
            fair, loss, works = fits[world_size]
            shown = ", ".join(f"{model} {one:+.0%} -> {other:+.0%}" for model, one, other in rows if model in SHOWN)
            print(f"{path.name} tp {world_size}: fair share {fair:.2f}, loss {loss * 1e3:.2f} ms per call (graphs' work "
                  f"{min(works) * 1e3:.2f}-{max(works) * 1e3:.2f} ms); compute form's median |error| "
                  f"{statistics.median(abs(one) for _, one, _ in rows):.1%} as priced, "
                  f"{statistics.median(abs(other) for _, _, other in rows):.1%} in the other form; {shown}", flush=True)


if __name__ == "__main__":
    main()
