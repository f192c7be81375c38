"""What gloo's collectives cost against each other: its reduce-scatter beside its all-reduce and all-gather.

The cost model prices a collective by its algorithm's steps and bytes (``cost_model/collectives.py``); for a ring,
a reduce-scatter moves what an all-gather does, half of an all-reduce. gloo runs its reduce-scatter as an all-reduce
of the whole input, so a CPU profile prices it by the all-reduce's formula (``GLOO_RUNS_AS``) and ``autotp
calibrate`` fits its samples so. This prints the evidence: ``ws`` gloo processes (one thread each) time
``wait_tensor`` of the functional all-reduce, all-gather and reduce-scatter (what a rewritten graph issues) of the
same full tensor, in turn within each round, per size; the median over rounds of the slowest rank's microseconds,
and reduce-scatter / all-reduce and all-gather / all-reduce. Usage::

    OMP_NUM_THREADS=1 python benchmarks/gloo_collectives.py --world-size 2 4
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20)
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _waited(collective, *args) -> torch.Tensor:
    """``collective(*args)`` waited on, as a rewritten graph runs it."""
    return torch.ops._c10d_functional.wait_tensor(collective(*args))


def _slowest_s(call) -> float:
    """Seconds of one ``call`` after a barrier, the slowest rank's."""
    dist.barrier()
    start = time.perf_counter()
    call()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _rank(rank: int, world_size: int, port: int, rounds: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    c10d, group = torch.ops._c10d_functional, dist.group.WORLD.group_name
    try:
        for nbytes in SIZES:
            per_rank = max(1, nbytes // 4 // world_size)
            full, shard = torch.ones(per_rank * world_size), torch.ones(per_rank)
            calls = {
                "all_reduce": functools.partial(_waited, c10d.all_reduce, full, "sum", group),
                "all_gather": functools.partial(_waited, c10d.all_gather_into_tensor, shard, world_size, group),
                "reduce_scatter": functools.partial(_waited, c10d.reduce_scatter_tensor, full, "sum", world_size, group),
            }
            for call in calls.values():
                call()  # connections and buffers made
            times: dict[str, list[float]] = {kind: [] for kind in KINDS}
            for _ in range(rounds):
                for kind in KINDS:
                    times[kind].append(_slowest_s(calls[kind]))
            if rank == 0:
                results[nbytes] = {kind: statistics.median(values) for kind, values in times.items()}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, gloo, 1 thread per rank, median of {args.rounds} rounds")
    for world_size in args.world_size:
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(_rank, args=(world_size, _free_port(), args.rounds, results), nprocs=world_size)
            measured = dict(results)
        print(f"\n{world_size} ranks: microseconds per call (full tensor of n bytes)")
        print(f"{'n':>10} {'all_reduce':>11} {'all_gather':>11} {'reduce_scatter':>15} {'RS / AR':>8} {'AG / AR':>8}")
        for nbytes in SIZES:
            row = measured[nbytes]
            print(f"{nbytes / 2**10:>8.0f}Ki {row['all_reduce'] * 1e6:>11.0f} {row['all_gather'] * 1e6:>11.0f} "
                  f"{row['reduce_scatter'] * 1e6:>15.0f} {row['reduce_scatter'] / row['all_reduce']:>8.2f} "
                  f"{row['all_gather'] / row['all_reduce']:>8.2f}")


if __name__ == "__main__":
    main()
