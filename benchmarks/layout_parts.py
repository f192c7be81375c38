"""One batch-1 forward of two layouts of docs/benchmarks/layouts.md by its parts, measured and priced.

On 2 hosts x 2 ranks (``tests/cluster.py``, a core per host; needs root and iproute2) and the model of
``benchmarks/layouts.py``, each of the layouts ``--layouts`` (dp x pp x tp; default pp 4 and 2 x 2 x 1) is compiled
with ``autotp.compile_mesh`` on the given profile (one the layouts benchmark calibrated: ``--keep``), and timed on
every rank, each call after a barrier, the median of ``--repeats``: when the rank's stage began computing (its input
received) and ended, when its pipeline step ended (its output sent), when the data-parallel gather began and ended
(``gather_batch``, on a replica's source), when the output's hand-out began and ended on the rank (received and
passed on) and when the rank had the whole output, each from the moment the first rank started the call (the ranks
share this machine's monotonic clock). Beside them, the search's parts of the same
layout on the same profile (compute, stage sends, output to every rank) and its stages' times. The timers wrap the
pipeline stage's ``forward_one_chunk``, the schedule's ``step``, ``mesh_module.gather_batch`` and ``mesh_module.hand_out``; nothing
else changes.

    sudo .venv/bin/python benchmarks/layout_parts.py PROFILE.json --rate 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT / "tests"))
sys.path.insert(0, str(_ROOT / "benchmarks"))

SEQ_LEN = 32  # tokens per request, as benchmarks/layouts.py measures by default
SERVING_BATCH = 8  # its throughput batch, which plan_layouts plans beside the latency read here


def measure_parts(rank: int, world_size: int, profile: str, layouts: list[list[int]], repeats: int) -> dict[str, Any]:
    """On every rank: per layout, the medians (ms) of its events from the first rank's start of the call."""
    import layouts as layouts_benchmark
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    import autotp.runtime.mesh.mesh_module as mesh_module

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model = layouts_benchmark.build_model()
    events: dict[str, float] = {}  # this call's: name -> time.perf_counter()

    def marked(begins: str | None, ends: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if begins is not None:
                events[begins] = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                events[ends] = time.perf_counter()
        return wrapper

    plain_gather, plain_hand_out = mesh_module.gather_batch, mesh_module.hand_out
    mesh_module.gather_batch = marked("gather over dp began", "gather over dp ended", plain_gather)
    mesh_module.hand_out = marked("hand-out began", "hand-out ended", plain_hand_out)
    out: dict[str, Any] = {}
    try:
        for dims in layouts:
            named = [(n, s) for n, s in zip(("dp", "pp", "tp"), dims) if s > 1]
            mesh = init_device_mesh("cpu", tuple(s for _, s in named), mesh_dim_names=tuple(n for n, _ in named))
            ids = layouts_benchmark.example_ids(dims[0], SEQ_LEN)
            part = autotp.compile_mesh(model, mesh, example_inputs=(ids,), example_kwargs={"use_cache": False},
                                       options=autotp.PlanOptions(hardware=profile))
            schedule = getattr(part, "_schedule", None)
            if schedule is not None:
                schedule.step = marked(None, "step ended", schedule.step)
                stage = schedule._stage
                stage.forward_one_chunk = marked("stage began", "stage computed", stage.forward_one_chunk)
            calls = []
            with torch.no_grad():
                part(ids, use_cache=False)
                for _ in range(repeats):
                    dist.barrier()
                    events.clear()
                    start = time.perf_counter()
                    part(ids, use_cache=False)
                    calls.append({"call began": start, **events, "output everywhere": time.perf_counter()})
            # every rank's events from the first rank's start of the same call
            everyone: list[Any] = [None] * world_size
            dist.all_gather_object(everyone, [call["call began"] for call in calls])
            firsts = [min(starts) for starts in zip(*everyone)]
            key = "x".join(map(str, dims))
            out[key] = {name: statistics.median((call[name] - first) * 1e3 for call, first in zip(calls, firsts))
                        for name in calls[0]}
    finally:
        mesh_module.gather_batch, mesh_module.hand_out = plain_gather, plain_hand_out
    return out


def priced_parts(profile: str, layouts: list[list[int]]) -> dict[str, dict[str, float]]:
    """The search's latency parts (ms) of each layout on ``profile``: the forced plans of
    ``benchmarks/layouts.py: plan_layouts``."""
    import layouts as layouts_benchmark
    import torch

    torch.set_num_threads(1)
    planned = layouts_benchmark.plan_layouts(Path(profile), SEQ_LEN, SERVING_BATCH, 0)["latency"]["layouts"]
    priced = {}
    for dims in layouts:
        candidate = json.loads(planned[tuple(dims)]["plan"])["candidates"][0]
        priced["x".join(map(str, dims))] = {**{k: v * 1e3 for k, v in candidate["latency_parts"].items()},
                                            "total": candidate["latency_s"] * 1e3,
                                            "stages (ranks all busy)": [round(v * 1e3, 2) for v in candidate["latency_stage_s"]]}
    return priced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", help="a profile calibrated in the cluster (benchmarks/layouts.py --keep)")
    parser.add_argument("--rate", type=float, default=200.0, help="the link's Mbit/s (0: unshaped)")
    parser.add_argument("--layouts", nargs="+", default=["1x4x1", "2x2x1"], help="dp x pp x tp of 4 ranks")
    parser.add_argument("--repeats", type=int, default=9)
    options = parser.parse_args()
    from cluster import Cluster, Link

    # the ranks import this module by name (Cluster.run_function)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(_ROOT / "benchmarks"), os.environ.get("PYTHONPATH"))))
    layouts = [[int(n) for n in layout.split("x")] for layout in options.layouts]
    profile = str(Path(options.profile).resolve())
    with Cluster(2, Link(rate_mbit=options.rate) if options.rate else None, cores=True) as cluster:
        measured = cluster.run_function("layout_parts:measure_parts", ranks_per_host=2, timeout_s=900.0,
                                        kwargs={"profile": profile, "layouts": layouts, "repeats": options.repeats})
    priced = priced_parts(profile, layouts)
    setting = "unshaped" if not options.rate else f"{options.rate:g} Mbit/s"
    print(f"2 hosts x 2 ranks, {setting}, batch 1 per replica, median of {options.repeats}; ms")
    for key in priced:
        print(f"{key}: priced " + ", ".join(f"{name} {value:.1f}" if isinstance(value, float) else f"{name} {value}"
                                            for name, value in priced[key].items()))
        for rank, per_layout in enumerate(measured):
            print(f"  rank {rank}: " + ", ".join(f"{name} {value:.1f}" for name, value in per_layout[key].items()))


if __name__ == "__main__":
    main()
