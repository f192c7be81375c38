"""Layouts on a two-host network: every dp x pp x tp of 4 ranks (2 hosts x 2 ranks, 1 thread each), predicted
against measured, at each link setting, for latency and for throughput.

For each link setting (``--rates``, Mbit/s; 0 is an unshaped veth) it builds a cluster of 2 hosts on this machine
(``tests/cluster.py``: network namespaces, links shaped by ``tc tbf``; needs root and iproute2), then

Each host runs on its own half of the machine's cores (``Cluster(..., cores=True)``; ``--shared-cores`` lets every
rank run on every core), so a host's two ranks compete for its cores only, as on two machines.

1. calibrates in the cluster: ``autotp calibrate --quick --threads 1`` started on the 4 ranks as torchrun starts
   them (compute, and the links inside each host and between hosts; at every setting after the first, or with
   ``--host-profile``, ``--links-only``: the compute terms are kept and only the links measured again);
2. plans in this process with that profile: the search ``autotp.plan_mesh`` runs (``mesh_costs`` +
   ``search_mesh``), once free (its pick) and once forced to each layout (its stage cuts and microbatches, and
   its predicted time);
3. measures every layout on the 4 ranks with ``autotp.compile_mesh`` and the forced plan: all of them compiled
   first, then ``--repeats`` rounds each timing every layout once (the order rotated per round, each call after
   a barrier), so that a change of the machine's load moves every layout alike; the median per layout of the
   time until every rank has the whole batch's logits, and the largest logit difference from one process.

The calibration measures collectives and kernels, never these layouts: nothing is tuned on the runs reported.
Latency is a forward of batch 1 (``--seq-len`` tokens); throughput a forward of the serving batch (``--batch``);
decode (``--decode-tokens``, 0 to skip) the time per new token of greedy ``generate`` at batch 1 (the
difference of the medians of 1 and of ``1 + decode-tokens`` new tokens, over ``decode-tokens``), predicted by
the search priced on one decode step (a token per row over the KV cache ``generate`` holds,
``mesh_costs(..., decode_cache_len=...)``). For latency
and decode a layout with ``dp`` replicas is called with ``dp`` rows, one request per replica, as the planner
prices it (a replica serves one request; the others serve theirs on the same cores). Printed: one table per
setting and objective (predicted and measured ms, the pick), Spearman's rank correlation of predicted and
measured times, whether the pick is the measured fastest or within 5% of it, and the markdown tables of
docs/benchmarks/layouts.md.

    sudo .venv/bin/python benchmarks/layouts.py                      # unshaped and 200 Mbit/s, 9 rounds
    sudo .venv/bin/python benchmarks/layouts.py --rates 0 200 --repeats 9 --host-profile host.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT / "tests"))

# A tiny Llama (random weights) whose forward of 32 tokens takes tens of milliseconds on one thread.
CONFIG = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=8, vocab_size=4096, max_position_embeddings=256, tie_word_embeddings=False)
LAYOUTS = ((1, 1, 4), (1, 2, 2), (2, 1, 2), (1, 4, 1), (2, 2, 1), (4, 1, 1))  # (dp, pp, tp)
RANKS_PER_HOST = 2
OBJECTIVES = ("latency", "throughput")


def build_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()


def example_ids(batch: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (batch, seq_len), generator=torch.Generator().manual_seed(1))


def describe(dims: tuple[int, int, int]) -> str:
    """Where each dim of a layout runs: ranks are (dp, pp, tp) with tp fastest, 2 consecutive ranks per host."""
    dp, pp, tp = dims
    inside, across = [], []
    for name, size, stride in (("tp", tp, 1), ("pp", pp, tp), ("dp", dp, tp * pp)):
        if size > 1:
            (inside if stride * size <= RANKS_PER_HOST else across).append(f"{name}{size}")
    return " ".join(filter(None, (" ".join(inside) + " in" if inside else "",
                                  " ".join(across) + " across" if across else "")))


# ------------------------------------------------------------------------------ on every rank (in the cluster)

def measure(rank: int, world_size: int, jobs: list[dict[str, Any]], profile: str, seq_len: int,
            repeats: int, decode_tokens: int) -> list[dict[str, float]]:
    """Each job's median seconds per call and its largest logit difference from one process; called by
    ``Cluster.run_function`` on every rank. Every job is compiled first, then ``repeats`` rounds each time
    every job once (after a barrier; the order rotated per round), so a change of the machine's load moves all
    layouts alike. A forward job's call ends when every rank has the whole batch's logits; a decode job times
    ``generate`` of 1 and of ``1 + decode_tokens`` new tokens, and its time per token is the difference of the
    medians over ``decode_tokens``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    from autotp.planning.mesh_plan import ParallelPlan

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model = build_model()
    references: dict[int, torch.Tensor] = {}
    calls: list[list[Any]] = []
    results: list[dict[str, float]] = []
    for job in jobs:
        ids = example_ids(job["batch"], seq_len)
        named = [(name, size) for name, size in zip(("dp", "pp", "tp"), job["dims"]) if size > 1]
        mesh = init_device_mesh("cpu", tuple(s for _, s in named), mesh_dim_names=tuple(n for n, _ in named))
        plan = ParallelPlan.from_json(job["plan"])
        if job["kind"] == "decode":
            part = autotp.compile_mesh(model, mesh, example_inputs=(ids,), max_cache_len=seq_len + decode_tokens + 1,
                                       plan=plan, options=autotp.PlanOptions(hardware=profile))

            def generate(part: Any = part, ids: torch.Tensor = ids, new: int = 1) -> Any:
                return part.generate(ids, max_new_tokens=new, eos_token_id=None)
            job_calls = [generate, functools.partial(generate, new=1 + decode_tokens)]
            with torch.no_grad():
                tokens = job_calls[1]()
                expected = _greedy(model, ids, 1 + decode_tokens)
            difference = float((tokens != expected).sum())  # tokens unlike one process's greedy ones
        else:
            if job["batch"] not in references:
                with torch.no_grad():
                    references[job["batch"]] = model(ids, use_cache=False).logits
            part = autotp.compile_mesh(model, mesh, example_inputs=(ids,), example_kwargs={"use_cache": False},
                                       plan=plan, options=autotp.PlanOptions(hardware=profile))
            job_calls = [functools.partial(part, ids, use_cache=False)]
            with torch.no_grad():
                logits = job_calls[0]().logits
            difference = float((logits - references[job["batch"]]).abs().max())
        with torch.no_grad():
            for call in job_calls:
                call()
        calls.append(job_calls)
        results.append({"max_abs_diff": difference})
        dist.barrier()
    times: list[list[list[float]]] = [[[] for _ in job_calls] for job_calls in calls]
    with torch.no_grad():
        for round_ in range(repeats):
            order = list(range(len(jobs)))
            order = order[round_ % len(order):] + order[:round_ % len(order)]
            for index in order:
                for which, call in enumerate(calls[index]):
                    dist.barrier()
                    start = time.perf_counter()
                    call()
                    times[index][which].append(time.perf_counter() - start)
    for index, per_call in enumerate(times):
        slowest = torch.tensor(per_call, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a call ends when every rank has its result
        medians = [statistics.median(row) for row in slowest.tolist()]
        if jobs[index]["kind"] == "decode":
            results[index]["seconds"] = max(0.0, medians[1] - medians[0]) / decode_tokens
            results[index]["first_token_s"] = medians[0]
        else:
            results[index]["seconds"] = medians[0]
    return results


def _greedy(model: torch.nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    """``ids`` followed by ``new`` greedy tokens of one process (no cache: the reference, not timed)."""
    out = ids
    for _ in range(new):
        out = torch.cat([out, model(out, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    return out


# ------------------------------------------------------------------------------ this process

def calibrate_in(cluster: Any, output: Path, host_profile: Path | None) -> str:
    """``autotp calibrate`` on the cluster's ranks as torchrun starts them; its printout (rank 0's)."""
    argv = [sys.executable, "-m", "autotp.cli.main", "calibrate", "--quick", "--threads", "1", "-o", str(output)]
    if host_profile is not None:
        argv += ["--links-only", str(host_profile)]
    outputs = cluster.run(argv, ranks_per_host=RANKS_PER_HOST, timeout_s=1800.0)
    return "\n".join(line for line in outputs[0].splitlines() if not line.startswith("[autotp calibrate]"))


def plan_layouts(profile: Path, seq_len: int, batch: int, decode_tokens: int) -> dict[str, Any]:
    """The pick for each objective and, per layout, the forced plan and its predicted seconds per call (per
    token for decode: the search priced on one decode step, a token per row over the KV cache that the
    measured ``generate`` holds, ``mesh_costs(..., decode_cache_len=...)``)."""
    from autotp.cost_model import get_hardware
    from autotp.planning.mesh_search import mesh_costs, search_mesh

    hardware = get_hardware(str(profile))
    model = build_model()
    costs = mesh_costs(model, (example_ids(1, seq_len),), {"use_cache": False}, [1, 2, 4], hardware)
    step = (mesh_costs(model, (example_ids(1, seq_len),), None, [1, 2, 4], hardware,
                       decode_cache_len=seq_len + decode_tokens + 1) if decode_tokens else None)
    planned: dict[str, Any] = {}
    for objective in objectives(decode_tokens > 0):
        priced = step if objective == "decode" else costs
        searched = "latency" if objective == "decode" else objective
        pick = search_mesh(priced, 4, objective=searched, batch=batch).mesh
        layouts = {}
        for dims in LAYOUTS:
            plan = search_mesh(priced, 4, objective=searched, batch=batch,
                               forced={"dp": dims[0], "pp": dims[1], "tp": dims[2]})
            predicted = (plan.predicted["latency_s"] if searched == "latency"
                         else batch / plan.predicted["throughput_per_s"])
            layouts[dims] = {"plan": plan.to_json(), "predicted_s": predicted, "microbatches": plan.microbatches}
        planned[objective] = {"pick": (pick.dp, pick.pp, pick.tp), "layouts": layouts}
    return planned


def objectives(decode: bool) -> tuple[str, ...]:
    return (*OBJECTIVES, "decode") if decode else OBJECTIVES


def call_batch(objective: str, dims: tuple[int, int, int], serving_batch: int) -> int:
    """The rows of a measured call: for latency one request per data-parallel replica (a replica serves a request
    of batch 1 while the others serve theirs, which is what the planner prices), else the serving batch."""
    return serving_batch if objective == "throughput" else dims[0]


def spearman(xs: list[float], ys: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(xs, ys).statistic) if len(xs) > 2 else float("nan")


def report(setting: str, objective: str, batch: int, planned: dict[str, Any],
           measured: dict[tuple[int, int, int], dict[str, float]]) -> dict[str, Any]:
    rows = planned[objective]["layouts"]
    pick = planned[objective]["pick"]
    what = {"latency": "batch 1 per replica", "decode": "ms per new token, batch 1 per replica"}.get(
        objective, f"batch {batch}")
    print(f"\n{setting}, {objective} ({what}): predicted vs measured ms per call (median)")
    print(f"  {'layout':>7}  {'where':<22} {'micro':>5} {'predicted':>10} {'measured':>9} {'pred/meas':>9} "
          f"{'max |diff|':>10}")
    for dims in LAYOUTS:
        row = rows[dims]
        label = "x".join(map(str, dims))
        if dims not in measured:
            print(f"  {label:>7}  {describe(dims):<22} {row['microbatches']:>5} {row['predicted_s'] * 1e3:>10.1f} "
                  f"{'-':>9} {'-':>9} {'-':>10}  not run: batch {batch} < dp {dims[0]}")
            continue
        seconds = measured[dims]["seconds"]
        mark = "  <- pick" if dims == pick else ""
        print(f"  {label:>7}  {describe(dims):<22} {row['microbatches']:>5} {row['predicted_s'] * 1e3:>10.1f} "
              f"{seconds * 1e3:>9.1f} {row['predicted_s'] / seconds:>9.2f} {measured[dims]['max_abs_diff']:>10.1e}{mark}")
    run = [d for d in LAYOUTS if d in measured]
    fastest = min(run, key=lambda d: measured[d]["seconds"])
    rho = spearman([rows[d]["predicted_s"] for d in run], [measured[d]["seconds"] for d in run])
    errors = [abs(rows[d]["predicted_s"] / measured[d]["seconds"] - 1) for d in run]
    if pick in measured:
        slower = measured[pick]["seconds"] / measured[fastest]["seconds"] - 1
        verdict = ("the measured fastest" if pick == fastest else
                   f"{slower:+.1%} vs the measured fastest {'x'.join(map(str, fastest))}"
                   + (" (within 5%)" if slower <= 0.05 else " (NOT within 5%)"))
    else:
        slower, verdict = float("nan"), "not run"
    print(f"  pick {'x'.join(map(str, pick))}: {verdict}; Spearman {rho:.2f} over {len(run)} layouts; "
          f"|pred/meas - 1| median {statistics.median(errors):.0%}, max {max(errors):.0%}; "
          f"within 25%: {sum(e <= 0.25 for e in errors)} of {len(errors)}")
    return {"setting": setting, "objective": objective, "pick": pick, "fastest": fastest, "pick_slower": slower,
            "spearman": rho, "errors": errors,
            "cells": {d: (rows[d]["predicted_s"], measured[d]["seconds"] if d in measured else None) for d in LAYOUTS}}


def markdown(summary: list[dict[str, Any]]) -> str:
    """The tables of docs/benchmarks/layouts.md: ms predicted / measured per layout and setting (the pick in
    bold, the measured fastest in italics), then one row per setting with the goals' figures."""
    def name(s: dict[str, Any]) -> str:
        return f"{s['setting']} {s['objective']}"

    lines = ["| layout dp×pp×tp | where | " + " | ".join(name(s) for s in summary) + " |",
             "|---|---|" + "---|" * len(summary)]
    for dims in LAYOUTS:
        cells = []
        for s in summary:
            predicted, seconds = s["cells"][dims]
            text = f"{predicted * 1e3:.1f} / " + ("-" if seconds is None else f"{seconds * 1e3:.1f}")
            if dims == s["pick"]:
                text = f"**{text}** pick"
            if dims == s["fastest"]:
                text = f"*{text}*"
            cells.append(text)
        lines.append(f"| {'×'.join(map(str, dims))} | {describe(dims)} | " + " | ".join(cells) + " |")
    lines += ["", "| setting | pick | measured fastest | pick vs fastest | Spearman | median \\|pred/meas − 1\\| | "
              "within 25% |", "|---|---|---|---|---|---|---|"]
    for s in summary:
        within = sum(e <= 0.25 for e in s["errors"])
        verdict = "0 (the fastest)" if s["pick"] == s["fastest"] else f"{s['pick_slower']:+.1%}"
        lines.append(f"| {name(s)} | {'×'.join(map(str, s['pick']))} | {'×'.join(map(str, s['fastest']))} | "
                     f"{verdict} | {s['spearman']:.2f} | {statistics.median(s['errors']):.0%} | "
                     f"{within} of {len(s['errors'])} |")
    return "\n".join(lines)


def main() -> None:
    from cluster import Cluster, Link

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0, 200],
                        help="link settings in Mbit/s, 0 for an unshaped link (default: 0 200)")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per request (default: 32)")
    parser.add_argument("--batch", type=int, default=8, help="the serving batch for throughput (default: 8)")
    parser.add_argument("--repeats", type=int, default=9,
                        help="rounds, each timing every layout once (default: 9); medians are quoted")
    parser.add_argument("--decode-tokens", type=int, default=8,
                        help="new tokens per timed generate for decode, 0 to skip decode (default: 8)")
    parser.add_argument("--host-profile", type=Path, default=None,
                        help="a profile of one host measured before (compute kept, links measured again)")
    parser.add_argument("--shared-cores", action="store_true",
                        help="let the hosts' ranks share every core of the machine (default: each host gets its own "
                             "half of the cores, as on two machines)")
    parser.add_argument("--keep", type=Path, default=None, help="folder to keep the calibrated profiles in")
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    folder = options.keep or Path(tempfile.mkdtemp(prefix="autotp-layouts-"))
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(_ROOT / "benchmarks"), os.environ.get("PYTHONPATH"))))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=_ROOT).stdout.strip()
    print(f"layouts of 4 ranks on 2 hosts x {RANKS_PER_HOST} (1 thread each), Llama {CONFIG['num_hidden_layers']} "
          f"layers hidden {CONFIG['hidden_size']}, {options.seq_len} tokens; throughput at batch {options.batch}; "
          f"commit {commit}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
          f"{'hosts share the cores' if options.shared_cores else 'each host on its own cores'}")
    host_profile = options.host_profile
    summary = []
    for rate in options.rates:
        setting = "unshaped" if rate == 0 else f"{rate:g} Mbit/s"
        link = None if rate == 0 else Link(rate_mbit=rate)
        profile = folder / f"profile-{'unshaped' if rate == 0 else f'{rate:g}mbit'}.json"
        with Cluster(2, link, cores=not options.shared_cores) as cluster:
            started = time.perf_counter()
            printed = calibrate_in(cluster, profile, host_profile)
            print(f"\n== {setting}: calibrated in {time.perf_counter() - started:.0f} s "
                  f"({'links only' if host_profile else 'compute and links'})")
            print("\n".join(line for line in printed.splitlines() if "link" in line or "nodes" in line
                            or "matmul float32" in line or "core share" in line or "shared memory" in line
                            or "busy" in line or "matrix-vector" in line))
            host_profile = host_profile or profile
            decode = options.decode_tokens > 0
            planned = plan_layouts(profile, options.seq_len, options.batch, options.decode_tokens)
            jobs, keys = [], []
            for objective in objectives(decode):
                for dims in LAYOUTS:
                    batch = call_batch(objective, dims, options.batch)
                    if dims[0] > batch:
                        continue
                    jobs.append({"dims": dims, "batch": batch, "plan": planned[objective]["layouts"][dims]["plan"],
                                 "kind": "decode" if objective == "decode" else "forward"})
                    keys.append((objective, dims))
            started = time.perf_counter()
            results = cluster.run_function("layouts:measure", ranks_per_host=RANKS_PER_HOST, timeout_s=3600.0,
                                           kwargs={"jobs": jobs, "profile": str(profile), "seq_len": options.seq_len,
                                                   "repeats": options.repeats,
                                                   "decode_tokens": options.decode_tokens})[0]
            print(f"measured {len(jobs)} layouts in {time.perf_counter() - started:.0f} s, {options.repeats} "
                  f"interleaved rounds; load average {os.getloadavg()[0]:.1f} at the end")
        for objective in objectives(options.decode_tokens > 0):
            measured = {dims: result for (o, dims), result in zip(keys, results) if o == objective}
            summary.append(report(setting, objective, options.batch, planned, measured))
    print("\nsummary: setting, objective -> pick, measured fastest, pick vs fastest, Spearman, median |error|")
    for s in summary:
        print(f"  {s['setting']:>12} {s['objective']:<10} -> {'x'.join(map(str, s['pick']))}, "
              f"{'x'.join(map(str, s['fastest']))}, {s['pick_slower']:+.1%}, {s['spearman']:.2f}, "
              f"{statistics.median(s['errors']):.0%}")
    print("\n" + markdown(summary) + "\n")
    print(json.dumps([{k: v for k, v in s.items() if k != "cells"} for s in summary], default=str))


if __name__ == "__main__":
    main()
