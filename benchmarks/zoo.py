"""The model zoo: every tiny model family compiled at several world sizes on real gloo ranks.

    python benchmarks/zoo.py                             # the project's test families, tp = 2, 3, 4
    python benchmarks/zoo.py --wide --world-sizes 2 3    # the wide zoo (tests/zoo_models.py), as docs/benchmarks/zoo.md
    python benchmarks/zoo.py --world-sizes 2 3 4 5 6 --models llama mixtral swin

For each model x world size, every rank runs ``autotp.compile(model, example_inputs=...)`` with every default
(planning on rank 0, hardware profile ``h100-sxm``, default memory budget), compares its outputs with the
single-process model, and for a causal LM compares ``tp.generate(ids, max_new_tokens=6)`` with
``model.generate`` (``tests/zoo_run.py``, which the zoo test tier asserts). Printed as a Markdown table:

- **match**: every rank's outputs within 1e-4 (max abs, float32) of the original, in the same structure;
- **max error**: the largest abs difference over ranks and outputs;
- **collectives / layer**: communicating collectives (local slices not counted) in each
  repeated layer (module path up to its first integer, e.g. ``model.layers.3``; for a
  ``Sequential`` CNN every numbered module counts as one), the most in any layer, then
  ``+ n`` outside layers;
- **fallback ops**: ops without a sharding rule (run replicated);
- **params / rank**: the largest rank's bytes of the parameters the graph reads (a tied
  weight counts once), and as a share of the model's;
- **split params**: share of the bytes of the *split* parameters one rank holds (≈ 1/tp when
  splits are even; larger when heads or channels do not divide);
- **generate**: greedy tokens equal to ``model.generate`` on every rank (``-``: not a causal LM; the error's
  type where generation is refused).

Exit status 1 when any row does not match.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

from distributed import RankError, run_on_ranks, shutdown_all  # noqa: E402
from zoo_run import TOLERANCE, run_zoo_model  # noqa: E402

DEFAULT_MODELS = ["llama", "gpt2", "bert", "mistral", "qwen2", "mixtral", "mixtral_batched_mm", "mlp", "tied_lm", "cnn"]


def _kib(nbytes: float) -> str:
    return f"{nbytes / 1024:,.0f} KiB"


def _row(name: str, world_size: int, results: list[dict]) -> tuple[str, bool]:
    failures = [r["failure"] for r in results if r["failure"]]
    if failures:
        return f"| {name} | {world_size} | NO | {failures[0][:90]} | | | | | | |", False
    error = max(r["error"] for r in results)
    match = error <= TOLERANCE
    first = results[0]
    largest = max(r["bytes"] for r in results)
    split_share = max(r["split_share"] for r in results)
    fallback = ", ".join(first["fallback"]) or "none"
    collectives = f"{first['per_layer_max']} + {first['outside']}"
    if first["generation_failure"]:
        generated = first["generation_failure"].split(":")[0]
        match = match and generated == "UnsupportedModelError"
    elif first["tokens_equal"] is None:
        generated = "-"
    else:
        equal = all(r["tokens_equal"] for r in results)
        generated = "equal" if equal else "DIFFER"
        match = match and equal
    return (f"| {name} | {world_size} | {'yes' if match else 'NO'} | {error:.1e} | {collectives} | {fallback} | "
            f"{_kib(largest)} ({largest / first['full_bytes']:.2f}) | {split_share:.2f} | {generated} | "
            f"{max(r['compile_s'] for r in results):.1f} s |"), match


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--models", nargs="+", default=None)
    parser.add_argument("--wide", action="store_true", help="every model of the wide zoo (tests/zoo_models.py)")
    args = parser.parse_args(argv)
    if args.models is None:
        from zoo_models import ZOO

        args.models = list(ZOO) if args.wide else DEFAULT_MODELS
    rows = []
    all_match = True
    started = time.perf_counter()
    try:
        for world_size in args.world_sizes:  # one pool of workers per world size
            for name in args.models:
                try:
                    results = run_on_ranks(world_size, run_zoo_model, name, timeout_s=600)
                except (RankError, TimeoutError) as exc:
                    row, match = f"| {name} | {world_size} | CRASH | {str(exc).splitlines()[0][:80]} | | | | | | |", False
                else:
                    row, match = _row(name, world_size, results)
                rows.append(row)
                all_match = all_match and match
                print(row, flush=True)
    finally:
        shutdown_all()
    print()
    print("| model | tp | match | max error | collectives / layer (+ outside) | fallback ops | params / rank (share) "
          "| split params share | generate | compile |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)
    print(f"\n{len(rows)} runs in {time.perf_counter() - started:.0f} s")
    return 0 if all_match else 1


if __name__ == "__main__":
    sys.exit(main())
