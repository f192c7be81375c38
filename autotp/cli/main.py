"""The ``autotp`` command line (``autotp plan`` lives in :mod:`autotp.cli.plan`).

``autotp demo`` spawns N local gloo processes on the CPU, builds the same small Llama with random
weights in each, makes it tensor-parallel with :func:`autotp.compile`, checks its logits against
the single-process model and prints the plan and the figures. It exits 1 if the outputs differ by
more than the tolerance, 2 if a rank failed.

``autotp demo --generate N`` then also generates N tokens greedily with a sharded KV cache and
prints the tokens, prefill ms, ms per token and tokens/s against the single process (exit 1 if the
tokens differ); see :mod:`autotp.cli.generate_demo`.

``autotp demo --mesh dp2,pp2,tp2`` runs it over a data x pipeline x tensor parallel mesh instead
(one process per mesh position); see :mod:`autotp.cli.mesh_demo`.

``autotp calibrate`` measures this machine (matmul throughput, memory bandwidth, the cost of a tiny
op, gloo collective latency and bandwidth across N local processes) and writes a hardware profile
as JSON, for ``autotp.plan(..., options=autotp.PlanOptions(hardware="profile.json"))``; see :mod:`autotp.calibration.calibrate`.
Started by a launcher on several nodes (``torchrun --nnodes 2 --nproc-per-node 2 -m autotp.cli.main
calibrate``), it measures on the launcher's ranks instead of spawning its own, inside each host and across
hosts, and writes a two-level profile (rank 0 writes it).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from autotp.cli.arguments import hardware_profile, output_path, positive_int
from autotp.cli.demo_ranks import (
    DEMO_BATCH,
    DEMO_HEADS,
    DEMO_HIDDEN,
    DEMO_KV_HEADS,
    DEMO_VOCAB,
    build_demo_llama,
    free_port,
    joined_group,
    say,
    spawn_ranks,
)
from autotp.cli.mesh_demo import mesh_spec, run_mesh_demo

__all__ = ["main"]

DEFAULT_TOLERANCE = 1e-4  # float32 logits: summation order differs under TP, far below this


@dataclass(frozen=True)
class DemoConfig:
    """What the demo builds and checks; passed to every rank."""

    world_size: int
    layers: int
    seq_len: int
    seed: int
    tolerance: float
    init_method: str
    hardware: str = "h100-sxm"  # the profile the plan is costed for; the run itself is CPU gloo
    generate: int = 0  # new tokens to generate after the logits check (0: no generation)


@dataclass
class DemoReport:
    """What rank 0 prints at the end."""

    max_abs_diff: float
    plan_text: str = ""
    plan_time_s: float = float("nan")
    compile_time_s: float = float("nan")
    parameter_bytes_original: int = 0
    parameter_bytes_per_rank: list[int] = field(default_factory=list)
    collective_counts: dict[str, int] = field(default_factory=dict)


def _logits(output: Any) -> Any:
    return output.logits if hasattr(output, "logits") else output[0]


def _demo_rank(rank: int, config: DemoConfig, results: Any) -> None:
    """One rank of the demo (the target of ``torch.multiprocessing.spawn``)."""
    import torch
    import torch.distributed as dist

    import autotp

    world_size = config.world_size
    with joined_group(rank, world_size, config.init_method):
        say(rank, f"process group up: gloo, {world_size} ranks")
        say(rank, f"building LlamaForCausalLM ({config.layers} layers, hidden {DEMO_HIDDEN}, {DEMO_HEADS} heads, "
                   f"{DEMO_KV_HEADS} kv heads, vocab {DEMO_VOCAB}) with seed {config.seed} on every rank...")
        model = build_demo_llama(config.layers, config.seq_len, config.seed)
        generator = torch.Generator().manual_seed(config.seed + 1)
        ids = torch.randint(0, DEMO_VOCAB, (DEMO_BATCH, config.seq_len), generator=generator)  # (batch, seq)
        with torch.no_grad():
            reference = _logits(model(ids, use_cache=False))  # (batch, seq, vocab), single process
        original_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

        say(rank, f"compiling with autotp.compile(world_size={world_size}, "
                  f"options=autotp.PlanOptions(hardware={config.hardware!r})); "
                  f"the plan is costed for that profile, the run is CPU gloo...")
        started = time.perf_counter()
        tp_model = autotp.compile(model, world_size=world_size, example_inputs=(ids,),
                                  example_kwargs={"use_cache": False}, options=autotp.PlanOptions(hardware=config.hardware))
        compile_time_s = time.perf_counter() - started

        say(rank, "running the tensor-parallel model...")
        with torch.no_grad():
            logits = _logits(tp_model(ids, use_cache=False))
        diff = torch.tensor([(logits - reference).abs().max().item()], dtype=torch.float64)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)  # the worst rank decides

        per_rank_bytes: list[Any] = [None] * world_size
        dist.all_gather_object(per_rank_bytes, int(tp_model.parameter_bytes()))
        if rank == 0:
            report = DemoReport(
                max_abs_diff=float(diff.item()),
                plan_text=str(tp_model.plan),
                plan_time_s=float(tp_model.plan.plan_time_s),
                compile_time_s=compile_time_s,
                parameter_bytes_original=original_bytes,
                parameter_bytes_per_rank=[int(b) for b in per_rank_bytes],
                collective_counts=dict(tp_model.collective_counts()),
            )
            print(format_report(report, config), flush=True)
        same_tokens = True
        if config.generate:
            from autotp.cli.generate_demo import generate_demo

            same_tokens = generate_demo(rank, model, ids, config.generate, config.hardware)
        if rank == 0:
            # small: a large message would block the pipe until join
            results.put(report.max_abs_diff if same_tokens else float("inf"))


def _costed_for(config: DemoConfig) -> str:
    """Why the plan names hardware this machine is not: the cost model prices the named profile."""
    return (f"Costed for the {config.hardware!r} hardware profile (--hardware): the plan and its predicted "
            f"times are for that hardware, while this run is {config.world_size} gloo processes on this "
            f"machine's CPU; `autotp calibrate` writes a profile of this machine.")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def format_report(report: DemoReport, config: DemoConfig) -> str:
    """The demo's closing figures as text."""
    ok = report.max_abs_diff <= config.tolerance
    lines = [
        "",
        report.plan_text,
        _costed_for(config),
        "",
        (f"max abs diff vs single process: {report.max_abs_diff:.3e} "
         f"(tolerance {config.tolerance:.0e}): {'OK' if ok else 'FAILED'}"),
        f"plan time: {report.plan_time_s:.3f} s (whole autotp.compile: {report.compile_time_s:.3f} s)",
        f"parameter bytes, original model: {_mib(report.parameter_bytes_original)}",
    ]
    for rank, nbytes in enumerate(report.parameter_bytes_per_rank):
        share = nbytes / report.parameter_bytes_original if report.parameter_bytes_original else float("nan")
        lines.append(f"  rank {rank}: {_mib(nbytes)} ({share:.1%} of the original)")
    if report.collective_counts:
        counts = ", ".join(f"{kind} x{count}" for kind, count in sorted(report.collective_counts.items()))
    else:
        counts = "none"
    lines.append(f"collectives in the rank-local graph (per forward): {counts}")
    return "\n".join(lines)


def run_demo(config: DemoConfig) -> int:
    """Spawn the ranks, wait for them, return the exit code."""
    if importlib.util.find_spec("transformers") is None:
        print("autotp demo builds a HuggingFace Llama and needs transformers: pip install 'autotp[hf]'",
              file=sys.stderr)
        return 2
    print(f"spawning {config.world_size} gloo processes...", flush=True)
    code, max_abs_diff = spawn_ranks(_demo_rank, (config,), config.world_size, "autotp demo")
    if code:
        return code
    return 0 if max_abs_diff <= config.tolerance else 1


def run_checkpoint_demo(config: DemoConfig, checkpoint: str) -> int:
    """``autotp demo --checkpoint DIR``: spawn the ranks of :mod:`autotp.cli.load_demo`, return the exit code."""
    from autotp.cli.load_demo import run_checkpoint_rank

    print(f"spawning {config.world_size} gloo processes to load {checkpoint}...", flush=True)
    code, max_abs_diff = spawn_ranks(
        run_checkpoint_rank, (config.world_size, config.init_method, checkpoint, config.seq_len, config.hardware,
                              config.tolerance), config.world_size, "autotp demo --checkpoint")
    if code:
        return code
    return 0 if max_abs_diff <= config.tolerance else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autotp", description="Automatic tensor parallelism for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="make a small random-weight Llama tensor-parallel over N local gloo processes and check it",
        description="Spawn N gloo processes on this machine's CPU, run autotp.compile on a small Llama "
                    "with random weights, compare its logits with the single-process model, and print "
                    "the plan, the difference, per-rank parameter bytes, plan time and collectives.",
    )
    demo.add_argument("--world-size", type=positive_int, default=4, help="number of processes (default: 4)")
    demo.add_argument("--layers", type=positive_int, default=2, help="decoder layers (default: 2)")
    demo.add_argument("--seq-len", type=positive_int, default=16, help="tokens per sequence (default: 16)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (default: 0)")
    demo.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                      help=f"largest max-abs logit difference accepted (default: {DEFAULT_TOLERANCE:g})")
    demo.add_argument("--checkpoint", metavar="DIR", default=None,
                      help="load this transformers safetensors checkpoint with autotp.from_pretrained instead of "
                           "building a random Llama, and show each rank's peak memory while loading")
    demo.add_argument("--hardware", type=hardware_profile, default="h100-sxm",
                      help="hardware profile the plan is costed for (name or JSON path; default: h100-sxm); "
                           "the run itself is always CPU gloo")
    demo.add_argument("--generate", type=positive_int, default=0, metavar="N",
                      help="then generate N tokens greedily with a sharded KV cache and compare tokens, prefill ms, "
                           "ms per token and tokens/s with the single-process model.generate")
    demo.add_argument("--mesh", type=mesh_spec, default=None, metavar="DIMS",
                      help="run over a data x pipeline x tensor parallel DeviceMesh instead, e.g. dp2,pp2,tp2 "
                           "(one process per position: the world size is the product of the sizes)")
    _add_calibrate_parser(commands)
    from autotp.cli.plan import add_plan_parser

    add_plan_parser(commands)
    return parser


def _add_calibrate_parser(commands: Any) -> None:
    calibrate = commands.add_parser(
        "calibrate",
        help="measure this machine (matmul, memory, gloo collectives) and write a hardware profile (JSON)",
        description="Spawn N gloo processes on this machine, measure matmul throughput, memory bandwidth, "
                    "the cost of a tiny op and the latency/bandwidth of gloo all_reduce, all_gather and "
                    "reduce_scatter, fit the alpha-beta collective model, and write a hardware profile "
                    "usable as autotp.plan(..., options=autotp.PlanOptions(hardware=\"PATH.json\")). The profile describes one rank "
                    "of an N-rank job on this machine. Started by torchrun on 2 or more nodes, it measures on the "
                    "launcher's ranks instead, inside each host and across hosts, and writes a two-level profile.",
    )
    calibrate.add_argument("--world-size", type=positive_int, default=2,
                           help="processes to measure with, as the runs you will plan for (default: 2)")
    calibrate.add_argument("--output", "-o", type=output_path, default="autotp-hardware.json",
                           help="where to write the profile (default: autotp-hardware.json)")
    calibrate.add_argument("--name", default="cpu-calibrated", help="profile name (default: cpu-calibrated)")
    calibrate.add_argument("--threads", type=positive_int, default=None,
                           help="torch threads per process (default: cores // world size, at least 1)")
    calibrate.add_argument("--quick", action="store_true",
                           help="small sizes and short timings: a rough profile in seconds")
    calibrate.add_argument("--links-only", type=hardware_profile, default=None, metavar="PROFILE",
                           help="under a launcher: keep this profile's compute terms (one written by `autotp "
                                "calibrate` on one of these hosts) and measure only the links inside and "
                                "between hosts")
    nodes = calibrate.add_argument_group(
        "two-level machine", "started by torchrun on 2 or more nodes, calibrate measures the network between "
                             "them (devices per node from the launcher); otherwise describe several nodes of this "
                             "machine: give the network's figures (a datasheet, or nccl-tests across nodes)")
    nodes.add_argument("--devices-per-node", type=positive_int, default=None,
                       help="devices that share the measured link (default: the measured world size)")
    nodes.add_argument("--inter-node-gbps", type=float, default=None,
                       help="network bandwidth between nodes, GB/s per direction per device (e.g. 50 for one "
                            "400 Gb/s NDR port per GPU)")
    nodes.add_argument("--inter-node-latency-us", type=float, default=None,
                       help="network latency per message step, microseconds (e.g. 2.7, NCCL's hwLat for NET)")


def run_calibrate(args: argparse.Namespace) -> int:
    """``autotp calibrate``: measure, write the JSON profile, print what was measured."""
    from autotp.calibration.calibrate import CalibrationConfig, calibrate
    from autotp.cost_model.calibrate import with_nodes
    from autotp.cost_model.hardware import get_hardware
    from autotp.runtime.collectives.hosts import launched

    if args.quick:
        config = CalibrationConfig.quick(progress=True, threads=args.threads)
    else:
        config = CalibrationConfig(progress=True, threads=args.threads)
    try:
        launch = launched(os.environ)  # the front door: the launcher's variables are read here, once
    except ValueError as error:
        print(f"autotp calibrate: {error}", file=sys.stderr)
        return 2
    if launch is not None:
        from autotp.calibration.calibrate import calibrate_launched

        try:
            host_profile = None if args.links_only is None else get_hardware(args.links_only)
            measured = calibrate_launched(launch, config=config, name=args.name, host_profile=host_profile)
        except ValueError as error:
            print(f"autotp calibrate (rank {launch.rank}): {error}", file=sys.stderr)
            return 2
        if measured is None:  # not rank 0: rank 0 writes the profile
            return 0
        profile, ranks = measured, launch.world_size
    elif args.links_only is not None:
        print("autotp calibrate: --links-only measures the links between hosts of a launcher's group; start it "
              "with torchrun on 2 or more nodes", file=sys.stderr)
        return 2
    else:
        profile, ranks = calibrate(args.world_size, config=config, name=args.name), args.world_size
    if (args.devices_per_node, args.inter_node_gbps, args.inter_node_latency_us) != (None, None, None):
        try:
            profile = with_nodes(profile, devices_per_node=args.devices_per_node,
                                 inter_node_bandwidth_gbps=args.inter_node_gbps,
                                 inter_node_latency_s=None if args.inter_node_latency_us is None
                                 else args.inter_node_latency_us * 1e-6)
        except ValueError as error:
            print(f"autotp calibrate: {error}", file=sys.stderr)
            return 2
    with open(args.output, "w", encoding="utf-8") as file:
        file.write(profile.to_json() + "\n")
    link = profile.intra_node
    where = "this machine" if launch is None else f"{launch.nodes} hosts of {launch.local_world_size}"
    print(f"wrote {args.output}: {profile.name!r} for {ranks} rank(s) on {where}")
    for dtype, tflops in profile.peak_tflops.items():
        print(f"  matmul {dtype:<9} {tflops * 1e3:10.2f} GFLOP/s per rank")
    print(f"  memory           {profile.memory_bandwidth_gbps:10.2f} GB/s per rank")
    if profile.memory_bandwidth_curve:
        print("  by working set   " + ", ".join(f"{size / 2**20:g} MiB {gbps:.1f}"
                                                for size, gbps in profile.memory_bandwidth_curve) + " GB/s")
    if profile.gemv_bandwidth_curve:
        print("  matrix-vector    " + ", ".join(f"{size / 2**20:g} MiB {gbps:.1f}"
                                                for size, gbps in profile.gemv_bandwidth_curve)
              + " GB/s of the matrix (one-row linears)")
    print(f"  tiny op          {profile.kernel_floor_s * 1e6:10.2f} us")
    print(f"  view op          {profile.view_op_s * 1e6:10.2f} us")
    print(f"  GEMM half rate   at smallest dim {profile.gemm_half_efficiency_dim:g}")
    if profile.op_fixed_s:
        print("  fixed per call   " + ", ".join(
            f"{name} {seconds * 1e6:.1f} us{' per block' if name == 'attention' else ''}"
            for name, seconds in profile.op_fixed_s))
    print(f"  transcendental   {profile.transcendental_element_s * 1e9:10.3f} ns per element")
    if profile.core_share < 1.0:
        print(f"  core share       {profile.core_share:.2f} of a core per rank while every rank computes (the rates "
              "above)" + (f", up to {profile.core_share_range_s * 1e3:.1f} ms of a call's compute; "
                          f"{profile.fair_core_share:.2f} beyond" if profile.core_share_range_s else "")
              + f"; {profile.core_share_call_s * 1e6:.1f} us lost once per call")
    if profile.busy_compute_scale:
        print(f"  busy ranks       compute time with k of the {profile.machine_ranks()} ranks of a machine busy, over "
              "all busy: " + ", ".join(f"{k} {scale:.2f}" for k, scale in profile.busy_compute_scale))
    print(f"  runtime          {profile.runtime_mode}: {profile.host_dispatch_s * 1e6:.2f} us host dispatch per "
          f"kernel node, {profile.graph_launch_s * 1e6:.1f} us per graph call "
          f"(+{profile.model_call_s * 1e6:.1f} us for a model's call), "
          f"{profile.collective_wait_s * 1e6:.1f} us wait per collective + {profile.call_sync_wait_s * 1e6:.1f} us "
          f"+ {profile.call_sync_wait_per_compute:.2f} s per s of compute"
          + (f" (up to {profile.call_sync_wait_compute_range_s * 1e3:.2f} ms of it)"
             if profile.call_sync_wait_compute_range_s else "")
          + " per call with collectives (fitted in graphs)")
    print(f"  gloo link        {link.base_latency_s * 1e6:.1f} us per call + {link.latency_s * 1e6:.1f} us per step, "
          f"{link.bandwidth_gbps:.3f} GB/s")
    if profile.shared_memory_link is not None:
        shared = profile.shared_memory_link
        print(f"  shared memory    {shared.base_latency_s * 1e6:.1f} us per call, {shared.bandwidth_gbps:.2f} GB/s; "
              f"+{profile.shared_memory_cold_call_s * 1e6:.1f} us per call with its slots out of cache")
        if profile.shared_memory_cold_curve:
            print("  slots cold after " + ", ".join(f"{size / 2**20:g} MiB +{seconds * 1e6:.1f}"
                                                    for size, seconds in profile.shared_memory_cold_curve) + " us")
    print(f"  nodes            {profile.devices_per_node} device(s) per node; between nodes "
          f"{profile.inter_node.base_latency_s * 1e6:.1f} us per call + {profile.inter_node.latency_s * 1e6:.1f} us "
          f"per step, {profile.inter_node.bandwidth_gbps:.3f} GB/s ({profile.inter_node.name})")
    if profile.inter_node_send is not None:
        send = profile.inter_node_send
        print(f"  sends between    {send.latency_s * 1e6:.1f} us + {send.bandwidth_gbps:.3f} GB/s past a "
              f"{send.burst_bytes / 2**10:.1f} KiB burst, one way, alone on the link ({send.name})")
    print(f"use it with: autotp.plan(model, inputs, world_size={ranks}, "
          f"options=autotp.PlanOptions(hardware={args.output!r}))")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``autotp`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        config = DemoConfig(
            world_size=args.world_size, layers=args.layers, seq_len=args.seq_len, seed=args.seed,
            tolerance=args.tolerance, init_method=f"tcp://127.0.0.1:{free_port()}", hardware=args.hardware,
            generate=args.generate,
        )
        try:
            if args.mesh is not None:
                if args.checkpoint is not None or args.generate:
                    build_parser().error("autotp demo --mesh does not take --checkpoint or --generate (yet)")
                return run_mesh_demo(args.mesh, layers=args.layers, seq_len=args.seq_len, seed=args.seed,
                                     hardware=args.hardware, tolerance=args.tolerance,
                                     init_method=config.init_method)
            if args.checkpoint is not None:
                return run_checkpoint_demo(config, args.checkpoint)
            return run_demo(config)
        except KeyboardInterrupt:
            return 130
    if args.command == "plan":
        from autotp.cli.plan import run_plan

        try:
            return run_plan(args)
        except KeyboardInterrupt:
            return 130
    if args.command == "calibrate":
        try:
            return run_calibrate(args)
        except KeyboardInterrupt:
            return 130
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
