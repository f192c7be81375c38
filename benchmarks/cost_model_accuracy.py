"""Predicted vs measured forward time on this CPU, for the tiny model zoo at world sizes 1, 2, 4.

    python benchmarks/cost_model_accuracy.py [--world-sizes 1 2 4] [--runs 20] [--threads T] [--full-calibration]

For each world size N:

1. calibrate this machine for N ranks (``autotp.cost_model.calibrate``, quick mode unless
   ``--full-calibration``): matmul peak, copy bandwidth and tiny-op floor measured with N ranks
   busy at once, gloo alpha/beta fitted across N processes (across 2 when N is 1);
2. spawn N gloo processes; in each, for every model (tiny MLP, Llama, GPT-2, BERT from
   ``tests/models.py``), ``autotp.compile`` it with ``hardware=`` that profile, and time the
   forward pass: a barrier, then the call, timed on each rank; the slowest rank counts, and the
   figure is the median of ``--runs`` runs after ``--warmup`` warm-up runs;
3. print predicted (``plan.estimate().time_s``) against measured, the error, and the
   compute/communication split of both: the measured split times every node of the rank-local
   graph (an ``fx.Interpreter``, ``--runs`` more runs), a collective with its ``wait_tensor``.

It ends with the median absolute percentage error over all (model, world size) pairs, overall
and per world size. Threads per rank: ``--threads``, by default ``max(1, cores // N)`` as in
``autotp demo``; calibration uses the same number.
Timings are wall-clock on a possibly shared machine: run it on an idle one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TESTS = str(Path(__file__).resolve().parent.parent / "tests")
MODELS = ("mlp", "llama", "gpt2", "bert")


@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    world_size: int
    predicted_s: float
    predicted_compute_s: float
    predicted_comm_s: float
    measured_s: float
    collectives: int
    ops: int
    measured_compute_s: float = float("nan")
    measured_comm_s: float = float("nan")

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _time_forward(model: Any, args: tuple, kwargs: dict, warmup: int, runs: int) -> float:
    """Median over ``runs`` of the slowest rank's forward time (each run starts after a barrier)."""
    with torch.no_grad():
        for _ in range(warmup):
            model(*args, **kwargs)
        times = []
        for _ in range(runs):
            dist.barrier()
            start = time.perf_counter()
            model(*args, **kwargs)
            times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


class _NodeTimer(torch.fx.Interpreter):
    """Runs a graph node by node, adding each node's seconds to ``compute_s`` or ``comm_s``."""

    def __init__(self, graph_module: torch.fx.GraphModule, is_comm: Any) -> None:
        super().__init__(graph_module)
        self.is_comm = is_comm
        self.compute_s = self.comm_s = 0.0

    def run_node(self, node: torch.fx.Node) -> Any:
        start = time.perf_counter()
        result = super().run_node(node)
        elapsed = time.perf_counter() - start
        if self.is_comm(node):
            self.comm_s += elapsed
        elif node.op == "call_function":
            self.compute_s += elapsed
        return result


def _time_by_kind(tp_model: Any, args: tuple, kwargs: dict, runs: int) -> tuple[float, float]:
    """Median (compute, communication) seconds of the slowest rank, node by node (fx.Interpreter).

    A collective counts with its ``wait_tensor``: the wait is where a rank sits until its peers
    arrive. The interpreter adds its own overhead per node, so the two parts add up to a little
    more than the plain forward time; they show where the time goes, not the total.
    """
    from autotp.passes.rewrite import is_collective

    wait = torch.ops._c10d_functional.wait_tensor.default
    graph_module = tp_model.graph_module
    samples = []
    for _ in range(runs):
        timer = _NodeTimer(graph_module, lambda n: is_collective(n) or n.target is wait)
        graph_module.forward = timer.run  # Module.__call__ looks forward up on the instance first
        try:
            dist.barrier()
            with torch.no_grad():
                tp_model(*args, **kwargs)
        finally:
            del graph_module.forward
        samples.append((timer.compute_s, timer.comm_s))
    slowest = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    compute = statistics.median(slowest[:, 0].tolist())
    comm = statistics.median(slowest[:, 1].tolist())
    return compute, comm


def _rank(rank: int, world_size: int, init_method: str, profile_json: str, models: tuple[str, ...],
          warmup: int, runs: int, threads: int, results: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.path.insert(0, TESTS)
    warnings.simplefilter("ignore")
    from models import BUILDERS

    import autotp
    from autotp.cost_model import Hardware
    from autotp.passes.rewrite import is_collective

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        hardware = Hardware.from_json(profile_json)
        for name in models:
            model, args, kwargs = BUILDERS[name]()
            tp_model = autotp.compile(model, world_size=world_size, example_inputs=args, example_kwargs=kwargs,
                                      hardware=hardware)
            measured = _time_forward(tp_model, args, kwargs, warmup, runs)
            measured_compute, measured_comm = _time_by_kind(tp_model, args, kwargs, runs)
            estimate = tp_model.plan.estimate(hardware)
            graph = tp_model.graph_module.graph
            ops = sum(1 for n in graph.nodes if n.op == "call_function")
            collectives = sum(1 for n in graph.nodes if is_collective(n))
            if rank == 0:
                results.put(Row(name, world_size, estimate.time_s, estimate.compute_s, estimate.comm_s, measured,
                                collectives, ops, measured_compute, measured_comm))
    finally:
        dist.destroy_process_group()


def measure(world_size: int, profile_json: str, models: tuple[str, ...], warmup: int, runs: int,
            threads: int) -> list[Row]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    context = mp.start_processes(
        _rank, args=(world_size, f"tcp://127.0.0.1:{_free_port()}", profile_json, models, warmup, runs, threads, results),
        nprocs=world_size, join=False, start_method="spawn",
    )
    rows: list[Row] = []
    while True:
        while not results.empty():
            rows.append(results.get())
        if context.join(timeout=0.1):
            break
    while not results.empty():
        rows.append(results.get())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--runs", type=int, default=20, help="timed forward passes per model (default: 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed forward passes first (default: 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores // N)")
    parser.add_argument("--full-calibration", action="store_true", help="full calibration instead of quick")
    parser.add_argument("--save-profiles", default=None, help="folder to write each calibrated profile to")
    options = parser.parse_args()

    from autotp.cost_model.calibrate import CalibrationConfig, calibrate

    print(f"torch {torch.__version__}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}", flush=True)
    rows: list[Row] = []
    for world_size in options.world_sizes:
        threads = options.threads or max(1, (os.cpu_count() or 1) // world_size)
        if options.full_calibration:
            config = CalibrationConfig(threads=threads)
        else:
            config = CalibrationConfig.quick(threads=threads)
        started = time.perf_counter()
        profile = calibrate(world_size, config=config, name=f"cpu-calibrated-{world_size}")
        link = profile.intra_node
        print(f"\n== world size {world_size}: calibrated in {time.perf_counter() - started:.1f} s: "
              f"float32 {profile.peak_tflops['float32'] * 1e3:.1f} GFLOP/s, memory {profile.memory_bandwidth_gbps:.2f} GB/s, "
              f"floor {profile.kernel_floor_s * 1e6:.1f} us, view {profile.view_op_s * 1e6:.1f} us, {threads} thread(s), gloo {link.base_latency_s * 1e6:.0f} us/call + "
              f"{link.latency_s * 1e6:.0f} us/step, {link.bandwidth_gbps:.3f} GB/s", flush=True)
        if options.save_profiles:
            Path(options.save_profiles).mkdir(parents=True, exist_ok=True)
            Path(options.save_profiles, f"cpu-ws{world_size}.json").write_text(profile.to_json())
        measured = measure(world_size, profile.to_json(), tuple(options.models), options.warmup, options.runs,
                           threads)
        print(f"{'model':<8} {'ws':>3} {'predicted':>11} {'measured':>11} {'error':>8}   "
              f"{'compute: predicted / measured':>31} {'comm: predicted / measured':>28} {'ops':>5} {'colls':>5}")
        for row in measured:
            print(f"{row.model:<8} {row.world_size:>3} {row.predicted_s * 1e3:>9.3f}ms {row.measured_s * 1e3:>9.3f}ms "
                  f"{row.error:>+8.1%}   {row.predicted_compute_s * 1e3:>13.3f}ms / {row.measured_compute_s * 1e3:>9.3f}ms "
                  f"{row.predicted_comm_s * 1e3:>10.3f}ms / {row.measured_comm_s * 1e3:>9.3f}ms "
                  f"{row.ops:>5} {row.collectives:>5}", flush=True)
        rows += measured

    print("\nmedian absolute percentage error (predicted vs measured forward time):")
    for world_size in options.world_sizes:
        errors = [abs(r.error) for r in rows if r.world_size == world_size]
        if errors:
            print(f"  world size {world_size}: {statistics.median(errors):.1%} over {len(errors)} models")
    overall = statistics.median(abs(r.error) for r in rows)
    print(f"  overall: {overall:.1%} over {len(rows)} (model, world size) pairs")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
