"""The default memory budget respects the device's memory (issue 13, requirement 4).

Tier (b): planning only, on the meta device; no process group. A hardware profile with a few
MiB of memory stands for a device too small for the model at world size 2.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from models import tiny_mlp

import autotp
from autotp.cost_model import get_hardware


def test_too_small_device_names_the_smallest_world_size_that_fits() -> None:
    """MLP 256 -> 4096 -> 256 (8.0 MiB fp32) on a 3 MiB device: tp=2 refused, the named world size plans."""
    model, args, kwargs = tiny_mlp(intermediate=4096, device="meta")
    small = dataclasses.replace(get_hardware("h100-sxm"), name="small", memory_gib=3 / 1024)
    with pytest.raises(autotp.PlanError, match="smallest world size that fits is") as caught:
        autotp.plan(model, args, kwargs, world_size=2, options=autotp.PlanOptions(hardware=small))
    match = re.search(r"pass world_size=(\d+)", str(caught.value))
    assert match, f"expected 'pass world_size=N' in the error, got {caught.value}"
    fits = int(match.group(1))
    assert fits > 2, f"the model cannot fit at 2, so the smallest fitting world size is above 2; got {fits}"
    plan = autotp.plan(model, args, kwargs, world_size=fits, options=autotp.PlanOptions(hardware=small))
    assert plan.parameter_bytes_per_rank <= 3 * 2**20, f"{plan.parameter_bytes_per_rank} bytes per rank > 3 MiB"
    with pytest.raises(autotp.PlanError, match="does not fit in device memory"):
        autotp.plan(model, args, kwargs, world_size=fits - 1, options=autotp.PlanOptions(hardware=small))
    unchecked = autotp.plan(model, args, kwargs, world_size=2, options=autotp.PlanOptions(hardware=small, memory_budget=8 * 2**20))
    assert unchecked.world_size == 2, "an explicit memory_budget plans without the device check"
