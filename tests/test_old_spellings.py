"""The front doors' old keyword spellings keep working for one release: each warns, saying what to write
instead, and gives the plan the one spelling (``options=`` / ``runtime=``) gives.

Tier (a) for ``autotp.plan`` and ``autotp.backend`` (no process group), tier (b) for ``autotp.compile`` and
``autotp.from_pretrained`` (a fake process group of 3 ranks: planning and rewrite, no collectives run). Each
case first checks that the option changes the plan, so that two equal plans say the option was honoured.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from models import tiny_llama, tiny_mlp

import autotp


@pytest.fixture
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=3)
    yield
    dist.destroy_process_group()


def _planned(plan: autotp.Plan) -> dict:
    """What a plan decided and predicted, without how long planning took (which no two runs share)."""
    data = json.loads(plan.to_json())
    data.pop("plan_time_s")
    return data


PLAN_SPELLINGS = [
    ("hardware", "a100-sxm", "hardware='a100-sxm'"),
    ("memory_budget", None, "memory_budget=None"),
    ("constraints", {"0.weight": "S(1)"}, "constraints={'0.weight': 'S(1)'}"),
    ("training", True, "training=True"),
]


@pytest.mark.parametrize(("name", "value", "spelled"), PLAN_SPELLINGS, ids=[case[0] for case in PLAN_SPELLINGS])
def test_plan_old_keyword_warns_and_plans_the_same(name: str, value: object, spelled: str) -> None:
    """tp=2, tiny MLP on meta: autotp.plan(..., name=value) warns with the PlanOptions spelling and plans as
    options=autotp.PlanOptions(name=value) does, which differs from the default plan."""
    model, args, _ = tiny_mlp(device="meta")
    default = _planned(autotp.plan(model, args, world_size=2))
    new = _planned(autotp.plan(model, args, world_size=2, options=autotp.PlanOptions(**{name: value})))
    assert new != default, f"{name}={value!r} should change the plan of this case"
    expected = f"autotp.plan(..., {spelled}) is deprecated: pass options=autotp.PlanOptions({spelled})"
    with pytest.warns(DeprecationWarning) as caught:
        old = _planned(autotp.plan(model, args, world_size=2, **{name: value}))
    messages = [str(w.message) for w in caught]
    assert messages == [expected], f"expected the one warning {expected!r}, got {messages}"
    assert caught[0].filename == __file__, f"the warning should point at the caller, got {caught[0].filename}"
    assert old == new, f"{name}: the old spelling planned otherwise than options= did"


def test_plan_old_keywords_together_warn_once() -> None:
    """tp=2, tiny MLP on meta: two old keywords in one call give one warning naming both."""
    model, args, _ = tiny_mlp(device="meta")
    with pytest.warns(DeprecationWarning, match=r"pass options=autotp\.PlanOptions\(hardware='h200', "
                                                r"memory_budget=None\)") as caught:
        old = _planned(autotp.plan(model, args, world_size=2, hardware="h200", memory_budget=None))
    assert len(caught) == 1, f"expected one warning, got {[str(w.message) for w in caught]}"
    new = _planned(autotp.plan(model, args, world_size=2, options=autotp.PlanOptions(hardware="h200", memory_budget=None)))
    assert old == new, "the old spelling planned otherwise than options= did"


@pytest.mark.parametrize(("name", "value", "spelled"), [("hardware", "a100-sxm", "hardware='a100-sxm'"),
                                                        ("training", True, "training=True")])
def test_compile_old_keyword_warns_and_plans_the_same(fake_group, name: str, value: object, spelled: str) -> None:
    """tp=3 (fake group), tiny MLP: autotp.compile(..., name=value) warns and compiles the plan that
    options=autotp.PlanOptions(name=value) gives, which differs from the default one."""
    model, args, _ = tiny_mlp()
    default = _planned(autotp.compile(model, example_inputs=args).plan)
    new = _planned(autotp.compile(model, example_inputs=args, options=autotp.PlanOptions(**{name: value})).plan)
    assert new != default, f"{name}={value!r} should change the plan of this case"
    expected = f"autotp.compile(..., {spelled}) is deprecated: pass options=autotp.PlanOptions({spelled})"
    with pytest.warns(DeprecationWarning) as caught:
        old = _planned(autotp.compile(model, example_inputs=args, **{name: value}).plan)
    assert [str(w.message) for w in caught] == [expected], [str(w.message) for w in caught]
    assert old == new, f"{name}: the old spelling compiled another plan than options= did"


@pytest.fixture
def llama_checkpoint(tmp_path: Path) -> str:
    """A one-layer Llama written by save_pretrained (before the fake group: transformers writes on rank 0 only)."""
    model, _, _ = tiny_llama(layers=1, num_heads=6, num_kv_heads=3, hidden=96, intermediate=192)
    model.save_pretrained(tmp_path)
    return str(tmp_path)


def test_from_pretrained_old_hardware_warns_and_plans_the_same(llama_checkpoint: str, fake_group) -> None:
    """tp=3 (fake group), a one-layer Llama checkpoint: from_pretrained(..., hardware=) warns and plans as
    options=autotp.PlanOptions(hardware=) does."""
    runtime = autotp.RuntimeOptions(trace_cache=False)
    new = _planned(autotp.from_pretrained(llama_checkpoint, options=autotp.PlanOptions(hardware="a100-sxm"), runtime=runtime).plan)
    assert new["hardware"] == "a100-sxm", f"expected the plan priced for a100-sxm, got {new['hardware']}"
    with pytest.warns(DeprecationWarning, match=r"^autotp\.from_pretrained\(\.\.\., hardware='a100-sxm'\) is "
                                                r"deprecated: pass options=autotp\.PlanOptions\(hardware='a100-sxm'\)$"):
        old = _planned(autotp.from_pretrained(llama_checkpoint, hardware="a100-sxm", runtime=runtime).plan)
    assert old == new, "the old spelling planned otherwise than options= did"


def test_backend_old_keywords_warn_and_build_the_same_backend() -> None:
    """No process group: autotp.backend(hardware=, memory_budget=, inner=) warns once per spelling and gives the
    planning options and runtime mode of options= and runtime=."""
    with pytest.warns(DeprecationWarning) as caught:
        old = autotp.backend(world_size=2, hardware="a100-sxm", memory_budget=None, inner="inductor")
    expected = ["autotp.backend(..., hardware='a100-sxm', memory_budget=None) is deprecated: pass "
                "options=autotp.PlanOptions(hardware='a100-sxm', memory_budget=None)",
                "autotp.backend(..., inner='inductor') is deprecated: pass "
                "runtime=autotp.RuntimeOptions(runtime_mode='compiled')"]
    assert [str(w.message) for w in caught] == expected, [str(w.message) for w in caught]
    new = autotp.backend(world_size=2, options=autotp.PlanOptions(hardware="a100-sxm", memory_budget=None),
                         runtime=autotp.RuntimeOptions(runtime_mode="compiled"))
    assert old._options == new._options, f"options differ: {old._options} vs {new._options}"
    assert old._options != autotp.backend(world_size=2)._options, "the old keywords should change the options"
    assert old.runtime.runtime_mode == new.runtime.runtime_mode == "compiled", (old.runtime, new.runtime)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="give it once, as runtime_mode"):
        autotp.backend(inner="eager", runtime=autotp.RuntimeOptions(runtime_mode="compiled"))


def test_backend_old_spelling_plans_the_same_graph(fake_group) -> None:
    """tp=3 (fake group), tiny MLP through torch.compile: the backend built with hardware= plans Dynamo's graph
    as the one built with options= does."""
    plans = []
    for spelling in ({"options": autotp.PlanOptions(hardware="a100-sxm")}, {"hardware": "a100-sxm"}, {}):
        model, args, _ = tiny_mlp()
        with pytest.warns(DeprecationWarning) if "hardware" in spelling else _nothing():
            tp_backend = autotp.backend(runtime=autotp.RuntimeOptions(runtime_mode="eager"), **spelling)
        torch._dynamo.reset()
        torch.compile(model, backend=tp_backend)(*args)
        plans.append(_planned(tp_backend.subgraphs[0].plan))
    torch._dynamo.reset()
    assert plans[0] != plans[2], "hardware='a100-sxm' should change the plan of this case"
    assert plans[1] == plans[0], "the old spelling planned otherwise than options= did"


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
