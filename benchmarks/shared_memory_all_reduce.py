"""Per-call time of a sum all-reduce on one host: gloo's functional all-reduce vs autotp's shared memory.

Spawns ``ws`` gloo processes (one thread each) and, per tensor size, times back-to-back calls of
``wait_tensor(all_reduce(x))`` (what a rewritten graph issues on gloo) and of
:class:`autotp.runtime.collectives.shared_memory.SharedMemoryAllReduce` (what it runs instead on one x86-64
host), and of the op ``torch.ops.autotp.shared_memory_all_reduce`` (the same call as the compiled runtime
modes make it, through the dispatcher), alternating them within each round so that all see the same machine
load. Prints the median microseconds per call over the rounds (the slowest rank's) and ratios. Usage::

    OMP_NUM_THREADS=1 python benchmarks/shared_memory_all_reduce.py --world-size 2 4
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _per_call_s(call, calls: int) -> float:
    """Seconds per call of ``call`` over ``calls`` calls, the slowest rank's, after a barrier."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _worker(rank: int, world_size: int, port: int, sizes: list[int], rounds: int, calls: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from autotp.passes.small_collectives import compiler_visible_collectives
    from autotp.runtime.collectives.hosts import local_host
    from autotp.runtime.collectives.shared_memory import shared_memory_all_reduce_for

    c10d = torch.ops._c10d_functional
    group_name = dist.group.WORLD.group_name
    shared = shared_memory_all_reduce_for(None, host=local_host(), timeout_s=60.0)
    if shared is None:
        raise SystemExit("these ranks cannot share memory (not one x86-64 host)")
    graph = torch.fx.Graph()  # one stand-in node, turned into the op call a compiled graph makes
    graph.output(graph.call_function(shared, (graph.placeholder("x"),)))
    as_op = compiler_visible_collectives(torch.fx.GraphModule(torch.nn.Module(), graph))
    op_node = next(n for n in as_op.graph.nodes if n.op == "call_function")
    segment = as_op.get_buffer(next(n.target for n in as_op.graph.nodes if n.op == "get_attr"))
    op, op_args = op_node.target, op_node.args[2:]
    for nbytes in sizes:
        calls_here = max(5, calls * 64 * 1024 // max(nbytes, 64 * 1024))  # fewer calls of large tensors
        x = torch.randn(max(1, nbytes // 4))
        variants = {"gloo": lambda x=x: c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name)),
                    "shared memory": lambda x=x: shared(x),
                    "op": lambda x=x: op(x, segment, *op_args)}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for call in variants.values():  # warm-up
            _per_call_s(call, max(1, calls_here // 10))
        for _ in range(rounds):
            for name, call in variants.items():
                times[name].append(_per_call_s(call, calls_here))
        if rank == 0:
            gloo_us, shm_us, op_us = (statistics.median(times[n]) * 1e6 for n in variants)
            print(f"ws {world_size}  {nbytes / 1024:>8.1f} KiB  gloo {gloo_us:>9.1f} us  shared memory "
                  f"{shm_us:>8.1f} us  as op {op_us:>8.1f} us  gloo / shared {gloo_us / shm_us:>6.1f}x  "
                  f"op / shared {op_us / shm_us:>4.2f}x", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, nargs="+", default=[2])
    parser.add_argument("--bytes", type=int, nargs="+", default=[2048, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200, help="calls per round (fewer for tensors over 1 MiB)")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores")
    for world_size in args.world_size:
        mp.spawn(_worker, args=(world_size, _free_port(), args.bytes, args.rounds, args.calls), nprocs=world_size)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
