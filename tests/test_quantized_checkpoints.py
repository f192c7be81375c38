"""Quantized checkpoints: ``tp.save`` of a torchao-quantized model and ``autotp.load`` at another world size.

Tier (c), real gloo: a tiny Llama quantized in int8 (per-row scales) and int4 (IntxWeightOnlyConfig,
groups of 32) is compiled and saved at tp=2 (then tp=3) and loaded at tp=3 (then tp=2) into the same
model quantized on the meta device; the logits equal the single-process quantized model's within 1e-4
and each rank holds whole groups of scales.
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
    model, args, kwargs = tiny_llama(batch=2, seq_len=6, device=device)
    tq.quantize_(model, CONFIGS[scheme]())
    return model, args, kwargs


def _save_and_load(rank: int, world_size: int, schemes: list[str], source: str | None, target: str) -> dict[str, float]:
    """Load each scheme's model from ``source`` (or compile it from memory when None) at this world size,
    compare with the single-process quantized model, and save it to ``target``."""
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
        tp.save(f"{target}/{scheme}")
    return diffs


def test_quantized_save_and_load_at_other_world_sizes(gloo: Any, tmp_path: Path) -> None:
    """tp=2 -> save -> load at tp=3 -> save -> load at tp=2 (uneven: 8 groups of 32 over 3 ranks)."""
    schemes = list(CONFIGS)
    steps = [(2, None, "tp2"), (3, "tp2", "tp3"), (2, "tp3", "tp2b")]
    for world_size, source, target in steps:
        results = gloo.run(world_size, _save_and_load, schemes, source and str(tmp_path / source), str(tmp_path / target),
                           timeout_s=600)
        for rank, diffs in enumerate(results):
            for scheme, diff in diffs.items():
                assert diff <= 1e-4, (f"tp={world_size} from {source or 'memory'} rank {rank} {scheme}: "
                                      f"max |tp - quantized model| {diff:.3g}, expected <= 1e-4")
