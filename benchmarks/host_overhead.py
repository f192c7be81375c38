"""Host (dispatch) time per token of a Llama-3-70B-shaped decode step, eager vs CUDA graph, from the plan.

    python benchmarks/host_overhead.py [--layers 80] [--world-size 8] [--hardware h200]

Plans a one-token forward (batch 1, the shape of a decode step; no KV cache) of the
Llama-3-70B shape (hidden 8192, 64 heads, 8 kv heads, intermediate 28672, vocab 128256,
bfloat16) on the meta device and prints what ``autotp.estimate(plan)`` says: the rank-local graph's
kernel and view nodes, the host time per call under each runtime mode of the profile (eager:
every node dispatched; compiled and cuda_graph: one call), and the predicted time per token as
priced in the profile's own mode and in eager mode; and the communication with small all-reduces priced as the
profile runs them (symmetric memory on the NVSwitch profiles) beside a plan made with them priced as NCCL's ring.
Nothing runs on a device: these are the
profile's cited terms (``autotp/cost_model/hardware.py``) times the plan's node counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import warnings

import torch

import autotp
from autotp.cost_model import Hardware, get_hardware
from autotp.cost_model.collective_forms import CollectiveForm

try:  # run as a script from the repository root
    from plan_time import llama70b_shaped
except ImportError:  # pragma: no cover - imported as benchmarks.host_overhead
    from benchmarks.plan_time import llama70b_shaped


def _plan(model: torch.nn.Module, ids: torch.Tensor, world_size: int, profile: Hardware) -> autotp.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autotp.plan(model, (ids,), {"use_cache": False}, world_size=world_size,
                           options=autotp.PlanOptions(dynamic=False, hardware=profile))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--hardware", default="h200")
    options = parser.parse_args()
    hardware = get_hardware(options.hardware)
    model = llama70b_shaped(options.layers)
    ids = torch.zeros(1, 1, dtype=torch.long, device="meta")  # (batch, seq): one decode token
    print(f"Llama-3-70B shape, {options.layers} layers, tp={options.world_size}, {hardware.name}, 1 token")
    for mode in (hardware.runtime_mode, "eager"):
        profile = dataclasses.replace(hardware, runtime_mode=mode)
        start = time.perf_counter()
        plan = _plan(model, ids, options.world_size, profile)
        estimate = autotp.estimate(plan, profile)
        host = estimate.host
        assert host is not None  # the profile is given
        print(f"\npriced as {mode} (planned in {time.perf_counter() - start:.1f} s): "
              f"{estimate.time_per_call_s * 1e3:.3f} ms per token = compute {estimate.compute_s * 1e3:.3f} ms "
              f"+ communication {estimate.comm_s * 1e3:.3f} ms + call {estimate.graph_call_s * 1e6:.0f} us")
        print(f"  rank-local graph: {host.kernels} kernel nodes, {host.views} view nodes, "
              f"{len(plan.collectives)} collectives")
        if profile.small_all_reduce != CollectiveForm.RING:  # planned again with its small all-reduces priced as NCCL's ring
            ring_profile = dataclasses.replace(profile, small_all_reduce=CollectiveForm.RING)
            ring = autotp.estimate(_plan(model, ids, options.world_size, ring_profile), ring_profile)
            print(f"  communication with small all-reduces as {profile.small_all_reduce}: {estimate.comm_s * 1e3:.3f} "
                  f"ms; as NCCL's ring: {ring.comm_s * 1e3:.3f} ms ({ring.time_per_call_s * 1e3:.3f} ms per token)")
        for name, seconds in host.by_mode.items():
            print(f"  host dispatch per token, {name:<10} {seconds * 1e3:9.3f} ms")
        if mode == "eager":
            break


if __name__ == "__main__":
    main()
