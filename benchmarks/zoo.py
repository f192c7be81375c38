"""The model zoo: every tiny model family compiled at several world sizes on real gloo ranks.

    python benchmarks/zoo.py                             # tp = 2, 3, 4
    python benchmarks/zoo.py --world-sizes 2 3 4 5 6 --models llama mixtral cnn

For each model x world size, every rank runs ``autotp.compile`` (planning on rank 0, hardware
profile ``h100-sxm``, default memory budget) and compares its outputs with the single-process
model. Printed as a Markdown table:

- **match**: every rank's outputs within 1e-4 (max abs, float32) of the original;
- **max error**: the largest abs difference over ranks and outputs;
- **collectives / layer**: communicating collectives (local slices not counted) in each
  repeated layer (module path up to its first integer, e.g. ``model.layers.3``; for a
  ``Sequential`` CNN every numbered module counts as one), the most in any layer, then
  ``+ n`` outside layers;
- **fallback ops**: ops without a sharding rule (run replicated);
- **params / rank**: the largest rank's bytes of the parameters the graph reads (a tied
  weight counts once), and as a share of the model's;
- **split params**: share of the bytes of the *split* parameters one rank holds (≈ 1/tp when
  splits are even; larger when heads or channels do not divide).

Models come from ``tests/models.py`` (tiny configs, random weights, nothing downloaded) and
``tests/odd_models.py``. Exit status 1 when any row does not match.
"""

from __future__ import annotations

import argparse
import collections
import math
import pathlib
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

from distributed import RankError, run_on_ranks, shutdown_all  # noqa: E402

TOLERANCE = 1e-4
DEFAULT_MODELS = ["llama", "gpt2", "bert", "mistral", "qwen2", "mixtral", "mixtral_batched_mm", "mlp", "tied_lm", "cnn"]


def _run_model(rank: int, world_size: int, name: str) -> dict[str, Any]:
    import torch
    import torch.utils._pytree as pytree
    from models import BUILDERS
    from odd_models import ODD_BUILDERS

    import autotp
    from autotp.base.module_paths import block_name
    from autotp.base.placements import placement_from_str, split_of
    from autotp.passes.resharding import is_collective_step

    model, args, kwargs = {**BUILDERS, **ODD_BUILDERS}[name]()
    with torch.no_grad():
        expected = model(*args, **kwargs)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp_model = autotp.compile(model, example_inputs=args, example_kwargs=kwargs)
    compile_s = time.perf_counter() - started
    got = tp_model(*args, **kwargs)
    error = max((e - g).abs().max().item() for e, g in zip(pytree.tree_leaves(expected), pytree.tree_leaves(got))
                if isinstance(e, torch.Tensor))
    plan = tp_model.plan
    per_layer: collections.Counter[str] = collections.Counter()
    outside = 0
    for collective in plan.collectives:
        if not any(is_collective_step(step) for step in collective.steps):
            continue
        layer = block_name(collective.module)
        if layer is None:
            outside += 1
        else:
            per_layer[layer] += 1
    layers = {block_name(n.module) for n in plan.nodes if block_name(n.module)}
    # parameters the graph reads (a tied weight's second name is never read, and not counted)
    read = {p for n in plan.nodes for p in n.input_nodes}
    read_fqns = {n.target for n in plan.nodes if n.op == "placeholder" and n.name in read}
    full = dict(model.named_parameters(remove_duplicate=False))
    local = tp_model.local_state()
    held = full_bytes = split_full = split_local = 0
    for fqn, placement in plan.parameters.items():
        if fqn not in read_fqns or fqn not in full or fqn not in local:
            continue
        whole = full[fqn].numel() * full[fqn].element_size()
        mine = local[fqn].numel() * local[fqn].element_size()
        full_bytes += whole
        held += mine
        if split_of(placement_from_str(placement)) is not None:
            split_full += whole
            split_local += mine
    return {
        "error": error,
        "per_layer_max": max((per_layer.get(layer, 0) for layer in layers), default=0),
        "outside": outside,
        "fallback": plan.fallback_ops,
        "bytes": held,
        "full_bytes": full_bytes,
        "split_share": split_local / split_full if split_full else math.nan,
        "compile_s": compile_s,
    }


def _kib(nbytes: float) -> str:
    return f"{nbytes / 1024:,.0f} KiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    args = parser.parse_args(argv)
    rows = []
    all_match = True
    try:
        for world_size in args.world_sizes:  # one pool of workers per world size
            for name in args.models:
                try:
                    results = run_on_ranks(world_size, _run_model, name, timeout_s=600)
                except (RankError, TimeoutError) as exc:
                    rows.append(f"| {name} | {world_size} | CRASH | {str(exc).splitlines()[0][:80]} | | | | | |")
                    all_match = False
                    print(rows[-1], flush=True)
                    continue
                error = max(r["error"] for r in results)
                match = error <= TOLERANCE
                all_match = all_match and match
                first = results[0]
                largest = max(r["bytes"] for r in results)
                split_share = max(r["split_share"] for r in results)
                fallback = ", ".join(first["fallback"]) or "none"
                collectives = f"{first['per_layer_max']} + {first['outside']}"
                rows.append(
                    f"| {name} | {world_size} | {'yes' if match else 'NO'} | {error:.1e} | {collectives} | {fallback} | "
                    f"{_kib(largest)} ({largest / first['full_bytes']:.2f}) | {split_share:.2f} | "
                    f"{max(r['compile_s'] for r in results):.1f} s |"
                )
                print(rows[-1], flush=True)
    finally:
        shutdown_all()
    print()
    print("| model | tp | match | max error | collectives / layer (+ outside) | fallback ops | params / rank (share) "
          "| split params share | compile |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)
    return 0 if all_match else 1


if __name__ == "__main__":
    sys.exit(main())
