"""Dump the plans of the tiny test models, or compare them with an earlier dump (refactor guard).

    python benchmarks/plan_snapshot.py --out DIR            # write DIR/<model>-tp<N>.json
    python benchmarks/plan_snapshot.py --compare DIR        # plan again, report every difference

Models: tiny Llama, GPT-2, BERT, Mixtral and MLP from ``tests/models.py`` on the meta device, at
tp 2, 3 and 4, planned with ``autotp.plan`` on the default hardware and budget, plus the
Megatron reference plan of tiny Llama. ``plan_time_s`` (wall clock) is set to 0 before dumping,
so two dumps of the same planner are byte-identical.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import autotp  # noqa: E402
from autotp.planning.megatron import megatron_plan  # noqa: E402
from tests import models  # noqa: E402

MODELS = ("tiny_llama", "tiny_gpt2", "tiny_bert", "tiny_mixtral", "tiny_mlp")
WORLD_SIZES = (2, 3, 4)


def snapshots() -> dict[str, str]:
    """File name -> plan JSON with the wall-clock field zeroed."""
    result = {}
    for name in MODELS:
        model, args, kwargs = getattr(models, name)(device="meta")
        for world_size in WORLD_SIZES:
            plan = autotp.plan(model, args, kwargs, world_size=world_size)
            result[f"{name}-tp{world_size}.json"] = dataclasses.replace(plan, plan_time_s=0.0).to_json()
    model, args, kwargs = models.tiny_llama(device="meta")
    plan = megatron_plan(model, args, kwargs, world_size=4)
    result["megatron-tiny_llama-tp4.json"] = dataclasses.replace(plan, plan_time_s=0.0).to_json()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", type=pathlib.Path, help="folder to write the plans to")
    group.add_argument("--compare", type=pathlib.Path, help="folder of an earlier --out to compare with")
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    plans = snapshots()
    if options.out is not None:
        options.out.mkdir(parents=True, exist_ok=True)
        for file, text in plans.items():
            (options.out / file).write_text(text)
        print(f"wrote {len(plans)} plans to {options.out}")
        return 0
    differ = [file for file, text in plans.items() if (options.compare / file).read_text() != text]
    print(f"{len(plans) - len(differ)}/{len(plans)} plans byte-identical" + (f"; differ: {', '.join(differ)}" if differ else ""))
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
