"""Training under one automatic plan (``autotp.compile(..., training=True)``), on real gloo ranks.

Gradients are compared in float64, so a difference above 1e-5 relative is a wrong adjoint (a
missing all-reduce doubles or halves a gradient; a wrong block moves it), never rounding.
"""

from __future__ import annotations

import warnings

import models
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


def _build(family: str) -> tuple[torch.nn.Module, torch.Tensor, dict]:
    model, (ids,), kwargs = FAMILIES[family]()
    return model.double(), ids, {**kwargs, "labels": ids}


def _local_block_of(full: torch.Tensor, block: tuple[int, list[tuple[int, int]]] | None) -> torch.Tensor:
    """This rank's block of ``full`` as :func:`autotp.runtime.module.local_block` places it."""
    if block is None:
        return full
    dim, ranges = block
    return torch.cat([full.narrow(dim, start, stop - start) for start, stop in ranges], dim)


def _gradients_match(rank: int, world_size: int, families: list[str]) -> dict[str, dict]:
    """For each family: the worst relative gradient error of this rank's parameters, the names not
    compared, and a fingerprint of the replicated parameters' gradients (to compare across ranks)."""
    out = {}
    for family in families:
        model, ids, kwargs = _build(family)
        model.zero_grad()
        model(ids, **kwargs).loss.backward()
        expected = {name: p.grad for name, p in model.named_parameters()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp = autotp.compile(model, example_inputs=(ids,), example_kwargs=kwargs, training=True)
        loss = tp(ids, **kwargs).loss
        loss.backward()
        worst, worst_name, missing, replicated = 0.0, "", [], []
        for name, param in tp.named_parameters():
            if param.grad is None:
                missing.append(name)
                continue
            _, blocks = tp.layout[name]
            want = _local_block_of(expected[name], None if blocks is None else blocks[rank])
            scale = want.abs().max().item() or 1.0
            error = (param.grad - want).abs().max().item() / scale
            if error > worst:
                worst, worst_name = error, name
            if blocks is None:
                replicated.append(param.grad.double().sum().item())
        out[family] = {"worst": worst, "worst_name": worst_name, "missing": missing, "replicated": replicated,
                       "loss": loss.item(), "expected_loss": model(ids, **kwargs).loss.item(),
                       "names": sorted(n for n, _ in tp.named_parameters())}
    return out


def test_llama_gradients_tp2(gloo) -> None:
    """tp=2, Llama (GQA, gated MLP, untied head): each shard's gradient is the matching block of the
    single-process gradient, replicated parameters have the same whole gradient on every rank."""
    results = gloo.run(2, _gradients_match, ["llama"])
    _check_gradients(results, ["llama"])


def _check_gradients(results: list[dict], families: list[str]) -> None:
    for family in families:
        for rank, per_family in enumerate(results):
            r = per_family[family]
            assert not r["missing"], f"{family} rank {rank}: parameters without a gradient: {r['missing']}"
            assert r["worst"] <= GRAD_RTOL, (
                f"{family} rank {rank}: gradient of {r['worst_name']} off by {r['worst']:.3g} relative, expected "
                f"<= {GRAD_RTOL}")
            assert abs(r["loss"] - r["expected_loss"]) <= 1e-9 * abs(r["expected_loss"]), (
                f"{family} rank {rank}: loss {r['loss']} != single-process {r['expected_loss']}")
            assert r["replicated"] == results[0][family]["replicated"], (
                f"{family}: replicated gradients differ between rank 0 and rank {rank}: "
                f"{results[0][family]['replicated']} vs {r['replicated']}")
