"""Quantized checkpoints: ``tp.save`` / ``autotp.load`` of a torchao-quantized model, and ``from_pretrained``
of a float checkpoint with a ``TorchAoConfig``.

Tier (c), real gloo: a tiny Llama quantized in int8 (per-row scales) and int4 (IntxWeightOnlyConfig,
groups of 32) is compiled and saved at tp=2, loaded at tp=3 into the same model quantized on the meta
device and saved again, then loaded at tp=2: the logits equal the single-process quantized model's
within 1e-4 (8 groups of 32 over 3 ranks: 3/3/2). ``autotp.from_pretrained(float checkpoint,
quantization_config=TorchAoConfig(...))`` at tp=2 and tp=3 gives the logits of transformers' own
``from_pretrained`` with the same config (each rank quantizes its blocks as it reads them), and ``tp.generate``
its greedy tokens.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torchao.quantization as tq
from models import tiny_llama

import autotp

GROUP = 32
CONFIGS = {
    "int8": lambda: tq.Int8WeightOnlyConfig(),
    "int4group": lambda: tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=tq.PerGroup(GROUP)),
}


def _quantized_llama(scheme: str, device: str = "cpu") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], dict[str, Any]]:
    model, args, kwargs = tiny_llama(batch=2, seq_len=6, layers=1, device=device)
    tq.quantize_(model, CONFIGS[scheme]())
    return model, args, kwargs


NEW_TOKENS = 8
GENERATED = "int4group"
"""The scheme generated from: on this tiny Llama its greedy tokens differ from the float model's (checked), so
tokens of a generation graph that read the float weights would fail the comparison."""


def _greedy(model: torch.nn.Module, ids: torch.Tensor) -> list[list[int]]:
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False).tolist()


def _save_and_load(rank: int, world_size: int, schemes: list[str], source: str | None, target: str,
                   generate: bool) -> dict[str, float]:
    """Load each scheme's model from ``source`` (or compile it from memory when None) at this world size,
    compare with the single-process quantized model (with ``generate``, :data:`GENERATED`'s greedy tokens too:
    1.0 when they differ), and save it to ``target``."""
    diffs = {}
    for scheme in schemes:
        model, args, kwargs = _quantized_llama(scheme)
        with torch.no_grad():
            expected = model(*args, **kwargs).logits
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if source is None:
                tp = autotp.compile(model, example_inputs=args, example_kwargs=kwargs)
            else:
                meta_model, _, _ = _quantized_llama(scheme, device="meta")
                tp = autotp.load(f"{source}/{scheme}", meta_model, world_size=world_size, example_inputs=args,
                                 example_kwargs=kwargs)
        diffs[scheme] = (tp(*args, **kwargs).logits - expected).abs().max().item()
        if generate and scheme == GENERATED:  # graphs built from the checkpoint saved at another world size
            got, wanted = tp.generate(args[0][:1], max_new_tokens=NEW_TOKENS).tolist(), _greedy(model, args[0][:1])
            diffs[f"{scheme} tokens"] = float(got != wanted)
        tp.save(f"{target}/{scheme}")
    return diffs


def test_quantized_save_and_load_at_other_world_sizes(gloo: Any, tmp_path: Path) -> None:
    """tp=2 -> save -> load at tp=3 (int8 per-row, int4 in groups) -> save -> load at tp=2 (int4: the tp=3 save
    wrote 8 groups of 32 as 3/3/2 per rank; its greedy tokens equal the quantized model's)."""
    both = list(CONFIGS)
    steps = [(2, None, "tp2", both), (3, "tp2", "tp3", both), (2, "tp3", "tp2b", ["int4group"])]
    for world_size, source, target, schemes in steps:
        generate = target == "tp2b"
        results = gloo.run(world_size, _save_and_load, schemes, source and str(tmp_path / source), str(tmp_path / target),
                           generate, timeout_s=600)
        cases = sorted([*schemes, *([f"{GENERATED} tokens"] if generate else [])])
        assert all(sorted(diffs) == cases for diffs in results), f"tp={world_size}: cases run {results}"
        for rank, diffs in enumerate(results):
            for scheme, diff in diffs.items():
                what = ("greedy tokens differ from the quantized model's generate" if scheme.endswith("tokens") else
                        f"max |tp - quantized model| {diff:.3g}, expected <= 1e-4")
                assert diff <= 1e-4, f"tp={world_size} from {source or 'memory'} rank {rank} {scheme}: {what}"


def _reference(path: str, scheme: str) -> torch.nn.Module:
    """transformers' own from_pretrained of the float checkpoint with a TorchAoConfig."""
    from transformers import AutoModelForCausalLM, TorchAoConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=TorchAoConfig(CONFIGS[scheme]()),
                                                    dtype=torch.float32).eval()


def _from_pretrained(rank: int, world_size: int, schemes: list[str], path: str, saved: dict[str, str]) -> dict[str, Any]:
    """autotp.from_pretrained of the float checkpoint with quantization_config=..., and of the checkpoint transformers
    saved from its quantized model (``saved``), each against transformers' own quantized load: logits, and for
    :data:`GENERATED` greedy tokens of ``tp.generate`` (its graphs built from the same checkpoint)."""
    from transformers import TorchAoConfig

    diffs: dict[str, float] = {}
    tokens: dict[str, tuple[list[list[int]], list[list[int]]]] = {}
    for scheme in schemes:
        _, args, kwargs = tiny_llama(batch=2, seq_len=6, layers=1)
        reference = _reference(path, scheme)
        with torch.no_grad():
            expected = reference(*args, **kwargs).logits
        ids = args[0][:1]
        expected_tokens = _greedy(reference, ids) if scheme == GENERATED else None
        sources = {f"{scheme} from float": (path, TorchAoConfig(CONFIGS[scheme]()))}
        if scheme in saved:
            sources[f"{scheme} saved by transformers"] = (saved[scheme], None)
        for name, (source, config) in sources.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tp = autotp.from_pretrained(source, world_size=world_size, example_inputs=args, example_kwargs=kwargs,
                                            quantization_config=config)
            assert any("parametrizations" in fqn for fqn in tp.plan.parameters), f"{name}: no quantized weight in the plan"
            diffs[name] = (tp(*args, **kwargs).logits - expected).abs().max().item()
            if expected_tokens is not None:
                tokens[name] = (tp.generate(ids, max_new_tokens=NEW_TOKENS).tolist(), expected_tokens)
    return {"diffs": diffs, "tokens": tokens}


def test_from_pretrained_quantizes_a_float_checkpoint_as_transformers_does(gloo: Any, tmp_path: Path) -> None:
    """tp=2 (int4 in groups of 32) and tp=3 (that and int8 per-row; 8 groups over 3 ranks) from a float safetensors
    checkpoint, and at tp=3 from the checkpoints transformers' save_pretrained writes of its quantized models
    (parts as ``q_proj._weight_qdata``...): logits equal transformers' from_pretrained(path, quantization_config=...),
    and greedy tokens of int4 ``tp.generate`` equal its ``generate`` (which differ from the float model's)."""
    from transformers import AutoModelForCausalLM

    model, (ids, *_), _ = tiny_llama(layers=1)
    model.save_pretrained(tmp_path / "hf")
    saved = {}
    for scheme in CONFIGS:
        _reference(str(tmp_path / "hf"), scheme).save_pretrained(tmp_path / scheme)
        saved[scheme] = str(tmp_path / scheme)
    float_tokens = _greedy(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval(), ids[:1])
    quantized_tokens = _greedy(_reference(str(tmp_path / "hf"), GENERATED), ids[:1])
    assert quantized_tokens != float_tokens, "the int4 model generates the float model's tokens: the check cannot fail"
    for world_size, schemes, prequantized in ((2, [GENERATED], {}), (3, list(CONFIGS), saved)):
        results = gloo.run(world_size, _from_pretrained, schemes, str(tmp_path / "hf"), prequantized, timeout_s=600)
        for rank, result in enumerate(results):
            diffs, tokens = result["diffs"], result["tokens"]
            assert len(diffs) == len(schemes) + len(prequantized), f"tp={world_size}: cases run {sorted(diffs)}"
            assert len(tokens) == 1 + (GENERATED in prequantized), f"tp={world_size}: generated {sorted(tokens)}"
            for name, diff in diffs.items():
                assert diff <= 1e-4, (f"tp={world_size} rank {rank} {name}: max |tp - transformers' quantized model| "
                                      f"{diff:.3g}, expected <= 1e-4")
            for name, (got, expected) in tokens.items():
                assert got == expected, f"tp={world_size} rank {rank} {name}: tokens {got}, transformers' generate {expected}"


def test_reports_name_a_quantized_weight_and_its_parts() -> None:
    """tp=2, int8 MLP 64 -> 128 -> 32 (no process group): explain finds a quantized weight by its own name (its data
    part) and names it as the weight (``0.weight (qdata)``), in its readers' notes on each option too; the DOT graph and the HTML payload name parts so too,
    never ``parametrizations``."""
    from autotp.inspect.html import plan_payload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32)).eval()
    tq.quantize_(model, tq.Int8WeightOnlyConfig())
    plan = autotp.plan(model, (torch.randn(4, 64),), world_size=2)
    explained = str(autotp.explain(plan, "0.weight"))
    first = explained.splitlines()[0]
    assert first.startswith("0.weight (qdata) (parameter) [128, 64]: chose"), first
    assert "0.weight (qdata)" in explained.split("read by", 1)[1], explained  # the readers' notes name it too
    assert "parametrizations" not in explained and "original0" not in explained, explained
    dot = autotp.to_dot(plan, fold=False)
    labels = [line for line in dot.splitlines() if "label=" in line and "shape=box" in line]
    assert any('label="weight (scale)\\n' in line for line in labels), "\n".join(labels)
    assert not any('label="original' in line for line in labels), "\n".join(labels)
    names = {node["t"] for node in plan_payload(plan, "mlp")["nodes"] if node["t"]}
    assert {"0.weight (qdata)", "0.weight (scale)", "2.weight (qdata)"} <= names, sorted(names)
    assert not any("parametrizations" in name for name in names), sorted(names)
