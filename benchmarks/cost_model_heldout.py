"""Cross-validation by family of the cost model's in-graph terms, from one or more runs of the accuracy benchmark.

    python benchmarks/cost_model_accuracy.py --models all --rounds 2 --runs 20 --threads 1 --json run.json
    python benchmarks/cost_model_heldout.py run.json [more.json ...] [--k 5] [--refit]
    python benchmarks/cost_model_heldout.py benchmarks/runs/*.json.xz --refit   # the runs kept in the repository

The accuracy benchmark measures every family's forward at every world size once and writes, per
(family, world size, round), the measured time, the plan it measured and the round's calibrated profile.
This script prices each measured plan again with every subset of the in-graph terms left out
(``autotp.cost_model.crossval.TERMS``; the same strategy for every node, so the same rank-local graph),
then cross-validates by family (``crossval.cross_validate``): on ``k - 1`` folds of families it keeps the
subset of terms with the least error, and predicts the held-out fold with it, each fold in turn. It prints,
per world size, the fitted and the held-out median absolute error and the worst held-out family; per family,
its signed held-out error next to the error of the profile as calibrated (every term kept; no term's value
is fitted on a model, so that column is held out for every family but the four the terms were designed on);
and what removing each term alone does to the error over every family. It does so twice: for the forward
on the group's wall clock, and for the compute form's work (each rank's CPU time, against the predicted
compute times the profile's core share), which a loaded machine does not lengthen.

``--refit`` prices every row with the profile this checkout's ``build_profile`` fits from the round's own
calibration measurements (which the run wrote), instead of the profile the run built: a change to how a profile
is fitted is judged on the same measurements as the code before it.

Given several runs (each its own calibration and timings, at other times of the day), it prints each run's
held-out medians on one line, then cross-validates them pooled: every run's rounds as rounds of one run, so a
(family, world size) is judged by its median prediction against its median measurement over all of them. On a
machine whose speed drifts, one run's error mixes the model's bias with that run's noise (its calibration and
its timings); over several runs the noise shrinks and what stays is the bias, the work the model misses.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import functools
import json
import lzma
import pickle
import statistics
import warnings
from pathlib import Path
from typing import Any

from cost_model_families import DESIGN, ORDER, build


@functools.cache
def _captured(family: str) -> Any:
    """The family's graph as ``autotp.compile`` captures it (the same at every world size)."""
    from autotp.capture.tracing import capture

    model, args, kwargs = build(family)
    return capture(model, args, kwargs)


def _pricer(family: str, world_size: int) -> Any:
    """A function ``(plan, profile) -> predicted seconds per call`` of ``plan``'s choice, for one family and world size:
    the graph captured and its strategies enumerated once, the choice costed on ``profile`` and priced as the solver
    and ``autotp.estimate`` price it."""
    from autotp.cost_model.runtime import graph_host_s
    from autotp.passes.costing import cost_strategy_graph
    from autotp.passes.pricing import price_choice
    from autotp.passes.strategies import build_strategy_graph

    captured = _captured(family)
    graph = build_strategy_graph(captured.graph_module, world_size,
                                 {**captured.parameter_fqns(), **captured.state_fqns()}, frozenset(captured.state))

    def predicted_s(plan: Any, profile: Any) -> float:
        chosen = {node.name: node.strategy() for node in plan.nodes}
        missing = [name for name in graph.order if chosen.get(name) not in graph.strategies[name]]
        if missing:
            raise RuntimeError(f"{family} at tp {world_size}: the plan's strategy of {missing[:3]} is not a candidate "
                               "of the graph captured again; the run and this checkout trace differently")
        # only the chosen strategy of every node: costing the graph is then a fraction of the planner's work
        narrowed = dataclasses.replace(graph, strategies={name: [chosen[name]] for name in graph.order})
        price = price_choice(cost_strategy_graph(narrowed, profile), dict.fromkeys(graph.order, 0))
        # per call, and its compute as work (CPU seconds: the profile prices work divided by its core share;
        # the compute beyond the share's range runs faster, not with less work)
        call_s = graph_host_s(profile)
        return price.total_s + call_s, (price.compute_s + price.local_s + call_s) * profile.core_share

    return predicted_s


def observations(rows: list[dict]) -> tuple[list[Any], list[Any], list[Any]]:
    """Per row, priced for every subset of terms, three lists of :class:`~autotp.cost_model.crossval.Observation`:
    the forward on the group's wall clock; the same at the calibration's speed (the measured time divided by the
    drift probe's ratio, ``benchmarks/cost_model_accuracy.py``; empty for runs without the probe); and its compute
    form's work (each rank's CPU time, which another process taking the core does not lengthen) against the
    predicted compute's work."""
    from autotp import Plan
    from autotp.cost_model import Hardware
    from autotp.cost_model.crossval import TERMS, Observation, subsets, without

    result, steady, work, moved = [], [], [], []
    for family, world_size in sorted({(r["model"], r["world_size"]) for r in rows}, key=lambda k: (ORDER.index(k[0]), k[1])):
        price = _pricer(family, world_size)
        for row in (r for r in rows if (r["model"], r["world_size"]) == (family, world_size)):
            plan, profile = Plan.from_json(row["plan_json"]), Hardware.from_json(row["profile_json"])
            full = price(plan, profile)
            # a term whose removal alone changes nothing touches nothing in this graph (a wait without
            # collectives, a family's fixed cost without its ops): the subsets are priced over the others
            active = frozenset(t.name for t in TERMS if price(plan, without(profile, [t.name]))[0] != full[0])
            priced = {removed: price(plan, without(profile, removed)) for removed in subsets() if removed <= active}
            predicted = {removed: priced[removed & active][0] for removed in subsets()}
            if abs(full[0] - row["predicted_s"]) > 1e-6 * row["predicted_s"]:  # the cost model changed since the run
                moved.append(f"{family} tp {world_size} {row['predicted_s'] * 1e3:.3f} -> {full[0] * 1e3:.3f} ms")
            result.append(Observation(family, world_size, row["round_index"], row["measured_s"], predicted))
            if row.get("probe_s", 0) > 0 and row.get("probe_calibration_s", 0) > 0:
                drift = row["probe_s"] / row["probe_calibration_s"]
                steady.append(Observation(family, world_size, row["round_index"], row["measured_s"] / drift, predicted))
            if row["measured_compute_work_s"] > 0:
                work.append(Observation(family, world_size, row["round_index"], row["measured_compute_work_s"],
                                        {removed: priced[removed & active][1] for removed in subsets()}))
    if moved:
        print(f"priced with this checkout's cost model, which moved {len(moved)} of {len(rows)} predictions "
              f"since the run: {'; '.join(moved)}")
    return result, steady, work


def _worst(errors: dict[str, float]) -> str:
    """The family of ``errors`` (family -> signed error) furthest from its measurement."""
    return max(errors, key=lambda family: abs(errors[family]))


def report(observed: list[Any], k: int, profile: Any) -> None:
    """Print the cross-validation (module docstring); ``profile``: one of the run's profiles, to count its numbers."""
    from autotp.cost_model.crossval import TERMS, cross_validate, fitted_numbers

    families = [f for f in ORDER if any(o.family == f for o in observed)]
    result = cross_validate(observed, families, k)
    held_out = result.held_out_errors()
    world_sizes = result.world_sizes

    def calibrated_error(family: str, world_size: int, removed: frozenset[str] = frozenset()) -> float:
        mine = [o for o in observed if (o.family, o.world_size) == (family, world_size)]
        return (statistics.median(o.predicted_s[removed] for o in mine)
                / statistics.median(o.measured_s for o in mine) - 1)

    print(f"{len(families)} families, {k} folds; in-graph terms: {', '.join(t.name for t in TERMS)}")
    print(f"  the profile as calibrated prices with {sum(fitted_numbers(profile).values())} measured numbers")
    for fold in result.folds:
        removed = [t.name for t in TERMS if t.name not in fold.kept]
        print(f"  held out {', '.join(fold.held_out):<28} kept {len(fold.kept)} "
              f"({sum(fitted_numbers(profile, removed).values())} numbers): {', '.join(fold.kept) or '-'}")
    print("\nper world size: fitted (training folds) and held-out median absolute error; worst held-out family")
    for ws in world_sizes:
        errors = {f: e for (f, w), e in held_out.items() if w == ws}
        worst = _worst(errors)
        as_calibrated = [abs(calibrated_error(f, ws)) for f in families if f not in DESIGN]
        print(f"  tp {ws}: fitted {result.fitted_median(ws):.1%}, held out {result.held_out_median(ws):.1%} "
              f"(worst {worst} {errors[worst]:+.1%}); as calibrated, families outside the design four: "
              f"{statistics.median(as_calibrated):.1%}" if as_calibrated else "")
    print("\nsigned error per family, tp " + " / ".join(map(str, world_sizes))
          + ": held out (terms chosen without it) | as calibrated (every term)")
    for family in families:
        held = " / ".join(f"{held_out[(family, ws)]:+6.1%}" if (family, ws) in held_out else "   -  " for ws in world_sizes)
        full = " / ".join(f"{calibrated_error(family, ws):+6.1%}" for ws in world_sizes)
        print(f"  {family:<11}{' (design)' if family in DESIGN else '':<10} {held} | {full}")
    print("\neach term removed alone (every family): median absolute error per tp, and the worst family")
    for removed in (frozenset(), *(frozenset({t.name}) for t in TERMS)):
        cells = []
        for ws in world_sizes:
            errors = {f: calibrated_error(f, ws, removed) for f in families}
            worst = _worst(errors)
            cells.append(f"{statistics.median(abs(e) for e in errors.values()):5.1%} ({worst} {errors[worst]:+.0%})")
        print(f"  {'none' if not removed else 'without ' + next(iter(removed)):<30} " + " | ".join(cells))


def timing_spread(data: dict) -> None:
    """Print how far two timings of the very same rank-local graph in one run differ: the forward the accuracy table
    timed against the median of the decisions' timings of the same graph (a run with ``--decisions``, where all three
    plans compiled to the forward's graph: at tp 1 always), seconds later in the same processes."""
    rows = {(r["model"], r["world_size"]): r for r in data["rows"] if r["round_index"] == 0}
    gaps = []
    for d in data.get("decisions", ()):
        row = rows.get((d["model"], d["world_size"]))
        if row is not None and set(d["same_graph_as"]) == {"megatron", "no split"}:
            again = statistics.median((d["autotp_s"], d["megatron_s"], d["no_split_s"]))
            gaps.append((abs(row["measured_s"] / again - 1), d["model"], d["world_size"]))
    if gaps:
        worst = max(gaps)
        print(f"the same graph timed twice in this run (the forward, and the decisions' three timings of it): median "
              f"difference {statistics.median(g for g, _, _ in gaps):.1%} over {len(gaps)} (model, tp), worst "
              f"{worst[0]:.1%} ({worst[1]} tp {worst[2]})")


def refitted(data: dict) -> list[dict]:
    """``data``'s rows with each profile fitted again by this checkout from its round's calibration measurements."""
    from autotp.calibration.graphs import fair_core_share
    from autotp.cost_model.calibrate import build_profile

    calibrations = {(c["world_size"], c["round_index"]): c["measurements"] for c in data.get("calibrations", ())}
    profiles = {}
    for (world_size, round_index), encoded in sorted(calibrations.items()):
        everyone, links = pickle.loads(base64.b64decode(encoded))
        # runs from before the calibration recorded the fair share: the cores and threads the run recorded
        everyone = [m if m.fair_core_share else dataclasses.replace(
            m, fair_core_share=fair_core_share(data["cores"], world_size, m.threads)) for m in everyone]
        profile = build_profile(everyone, links, world_size=world_size, name=f"cpu-calibrated-{world_size}")
        profiles[world_size, round_index] = profile.to_json()
        print(f"  refitted tp {world_size} round {round_index}: dispatch {profile.host_dispatch_s * 1e6:.1f} us/node, "
              f"call {profile.graph_launch_s * 1e6:.0f} us, core share {profile.core_share:.2f} up to "
              f"{profile.core_share_range_s * 1e3:.1f} ms of compute and {profile.core_share_call_s * 1e6:.0f} us "
              "lost per call, wait "
              f"{profile.collective_wait_s * 1e6:.0f} us/coll + {profile.call_sync_wait_s * 1e6:.0f} us/call")
    missing = sorted({(r["world_size"], r["round_index"]) for r in data["rows"]} - set(profiles))
    if missing:
        raise SystemExit(f"the run has no calibration measurements for (tp, round) {missing}: run "
                         "benchmarks/cost_model_accuracy.py --json again with this checkout")
    return [{**row, "profile_json": profiles[row["world_size"], row["round_index"]]} for row in data["rows"]]


def run_threads(data: dict) -> int:
    """The threads each rank of the run computed with: its ``--threads``, else its first calibration's, else 1."""
    if data.get("threads"):
        return int(data["threads"])
    for calibration in data.get("calibrations", ()):
        everyone, _ = pickle.loads(base64.b64decode(calibration["measurements"]))
        return int(everyone[0].threads)
    return 1


def held_out_line(observed: list[Any], k: int) -> str:
    """Per world size, the held-out median absolute error and the worst held-out family, on one line."""
    from autotp.cost_model.crossval import cross_validate

    result = cross_validate(observed, [f for f in ORDER if any(o.family == f for o in observed)], k)
    cells = []
    for ws in result.world_sizes:
        errors = {f: e for (f, w), e in result.held_out_errors().items() if w == ws}
        worst = _worst(errors)
        cells.append(f"tp {ws} {result.held_out_median(ws):5.1%} ({worst} {errors[worst]:+.0%})")
    return "; ".join(cells)


def read_run(path: Path) -> dict:
    """One run's JSON, from ``path`` as the accuracy benchmark wrote it or compressed with xz (``.xz``)."""
    if path.suffix == ".xz":
        with lzma.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    return json.loads(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+",
                        help="--json files of benchmarks/cost_model_accuracy.py (or .json.xz: benchmarks/runs/)")
    parser.add_argument("--k", type=int, default=5, help="folds of families (default: 5)")
    parser.add_argument("--refit", action="store_true",
                        help="fit every round's profile again from its calibration measurements with this checkout")
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    import torch

    runs = [read_run(path) for path in options.runs]
    threads = {run_threads(data) for data in runs}
    if len(threads) > 1:
        raise SystemExit(f"the runs computed with different thread counts {sorted(threads)}: "
                         "pool runs of one --threads")
    # priced as the run's ranks priced it: PyTorch picks a convolution's kernel by the thread count
    torch.set_num_threads(threads.pop())
    pooled: list[tuple[list[Any], list[Any], list[Any]]] = []
    rows: list[dict] = []
    for index, (path, data) in enumerate(zip(options.runs, runs)):
        mine = data["rows"]
        if not mine or not mine[0].get("plan_json"):
            raise SystemExit(f"{path} has no plans: run benchmarks/cost_model_accuracy.py with --json")
        print(f"{path}: {len(mine)} rows, torch {data['torch']}, {data['cores']} cores, "
              f"load average at the end of the run {data['load_average_end']:.1f}")
        if options.refit:
            mine = refitted(data)
        timing_spread(data)
        # each run's rounds numbered apart from the others', so that pooled they stay rounds of their own
        mine = [{**row, "round_index": index * 1000 + row["round_index"]} for row in mine]
        pooled.append(observations(mine))
        rows += mine
    if len(runs) > 1:
        print("\neach run alone, on the group's wall clock: held-out median absolute error (worst held-out family)")
        for path, (wall, _, _) in zip(options.runs, pooled):
            print(f"  {path.name:<16} {held_out_line(wall, options.k)}")
        print(f"\n{len(runs)} runs pooled: every (family, world size) judged by its median over the runs' rounds")
    wall, steady, work = ([o for observed in pooled for o in observed[form]] for form in range(3))
    from autotp.cost_model import Hardware

    largest = max(r["world_size"] for r in rows)
    profile = Hardware.from_json(next(r["profile_json"] for r in rows if r["world_size"] == largest))
    print("\n== the forward on the group's wall clock (what the goal is stated in)")
    report(wall, options.k, profile)
    if steady:
        if len(steady) < len(wall):
            print(f"\n({len(wall) - len(steady)} of {len(wall)} rows have no drift probe and are left out below)")
        probed = [r for r in rows if r.get("probe_s", 0) > 0 and r.get("probe_calibration_s", 0) > 0]
        drifts = {ws: sorted(r["probe_s"] / r["probe_calibration_s"] for r in probed if r["world_size"] == ws)
                  for ws in sorted({r["world_size"] for r in probed})}
        print("\n== the same at the calibration's speed (each measurement divided by its drift probe's ratio; drift "
              + ", ".join(f"tp {ws} {d[0]:.2f}-{d[-1]:.2f}x (median {statistics.median(d):.2f})"
                          for ws, d in drifts.items()) + ")")
        report(steady, options.k, profile)
    print("\n== the compute form's work (CPU time: what the load does not lengthen; no communication)")
    report(work, options.k, profile)


if __name__ == "__main__":
    main()
