"""Experts placed whole on ranks against experts split, measured beside the planner's pick and its prediction.

A Mixtral-style decoder with random weights (``--layers`` layers, hidden ``--hidden``, expert intermediate
``--intermediate``, top-``--top-k`` routing (2), vocabulary 256, 8 query / 4 kv heads, so the experts hold most of the weights
and most of a forward's work), per number of experts (``--experts``) and tensor-parallel size
(``--world-sizes``), gloo on this machine's CPU, in two phases: a one-token forward at batch 1 (the decode of
one token without a cache: the experts' weights are read for a single token's two experts) and a forward of
``--prefill`` tokens at batch 1 (a comma-separated list gives a cell per length, e.g. ``--prefill 32,512``: a
short prefill, or a decode step of 32 sequences, is where many small experts run as many small GEMMs). Per cell:

- ``single``: the model's own forward in one process (rank 0 alone; the other ranks wait at a barrier);
- ``placed`` / ``split``: ``autotp.compile(..., options=PlanOptions(experts="placed" | "split"))``, each MoE
  block forced to that form;
- the planner's pick (``experts="auto"``) and its predicted forward with each form forced
  (``Plan.expert_form_times``), on the ``--hardware`` profile (default ``cpu-gloo``, whose numbers are
  placeholders; ``{ws}`` in it is replaced by the world size, so ``--hardware cpu{ws}.json`` takes the profile
  ``autotp calibrate --world-size N`` wrote for each size); where the planner mixes the forms inside a block
  (``mixed``: e.g. the gate/up GEMM placed and the down GEMM split), its plan is timed too (``pick ms``).

Each variant's median ms per forward over ``--rounds`` interleaved rounds (``--decode-rounds`` for the one-token
forward; every variant once per round, one warm-up round first; a round's time is its slowest rank's), so load
from other jobs on the machine falls on every variant alike; and the ratio placed / split of the same round, whose
quartiles say which form is faster: "tie" where they straddle 1 (the forms differ by less than the rounds
do). Every compile is
traced at the phase's own shape (``dynamic=False``), so the plan is priced at that shape. Prints a markdown
table. Usage::

    OMP_NUM_THREADS=1 python benchmarks/moe_placement.py --experts 8,16 --world-sizes 2,4
    OMP_NUM_THREADS=1 python benchmarks/moe_placement.py --kernels
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import autotp
from autotp.planning.experts import planned_experts

FORMS = ("placed", "split")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _model(experts: int, args: argparse.Namespace) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.intermediate,
                           num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                           num_local_experts=experts, num_experts_per_tok=args.top_k,
                           max_position_embeddings=2 * max(args.prefill),
                           attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    return MixtralForCausalLM(config).eval()


def _rank(rank: int, world_size: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    warnings.simplefilter("ignore")
    rows = []
    for experts in args.experts:
        model = _model(experts, args)
        for phase, tokens in (("decode", 1), *(("prefill", length) for length in args.prefill)):
            ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(1))  # (batch 1, tokens)
            with torch.no_grad():
                expected = model(ids).logits
            compiled = {}
            for form in (*FORMS, "auto"):
                options = autotp.PlanOptions(experts=form, hardware=args.hardware.format(ws=world_size), dynamic=False)
                compiled[form] = autotp.compile(model, example_inputs=(ids,), example_kwargs={"use_cache": False},
                                                options=options)
            auto = compiled["auto"].plan
            picked = {b.form for b in planned_experts(auto.nodes, world_size)}
            timed = (*FORMS, "auto") if not picked <= set(FORMS) else FORMS  # a mixed pick is a plan of its own
            single = model if rank == 0 else None  # rank 0 alone runs the model; the others wait at the barrier
            runs = {"single": lambda m=single, x=ids: m(x, use_cache=False) if m is not None else None,
                    **{form: (lambda tp=compiled[form], x=ids: tp(x, use_cache=False)) for form in timed}}
            times: dict[str, list[float]] = {name: [] for name in runs}
            for round_index in range((args.decode_rounds if tokens == 1 else args.rounds) + 1):
                for name, run in runs.items():
                    dist.barrier()
                    started = time.perf_counter()
                    with torch.no_grad():
                        run()
                    elapsed = time.perf_counter() - started
                    if round_index:
                        times[name].append(elapsed)
            diffs = {form: (compiled[form](ids, use_cache=False).logits - expected).abs().max().item() for form in timed}
            rows.append({"experts": experts, "phase": phase, "tokens": tokens, "times": times,
                         "ms": {name: statistics.median(values) * 1e3 for name, values in times.items()},
                         "pick": "/".join(sorted(picked)), "predicted_ms": {f: t * 1e3 for f, t in auto.expert_form_times},
                         "max_diff": max(diffs.values())})
    slowest = [None] * world_size
    dist.all_gather_object(slowest, rows)
    if rank == 0:
        for index, row in enumerate(rows):  # a forward takes as long as its slowest rank, round by round
            per_round = {name: [max(values) for values in zip(*(r[index]["times"][name] for r in slowest))]
                         for name in row["times"] if name != "single"}
            for name in per_round:
                row["ms"][name] = statistics.median(per_round[name]) * 1e3
            row["ratio"] = _quartiles([p / s for p, s in zip(per_round["placed"], per_round["split"])])
            if "auto" in per_round:  # the mixed pick against the faster forced form, round by round
                best = [min(p, s) for p, s in zip(per_round["placed"], per_round["split"])]
                row["pick_ratio"] = _quartiles([a / b for a, b in zip(per_round["auto"], best)])
            del row["times"]
        queue.put(rows)
    dist.destroy_process_group()


def _quartiles(ratios: list[float]) -> tuple[float, float, float]:
    """Lower quartile, median and upper quartile of per-round ratios."""
    ordered = sorted(ratios)
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
    return quartiles[0], statistics.median(ordered), quartiles[2]


def _median_ms(run: Any, rounds: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def _split_block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor, part: int) -> torch.Tensor:
    """One rank's expert block under experts split: its ``part`` columns of every expert's gate and up, then rows."""
    fallback = torch.ops.transformers.grouped_mm_fallback
    gate, up = fallback(x, w1, offs).split(part, -1)
    return fallback(torch.nn.functional.silu(gate) * up, w2, offs)


def _placed_block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor, first: int,
                  inner: int) -> torch.Tensor:
    """One rank's expert block under experts placed: its whole experts from ``first``, over their rows."""
    from autotp.passes.rules.experts import placed_grouped_mm

    gate, up = placed_grouped_mm(x, w1, offs, first, False).split(inner, -1)
    return placed_grouped_mm(torch.nn.functional.silu(gate) * up, w2, offs, first, False)


def _kernels(args: argparse.Namespace) -> None:
    """The ``--kernels`` table (module docstring)."""
    torch.set_num_threads(args.threads)
    print("| experts | tp | tokens | split ms (every rank) | placed ms (busiest rank) | busiest rank's rows / mean |")
    print("|---|---|---|---|---|---|")
    for experts in args.experts:
        model = _model(experts, args)
        block = model.model.layers[0].mlp
        inner = args.intermediate
        gate_up = block.experts.gate_up_proj.detach().transpose(-2, -1)  # (E, H, 2I)
        down = block.experts.down_proj.detach().transpose(-2, -1)  # (E, I, H)
        for tokens in (1, *args.prefill):
            hidden = torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(2))  # (tokens, H)
            with torch.no_grad():
                logits = hidden @ block.gate.weight.detach().T  # (tokens, E): the router's scores
                top = torch.topk(logits, args.top_k).indices.reshape(-1)  # (tokens * k,)
            ids, perm = torch.sort(top)
            x = hidden[perm // args.top_k]  # (rows, H), sorted by expert
            offs = torch.cumsum(torch.bincount(ids, minlength=experts), 0).to(torch.int32)  # (E,)
            for world_size in args.world_sizes:
                part = inner // world_size
                gate_up_slice = torch.cat([gate_up[..., :part], gate_up[..., inner:inner + part]], -1).contiguous()
                down_slice = down[:, :part].contiguous()

                held = [experts // world_size + (1 if r < experts % world_size else 0) for r in range(world_size)]
                firsts = [sum(held[:r]) for r in range(world_size)]
                rows = [int(offs[f + n - 1]) - (int(offs[f - 1]) if f else 0) for f, n in zip(firsts, held)]
                busiest = max(range(world_size), key=lambda r: rows[r])
                first, count = firsts[busiest], held[busiest]
                w1_local, w2_local = gate_up[first:first + count].contiguous(), down[first:first + count].contiguous()

                split = functools.partial(_split_block, x, gate_up_slice, down_slice, offs, part)
                placed = functools.partial(_placed_block, x, w1_local, w2_local, offs, first, inner)
                with torch.no_grad():
                    rounds = args.decode_rounds if tokens == 1 else args.rounds
                    split_ms, placed_ms = _median_ms(split, rounds), _median_ms(placed, rounds)
                mean = args.top_k * tokens / world_size
                print(f"| {experts} | {world_size} | {tokens} | {split_ms:.3f} | {placed_ms:.3f} | "
                      f"{rows[busiest]} / {mean:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", default="8,16", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--world-sizes", default="2,4", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default: 2)")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--prefill", default="512", type=lambda s: [int(x) for x in s.split(",")],
                        help="tokens of the prefill cells, comma-separated (default: 512)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode-rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hardware", default="cpu-gloo")
    parser.add_argument("--kernels", action="store_true", help="time the expert block's compute alone, one process")
    args = parser.parse_args()
    if args.kernels:
        _kernels(args)
        return
    context = mp.get_context("spawn")
    print("| experts | tp | phase | single ms | placed ms | split ms | placed / split per round (quartiles) | "
          "measured faster | planner's pick | predicted placed ms | predicted split ms | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for world_size in args.world_sizes:
        queue = context.Queue()
        port = _free_port()
        procs = [context.Process(target=_rank, args=(r, world_size, port, args, queue)) for r in range(world_size)]
        for proc in procs:
            proc.start()
        rows = queue.get()
        for proc in procs:
            proc.join()
        for row in rows:
            ms, predicted = row["ms"], row["predicted_ms"]
            low, mid, high = row["ratio"]
            faster = "tie" if low <= 1.0 <= high else ("placed" if high < 1.0 else "split")
            pick = row["pick"]
            if "pick_ratio" in row:  # a mixed pick: its ms, and per round against the faster forced form
                p_low, p_mid, p_high = row["pick_ratio"]
                pick = f"{pick} ({ms['auto']:.2f} ms; / faster form {p_mid:.2f} ({p_low:.2f}–{p_high:.2f}))"
            print(f"| {row['experts']} | {world_size} | {row['phase']} ({row['tokens']} tok) | {ms['single']:.2f} | "
                  f"{ms['placed']:.2f} | {ms['split']:.2f} | {mid:.2f} ({low:.2f}–{high:.2f}) | {faster} | {pick} | "
                  f"{predicted.get('placed', float('nan')):.2f} | {predicted.get('split', float('nan')):.2f} | "
                  f"{row['max_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
