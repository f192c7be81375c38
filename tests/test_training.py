"""Training under one automatic plan (``autotp.compile(..., training=True)``), on real gloo ranks.

Gradients are compared in float64 (Mixtral: float32, ~1e-6 rounding), so a difference above 1e-5
relative (to the tensor's largest gradient) is a wrong adjoint (a missing all-reduce doubles or halves
a gradient; a wrong block moves it), never rounding.
"""

from __future__ import annotations

import warnings

import models
import pytest
import torch

import autotp

GRAD_RTOL = 1e-5
LOSS_RTOL = 1e-4

# tiny configs: 2 layers, hidden 48 (heads split 4/4/4 at tp=3, 3/3/3/3 at tp=4 after padding-free cuts)
_SMALL = {"hidden": 48, "layers": 2, "vocab_size": 96, "seq_len": 8}
FAMILIES = {
    "gpt2": lambda: models.tiny_gpt2(num_heads=4, **_SMALL),
    "llama": lambda: models.tiny_llama(num_heads=4, num_kv_heads=2, intermediate=96, **_SMALL),
    "bert": lambda: models.tiny_bert_mlm(num_heads=4, intermediate=96, **_SMALL),
    "mixtral": lambda: models.tiny_mixtral(num_heads=4, num_kv_heads=2, intermediate=32, **_SMALL),
}
FLOAT32 = {"mixtral"}
DROPOUT = {"gpt2"}  # run in training mode: GPT-2's default dropout 0.1 (embedding, attention, residual)
SEED = 1234  # torch._grouped_mm (transformers' default experts) takes float32/bfloat16 only


def _build(family: str) -> tuple[torch.nn.Module, torch.Tensor, dict]:
    model, (ids,), kwargs = FAMILIES[family]()
    return model if family in FLOAT32 else model.double(), ids, {**kwargs, "labels": ids}


def _local_block_of(full: torch.Tensor, block: tuple[int, list[tuple[int, int]]] | None) -> torch.Tensor:
    """This rank's block of ``full`` as :func:`autotp.runtime.execution.module.local_block` places it."""
    if block is None:
        return full
    dim, ranges = block
    return torch.cat([full.narrow(dim, start, stop - start) for start, stop in ranges], dim)


def _gradients_match(rank: int, world_size: int, families: list[str], trace_cache: str) -> dict[str, dict]:
    """For each family: the worst relative gradient error of this rank's parameters, the names not
    compared, and a fingerprint of the replicated parameters' gradients (to compare across ranks). Compiled
    through ``trace_cache`` (the tests' shared directory): the programs traced at the first world size are
    rebuilt at the others (a trace depends on the model and its inputs, not on the world size)."""
    out = {}
    for family in families:
        model, ids, kwargs = _build(family)
        if family in DROPOUT:
            model.train()
        torch.manual_seed(SEED)
        expected_loss = model(ids, **kwargs).loss
        expected_loss.backward()
        expected = {name: p.grad for name, p in model.named_parameters(remove_duplicate=False)}
        torch.manual_seed(SEED)  # compile checks that the ranks' generators agree (the graph has dropout)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # static shapes: the gradients do not depend on them, and a static trace is ~3x faster
            # (one compile serving every shape is tests/test_shapes.py's)
            tp = autotp.compile(model, example_inputs=(ids,), example_kwargs=kwargs,
                                options=autotp.PlanOptions(dynamic=False, training=True),
                                runtime=autotp.RuntimeOptions(trace_cache=trace_cache))
        torch.manual_seed(SEED)  # the same dropout masks as the single-process step
        loss = tp(ids, **kwargs).loss
        loss.backward()
        worst, worst_name, missing, replicated = 0.0, "", [], []
        for name, param in tp.named_parameters():
            if param.grad is None:
                missing.append(name)
                continue
            _, blocks = tp.layout[name]
            want = _local_block_of(expected[name], None if blocks is None else blocks[rank])
            assert param.grad.shape == want.shape, f"{name}: gradient {tuple(param.grad.shape)}, block {tuple(want.shape)}"
            if want.numel() == 0:  # more ranks than rows (2 kv heads over 3 ranks): this rank holds none
                continue
            scale = max(want.abs().max().item(), 1e-9)  # a zero gradient (a key bias under softmax) is rounding noise
            error = (param.grad - want).abs().max().item() / scale
            if error > worst:
                worst, worst_name = error, name
            if blocks is None:
                replicated.append(param.grad.double().sum().item())
        out[family] = {"worst": worst, "worst_name": worst_name, "missing": missing, "replicated": replicated,
                       "loss": loss.item(), "expected_loss": expected_loss.item(),
                       "names": sorted(n for n, _ in tp.named_parameters())}
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gradients_match_single_process(gloo, world_size: int, trace_cache: str) -> None:
    """tp=2, 3 (uneven: 2 kv heads, 4 heads, vocab 96 over 3 ranks) and 4; GPT-2 (tied head, dropout 0.1
    in training mode, same seed), Llama (GQA, untied head), BERT masked LM, Mixtral (top-2 of 4 experts):
    each shard's gradient is the matching block of the single-process gradient, the loss is the
    single-process loss, and replicated parameters have the same whole gradient on every rank."""
    families = list(FAMILIES)
    _check_gradients(gloo.run(world_size, _gradients_match, families, trace_cache), families)


def _check_gradients(results: list[dict], families: list[str]) -> None:
    for family in families:
        for rank, per_family in enumerate(results):
            r = per_family[family]
            assert not r["missing"], f"{family} rank {rank}: parameters without a gradient: {r['missing']}"
            assert r["worst"] <= GRAD_RTOL, (
                f"{family} rank {rank}: gradient of {r['worst_name']} off by {r['worst']:.3g} relative, expected "
                f"<= {GRAD_RTOL}")
            assert abs(r["loss"] - r["expected_loss"]) <= 1e-6 * abs(r["expected_loss"]), (
                f"{family} rank {rank}: loss {r['loss']} != single-process {r['expected_loss']}")
            assert r["replicated"] == results[0][family]["replicated"], (
                f"{family}: replicated gradients differ between rank 0 and rank {rank}: "
                f"{results[0][family]['replicated']} vs {r['replicated']}")


def _loss_curve(rank: int, world_size: int, steps: int, mistakes: bool,
                trace_cache: str) -> tuple[list[tuple[float, float]], dict]:
    """(tensor-parallel loss, single-process loss) at each of ``steps`` AdamW steps on fixed data; with
    ``mistakes``, then the messages of the mistakes a training user makes (see :func:`_mistakes`). The training
    compile goes through ``trace_cache``, as :func:`_gradients_match`'s."""
    torch.manual_seed(0)
    reference, ids, kwargs = _build("llama")
    model, _, _ = _build("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # static shapes: the data has one size, and the mistakes below include a step at another
        tp = autotp.compile(model, example_inputs=(ids,), example_kwargs=kwargs,
                            options=autotp.PlanOptions(dynamic=False, training=True),
                            runtime=autotp.RuntimeOptions(trace_cache=trace_cache))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (tp, reference)]
    losses = []
    for _ in range(steps):
        step = []
        for m, opt in zip((tp, reference), optimizers):
            loss = m(ids, **kwargs).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            step.append(loss.item())
        losses.append((step[0], step[1]))
    full = tp.full_state_dict()
    expected = reference.state_dict()
    assert full.keys() == expected.keys(), f"full_state_dict keys {sorted(set(full) ^ set(expected))} differ"
    worst = max((full[k] - expected[k]).abs().max().item() / (expected[k].abs().max().item() or 1.0) for k in full)
    assert worst <= LOSS_RTOL, f"weights after {steps} steps differ from single-process by {worst:.3g} relative"
    return losses, _mistakes(model, tp, ids, kwargs) if mistakes else {}


def _mistakes(model: torch.nn.Module, tp: torch.nn.Module, ids: torch.Tensor, kwargs: dict) -> dict[str, str]:
    """The messages of: backward() through a model compiled for inference, an optimizer over the
    original model's parameters, a step without the traced labels, a step at an untraced size."""
    from autotp.base.errors import InputShapeError

    messages = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inference = autotp.compile(model, example_inputs=(ids,), example_kwargs=kwargs)
    try:
        inference(ids, **kwargs).loss.backward()
    except RuntimeError as exc:
        messages["backward_through_inference"] = str(exc)
    optimizer = torch.optim.AdamW(model.parameters())
    tp(ids, **kwargs).loss.backward()
    try:
        optimizer.step()
    except RuntimeError as exc:
        messages["optimizer_over_original"] = str(exc)
    try:
        tp(ids, use_cache=False)
    except TypeError as exc:
        messages["missing_labels"] = str(exc)
    longer = torch.cat([ids, ids], dim=1)
    try:
        tp(longer, use_cache=False, labels=longer)
    except InputShapeError as exc:
        messages["static_dim"] = str(exc)
    return messages


@pytest.mark.parametrize("world_size", [2, 3])
def test_loss_curve_matches_single_process(gloo, world_size: int, trace_cache: str) -> None:
    """tp=2 and tp=3 (uneven: 2 kv heads, 96 MLP columns over 3 ranks), Llama, 50 AdamW steps on fixed
    data: the loss at every step equals the single-process loss, and full_state_dict() the trained
    weights. At tp=2 also: backward() through a model compiled for inference, an optimizer over the
    original model's parameters, a step without the traced labels and one at a sequence length a
    static plan was not made for each raise an error that names the fix."""
    curve, messages = gloo.run(world_size, _loss_curve, 50, world_size == 2, trace_cache)[0]
    for step, (got, want) in enumerate(curve):
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"tp={world_size} step {step}: loss {got} != {want}"
    assert curve[-1][1] < 0.5 * curve[0][1], f"the loss did not fall: {curve[0][1]} -> {curve[-1][1]}"
    if world_size != 2:
        return
    fixes = {
        "backward_through_inference": "training=True",
        "optimizer_over_original": "tp.parameters()",
        "missing_labels": "labels",
        "static_dim": "dynamic=True",
    }
    for case, fix in fixes.items():
        assert case in messages, f"{case}: no error raised (messages: {sorted(messages)})"
        assert fix in messages[case], f"{case}: the message does not name {fix!r}: {messages[case]}"
