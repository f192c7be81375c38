"""One rank: a decode step priced with and without the matrix-vector rate, against ``generate``'s time per token.

The model of ``benchmarks/layouts.py`` (a Llama of 4 layers, hidden 512, float32) on one process with one thread:
the search's price of one decode step (``mesh_costs(..., decode_cache_len=41)`` at tp 1, as the layouts benchmark
prices its decodes) on the given profile, once as calibrated and once with ``Hardware.gemv_bandwidth_curve``
removed (the one-row linears at the copy's rate, as before the curve existed); then ``tp.generate`` of 1 and of 9
new tokens in turn, ``--rounds`` times, the difference of the medians over 8: ms per new token. Calibrate the profile
on this machine first::

    python -m autotp.cli.main calibrate --quick --world-size 1 --threads 1 -o one.json
    taskset -c 0 python benchmarks/decode_priced.py one.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

SEQ_LEN, NEW_TOKENS = 32, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="a profile of `autotp calibrate --world-size 1` on this machine")
    parser.add_argument("--rounds", type=int, default=9)
    options = parser.parse_args()

    import layouts as layouts_benchmark
    import torch
    import torch.distributed as dist

    import autotp
    from autotp.cost_model import get_hardware
    from autotp.planning.mesh_search import mesh_costs, search_mesh

    torch.set_num_threads(1)
    hardware = get_hardware(options.profile)
    model = layouts_benchmark.build_model()
    ids = layouts_benchmark.example_ids(1, SEQ_LEN)
    unmeasured = dataclasses.replace(hardware, gemv_bandwidth_gbps=0.0, gemv_bandwidth_curve=())
    for name, profile in (("as calibrated", hardware), ("one-row linears at the copy's rate", unmeasured)):
        costs = mesh_costs(model, (ids,), None, [1], profile, decode_cache_len=SEQ_LEN + NEW_TOKENS + 1)
        plan = search_mesh(costs, 1, objective="latency", batch=1)
        print(f"priced, {name}: {plan.predicted['latency_s'] * 1e3:.2f} ms per step")

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        tp = autotp.compile(model, example_inputs=(ids,), options=autotp.PlanOptions(hardware=options.profile))

        def generate_s(new_tokens: int) -> float:
            start = time.perf_counter()
            tp.generate(ids, max_new_tokens=new_tokens, eos_token_id=None)
            return time.perf_counter() - start

        generate_s(1), generate_s(1 + NEW_TOKENS)
        one, more = [], []
        for _ in range(options.rounds):
            one.append(generate_s(1))
            more.append(generate_s(1 + NEW_TOKENS))
        per_token = (statistics.median(more) - statistics.median(one)) / NEW_TOKENS
        print(f"measured: {per_token * 1e3:.2f} ms per new token (the medians of {options.rounds})")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
