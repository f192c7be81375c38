"""Predicted vs measured forward time on this CPU, for the tiny model zoo at world sizes 1, 2, 4.

    python benchmarks/cost_model_accuracy.py [--world-sizes 1 2 4] [--rounds 3] [--runs 20] [--threads T]
                                             [--decisions] [--models mlp llama gpt2 bert | all] [--json run.json]

``--models`` takes any family of ``benchmarks/cost_model_families.py`` (``tests/models.py``, the generation
families, Falcon and OPT); the default four are the ones the cost model's terms were designed on, ``all`` is
every family, and ``--models llama_wide gpt2_wide`` checks kernels far larger than the calibration's, and weights
larger than a CPU's last-level cache (``all llama_wide gpt2_wide``: every family and both).
``--json`` writes every (model, world size, round) with the plan measured and the round's profile, and every
round's calibration measurements (every rank's, pickled), for the cross-validation by family of
``benchmarks/cost_model_heldout.py``, which can fit the profile again from them (``--refit``).

For each world size N, spawn N gloo processes; then, ``--rounds`` times:

1. calibrate (``autotp.calibration.calibrate.measure_rank``, quick mode unless
   ``--full-calibration``) in these very processes: matmul peak, GEMM shape curve, copy
   bandwidth, transcendental rate, per-op floor and view cost with all N ranks busy at once, gloo
   alpha/beta fitted across the N ranks (for N = 1, across 2 other processes, once: a plan on
   one rank has no collective), and the eager host terms (dispatch per node, wait per collective,
   call of the graph) fitted over rank-local graphs with the op mix of HF graphs, run on all
   ranks at once; single ops and graphs are timed on each rank's work clock (its CPU time) and
   the share of a core a rank gets while running graphs is measured apart and divides every work
   term (``autotp.cost_model.graph_calibration``); build the profile;
2. for every model (by default the tiny MLP, Llama, GPT-2 and BERT of ``tests/models.py``), ``autotp.compile`` it
   with ``hardware=`` that profile and time the forward pass as the calibration times its graphs
   (``autotp.calibration.graphs.time_in_turn``): one untimed call, then the timed call on every rank from
   one moment (``autotp.calibration.graphs.common_start``: gloo's barrier alone releases the ranks up to
   0.8 ms apart, a skew ranks that serve call after call do not have) to the last rank's end, the
   time the group takes to have the forward's result on every rank; the median of ``--runs`` runs
   after ``--warmup`` runs.
   The prediction is ``autotp.estimate(plan, profile).time_per_call_s``;
3. time it once more with every collective (and its ``wait_tensor``) replaced by a local
   stand-in of its output's shape: that is the measured compute, and the forward time minus it
   the measured communication (the collectives and the waits for the slowest rank that they
   impose, and the wait of a rank that slept in a collective to get its core back). The two
   forms take turns, each timed after one untimed call of itself (not right after the real form,
   whose collectives would leave the compute form waiting for a core). The
   calibration times its graphs' compute in the same form, so predicted and measured compute
   mean the same thing: the time a rank takes to compute, sharing its core with the other ranks
   as they compute too. Timing the nodes one by one instead would slow
   every rank by the timer's own overhead, and the waits with it. Both forms are compiled once
   and take turns without recompiling (a freshly generated ``forward`` runs slower). The compute
   form's work (each rank's CPU time, mean over ranks) splits the compute error in two: the work
   terms (predicted compute times the profile's core share against that work) and the share of a
   core the forward got (its work over its wall time) against the profile's.

With ``--decisions`` (first round only), each (model, world size, phase) is also run three ways
and timed the same way: autotp's plan with the calibrated profile and ``memory_budget=None``,
Megatron's plan (``autotp.planning.megatron.megatron_plan``, same profile and budget), and no
split (every tensor whole on every rank, run by the same runtime: autotp's plan on the profile
with collectives made prohibitively slow); a table says whether autotp's plan is the
fastest measured or within 5% of it, or runs the very rank-local graph (the same generated code) as
the fastest: two plans that compile to one graph differ only by the spread of timing it, which
the table says. The phase is the forward pass of the zoo's inputs (batch 2, sequence 16; no KV
cache).

Right before every forward, a drift probe (``PROBE_SHAPE``: one of the calibration's own graphs) is timed on its
own, as the calibration timed it: its time then over its time in the calibration is how much slower or faster the
machine ran the same graph when the model was measured (the ``drift`` column). The summary gives the error as
measured and with that drift taken out (the prediction scaled by the drift). The first is what a user of the profile
sees; the second is a diagnostic, not a correction: the probe moves with the machine, and with what ran before it.
The probe does not take turns with the forward: at four ranks on two cores, a small model's compute form timed in
turn with it took 1.2-2.7x as long as without it, and the probe itself ran faster there than on its own, as the
calibration times it (``benchmarks/probe_in_turn.py``).

Calibrating in the same processes, right before measuring, keeps both under the same conditions
(on a shared machine the load moves within seconds); the rounds repeat the whole and the
figures are medians over rounds. Each line shows predicted (``autotp.estimate(plan).time_s``) and
measured time, the error, the compute/communication split of both, and the spread of the
measured time over rounds (max / min). It ends with the median absolute percentage error over
all (model, world size) pairs, overall and per world size. Threads per rank: ``--threads``, by
default ``max(1, cores // N)`` as in ``autotp demo``; calibration uses the same number.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import pickle
import socket
import statistics
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cost_model_families import DESIGN, FAMILIES, ORDER, build

from autotp.cost_model.graph_calibration import GraphShape

TESTS = str(Path(__file__).resolve().parent.parent / "tests")
MODELS = DESIGN
"""The models the cost model's terms were designed on (the default)."""
CALIBRATION_ATTEMPTS = 3
"""Calibrations per round before giving up: on a loaded machine the gloo timings of one attempt
may not grow with the message size, and no link can be fitted to them."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One (model, world size, round): prediction from that round's profile and measurement."""

    model: str
    world_size: int
    round_index: int
    predicted_s: float
    predicted_compute_s: float
    predicted_comm_s: float
    measured_s: float
    measured_compute_s: float
    measured_comm_s: float
    ops: int
    collectives: int
    profile_share: float = 1.0
    measured_compute_work_s: float = 0.0
    predicted_comm_per_collective_only_s: float = 0.0
    """The communication priced with the whole fitted wait per collective (the median over the calibration graphs
    of wait over count, the model before ``graph_calibration.fit_wait_terms``), from the same calibration."""
    plan_json: str = ""
    """The plan that was measured (``--json``: ``benchmarks/cost_model_heldout.py`` prices it again)."""
    profile_json: str = ""
    """The round's calibrated profile (``--json``)."""
    probe_calibration_s: float = 0.0
    """The drift probe (:data:`PROBE_SHAPE`, a calibration graph) as the round's calibration timed it, on the group."""
    probe_s: float = 0.0
    """The same probe timed on its own right before this model's forward (0.0: not measured);
    ``probe_s / probe_calibration_s`` is how much slower the machine ran the same graph when the model was measured
    than when it was calibrated."""
    fair_share_saving_s: float = 0.0
    """What the compute beyond the profile's core-share range saves at the fair share (``Estimate.fair_share_saving_s``,
    already off ``predicted_compute_s``)."""

    @property
    def drift(self) -> float:
        """The machine's speed when measured against when calibrated, by the probe (1.0 when not measured)."""
        return self.probe_s / self.probe_calibration_s if self.probe_s and self.probe_calibration_s else 1.0


@dataclasses.dataclass(frozen=True)
class Calibration:
    """One round's calibration at one world size: every rank's measurements and the link samples the profile was
    built from (``autotp.cost_model.calibrate.build_profile``), pickled and base64-encoded for the JSON file."""

    world_size: int
    round_index: int
    measurements: str


@dataclasses.dataclass(frozen=True)
class Decision:
    """Measured seconds of autotp's plan, Megatron's plan and no split for one (model, world size)."""

    model: str
    world_size: int
    phase: str
    autotp_s: float
    megatron_s: float
    no_split_s: float
    autotp_collectives: int
    megatron_collectives: int
    same_graph_as: tuple[str, ...] = ()
    """The other plans (``"megatron"``, ``"no split"``) whose rank-local graph is autotp's, line for line."""

    @property
    def best_s(self) -> float:
        return min(self.autotp_s, self.megatron_s, self.no_split_s)

    @property
    def fastest(self) -> str:
        return min((self.autotp_s, "autotp"), (self.megatron_s, "megatron"), (self.no_split_s, "no split"))[1]

    @property
    def ok(self) -> bool:
        """autotp's plan is the fastest measured, within 5% of the fastest, or the very graph of the fastest
        (then the two times measure one graph twice, and their difference is the spread of the timing)."""
        return self.autotp_s <= 1.05 * self.best_s or self.fastest in self.same_graph_as


@dataclasses.dataclass(frozen=True)
class Summary:
    """Medians over rounds of one (model, world size)."""

    model: str
    world_size: int
    predicted_s: float
    predicted_compute_s: float
    predicted_comm_s: float
    measured_s: float
    measured_compute_s: float
    measured_comm_s: float
    spread: float
    ops: int
    collectives: int
    profile_share: float = 1.0
    measured_compute_work_s: float = 0.0
    predicted_comm_per_collective_only_s: float = 0.0
    drift: float = 1.0
    """The machine's speed when measured against when calibrated (``Row.drift``, median over rounds)."""
    fair_share_saving_s: float = 0.0

    @property
    def comm_error_per_collective_only(self) -> float | None:
        """:attr:`comm_error` of the wait priced per collective alone (``Row.predicted_comm_per_collective_only_s``)."""
        if not self.collectives or not self.measured_comm_s:
            return None
        return (self.predicted_comm_per_collective_only_s - self.measured_comm_s) / self.measured_comm_s

    @property
    def predicted_compute_work_s(self) -> float:
        """The predicted compute on the work clock: the profile prices work divided by the core share (the compute
        beyond the share's range runs faster, not with less work)."""
        return (self.predicted_compute_s + self.fair_share_saving_s) * self.profile_share

    @property
    def work_error(self) -> float:
        """Error of the work terms alone (kernels, dispatch, call), with the share taken out of both sides."""
        return self.predicted_compute_work_s / self.measured_compute_work_s - 1 if self.measured_compute_work_s else 0.0

    @property
    def forward_share(self) -> float:
        """The share of a core the forward's compute got: its work over its wall time on the group."""
        return self.measured_compute_work_s / self.measured_compute_s if self.measured_compute_s else 0.0

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def error_without_drift(self) -> float:
        """:attr:`error` against the measurement at the calibration's speed (divided by :attr:`drift`)."""
        return self.predicted_s * self.drift / self.measured_s - 1

    @property
    def compute_error(self) -> float:
        return (self.predicted_compute_s - self.measured_compute_s) / self.measured_compute_s

    @property
    def comm_error(self) -> float | None:
        """None without collectives: what is measured then is timing noise between two runs of one graph."""
        if not self.collectives or not self.measured_comm_s:
            return None
        return (self.predicted_comm_s - self.measured_comm_s) / self.measured_comm_s


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def calling_with(tp_model: Any, module: torch.fx.GraphModule, args: tuple, kwargs: dict) -> Callable[[], Any]:
    """A call of ``tp_model`` on ``args`` and ``kwargs`` that runs ``module`` as its graph (swapped in by attribute,
    so that one compiled form of each graph is timed call after call)."""
    def call() -> Any:
        tp_model.graph_module = module
        return tp_model(*args, **kwargs)
    return call


def _time_with_and_without_comm(tp_model: Any, args: tuple, kwargs: dict, warmup: int, runs: int,
                                probe: Any) -> tuple[float, float, float, float]:
    """(forward, forward without communication): median seconds of the rank-local graph as it is, and of
    a copy of it with every collective and its wait replaced by a local stand-in of its output's shape
    (``autotp.calibration.graphs.local_stand_ins``, the same form the calibration times a
    graph's compute in), timed in turn as the calibration times its graphs
    (``autotp.calibration.graphs.time_in_turn``: each after one untimed call of itself, from a start common to every
    rank to the last rank's end); and the work
    (CPU time, mean over ranks) of the second; and the drift probe's seconds (``probe``: a call timed on its own right
    before them, as the calibration timed it; in turn with them, it slowed a small model's compute form, module
    docstring).
    Each form is compiled once and swapped in by attribute: recompiling before every call would
    time a freshly generated ``forward``, 5-20% slower than the one a model runs call after call."""
    from autotp.calibration.graphs import local_stand_ins, time_in_turn

    real = tp_model.graph_module
    compute = local_stand_ins(real) or real
    try:
        [(probe_s, _)] = time_in_turn([probe], runs, warmup)
        (seconds, _), (compute_s, compute_work_s) = time_in_turn(
            [calling_with(tp_model, real, args, kwargs), calling_with(tp_model, compute, args, kwargs)], runs, warmup)
    finally:
        tp_model.graph_module = real
    mean_work = torch.tensor([compute_work_s], dtype=torch.float64)
    dist.all_reduce(mean_work)
    return seconds, compute_s, float(mean_work) / dist.get_world_size(), probe_s


PROBE_SHAPE = GraphShape(3, 32, 256, collectives=False)
"""The drift probe: a calibration graph (three Llama-like blocks, 32 tokens, hidden 256, no collective) that the
calibration times and that is timed again on its own right before every model's forward. On a shared or virtual
machine the speed of the same graph moves between the calibration and a measurement minutes later (on this project's
idle 2-core VM, 0.63-1.63x in one run, no steal time reported); the ratio of the two probe timings says by how much,
so that the cost model's error can be told apart from the machine's drift."""


def _drift_probe(config: Any, everyone: list[Any], world_size: int) -> tuple[Any, float]:
    """``(call, seconds)``: a call of :data:`PROBE_SHAPE`'s graph on this rank and its time in the calibration
    (the group's median, as every rank gathered); the shape must be one of the calibration's."""
    from autotp.calibration.graphs import block_graph

    if PROBE_SHAPE not in config.graph_shapes:
        raise ValueError(f"the drift probe {PROBE_SHAPE} is not one of the calibration's graph shapes")
    index = config.graph_shapes.index(PROBE_SHAPE)
    module, example = block_graph(PROBE_SHAPE, world_size, None)
    return (lambda: module(example)), statistics.median(m.graphs[index].seconds for m in everyone)


def _decision(name: str, world_size: int, model: Any, args: tuple, kwargs: dict, hardware: Any,
              options: argparse.Namespace) -> Decision:
    """Time autotp's plan (memory_budget=None), Megatron's plan and no split, on every rank."""
    import autotp
    from autotp.calibration.graphs import time_in_turn
    from autotp.planning.megatron import megatron_plan

    ours = autotp.compile(model, world_size=world_size, example_inputs=args, example_kwargs=kwargs,
                          options=autotp.PlanOptions(memory_budget=None, hardware=hardware))
    reference = megatron_plan(model, args, kwargs, world_size=world_size, hardware=hardware, memory_budget=None)
    theirs = autotp.compile(model, world_size=world_size, example_inputs=args, example_kwargs=kwargs,
                            options=autotp.PlanOptions(hardware=hardware), plan=reference)
    # No split, run by the same runtime: the plan of a profile on which any collective costs an
    # hour, which the solver (with no memory budget) answers by keeping every tensor whole.
    # Every link the profile prices collectives on costs that hour, the shared-memory one included.
    no_link = dataclasses.replace(hardware.intra_node, base_latency_s=3600.0)
    no_shared_memory = (None if hardware.shared_memory_link is None
                        else dataclasses.replace(hardware.shared_memory_link, base_latency_s=3600.0))
    whole = autotp.compile(model, world_size=world_size, example_inputs=args, example_kwargs=kwargs,
                           options=autotp.PlanOptions(memory_budget=None, hardware=dataclasses.replace(hardware, intra_node=no_link, inter_node=no_link,
                                                        shared_memory_link=no_shared_memory)))
    if _collective_count(whole.plan):
        raise RuntimeError(f"{name}: the no-split plan still has collectives: {whole.plan.collective_counts()}")
    (autotp_s, _), (megatron_s, _), (no_split_s, _) = time_in_turn(
        [lambda module=module: module(*args, **kwargs) for module in (ours, theirs, whole)],
        options.runs, options.warmup)
    same = tuple(label for label, module in (("megatron", theirs), ("no split", whole))
                 if module.graph_module.code == ours.graph_module.code)
    return Decision(name, world_size, "forward", autotp_s, megatron_s, no_split_s,
                    autotp_collectives=_collective_count(ours.plan), megatron_collectives=_collective_count(reference),
                    same_graph_as=same)


def _per_collective_only_wait_s(everyone: list[Any], hardware: Any) -> float:
    """The wait per collective of the model before ``fit_wait_terms``: per rank, the median over its calibration
    graphs with collectives of their wait (real form beyond measured compute and link) over their count, at least
    0; the median over ranks. For comparison only, from the very samples the profile was fitted on."""
    from autotp.cost_model.graph_calibration import graph_link_s

    link, shared, cold = hardware.intra_node, hardware.shared_memory_link, hardware.shared_memory_cold_curve
    per_rank = []
    for measured in everyone:
        waits = [(g.seconds - g.compute_s - graph_link_s(g, link, shared, cold)) / len(g.collectives)
                 for g in measured.graphs if g.collectives and g.compute_s > 0]
        if waits:
            per_rank.append(max(0.0, statistics.median(waits)))
    return statistics.median(per_rank) if per_rank else 0.0


def _collective_count(plan: Any) -> int:
    """Collectives a forward of ``plan`` issues (local slices are not collectives)."""
    return sum(plan.collective_counts().values())


def _rank(rank: int, world_size: int, init_method: str, options: argparse.Namespace, threads: int,
          link_samples: list[Any], results: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.path.insert(0, TESTS)
    warnings.simplefilter("ignore")
    import autotp
    from autotp.calibration.calibrate import CalibrationConfig, measure_rank
    from autotp.cost_model.calibrate import build_profile
    from autotp.cost_model.graph_calibration import fit_host_terms
    from autotp.passes.rewrite import is_collective

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    config = CalibrationConfig(threads=threads) if options.full_calibration else CalibrationConfig.quick(threads=threads)
    try:
        for round_index in range(options.rounds):
            for attempt in range(CALIBRATION_ATTEMPTS):
                measured_here = measure_rank(rank, world_size, config, collectives=world_size > 1)
                everyone: list[Any] = [None] * world_size
                dist.all_gather_object(everyone, measured_here)
                links = list(everyone[0].collectives) if world_size > 1 else link_samples
                try:  # every rank builds from the same gathered samples, so all fail or none does
                    hardware = build_profile(everyone, links, world_size=world_size,
                                             name=f"cpu-calibrated-{world_size}")
                    break
                except ValueError as error:  # e.g. gloo timings that did not grow with size under load
                    if attempt + 1 == CALIBRATION_ATTEMPTS:
                        raise
                    if rank == 0:
                        print(f"   round {round_index}: calibration unusable ({error}); measuring again", flush=True)
            if rank == 0 and options.json:
                results.put(Calibration(world_size, round_index,
                                        base64.b64encode(pickle.dumps((everyone, links))).decode("ascii")))
            probe, probe_calibration_s = _drift_probe(config, everyone, world_size)
            link = hardware.intra_node
            share = statistics.median(fit_host_terms(m.graphs, view_op_s=m.view_op_s, link=link).core_share
                                      for m in everyone)
            flat_wait_s = _per_collective_only_wait_s(everyone, hardware)
            if rank == 0:
                print(f"   round {round_index}: float32 {hardware.peak_tflops['float32'] * 1e3:.1f} GFLOP/s "
                      f"(half rate at dim {hardware.gemm_half_efficiency_dim:g}), "
                      f"memory {hardware.memory_bandwidth_gbps:.2f} GB/s, floor {hardware.kernel_floor_s * 1e6:.1f} us, "
                      f"conv {hardware.op_fixed_cost_s('convolution') * 1e6:.0f} us, first call "
                      f"{hardware.first_call_cost_s(None) * 1e6:.1f} us (conv "
                      f"{hardware.first_call_cost_s('convolution') * 1e6:.1f}), "
                      f"view {hardware.view_op_s * 1e6:.1f} us, dispatch {hardware.host_dispatch_s * 1e6:.1f} us/node, "
                      f"core share {share:.2f}, "
                      f"call {hardware.graph_launch_s * 1e6:.0f} us "
                      f"(a model's {hardware.model_call_s * 1e6:.0f} more), "
                      f"wait {hardware.collective_wait_s * 1e6:.0f} us/coll "
                      f"+ {hardware.call_sync_wait_s * 1e6:.0f} us/call + {hardware.call_sync_wait_per_compute:.2f} "
                      f"x compute, "
                      f"gloo {link.base_latency_s * 1e6:.0f} us/call + "
                      f"{link.latency_s * 1e6:.0f} us/step, {link.bandwidth_gbps:.3f} GB/s; "
                      f"load average {os.getloadavg()[0]:.1f}", flush=True)
            for name in options.models:
                model, args, kwargs = build(name)
                tp_model = autotp.compile(model, world_size=world_size, example_inputs=args, example_kwargs=kwargs,
                                          options=autotp.PlanOptions(hardware=hardware))
                measured, measured_compute, compute_work, probe_s = _time_with_and_without_comm(
                    tp_model, args, kwargs, options.warmup, options.runs, probe)
                estimate = autotp.estimate(tp_model.plan, hardware)
                graph = tp_model.graph_module.graph
                count = sum(tp_model.plan.collective_counts().values())
                flat_comm_s = estimate.comm_s + count * (flat_wait_s - hardware.collective_wait_s)
                if rank == 0:
                    results.put(Row(
                        name, world_size, round_index, estimate.time_per_call_s,
                        estimate.time_per_call_s - estimate.comm_per_call_s, estimate.comm_per_call_s,
                        measured, measured_compute, max(measured - measured_compute, 0.0),
                        ops=sum(1 for n in graph.nodes if n.op == "call_function"),
                        collectives=sum(1 for n in graph.nodes if is_collective(n)),
                        profile_share=share, measured_compute_work_s=compute_work,
                        predicted_comm_per_collective_only_s=flat_comm_s,
                        plan_json=tp_model.plan.to_json() if options.json else "",
                        profile_json=hardware.to_json() if options.json else "",
                        probe_calibration_s=probe_calibration_s, probe_s=probe_s,
                        fair_share_saving_s=estimate.fair_share_saving_s,
                    ))
                if options.decisions and round_index == 0:
                    decision = _decision(name, world_size, model, args, kwargs, hardware, options)
                    if rank == 0:
                        results.put(decision)
    finally:
        dist.destroy_process_group()


def measure(world_size: int, options: argparse.Namespace, threads: int,
            link_samples: list[Any]) -> list[Row | Decision | Calibration]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    context = mp.start_processes(
        _rank, args=(world_size, f"tcp://127.0.0.1:{_free_port()}", options, threads, link_samples, results),
        nprocs=world_size, join=False, start_method="spawn",
    )
    rows: list[Row | Decision | Calibration] = []
    while True:
        while not results.empty():
            rows.append(results.get())
        if context.join(timeout=0.1):
            break
    while not results.empty():
        rows.append(results.get())
    return rows


def summarise(rows: list[Row]) -> list[Summary]:
    keys = sorted({(r.world_size, r.model) for r in rows}, key=lambda k: (k[0], ORDER.index(k[1])))
    summaries = []
    for world_size, model in keys:
        mine = [r for r in rows if (r.world_size, r.model) == (world_size, model)]

        def median(field: str, rows_: list[Row] = mine) -> float:
            return statistics.median(getattr(r, field) for r in rows_)

        measured = [r.measured_s for r in mine]
        summaries.append(Summary(
            model, world_size, median("predicted_s"), median("predicted_compute_s"), median("predicted_comm_s"),
            median("measured_s"), median("measured_compute_s"), median("measured_comm_s"),
            max(measured) / min(measured), mine[0].ops, mine[0].collectives,
            median("profile_share"), median("measured_compute_work_s"), median("predicted_comm_per_collective_only_s"),
            statistics.median(r.drift for r in mine), median("fair_share_saving_s"),
        ))
    return summaries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=(*ORDER, "all"),
                        help="families to measure (default: the four the terms were designed on; all: every family)")
    parser.add_argument("--rounds", type=int, default=3, help="calibrate-then-measure rounds (default: 3)")
    parser.add_argument("--runs", type=int, default=20, help="timed forward passes per model and round (default: 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed forward passes first (default: 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores // N)")
    parser.add_argument("--full-calibration", action="store_true", help="full calibration instead of quick")
    parser.add_argument("--per-round", action="store_true",
                        help="also print every round's prediction and measurement (the table shows medians over rounds)")
    parser.add_argument("--decisions", action="store_true",
                        help="also time autotp's plan (memory_budget=None), Megatron's plan and no split")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write every (model, world size, round) with its plan and profile to this file "
                             "(the input of benchmarks/cost_model_heldout.py)")
    options = parser.parse_args()
    if "all" in options.models:  # every family, and any wide model named beside it
        options.models = [*FAMILIES, *(m for m in options.models if m != "all" and m not in FAMILIES)]

    from autotp.calibration.calibrate import CalibrationConfig, measure_links

    print(f"torch {torch.__version__}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}", flush=True)
    rows: list[Row] = []
    decisions: list[Decision] = []
    calibrations: list[Calibration] = []
    for world_size in options.world_sizes:
        threads = options.threads or max(1, (os.cpu_count() or 1) // world_size)
        link_samples: list[Any] = []
        if world_size == 1:  # a plan on one rank has no collective; the profile still needs a link
            link_samples = measure_links(2, CalibrationConfig.quick(threads=threads))
        print(f"\n== world size {world_size}, {threads} thread(s) per rank", flush=True)
        measured = measure(world_size, options, threads, link_samples)
        rows += [r for r in measured if isinstance(r, Row)]
        decisions += [d for d in measured if isinstance(d, Decision)]
        calibrations += [c for c in measured if isinstance(c, Calibration)]
        summaries = summarise([r for r in measured if isinstance(r, Row)])
        if options.per_round:
            for r in sorted((r for r in measured if isinstance(r, Row)), key=lambda r: (r.round_index, ORDER.index(r.model))):
                print(f"   round {r.round_index} {r.model:<7} predicted {r.predicted_s * 1e3:.3f} / measured "
                      f"{r.measured_s * 1e3:.3f} ms ({r.predicted_s / r.measured_s - 1:+.1%}); compute "
                      f"{r.predicted_compute_s * 1e3:.3f} / {r.measured_compute_s * 1e3:.3f}; work "
                      f"{(r.predicted_compute_s + r.fair_share_saving_s) * r.profile_share * 1e3:.3f} / {r.measured_compute_work_s * 1e3:.3f}; "
                      f"share {r.profile_share:.2f} / "
                      f"{r.measured_compute_work_s / r.measured_compute_s if r.measured_compute_s else 0:.2f}; comm "
                      f"{r.predicted_comm_s * 1e3:.3f} (per collective only "
                      f"{r.predicted_comm_per_collective_only_s * 1e3:.3f}) / {r.measured_comm_s * 1e3:.3f}",
                      flush=True)
        print(f"{'model':<7} {'ws':>2} {'predicted':>10} {'measured':>10} {'error':>7} "
              f"{'compute pred/meas (ms)':>23} {'comm pred/meas (ms)':>21} {'spread':>7} {'ops':>4} {'colls':>5} "
              f"{'drift':>6}")
        for s in summaries:
            print(f"{s.model:<7} {s.world_size:>2} {s.predicted_s * 1e3:>8.3f}ms {s.measured_s * 1e3:>8.3f}ms "
                  f"{s.error:>+7.1%} {s.predicted_compute_s * 1e3:>11.3f} / {s.measured_compute_s * 1e3:>8.3f} "
                  f"{s.predicted_comm_s * 1e3:>9.3f} / {s.measured_comm_s * 1e3:>8.3f} {s.spread:>6.2f}x "
                  f"{s.ops:>4} {s.collectives:>5} {s.drift:>5.2f}x", flush=True)
        print("  compute split into work (CPU time: kernels, dispatch, call) and the share of a core it ran at:")
        for s in summaries:
            print(f"  {s.model:<7} {s.world_size:>2} work pred/meas {s.predicted_compute_work_s * 1e3:7.3f} / "
                  f"{s.measured_compute_work_s * 1e3:7.3f} ms ({s.work_error:+.1%}); share profile/forward "
                  f"{s.profile_share:.2f} / {s.forward_share:.2f}", flush=True)

    summaries = summarise(rows)
    print("\nmedian absolute percentage error (predicted vs measured forward time; compute; communication):")
    for world_size in options.world_sizes:
        mine = [s for s in summaries if s.world_size == world_size]
        if not mine:
            continue
        comm = [abs(s.comm_error) for s in mine if s.comm_error is not None]
        comm_text = f"{statistics.median(comm):.1%}" if comm else "-"
        flat = [abs(e) for s in mine if (e := s.comm_error_per_collective_only) is not None]
        if flat:
            comm_text += f" (wait per collective only: {statistics.median(flat):.1%})"
        print(f"  world size {world_size}: {statistics.median(abs(s.error) for s in mine):.1%} over {len(mine)} models; "
              f"compute {statistics.median(abs(s.compute_error) for s in mine):.1%}, communication {comm_text}; "
              f"with the machine's drift taken out {statistics.median(abs(s.error_without_drift) for s in mine):.1%} "
              f"(drift {min(s.drift for s in mine):.2f}x to {max(s.drift for s in mine):.2f}x)")
    overall = statistics.median(abs(s.error) for s in summaries)
    print(f"  overall: {overall:.1%} over {len(summaries)} (model, world size) pairs")
    if decisions:
        print("\ndecisions (measured ms per forward; autotp memory_budget=None; ok: fastest, within 5%, or the same "
              "rank-local graph as the fastest):")
        print(f"{'model':<7} {'ws':>2} {'phase':<8} {'autotp':>9} {'megatron':>9} {'no split':>9} "
              f"{'colls a/m':>9}  verdict")
        for d in sorted(decisions, key=lambda d: (d.world_size, ORDER.index(d.model))):
            print(f"{d.model:<7} {d.world_size:>2} {d.phase:<8} {d.autotp_s * 1e3:>9.3f} {d.megatron_s * 1e3:>9.3f} "
                  f"{d.no_split_s * 1e3:>9.3f} {d.autotp_collectives:>4}/{d.megatron_collectives:<4}  "
                  f"{'ok' if d.ok else 'SLOWER'} ({d.autotp_s / d.best_s:.2f}x the fastest"
                  + (f"; the same rank-local graph as {' and '.join(d.same_graph_as)}" if d.same_graph_as else "")
                  + ")")
        print(f"  autotp fastest, within 5%, or the same graph as the fastest: {sum(d.ok for d in decisions)} of "
              f"{len(decisions)} ({sum(d.autotp_s <= 1.05 * d.best_s for d in decisions)} by time alone)")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    if options.json is not None:
        options.json.write_text(json.dumps({
            "torch": torch.__version__, "cores": os.cpu_count(), "load_average_end": os.getloadavg()[0],
            "threads": options.threads, "rows": [dataclasses.asdict(r) for r in rows],
            "decisions": [dataclasses.asdict(d) for d in decisions],
            "calibrations": [dataclasses.asdict(c) for c in calibrations],
        }))
        print(f"wrote {len(rows)} rows to {options.json}")


if __name__ == "__main__":
    main()
