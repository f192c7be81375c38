"""Ranks agree or fail together: faults injected on one rank, on real gloo groups.

Each distributed test runs on the shared 2-rank gloo pool with a deadline (``timeout_s``), so a
hang fails the test instead of stalling the run. A fault is injected on rank 1 only (another
model, weights, option or input); the expected outcome is the same clear error on every rank,
naming the ranks and what differs, never a wrong answer, a hang or an abort. The fast tests at
the end check the pieces without processes (checksums, traced values, messages).
"""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
from models import tiny_llama, tiny_mlp
from torch import nn

import autotp
from autotp.runtime.agreement.exchanges import InputGuard, weight_checksum

DEADLINE_S = 150.0  # per test: a hang fails here


def _mlp(rank: int, *, intermediate: int = 64, seed: int = 0, seq_len: int = 4) -> tuple[nn.Module, tuple, dict]:
    return tiny_mlp(hidden=32, intermediate=intermediate, seq_len=seq_len, seed=seed)


def _outcome(call) -> tuple[str, str]:
    """``(exception type, message)``, or ``("ok", "")`` when ``call()`` returned."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call()
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return type(exc).__name__, str(exc)
    return "ok", ""


class _DataDependent(nn.Module):
    """Branches on a tensor value: torch.export cannot trace it (a CaptureError)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) if x.sum() > 0 else -self.proj(x)


def _compile_with_fault(rank: int, world_size: int, fault: str) -> tuple[str, str]:
    """Compile a tiny MLP on every rank, with ``fault`` injected on rank 1."""
    model, args, kwargs = _mlp(rank)
    options: dict = {}
    planning: dict = {}
    faulty = rank == 1
    if faulty and fault == "wider_mlp":
        model, args, kwargs = _mlp(rank, intermediate=128)
    elif faulty and fault == "weights":
        model, args, kwargs = _mlp(rank, seed=1)
    elif faulty and fault == "example_input_shapes":
        model, args, kwargs = _mlp(rank, seq_len=8)
    elif faulty and fault == "gelu_approximate":  # same classes and shapes, another graph (trace keys differ)
        model[1].approximate = "tanh"
    elif faulty and fault == "trace_fails":
        model = _DataDependent()
    elif faulty and fault == "memory_budget":
        planning["memory_budget"] = None
    elif faulty and fault == "constraints":
        planning["constraints"] = {"2.weight": autotp.Replicate()}
    elif faulty and fault == "hardware":
        planning["hardware"] = "a100-sxm"
    elif faulty and fault == "world_size":
        options["world_size"] = 3
    elif fault == "plan":  # each rank plans with other constraints, then applies its own plan
        constraints = {"0.weight": "S(1)", "2.weight": "S(0)"} if faulty else {"0.weight": "S(0)", "2.weight": "S(1)"}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            options["plan"] = autotp.plan(model, args, kwargs, world_size=world_size, options=autotp.PlanOptions(hardware="cpu-gloo", constraints=constraints))
    return _outcome(lambda: autotp.compile(model, example_inputs=args, example_kwargs=kwargs, **options,
                                           options=autotp.PlanOptions(**planning),
                                           runtime=autotp.RuntimeOptions(agreement_timeout_s=60.0)))


FAULTS = {
    # fault on rank 1 -> words the common error must contain
    "wider_mlp": ["parameter 0.weight: rank 0 (64, 32) float32; rank 1 (128, 32) float32", "same model"],
    "weights": ["weight 0.weight: rank 1 holds other values than rank 0", "torch.manual_seed", "check_weights=False"],
    "example_input_shapes": ["input argument 0: rank 0 (2, 4, 32) float32; rank 1 (2, 8, 32) float32"],
    "gelu_approximate": ["constant arguments of node gelu (aten.gelu.default)", "rank 1 "],
    "trace_fails": ["rank 1 failed: CaptureError: could not trace _DataDependent", "rank 0 succeeded"],
    "memory_budget": ["option memory_budget: rank 0 'auto'; rank 1 None", "same options"],
    "constraints": ["option constraints: rank 0 none; rank 1 2.weight=R"],
    "hardware": ["option hardware: rank 0 h100-sxm", "rank 1 a100-sxm"],
    "world_size": ["rank 1 failed: ValueError: world_size=3 but the process group has 2 ranks"],
    "plan": ["option plan: rank 0 plan ", "rank 1 plan "],
}


@pytest.mark.distributed
@pytest.mark.parametrize("fault", list(FAULTS))
def test_one_rank_differs_at_compile(gloo, fault: str) -> None:
    """tp=2, fault on rank 1 only (model shape, weights, example inputs, failed trace, option, plan):
    both ranks raise the same AgreementError naming rank 1 and what differs; nobody hangs."""
    outcomes = gloo.run(2, _compile_with_fault, fault, timeout_s=DEADLINE_S)
    kinds = [kind for kind, _ in outcomes]
    assert kinds == ["AgreementError", "AgreementError"], f"expected AgreementError on both ranks, got {outcomes}"
    assert outcomes[0][1] == outcomes[1][1], f"ranks raised different messages:\n{outcomes[0][1]}\n---\n{outcomes[1][1]}"
    for words in FAULTS[fault]:
        assert words in outcomes[0][1], f"expected {words!r} in the error, got:\n{outcomes[0][1]}"


def _compile_unplannable(rank: int, world_size: int) -> tuple[str, str]:
    """Compile a tiny MLP with a memory budget no plan meets: rank 0 fails to plan (ahead of the agreement)."""
    model, args, kwargs = _mlp(rank)
    return _outcome(lambda: autotp.compile(model, example_inputs=args, example_kwargs=kwargs,
                                           options=autotp.PlanOptions(memory_budget=64),
                                           runtime=autotp.RuntimeOptions(agreement_timeout_s=60.0)))


@pytest.mark.distributed
def test_rank0_failure_to_plan_reaches_every_rank(gloo) -> None:
    """tp=2, a 64-byte memory budget on both ranks: rank 0 plans while the others rebuild its program, fails,
    and after the ranks agree on their graphs every rank raises a PlanError (rank 1 naming rank 0); nobody hangs."""
    outcomes = gloo.run(2, _compile_unplannable, timeout_s=DEADLINE_S)
    assert [kind for kind, _ in outcomes] == ["PlanError", "PlanError"], f"expected PlanError on both ranks, got {outcomes}"
    assert "memory" in outcomes[0][1], outcomes[0][1]
    assert outcomes[1][1].startswith("planning failed on rank 0: PlanError: "), outcomes[1][1]
    assert outcomes[0][1] in outcomes[1][1], f"rank 1 should carry rank 0's error:\n{outcomes[0][1]}\n---\n{outcomes[1][1]}"


def _compile_llama_depth(rank: int, world_size: int) -> tuple[str, str]:
    model, args, kwargs = tiny_llama(hidden=64, intermediate=128, num_heads=4, num_kv_heads=2, seq_len=8,
                                     layers=2 if rank == 0 else 1)
    return _outcome(lambda: autotp.compile(model, example_inputs=args, example_kwargs=kwargs))


@pytest.mark.distributed
def test_depth_differs(gloo) -> None:
    """tp=2, Llama with 2 layers on rank 0 and 1 on rank 1: one AgreementError naming the missing layer's weights
    (was a KeyError on one rank, then a gloo error)."""
    outcomes = gloo.run(2, _compile_llama_depth, timeout_s=DEADLINE_S)
    assert [k for k, _ in outcomes] == ["AgreementError"] * 2, outcomes
    assert outcomes[0][1] == outcomes[1][1], outcomes
    expected = "parameter model.layers.1.self_attn.q_proj.weight: rank 0 (64, 64) float32; rank 1 (missing)"
    assert expected in outcomes[0][1], f"expected {expected!r} in:\n{outcomes[0][1]}"


def _weights_unchecked(rank: int, world_size: int) -> tuple[str, str]:
    model, args, kwargs = _mlp(rank, seed=rank)
    return _outcome(lambda: autotp.compile(model, example_inputs=args, example_kwargs=kwargs,
                                           runtime=autotp.RuntimeOptions(check_weights=False)))


@pytest.mark.distributed
def test_check_weights_false_skips_the_checksums(gloo) -> None:
    """tp=2, different weights per rank and check_weights=False (documented opt-out): compile proceeds."""
    outcomes = gloo.run(2, _weights_unchecked, timeout_s=DEADLINE_S)
    assert outcomes == [("ok", ""), ("ok", "")], outcomes


def _late_rank(rank: int, world_size: int, timeout_s: float, gave_up: str) -> tuple[str, str, float]:
    """Rank 1 is stuck elsewhere until rank 0's compile has returned (``gave_up`` exists), however long rank 0
    took to trace before it began to wait."""
    model, args, kwargs = _mlp(rank)
    if rank == 1:
        deadline = time.monotonic() + DEADLINE_S / 2
        while not os.path.exists(gave_up) and time.monotonic() < deadline:
            time.sleep(0.05)
    started = time.monotonic()
    kind, message = _outcome(lambda: autotp.compile(model, example_inputs=args, example_kwargs=kwargs,
                                                    runtime=autotp.RuntimeOptions(agreement_timeout_s=timeout_s)))
    waited = time.monotonic() - started
    if rank == 0:
        with open(gave_up, "w"):
            pass
    return kind, message, waited


@pytest.mark.distributed
def test_a_rank_that_never_arrives_is_named(gloo, tmp_path) -> None:
    """tp=2, rank 1 reaches compile only after rank 0 gave up (agreement_timeout_s=2): rank 0 raises
    RankTimeoutError naming rank 1 after ~2 s; rank 1 finds rank 0's note and fails at once."""
    outcomes = gloo.run(2, _late_rank, 2.0, str(tmp_path / "rank 0 gave up"), timeout_s=DEADLINE_S)
    (kind0, message0, waited0), (kind1, message1, waited1) = outcomes
    assert kind0 == kind1 == "RankTimeoutError", outcomes
    assert "rank 1 did not arrive within 2 s" in message0, message0
    assert "after the other ranks had stopped waiting" in message1 and "rank 1 did not arrive" in message1, message1
    assert 1.5 <= waited0 < 30, f"rank 0 waited {waited0:.1f} s, expected about agreement_timeout_s=2"
    assert waited1 < 10, f"rank 1 should fail at once, took {waited1:.1f} s"
    # both ranks made one exchange, so the next compile on the same group still pairs them up
    assert gloo.run(2, _weights_unchecked, timeout_s=DEADLINE_S) == [("ok", ""), ("ok", "")]


class _Scaled(nn.Module):
    """``forward(x, scale=1.0, shift=False)``: non-tensor arguments that export bakes into the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor, scale: float = 1.0, shift: bool = False) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x))) * scale
        return y + 1 if shift else y


def _calls(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = _Scaled().eval()
    x = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(model, example_inputs=(x,), example_kwargs={"scale": 1.0, "shift": False},
                            runtime=autotp.RuntimeOptions(agreement_timeout_s=60.0))
    results = {
        "scale": _outcome(lambda: tp(x, scale=3.0, shift=False)),
        "shift": _outcome(lambda: tp(x, scale=1.0, shift=True)),
        # rank 1 calls with another sequence length, rank 0 with the traced one
        "shapes": _outcome(lambda: tp(x if rank == 0 else x[:, :2], scale=1.0, shift=False)),
    }
    with torch.no_grad():
        expected = model(x, scale=1.0, shift=False)
    results["same_after"] = (tp(x, scale=1.0, shift=False) - expected).abs().max().item()
    return results


@pytest.mark.distributed
def test_call_time_values_and_shapes(gloo) -> None:
    """tp=2: a call with scale=3.0 or shift=True where 1.0/False were traced raises TracedValueError (never the
    traced value silently); rank 1 calling with another input shape gives the same AgreementError on both
    ranks (was SIGABRT in gloo); the next correct call still matches the single-process model."""
    results = gloo.run(2, _calls, timeout_s=DEADLINE_S)
    for rank, result in enumerate(results):
        kind, message = result["scale"]
        assert kind == "TracedValueError" and "scale was 1.0 when the model was traced" in message \
            and "passes 3.0" in message, f"rank {rank}: {result['scale']}"
        kind, message = result["shift"]
        assert kind == "TracedValueError" and "shift was False" in message, f"rank {rank}: {result['shift']}"
        kind, message = result["shapes"]
        assert kind == "AgreementError", f"rank {rank}: expected AgreementError, got {result['shapes']}"
        assert "argument 0: rank 0 (2, 4, 32) float32; rank 1 (2, 2, 32) float32" in message, message
        assert result["same_after"] <= 1e-4, f"rank {rank}: max abs diff {result['same_after']:.3g} > 1e-4"
    assert results[0]["shapes"] == results[1]["shapes"], results


def _plan_by_path_or_dict(rank: int, world_size: int, directory: str) -> dict:
    model, args, kwargs = _mlp(rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autotp.plan(model, args, kwargs, world_size=world_size, options=autotp.PlanOptions(hardware="cpu-gloo"))
    path = f"{directory}/plan-{rank}.json"
    plan.save(path)
    tp = autotp.compile(model, example_inputs=args, plan=path)
    with torch.no_grad():
        diff = (tp(*args) - model(*args)).abs().max().item()
    as_dict = _outcome(lambda: autotp.compile(model, example_inputs=args, plan={"nodes": []}))
    return {"diff": diff, "applied": tp.plan.to_json() == plan.to_json(), "dict": as_dict}


@pytest.mark.distributed
def test_plan_given_as_a_path_or_a_dict(gloo, tmp_path) -> None:
    """tp=2: plan= a saved file's path is loaded and applied; plan= a dict raises TypeError saying what to pass."""
    results = gloo.run(2, _plan_by_path_or_dict, str(tmp_path), timeout_s=DEADLINE_S)
    for rank, result in enumerate(results):
        assert result["applied"] and result["diff"] <= 1e-4, f"rank {rank}: {result}"
        kind, message = result["dict"]
        assert kind == "TypeError" and "autotp.Plan.from_json(json.dumps(d))" in message, f"rank {rank}: {result}"


def _backend_weights(rank: int, world_size: int) -> tuple[str, str]:
    model, args, _ = _mlp(rank, seed=rank)
    compiled = torch.compile(model, backend=autotp.backend(runtime=autotp.RuntimeOptions(agreement_timeout_s=60.0)))
    try:
        return _outcome(lambda: compiled(*args))
    finally:
        torch._dynamo.reset()


@pytest.mark.distributed
def test_backend_ranks_agree_on_weights(gloo) -> None:
    """tp=2, torch.compile backend, rank 1 built with another seed: the same AgreementError on both ranks at the
    first call (was a silently wrong output)."""
    outcomes = gloo.run(2, _backend_weights, timeout_s=DEADLINE_S)
    assert [k for k, _ in outcomes] == ["AgreementError"] * 2, outcomes
    assert outcomes[0][1] == outcomes[1][1], outcomes
    assert "at torch.compile graph 0" in outcomes[0][1] and "weight 0.weight: rank 1" in outcomes[0][1], outcomes[0][1]


def _generation_depth(rank: int, world_size: int) -> tuple[str, str]:
    model, args, _ = tiny_llama(hidden=64, intermediate=128, num_heads=4, num_kv_heads=2, seq_len=4,
                                layers=2 if rank == 0 else 1)
    return _outcome(lambda: autotp.compile(model, example_inputs=args, max_cache_len=8))


@pytest.mark.distributed
def test_generation_ranks_agree_before_capturing(gloo) -> None:
    """tp=2, generation (max_cache_len=8), Llama with 2 layers on rank 0 and 1 on rank 1: the ranks agree before
    capturing the decode and prefill graphs, so both raise one AgreementError naming the missing layer."""
    outcomes = gloo.run(2, _generation_depth, timeout_s=DEADLINE_S)
    assert [k for k, _ in outcomes] == ["AgreementError"] * 2, outcomes
    assert outcomes[0][1] == outcomes[1][1], outcomes
    expected = "weight model.layers.1.mlp.down_proj.weight: rank 0 (64, 128) float32; rank 1 (missing)"
    assert expected in outcomes[0][1], f"expected {expected!r} in:\n{outcomes[0][1]}"


# --------------------------------------------------------------------------- no processes

def test_weight_checksum_tolerates_order_not_values() -> None:
    """No process group: the same values (another summation order) match; one changed element does not."""
    values = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
    same = values.clone()
    assert weight_checksum(values).matches(weight_checksum(same)), "identical tensors must match"
    changed = values.clone()
    changed[17, 3] += 1e-3
    first, second = weight_checksum(values), weight_checksum(changed)
    assert not first.matches(second), f"a changed element must not match: {first} vs {second}"


def test_records_without_a_graph_name_weight_shapes() -> None:
    """No process group, records of 3 ranks with weights only (generation agrees before it captures): a weight of
    another shape, one missing, and one with other values are each named with the ranks concerned."""
    from autotp.runtime.agreement.exchanges import CompileRecord, disagreement

    small, large = torch.randn(4, 3), torch.randn(8, 3)
    rank0 = CompileRecord(weights=(("w", weight_checksum(small)), ("v", weight_checksum(small))))
    rank1 = CompileRecord(weights=(("w", weight_checksum(large)),))
    found = disagreement([rank0, rank1, rank0])
    assert found is not None, "different weights must disagree"
    lines, hint = found
    expected = ["weight w: ranks 0, 2 (4, 3) float32; rank 1 (8, 3) float32",
                "weight v: ranks 0, 2 (4, 3) float32; rank 1 (missing)"]
    assert lines == expected, f"expected {expected}, got {lines}"
    assert "same model" in hint, hint
    rank1 = CompileRecord(weights=(("w", weight_checksum(small * 2)), ("v", weight_checksum(small))))
    found = disagreement([rank0, rank1])
    assert found is not None and found[0][0].startswith("weight w: rank 1 holds other values than rank 0"), found
    assert disagreement([rank0, rank0]) is None, "identical records must agree"


class _Activation(nn.Module):
    def __init__(self, activation: nn.Module) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(8, 16), activation, nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def test_graphs_that_differ_name_their_first_differing_node() -> None:
    """No process group, records of 3 ranks whose graphs differ in one op (ReLU on rank 1, SiLU elsewhere) with the
    same parameters and inputs: the disagreement names the first node that differs and what each rank has there."""
    from autotp.capture.tracing import capture
    from autotp.runtime.agreement.exchanges import compile_record, disagreement

    x = torch.randn(2, 8)
    silu, relu = (compile_record(capture(_Activation(act), (x,)), options={}, weights=None)
                  for act in (nn.SiLU(), nn.ReLU()))
    assert silu.fingerprint != relu.fingerprint, "the case must give two graphs"
    found = disagreement([silu, relu, silu])
    assert found is not None, "different graphs must disagree"
    lines, _ = found
    node = [line for line in lines if line.startswith("first differing node")]
    assert len(node) == 1, f"expected the first differing node named, got {lines}"
    assert "aten.silu.default" in node[0] and "aten.relu.default" in node[0] and "ranks 0, 2" in node[0], node[0]


def test_traced_values_guarded_without_a_process_group() -> None:
    """No process group (one rank): InputGuard refuses another value for a traced float and bool argument."""
    from autotp.capture.tracing import capture

    model = _Scaled().eval()
    x = torch.randn(2, 4, 32)
    captured = capture(model, (x,), {"scale": 2.0, "shift": True})
    guard = InputGuard(captured, group=None, timeout_s=1.0)
    guard.check([x, 2.0, True])  # the traced values: fine
    with pytest.raises(autotp.TracedValueError, match=r"scale was 2.0 when the model was traced.*passes 0.5"):
        guard.check([x, 0.5, True])
    with pytest.raises(autotp.TracedValueError, match=r"shift was True .* passes 1"):
        guard.check([x, 2.0, 1])  # 1 is not True: a bool argument given an int
    with pytest.raises(TypeError, match=r"argument 0 was a tensor when the model was traced"):
        guard.check([1.0, 2.0, True])


def test_model_that_is_not_a_module() -> None:
    """No process group: autotp.plan of a plain function says to pass an nn.Module."""
    with pytest.raises(TypeError, match=r"autotp needs a torch.nn.Module .* got builtin_function_or_method 'relu'"):
        autotp.plan(torch.relu, (torch.randn(2, 2),), world_size=2)


# --------------------------------------------------------------------------- the smaller ones (item 5)

def test_budget_error_names_the_replicate_constraint() -> None:
    """tp=2 plan, default budget, a Replicate() constraint that the default budget cannot hold: the error names the
    constraint and says to pass memory_budget=None, instead of blaming the budget alone."""
    model, args, kwargs = tiny_mlp(hidden=32, intermediate=64)
    with pytest.raises(autotp.PlanError) as caught:
        autotp.plan(model, args, kwargs, world_size=2, options=autotp.PlanOptions(constraints={"0.weight": autotp.Replicate()}))
    message = str(caught.value)
    for words in ("0.weight=Replicate()", "memory_budget='auto'", "memory_budget=None"):
        assert words in message, f"expected {words!r} in: {message}"
    assert "even with every parameter split" not in message, message


def _write_config(tmp_path, values: dict) -> str:
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    return str(path)


@pytest.mark.parametrize(("values", "expected"), [
    ({"model_type": "llama", "hidden_size": "big"}, "is not a valid llama config: Field 'hidden_size' expected int"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5},
     "is not a valid llama config: The hidden size (64) is not a multiple of the number of attention heads (5)"),
    ({"model_type": "lama"}, "model_type 'lama' is not an architecture transformers"),
])
def test_cli_reports_a_bad_hf_config_in_one_line(tmp_path, values: dict, expected: str) -> None:
    """No process group: `autotp plan config.json` with a bad value, a failing check or an unknown architecture
    raises SpecError with a short message (was a raw traceback, or a 10 KB list of architectures)."""
    from autotp.cli.plan import SpecError, load_spec

    with pytest.raises(SpecError) as caught:
        load_spec(_write_config(tmp_path, values))
    message = str(caught.value)
    assert expected in message, f"expected {expected!r} in: {message}"
    assert len(message) < 500, f"message is {len(message)} characters long: {message[:600]}"


def test_cli_builds_t5_and_mamba(tmp_path) -> None:
    """No process group: T5 (encoder-decoder) is built with its LM head and fed decoder tokens, Mamba (no attention)
    without SDPA; both were refused with a misleading hint."""
    from autotp.cli.plan import load_spec

    t5 = load_spec(_write_config(tmp_path, {"model_type": "t5", "d_model": 32, "num_layers": 1, "num_heads": 2,
                                            "d_ff": 64, "vocab_size": 100, "d_kv": 16}))
    model, args, kwargs = t5.build(1, 4)
    assert type(model).__name__ == "T5ForConditionalGeneration", type(model).__name__
    assert tuple(kwargs["decoder_input_ids"].shape) == (1, 4), kwargs
    mamba = load_spec(_write_config(tmp_path, {"model_type": "mamba", "hidden_size": 32, "num_hidden_layers": 1,
                                               "vocab_size": 100, "state_size": 4}))
    model, args, kwargs = mamba.build(1, 4)
    assert type(model).__name__ == "MambaForCausalLM", type(model).__name__


def test_hardware_json_with_an_unknown_field() -> None:
    """No process group: a hardware profile with a typo'd field is refused, naming the field and the likely one."""
    import json

    from autotp.cost_model import Hardware, get_hardware

    data = json.loads(get_hardware("h100-sxm").to_json())
    data["memory_bandwith_gbps"] = data.pop("memory_bandwidth_gbps")
    with pytest.raises(ValueError, match=r"unknown field 'memory_bandwith_gbps' \(did you mean 'memory_bandwidth_gbps'"):
        Hardware.from_dict(data)
