"""What a call timed in turn with another does to both: a model's forward and its compute form with and without the
accuracy benchmark's drift probe in the rotation, and the probe on its own.

    OMP_NUM_THREADS=1 python benchmarks/probe_in_turn.py --world-size 4 --models mlp tied_lm cnn

``autotp.calibration.graphs.time_in_turn`` times several calls in turn, each after an untimed call of itself and a
start common to every rank. Where ranks outnumber cores, what else is in the rotation changes a call's share of a
core; this script prints, per model and per rotation, each call's median wall time on the group, its work (CPU
time) and their ratio, then the ratio of the compute form with the probe in turn to without, and of the probe in
turn to on its own (on this project's 2-core VM at tp 4: 1.2-2.7x and 0.7-0.9x over four runs), which is why
``benchmarks/cost_model_accuracy.py`` times the probe on its own.
"""

from __future__ import annotations

import argparse
import socket
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cost_model_accuracy import PROBE_SHAPE, calling_with
from cost_model_families import ORDER, build


def _worker(rank: int, world_size: int, port: int, models: list[str], runs: int) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    import autotp
    from autotp.calibration.graphs import block_graph, local_stand_ins, time_in_turn

    probe_module, probe_input = block_graph(PROBE_SHAPE, world_size, None)
    try:
        for name in models:
            model, args, kwargs = build(name)
            tp_model = autotp.compile(model, world_size=world_size, example_inputs=args, example_kwargs=kwargs)
            real = tp_model.graph_module
            compute = local_stand_ins(real) or real
            forms = [calling_with(tp_model, real, args, kwargs), calling_with(tp_model, compute, args, kwargs)]

            def probe() -> Any:
                return probe_module(probe_input)

            rotations = {"real, compute, probe": [*forms, probe], "real, compute": forms, "probe": [probe]}
            timed = {label: time_in_turn(calls, runs) for label, calls in rotations.items()}
            tp_model.graph_module = real
            if rank == 0:
                for label, results in timed.items():
                    cells = "; ".join(f"{wall * 1e3:.3f} ms ({work / wall:.2f} of a core)" for wall, work in results)
                    print(f"{name} tp {world_size} [{label}]: {cells}")
                with_probe, without = timed["real, compute, probe"], timed["real, compute"]
                print(f"  compute form with the probe in turn / without: {with_probe[1][0] / without[1][0]:.2f}x; "
                      f"probe in turn / on its own: {with_probe[2][0] / timed['probe'][0][0]:.2f}x", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=ORDER, default=["mlp", "tied_lm", "cnn"])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--runs", type=int, default=21)
    options = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_worker, args=(options.world_size, port, options.models, options.runs), nprocs=options.world_size)


if __name__ == "__main__":
    main()
