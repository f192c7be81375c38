"""Generation straight from a checkpoint: ``from_pretrained(path).generate``, ``load(saved).generate`` and
``compile(meta_model, checkpoint=path, max_cache_len=N)``, each rank reading only its blocks.

Tier (c): a tiny HF model is written once by the test process (``save_pretrained``, random weights from a
seed) and its greedy tokens computed there with HF ``generate``; the gloo ranks build the model on meta and
read their blocks of the same files. Every read of a safetensors tensor is counted in the workers (a spy on
:func:`autotp.runtime.checkpoints.loading.read_block` that still reads), so the test sees which blocks each rank read.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from models import tiny_llama

import autotp
from autotp.runtime.checkpoints import loading

NEW_TOKENS = 8
PROMPT = 6
CACHE_LEN = 32  # compile(..., max_cache_len=): prompt + new tokens fit
LAYERS = 4  # as a real model's many: each graph is traced with three layers on meta and the fourth stamped


def _model() -> torch.nn.Module:
    """tiny Llama, four layers: 8 heads, 4 kv heads (uneven at tp 3), untied lm head, HF's default use_cache=True."""
    model = tiny_llama(layers=LAYERS)[0]
    model.config.use_cache = True
    model.generation_config.pad_token_id = 0  # no "setting pad_token_id" warning from HF generate
    return model


def _prompt() -> torch.Tensor:
    return tiny_llama()[1][0][:, :PROMPT]  # (batch 2, 6) token ids


class _ReadCounter:
    """Counts the bytes of every tensor block read from a safetensors file, by checkpoint key, while active."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, int]] = []

    def __enter__(self) -> _ReadCounter:
        self._read_block = loading.read_block

        def counted(entry: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            value = self._read_block(entry, *args, **kwargs)
            self.reads.append((entry.key, value.numel() * value.element_size()))
            return value

        loading.read_block = counted  # a spy in this worker only (it still reads)
        return self

    def __exit__(self, *exc: object) -> None:
        loading.read_block = self._read_block


def _blocks_read(counter: _ReadCounter, built: autotp.TensorParallelModule) -> dict[str, Any]:
    """What one generation build read, against what it holds: the keys read (in order), and those whose bytes
    differ from this rank's tensor."""
    held = {fqn.removeprefix("model."): t.numel() * t.element_size() for fqn, t in built.local_state().items()}
    return {"keys": [key for key, _ in counter.reads], "bytes": sum(size for _, size in counter.reads),
            "differ": [(key, size, held.get(key)) for key, size in counter.reads if held.get(key) != size]}


def _generate_from_checkpoint(rank: int, world_size: int, pretrained: str, saved: str) -> dict[str, Any]:
    """tp 2: from_pretrained then generate, tp.save, compile(meta, checkpoint=, max_cache_len=); tp 3: load of the
    saved directory then generate."""
    ids = _prompt()
    results: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if world_size == 3:
            meta = tiny_llama(layers=LAYERS, device="meta")[0]
            meta.config.use_cache = True
            tp = autotp.load(saved, meta, world_size=world_size, example_inputs=(ids,))
            results["load"] = {"tokens": tp.generate(ids, max_new_tokens=NEW_TOKENS).tolist(),
                               "held": tp.generation_on_demand.built.parameter_bytes()}
            return results
        tp = autotp.from_pretrained(pretrained, world_size=world_size)  # the first call: 1 x 16 example ids
        with _ReadCounter() as counter:
            tokens = tp.generate(ids, max_new_tokens=NEW_TOKENS)
        built = tp.generation_on_demand.built
        held, state = tp.local_state(), built.local_state()
        results["from_pretrained"] = {"tokens": tokens.tolist(), "read": _blocks_read(counter, built),
                                      "meta_left": [k for k, v in state.items() if v.device.type == "meta"],
                                      "reused": sorted(k for k, v in held.items() if state.get("model." + k) is v)}
        tp.save(saved)
        del tp, built
        with _ReadCounter() as counter:
            tp = autotp.compile(tiny_llama(layers=LAYERS, device="meta")[0], world_size=world_size, example_inputs=(ids,),
                                checkpoint=pretrained, max_cache_len=CACHE_LEN)
        results["compile"] = {"tokens": tp.generate(ids, max_new_tokens=NEW_TOKENS).tolist(),
                              "read": _blocks_read(counter, tp), "cache": tp.cache_bytes()}
    return results


def _check(results: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    world_size = len(results)
    full = expected["bytes"]
    for rank, result in enumerate(results):
        for case, got in result.items():
            where = f"tp={world_size} rank {rank}, {case}"
            assert got["tokens"] == expected["tokens"], (
                f"{where}: tokens differ from HF generate:\n expected {expected['tokens']}\n got {got['tokens']}")
            read = got.get("read")
            if read is not None:  # every weight read once (or its block taken from the forward module), this rank's
                reused = got.get("reused", [])  # block of it only
                assert sorted(read["keys"] + reused) == expected["keys"], (
                    f"{where}: read {sorted(read['keys'])} and took {reused} from the forward module, expected each "
                    f"of {expected['keys']} once")
                assert not read["differ"], f"{where}: (key, bytes read, bytes held) differ: {read['differ'][:4]}"
                assert read["bytes"] < 0.75 * full, f"{where}: read {read['bytes']} of {full} bytes"
            if "reused" in got:
                assert got["reused"], f"{where}: the generation graphs took no block from the forward module"
            if "held" in got:
                assert got["held"] < 0.5 * full, f"{where}: holds {got['held']} of {full} bytes (about a third expected)"
            if "cache" in got:  # 4 kv heads: split by heads, made on each rank in its block only
                assert got["cache"] < expected["cache"], (
                    f"{where}: a {got['cache']}-byte cache of {expected['cache']} bytes in all")
            assert not got.get("meta_left"), f"{where}: left on meta: {got['meta_left']}"


def _expected(directory: Path) -> dict[str, Any]:
    """Write the checkpoint; HF greedy tokens of it, its keys, its parameters' bytes, a whole 2 x 32 cache's bytes."""
    from safetensors import safe_open

    model = _model()
    model.save_pretrained(directory)
    ids = _prompt()
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        keys = sorted(handle.keys())
    return {"tokens": tokens.tolist(), "keys": keys, "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "cache": 2 * config.num_hidden_layers * ids.shape[0] * config.num_key_value_heads * CACHE_LEN * head_dim * 4}


@pytest.mark.distributed
def test_generate_from_checkpoint(gloo, tmp_path: Path) -> None:
    """tp=2, tiny Llama (8 heads, 4 kv heads): from_pretrained(path, world_size=2).generate and compile(meta_model,
    checkpoint=path, max_cache_len=32).generate give HF's greedy tokens; each generation build reads every
    weight once, this rank's block only (after from_pretrained, only the blocks the forward module does not
    hold: the others are its very tensors) and makes the cache in this rank's blocks; tp=3 (uneven heads):
    load of the tp=2 model's tp.save directory, then generate, gives them too."""
    expected = _expected(tmp_path / "hf")
    _check(gloo.run(2, _generate_from_checkpoint, str(tmp_path / "hf"), str(tmp_path / "saved")), expected)
    _check(gloo.run(3, _generate_from_checkpoint, str(tmp_path / "hf"), str(tmp_path / "saved")), expected)
