"""Whether a world size's error is its profile's: each run's plans priced with another world size's profile.

    python benchmarks/cost_model_accuracy.py --models all --rounds 1 --runs 15 --threads 1 --json run.json
    python benchmarks/cost_model_profiles.py run.json [more.json ...] [--world-size 2] [--with-tp 1]

The accuracy benchmark calibrates one profile per world size and measures every family's forward with it. When
one world size comes out low for every family (tp 2 in some runs, the MLP too), either its calibration priced
the machine lower than the others did, or the models at that world size run work none of the calibrations
saw. This script tells the two apart on the runs' own measurements: it prices every measured plan of
``--world-size`` (on the work clock: the compute form's CPU time, which a loaded machine does not lengthen, against
the predicted compute's work) with that world size's profile, with the same run's ``--with-tp`` profile (the
link and the waits kept from its own: a world size of 1 has none), and with its own profile with one group of
terms taken from the other (what that group alone moves). Per family the median over the runs' rows, then the
median over families. The plans were made at ``--world-size``, so every graph is the one that was measured.

First it splits every world size's error by clock, from the runs' rows alone: the forward on the group's wall
clock, its compute form on the wall clock, the compute form's work (CPU time), and the ratio of the compute form's
wall time to its work, measured against what the profile's core share predicts. A work error is the level of the
work a profile prices; the rest of the compute form's wall-clock error is the share of a core the ranks ran at.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import warnings
from pathlib import Path

from cost_model_families import ORDER
from cost_model_heldout import _pricer, run_threads

TERM_GROUPS = {
    "GEMM rate": ("peak_tflops", "gemm_half_efficiency_dim"),
    "memory": ("memory_bandwidth_gbps", "memory_bandwidth_curve"),
    "element rates": ("op_element_s", "transcendental_element_s"),
    "dispatch": ("host_dispatch_s",),
    "views": ("view_op_s",),
    "first calls": ("first_call_s",),
    "op families' fixed costs": ("op_fixed_s",),
    "calls": ("graph_launch_s", "model_call_s"),
}
"""The profile's work terms, grouped as the calibration measures or fits them together."""

LINK_FIELDS = ("intra_node", "inter_node", "shared_memory_link", "small_all_reduce", "shared_memory_cold_call_s",
               "shared_memory_cold_curve", "collective_wait_s", "call_sync_wait_s", "call_sync_wait_per_compute",
               "devices_per_node")
"""What a profile prices communication with: kept from the plan's own world size when another's is used."""


def by_clock(runs: list[dict]) -> None:
    """Per world size, the signed error of the forward, of its compute form and of that form's work, and the compute
    form's wall time over its work, measured and predicted (1 / the profile's core share): per family the median
    over the runs' rows, then the median over families."""
    rows: dict[tuple[int, str], list[dict]] = collections.defaultdict(list)
    for data in runs:
        for row in data["rows"]:
            if row["measured_compute_work_s"] and row["profile_share"]:
                rows[row["world_size"], row["model"]].append(row)
    print(f"The error by clock, {len(runs)} run(s) (signed, median over rows per family, then over families):")
    print(f"  {'tp':>3} {'families':>8} {'forward':>8} {'compute':>8} {'work':>7}   wall / work of the compute form, "
          f"measured and predicted")
    for world_size in sorted({ws for ws, _ in rows}):
        families = [f for f in ORDER if (world_size, f) in rows]
        cells: dict[str, list[float]] = collections.defaultdict(list)
        for family in families:
            of = rows[world_size, family]
            for name, of_row in (
                    ("forward", lambda r: r["predicted_s"] / r["measured_s"] - 1),
                    ("compute", lambda r: r["predicted_compute_s"] / r["measured_compute_s"] - 1),
                    ("work", lambda r: (r["predicted_compute_s"] + r.get("fair_share_saving_s", 0.0))
                     * r["profile_share"] / r["measured_compute_work_s"] - 1),
                    ("measured", lambda r: r["measured_compute_s"] / r["measured_compute_work_s"]),
                    ("predicted", lambda r: 1 / r["profile_share"])):
                cells[name].append(statistics.median(of_row(r) for r in of))
        m = {name: statistics.median(values) for name, values in cells.items()}
        print(f"  {world_size:>3} {len(families):>8} {m['forward']:>+8.1%} {m['compute']:>+8.1%} {m['work']:>+7.1%}   "
              f"{m['measured']:.3f} and {m['predicted']:.3f}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="--json files of benchmarks/cost_model_accuracy.py")
    parser.add_argument("--world-size", type=int, default=2, help="the plans priced (default 2)")
    parser.add_argument("--with-tp", type=int, default=1, help="the other world size's profile (default 1)")
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    import torch

    from autotp import Plan
    from autotp.cost_model import Hardware

    runs = [json.loads(path.read_text()) for path in options.runs]
    threads = {run_threads(data) for data in runs}
    if len(threads) > 1:
        raise SystemExit(f"the runs computed with different thread counts {sorted(threads)}: pass runs of one --threads")
    torch.set_num_threads(threads.pop())
    by_clock(runs)
    errors: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    pricers = {}
    for path, data in zip(options.runs, runs):
        profiles = {(r["world_size"], r["round_index"]): Hardware.from_json(r["profile_json"]) for r in data["rows"]}
        for row in data["rows"]:
            other = profiles.get((options.with_tp, row["round_index"]))
            if row["world_size"] != options.world_size or not row["measured_compute_work_s"]:
                continue
            if other is None:
                raise SystemExit(f"{path} has no tp {options.with_tp} profile for round {row['round_index']}")
            own = profiles[options.world_size, row["round_index"]]
            family = row["model"]
            if family not in pricers:
                pricers[family] = _pricer(family, options.world_size)
            plan = Plan.from_json(row["plan_json"])

            def error(profile: Hardware, family: str = family, plan: Plan = plan, row: dict = row) -> float:
                # the predicted compute's work: what the compute form's CPU time measured
                return pricers[family](plan, profile)[1] / row["measured_compute_work_s"] - 1

            swapped = dataclasses.replace(other, **{name: getattr(own, name) for name in LINK_FIELDS})
            errors["its own profile"][family].append(error(own))
            errors[f"tp {options.with_tp}'s profile"][family].append(error(swapped))
            for group, fields in TERM_GROUPS.items():
                mixed = dataclasses.replace(own, **{name: getattr(swapped, name) for name in fields})
                errors[f"its own, {group} of tp {options.with_tp}"][family].append(error(mixed))
    families = [f for f in ORDER if f in pricers]
    print(f"tp {options.world_size}'s plans, {len(runs)} run(s), {len(families)} families: the predicted compute's "
          f"work against the measured (signed error, median over rows; then over families)")
    print(f"  {'priced with':<44} {'median':>7} {'|median|':>9}  per family")
    for label, by_family in errors.items():
        medians = [statistics.median(by_family[f]) for f in families]
        cells = " ".join(f"{f} {m:+.0%}" for f, m in zip(families, medians))
        print(f"  {label:<44} {statistics.median(medians):>+7.1%} {statistics.median(abs(m) for m in medians):>9.1%}  {cells}")


if __name__ == "__main__":
    main()
