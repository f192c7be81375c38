"""Where the predicted time of a rank-local graph goes wrong, by op kind (world size 1, this CPU).

    python benchmarks/cost_model_breakdown.py [--models llama gpt2 bert mlp] [--runs 15] [--by kind|op]

Calibrates a profile in this process (``CalibrationConfig.quick``, one thread, a gloo group of
one; the link across two other processes) on the work clock (the graphs' share of a core taken
as 1, so that the profile prices what the timings below measure), compiles each family named (``benchmarks/cost_model_families.py``) with
it, and times

- the whole call of the compiled model and of its rank-local ``GraphModule``, on the work clock
  (this thread's CPU time: another process taking the core does not count), median of ``--runs``;
- every node of the graph, run by an ``fx.Interpreter`` on the work clock (median per node;
  the interpreter adds its own few microseconds to every node, views most visibly);

and prints, per op kind (views, GEMMs, attention, lookups, transcendental, reductions and norms,
other elementwise; with ``--by op``, per ATen op instead), the node count, the measured and the predicted
milliseconds (the plan's ``compute_s`` of the same nodes), so the kind whose prediction is low stands out.
"""

from __future__ import annotations

import argparse
import collections
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
from cost_model_families import DESIGN, ORDER, build

TESTS = str(Path(__file__).resolve().parent.parent / "tests")


def kind_of(target: Any) -> str:
    """The op kind a node is reported under."""
    from autotp.cost_model.compute import gemm_dims, is_lookup, is_transcendental, launches_no_kernel

    name = str(target)
    if launches_no_kernel(target):
        return "view"
    if "scaled_dot_product" in name:
        return "attention"
    if gemm_dims(target, ()) is not None or any(word in name for word in ("linear", "addmm", ".mm", "bmm", "matmul")):
        return "gemm"
    if is_lookup(target):
        return "lookup"
    if is_transcendental(target):
        return "transcendental"
    if any(word in name for word in ("norm", "mean", "sum", "amax", "softmax", "var")):
        return "reduction/norm"
    return "other elementwise"


class _NodeTimer(torch.fx.Interpreter):
    def __init__(self, module: torch.fx.GraphModule) -> None:
        super().__init__(module)
        self.seconds: dict[str, list[float]] = collections.defaultdict(list)

    def run_node(self, node: torch.fx.Node) -> Any:
        start = time.thread_time()
        result = super().run_node(node)
        self.seconds[node.name].append(time.thread_time() - start)
        return result


def _median_work_s(call: Any, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.thread_time()
        call()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def _breakdown(name: str, hardware: Any, runs: int, by: str = "kind") -> None:
    """Time and print one model's graph by op kind (module docstring)."""
    import autotp

    model, args, kwargs = build(name)
    compiled = autotp.compile(model, world_size=1, example_inputs=args, example_kwargs=kwargs, hardware=hardware)
    graph_module = compiled.graph_module
    captured: dict[str, tuple] = {}
    forward = graph_module.forward

    def grab(*values: Any, forward: Any = forward) -> Any:
        captured["values"] = values
        return forward(*values)

    graph_module.forward = grab
    with torch.no_grad():
        compiled(*args, **kwargs)
        graph_module.forward = forward
        values = captured["values"]
        for _ in range(3):
            compiled(*args, **kwargs)
        model_s = _median_work_s(lambda: compiled(*args, **kwargs), runs)
        graph_s = _median_work_s(lambda: graph_module(*values), runs)
        timer = _NodeTimer(graph_module)
        for _ in range(runs):
            timer.run(*values)
    estimate = autotp.estimate(compiled.plan, hardware)
    predicted = {node.name: node.compute_s for node in compiled.plan.nodes}
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.name not in timer.seconds:
            continue
        row = kinds[kind_of(node.target) if by == "kind" else str(node.target)]
        row[0] += 1
        row[1] += statistics.median(timer.seconds[node.name])
        row[2] += predicted.get(node.name, 0.0)
    print(f"\n{name}: model call {model_s * 1e3:.3f} ms, graph call {graph_s * 1e3:.3f} ms (work clock), "
          f"predicted {estimate.time_per_call_s * 1e3:.3f} ms ({(estimate.time_per_call_s / model_s - 1):+.0%} "
          f"vs the model call)")
    width = 18 if by == "kind" else max(len(kind) for kind in kinds)
    print(f"  {by:<{width}} {'nodes':>5} {'measured ms':>12} {'predicted ms':>13} {'us/node meas':>13} {'pred':>7}")
    for kind, (count, measured_s, predicted_s) in sorted(kinds.items(), key=lambda item: -item[1][1]):
        print(f"  {kind:<{width}} {count:>5} {measured_s * 1e3:>12.3f} {predicted_s * 1e3:>13.3f} "
              f"{measured_s / count * 1e6:>13.1f} {predicted_s / count * 1e6:>7.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DESIGN), choices=ORDER,
                        help="families of benchmarks/cost_model_families.py (default: the four the terms were designed on)")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--by", choices=("kind", "op"), default="kind", help="group the nodes by op kind or ATen op")
    options = parser.parse_args()
    sys.path.insert(0, TESTS)
    warnings.simplefilter("ignore")
    from autotp.calibration.calibrate import CalibrationConfig, measure_links, measure_rank
    from autotp.cost_model.calibrate import build_profile

    torch.set_num_threads(1)
    config = CalibrationConfig.quick(threads=1)
    links = measure_links(2, config)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        measured = measure_rank(0, 1, config, collectives=False)
        # priced on the work clock, as measured here: the graphs' share of a core set to 1
        alone = dataclasses.replace(measured, graphs=tuple(dataclasses.replace(g, core_share=1.0) for g in measured.graphs))
        hardware = build_profile([alone], links, world_size=1)
        print(f"profile: dispatch {hardware.host_dispatch_s * 1e6:.1f} us/node, view {hardware.view_op_s * 1e6:.1f} us, "
              f"call {hardware.graph_launch_s * 1e6:.0f} us, float32 {hardware.peak_tflops['float32'] * 1e3:.0f} GFLOP/s "
              f"(half rate at dim {hardware.gemm_half_efficiency_dim:g}), memory {hardware.memory_bandwidth_gbps:.1f} GB/s; "
              f"load average {os.getloadavg()[0]:.1f}")
        for name in options.models:
            _breakdown(name, hardware, options.runs, options.by)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
