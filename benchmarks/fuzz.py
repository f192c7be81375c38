"""Fuzz autotp with many random models on real gloo process groups and print the counts.

    python benchmarks/fuzz.py                       # 500 models at tp=2 and 500 at tp=3: 1000 per run
    python benchmarks/fuzz.py --examples 500 --world-sizes 2 3 4 --seed 1000
    python benchmarks/fuzz.py --seed 1234 --examples 1 --world-sizes 3   # replay one printed failure

The models are those of ``tests/fuzz_models.py`` (linear, matmul, elementwise, reductions,
reshape/permute, softmax, norms, concat/split, residual adds, attention; random and awkward
sizes). Each is compiled with ``autotp.compile`` on every rank and compared with the
single-process model. Printed per world size: examples (and how many had split weights, and
how many pinned some weights with constraints), mismatches (error above 1e-4, relative where
the output exceeds 1), crashes (an exception on any rank), examples with fallback ops (and
which ops), and the largest error seen. Runs are reproducible: example ``i`` draws its model from
seed ``--seed + i`` (the first line printed says the seed), and each failure is printed with its
own seed and the command that replays it, and with its spec, which also replays in Python::

    from fuzz_models import Spec, build          # with tests/ on sys.path
    model, args = build(Spec(...))

``tests/test_fuzz.py`` runs a bounded number of the same models in CI with hypothesis.
Exit status 1 when any example mismatched or crashed.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

from distributed import RankError, run_on_ranks, shutdown_all  # noqa: E402
from fuzz_models import TOLERANCE, RandomDraw, check_spec, draw_spec  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=500, help="random models per world size")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--seed", type=int, default=0, help="first spec seed (example i uses seed + i; default 0)")
    parser.add_argument("--max-steps", type=int, default=6, help="most steps per model")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="seconds one example may take (a hang)")
    args = parser.parse_args(argv)

    print(f"fuzzing with seed {args.seed} (example i draws from seed {args.seed} + i), {args.examples} examples "
          f"per world size {args.world_sizes}, at most {args.max_steps} steps", flush=True)
    failed = False
    try:
        for world_size in args.world_sizes:
            counts: collections.Counter[str] = collections.Counter()
            fallbacks: collections.Counter[str] = collections.Counter()
            worst = 0.0
            failures = []
            started = time.perf_counter()
            for i in range(args.examples):
                spec_seed = args.seed + i
                spec = draw_spec(RandomDraw(spec_seed), args.max_steps)
                counts["examples"] += 1
                try:
                    results = run_on_ranks(world_size, check_spec, spec, timeout_s=args.timeout_s)
                except (RankError, TimeoutError) as exc:  # a crash outside check_spec's own try, or a hang
                    results = [{"max_error": float("inf"), "fallback_ops": (), "error": str(exc).splitlines()[0]}]
                errors = [r["error"] for r in results if r["error"]]
                if errors:
                    counts["crashes"] += 1
                    failures.append(("crash", spec_seed, spec, errors[0][:300]))
                    continue
                error = max(r["max_error"] for r in results)
                worst = max(worst, error)
                if error > TOLERANCE:
                    counts["mismatches"] += 1
                    failures.append(("mismatch", spec_seed, spec, f"max error {error:.3g}"))
                if results[0].get("split"):
                    counts["split"] += 1
                if spec.pins:
                    counts["pinned"] += 1
                if results[0]["fallback_ops"]:
                    counts["with fallback"] += 1
                    fallbacks.update(results[0]["fallback_ops"])
            elapsed = time.perf_counter() - started
            print(f"tp={world_size}: examples {counts['examples']} ({counts['split']} with split weights, "
                  f"{counts['pinned']} with pinned weights), mismatches {counts['mismatches']}, "
                  f"crashes {counts['crashes']}, with fallback ops {counts['with fallback']}"
                  f"{' ' + dict(fallbacks).__repr__() if fallbacks else ''}, largest error {worst:.2g} "
                  f"({elapsed:.0f} s)", flush=True)
            for kind, spec_seed, spec, text in failures:
                print(f"  {kind} (seed {spec_seed}; replay: python benchmarks/fuzz.py --seed {spec_seed} --examples 1 "
                      f"--world-sizes {world_size} --max-steps {args.max_steps}): {text}\n    {spec}", flush=True)
            failed = failed or bool(failures)
    finally:
        shutdown_all()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
