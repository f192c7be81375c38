"""Where the predicted time of a rank-local graph goes wrong, by op kind (this CPU, world size 1 or more).

    python benchmarks/cost_model_breakdown.py [--models llama gpt2 bert mlp] [--runs 15] [--by kind|op|node]
                                              [--world-size N] [--against-tp1]

Calibrates a profile in these processes (``CalibrationConfig.quick``, one thread per rank, a gloo group of
``--world-size`` ranks, every rank measuring at once; the link across two other processes)
on the work clock (the graphs' share of a core taken as 1, so that the profile prices what the timings below
measure), compiles each family named (``benchmarks/cost_model_families.py``) with it at that world size, and
times, on every rank at once (rank 0's figures printed), the graph's compute (at world size > 1 its
collectives replaced by local stand-ins, ``autotp.calibration.graphs.local_stand_ins``, as the accuracy
benchmark measures compute):

- the whole call of the compiled model and of its rank-local ``GraphModule``, on the work clock
  (this thread's CPU time: another process taking the core does not count), median of ``--runs``;
- every node of the graph, from work-clock readings the graph itself takes between its nodes (a copy with a
  clock read after each call node; median per node), in two conditions: back to back (each call right after
  one of itself) and after a common start (a barrier, then a few milliseconds' wait, as the accuracy benchmark
  and the calibration time every call: ``autotp.calibration.graphs.common_start``). The second shows what a
  call pays for starting cold: on this project's 2-core VM a CNN's first oneDNN convolution took 60 us more
  than back to back, the first call of each other kernel 3-16 us more, and a kernel's later calls nothing;

and prints, per op kind (views, GEMMs, attention, lookups, transcendental, pooling, reductions and norms,
other elementwise; with ``--by op``, per ATen op; with ``--by node``, per node in graph order; with several
families, once more for all of them summed), the node count,
the measured milliseconds in both conditions and the predicted ones (the plan's ``compute_s`` of the same
nodes), so the kind whose prediction is low stands out; and the first calls the plan was charged
(``Hardware.first_call_s``) next to what every node took after a common start beyond back to back. Nodes the rewrite added (a collective's stand-in, the
layout copies around a gather, a local form's own ops) have no plan node of their own: they are listed apart,
marked ``+``, at a predicted 0 (the plan prices them inside the node they serve).

With ``--against-tp1`` (and ``--world-size`` 2 or more) it prints instead, per family, its GEMMs and its other
nodes at that world size and at tp 1 (each rank compiling the model alone too), measured and predicted with the
same profile, the two graphs timed in turn: whether the predicted tp N / tp 1 ratio is the measured one, apart
from the drift of the machine and of the calibration between two runs.
"""

from __future__ import annotations

import argparse
import collections
import copy
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
    from autotp.cost_model.compute import gemm_dims, is_lookup, is_transcendental, launches_no_kernel, op_family

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
    if op_family(target) == "pooling":
        return "pooling"
    if any(word in name for word in ("norm", "mean", "sum", "amax", "softmax", "var")):
        return "reduction/norm"
    return "other elementwise"


_STAMPS: list[float] = []


def _stamp() -> None:
    """Read this thread's CPU clock into :data:`_STAMPS` (a node of a stamped graph calls it)."""
    _STAMPS.append(time.thread_time())


def _stamped(module: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str]]:
    """A copy of ``module`` that reads the work clock before its first node and after every call node, and the
    names of those nodes in order: the nodes timed as the graph runs them (an ``fx.Interpreter`` adds its own
    5-10 us to every node)."""
    graph = copy.deepcopy(module.graph)
    calls = [node for node in graph.nodes if node.op == "call_function"]
    if calls:
        with graph.inserting_before(calls[0]):
            graph.call_function(_stamp)
    for node in calls:
        with graph.inserting_after(node):
            graph.call_function(_stamp)
    return torch.fx.GraphModule(module, graph), [node.name for node in calls]


def _node_seconds(module: torch.fx.GraphModule, values: tuple, runs: int, after_start: bool
                  ) -> dict[str, float]:
    """Median work seconds of each call node of ``module`` over ``runs`` calls, each after one untimed call:
    back to back, or (``after_start``) after a common start of every rank, as the accuracy benchmark and the
    calibration time a call (:func:`autotp.calibration.graphs.common_start`)."""
    from autotp.calibration.graphs import common_start

    stamped, names = _stamped(module)
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(runs):
        stamped(*values)
        if after_start:
            common_start(True)
        else:
            dist.barrier()  # every rank at once, as in a forward, without the wait of a common start
            stamped(*values)
        _STAMPS.clear()
        stamped(*values)
        for name, start, end in zip(names, _STAMPS, _STAMPS[1:]):
            seconds[name].append(end - start)
    return {name: statistics.median(values_) for name, values_ in seconds.items()}


def _median_work_s(call: Any, runs: int) -> float:
    times = []
    for _ in range(runs):
        dist.barrier()  # every rank computes at the same time, as in a forward
        start = time.thread_time()
        call()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def _first_calls_priced_s(compute: torch.fx.GraphModule, priced: dict[str, float], hardware: Any
                          ) -> tuple[float, int]:
    """``(seconds, count)`` of the first calls the cost pass charges ``compute``'s plan nodes (``priced``: their
    names): each kernel's first call in graph order (``autotp.cost_model.compute.first_call_key``) pays
    ``Hardware.first_call_cost_s`` of its family; a view never."""
    from autotp.cost_model.compute import first_call_key, launches_no_kernel, op_family

    called: set[str] = set()
    seconds = 0.0
    for node in compute.graph.nodes:
        if (node.op != "call_function" or node.name not in priced or not isinstance(node.target, torch._ops.OpOverload)
                or launches_no_kernel(node.target)):
            continue
        key = first_call_key(node.target)
        if key not in called:
            called.add(key)
            seconds += hardware.first_call_cost_s(op_family(node.target))
    return seconds, len(called)


def _compute_form(name: str, hardware: Any, group: Any = None) -> tuple[Any, torch.fx.GraphModule, tuple, tuple]:
    """``(compiled, compute form, its inputs, (args, kwargs))`` of family ``name`` compiled over ``group`` (default:
    the whole world) with ``hardware``: the rank-local graph with its collectives replaced by local stand-ins
    (no rank waits for another), and the values the compiled model calls it with."""
    import autotp
    from autotp.calibration.graphs import local_stand_ins

    model, args, kwargs = build(name)
    compiled = autotp.compile(model, group=group, example_inputs=args, example_kwargs=kwargs, options=autotp.PlanOptions(hardware=hardware))
    graph_module = compiled.graph_module
    compute = local_stand_ins(graph_module) or graph_module
    captured: dict[str, tuple] = {}
    forward = graph_module.forward

    def grab(*values: Any, forward: Any = forward) -> Any:
        captured["values"] = values
        return forward(*values)

    graph_module.forward = grab
    with torch.no_grad():
        compiled(*args, **kwargs)
        graph_module.forward = forward
        for _ in range(3):
            compiled(*args, **kwargs)
    return compiled, compute, captured["values"], (args, kwargs)


def _work_by_kind(module: torch.fx.GraphModule, values: tuple, runs: int) -> dict[str, float]:
    """Median work seconds per op kind (:func:`kind_of`) of ``module``'s call nodes over ``runs`` calls, every
    rank calling at once, back to back."""
    stamped, names = _stamped(module)
    targets = {node.name: node.target for node in module.graph.nodes}
    totals: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(runs):
        stamped(*values)
        dist.barrier()
        _STAMPS.clear()
        stamped(*values)
        call: dict[str, float] = collections.defaultdict(float)
        for name, start, end in zip(names, _STAMPS, _STAMPS[1:]):
            call[kind_of(targets[name])] += end - start
        for kind, seconds in call.items():
            totals[kind].append(seconds)
    return {kind: statistics.median(seconds) for kind, seconds in totals.items()}


def _against_tp1(name: str, hardware: Any, runs: int, alone: Any) -> None:
    """Price and time family ``name``'s graph at this world size and at world size 1 (``alone``: a group of
    this rank only) with the same profile, their calls interleaved, every rank computing at once, and print
    rank 0's GEMMs and other nodes, measured and predicted: how the prediction's tp N / tp 1 ratio compares
    with the measured one, free of the calibration's and the machine's drift between two runs."""
    world_size = dist.get_world_size()
    forms = {size: _compute_form(name, hardware, group) for size, group in ((1, alone), (world_size, None))}
    with torch.no_grad():
        timed = {size: [] for size in forms}
        for _ in range(3):  # in turn, so that a slow stretch of the machine falls on both
            for size, (_, compute, values, _) in forms.items():
                timed[size].append(_work_by_kind(compute, values, runs))
    if dist.get_rank() != 0:
        return

    def gemm_and_rest(by_kind: dict[str, float]) -> tuple[float, float]:
        return by_kind.get("gemm", 0.0), sum(s for kind, s in by_kind.items() if kind != "gemm")

    measured, predicted = {}, {}
    for size, (compiled, compute, _, _) in forms.items():
        kinds = {kind for call in timed[size] for kind in call}
        measured[size] = gemm_and_rest({k: statistics.median(c.get(k, 0.0) for c in timed[size]) for k in kinds})
        targets = {node.name: node.target for node in compute.graph.nodes}
        by_kind: dict[str, float] = collections.defaultdict(float)
        for node in compiled.plan.nodes:
            if node.name in targets:
                by_kind[kind_of(targets[node.name])] += node.compute_s
        predicted[size] = gemm_and_rest(by_kind)
    cells = []
    for size in forms:
        (gemm, rest), (gemm_p, rest_p) = measured[size], predicted[size]
        cells.append(f"tp {size}: GEMMs {gemm * 1e3:.3f} ms measured, {gemm_p * 1e3:.3f} predicted ({gemm_p / gemm - 1:+.0%}); "
                     f"the rest {rest * 1e3:.3f} ms, {rest_p * 1e3:.3f} ({rest_p / rest - 1:+.0%})")
    ratio_m = sum(measured[world_size]) / sum(measured[1])
    ratio_p = sum(predicted[world_size]) / sum(predicted[1])
    print(f"\n{name} against tp 1 (rank 0, one profile, work clock, nodes' sums): " + "; ".join(cells)
          + f"; tp {world_size} / tp 1: measured {ratio_m:.2f}, predicted {ratio_p:.2f}", flush=True)


def _breakdown(name: str, hardware: Any, runs: int, by: str = "kind") -> None:
    """Time one model's graph by op kind on every rank and print rank 0's (module docstring)."""
    import autotp

    world_size = dist.get_world_size()
    compiled, compute, values, (args, kwargs) = _compute_form(name, hardware)
    with torch.no_grad():
        model_s = _median_work_s(lambda: compiled(*args, **kwargs), runs)
        graph_s = _median_work_s(lambda: compute(*values), runs)
        back_to_back = _node_seconds(compute, values, runs, after_start=False)
        after_start = _node_seconds(compute, values, runs, after_start=True)
    if dist.get_rank() != 0:
        return
    estimate = autotp.estimate(compiled.plan, hardware)
    predicted = {node.name: node.compute_s for node in compiled.plan.nodes}
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for node in compute.graph.nodes:
        if node.op != "call_function" or node.name not in back_to_back:
            continue
        key = {"kind": kind_of(node.target), "op": str(node.target)}.get(by, f"{node.name} ({node.target})")
        # a node the rewrite added (a collective's stand-in, a slice of an input, a mask) has no plan node of its
        # own: the plan prices it inside the node it serves, so it is listed apart, its predicted time as 0
        row = kinds[key if node.name in predicted else f"+ {key}"]
        row[0] += 1
        row[1] += back_to_back[node.name]
        row[2] += after_start[node.name]
        row[3] += predicted.get(node.name, 0.0)
    print(f"\n{name} (tp {world_size}, rank 0): model call {model_s * 1e3:.3f} ms, compute graph call "
          f"{graph_s * 1e3:.3f} ms (work clock, each after a barrier), "
          f"predicted {estimate.time_per_call_s * 1e3:.3f} ms ({(estimate.time_per_call_s / model_s - 1):+.0%} "
          f"vs the model call); nodes {sum(back_to_back.values()) * 1e3:.3f} ms back to back, "
          f"{sum(after_start.values()) * 1e3:.3f} ms after a common start")
    priced_s, firsts = _first_calls_priced_s(compute, predicted, hardware)
    print(f"  first calls: priced {priced_s * 1e3:.3f} ms ({firsts} kernels' first call in the graph, "
          f"Hardware.first_call_s); measured, every node after a common start beyond back to back: "
          f"{(sum(after_start.values()) - sum(back_to_back.values())) * 1e3:+.3f} ms")
    _print_rows(kinds, by)
    if by != "node":
        for kind, row in kinds.items():
            _ALL_FAMILIES[kind] = [total + value for total, value in zip(_ALL_FAMILIES[kind], row)]


_ALL_FAMILIES: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
"""Rank 0's rows of every family broken down so far, summed (printed at the end with several families)."""


def _print_rows(kinds: dict[str, list[float]], by: str) -> None:
    """One row per op kind, ATen op or node of ``kinds`` (``[nodes, back to back s, after a start s, predicted s]``):
    sorted by the time after a common start (in graph order for nodes)."""
    width = 18 if by == "kind" else max(len(kind) for kind in kinds)
    print(f"  {by:<{width}} {'nodes':>5} {'b2b ms':>8} {'start ms':>9} {'predicted ms':>13} "
          f"{'us/node b2b':>12} {'start':>7} {'pred':>7}")
    order = list(kinds.items()) if by == "node" else sorted(kinds.items(), key=lambda item: -item[1][2])
    for kind, (count, b2b_s, start_s, predicted_s) in order:
        print(f"  {kind:<{width}} {count:>5} {b2b_s * 1e3:>8.3f} {start_s * 1e3:>9.3f} {predicted_s * 1e3:>13.3f} "
              f"{b2b_s / count * 1e6:>12.1f} {start_s / count * 1e6:>7.1f} {predicted_s / count * 1e6:>7.1f}")


def _rank(rank: int, world_size: int, port: int, links: Any, options: argparse.Namespace) -> None:
    """One rank: calibrate with every rank at once, then break each family down (module docstring)."""
    sys.path.insert(0, TESTS)
    warnings.simplefilter("ignore")
    from autotp.calibration.calibrate import CalibrationConfig, measure_rank
    from autotp.cost_model.calibrate import build_profile

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        measured = measure_rank(rank, world_size, CalibrationConfig.quick(threads=1), collectives=False)
        # priced on the work clock, as measured here: the graphs' share of a core set to 1
        alone = dataclasses.replace(measured, graphs=tuple(dataclasses.replace(g, core_share=1.0) for g in measured.graphs))
        every: list[Any] = [None] * world_size
        dist.all_gather_object(every, alone)
        hardware = build_profile(every, links, world_size=world_size)
        if rank == 0:
            print(f"profile (tp {world_size}): dispatch {hardware.host_dispatch_s * 1e6:.1f} us/node, view "
                  f"{hardware.view_op_s * 1e6:.1f} us, call {hardware.graph_launch_s * 1e6:.0f} us (a model's "
                  f"{hardware.model_call_s * 1e6:.0f} more), float32 "
                  f"{hardware.peak_tflops['float32'] * 1e3:.0f} GFLOP/s (half rate at dim "
                  f"{hardware.gemm_half_efficiency_dim:g}), memory {hardware.memory_bandwidth_gbps:.1f} GB/s, "
                  f"first call of a kernel {hardware.first_call_cost_s(None) * 1e6:.1f} us (convolution "
                  f"{hardware.first_call_cost_s('convolution') * 1e6:.1f}); load average {os.getloadavg()[0]:.1f}",
                  flush=True)
        # a group of each rank alone (every rank creates every group, in the same order)
        alone = [dist.new_group([r]) for r in range(world_size)][rank] if options.against_tp1 else None
        for name in options.models:
            if options.against_tp1:
                _against_tp1(name, hardware, options.runs, alone)
            else:
                _breakdown(name, hardware, options.runs, options.by)
        if rank == 0 and len(options.models) > 1 and _ALL_FAMILIES:
            print(f"\nevery family above together (tp {world_size}, rank 0; summed)")
            _print_rows(_ALL_FAMILIES, options.by)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DESIGN), choices=ORDER,
                        help="families of benchmarks/cost_model_families.py (default: the four the terms were designed on)")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--by", choices=("kind", "op", "node"), default="kind",
                        help="group the nodes by op kind or ATen op, or one row per node in graph order")
    parser.add_argument("--world-size", type=int, default=1, help="ranks (gloo, one thread each; default 1)")
    parser.add_argument("--against-tp1", action="store_true",
                        help="instead of the tables: each family's GEMMs and other nodes at --world-size and at tp 1, "
                             "measured and predicted with one profile, interleaved")
    options = parser.parse_args()
    if options.against_tp1 and options.world_size < 2:
        parser.error("--against-tp1 compares a world size of 2 or more with tp 1: pass --world-size")
    from autotp.calibration.calibrate import CalibrationConfig, measure_links

    # the link across two processes at every world size: only the plan's choice reads it (the timings are of the
    # compute form), and the quick fit across four processes on two cores can find no bandwidth
    links = measure_links(2, CalibrationConfig.quick(threads=1))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.start_processes(_rank, args=(options.world_size, port, links, options),
                                          nprocs=options.world_size, start_method="spawn")

if __name__ == "__main__":
    main()
