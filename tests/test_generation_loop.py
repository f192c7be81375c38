"""The generation loop's stopping rules, without processes: eos and pad default to the model's ``generation_config``.

HF's ``model.generate`` stops a row at ``generation_config.eos_token_id`` and pads it with
``pad_token_id`` when the call names neither; ``tp.generate`` must do the same, or its tokens differ
from HF's as soon as a row draws eos (found in benchmarks/generate.py at batch 8).
"""

from __future__ import annotations

import torch

from autotp.capture.kv_cache import CacheLayout, generation_defaults
from autotp.runtime.generation.generate import generation_loop

VOCAB = 5
FAVOURITE = torch.tensor([2, 3])  # row 0 always draws token 2 (the eos below), row 1 token 3


def _decode_runner(phase: str):
    """A decode graph's stand-in: logits (batch, 1, vocab) whose argmax is each row's favourite token."""
    assert phase == "decode", f"expected only decode calls at prefill_len 1, got {phase!r}"
    return lambda inputs: torch.nn.functional.one_hot(FAVOURITE, VOCAB).float().unsqueeze(1)


def _greedy(layout: CacheLayout, **options: object) -> torch.Tensor:
    ids = torch.tensor([[1, 1], [1, 1]])
    out = generation_loop(layout, _decode_runner, ids, None, max_new_tokens=4, seed=None, streamer=None,
                          pick=lambda logits, generator: logits.argmax(-1), **options)  # type: ignore[arg-type]
    return out[:, 2:]


def test_eos_and_pad_default_to_the_models_generation_config() -> None:
    """Row 0 draws eos 2 first: with the config's eos=2, pad=0 it stops and pads; eos_token_id=[] turns that off."""
    layout = CacheLayout(batch_size=2, max_cache_len=8, prefill_len=1, vocab_size=VOCAB, eos_token_ids=(2,),
                         pad_token_id=0)
    defaults = _greedy(layout, eos_token_id=None, pad_token_id=None)
    assert defaults.tolist() == [[2, 0, 0, 0], [3, 3, 3, 3]], f"expected row 0 stopped at eos 2, got {defaults.tolist()}"
    named = _greedy(layout, eos_token_id=3, pad_token_id=4)
    assert named.tolist() == [[2, 2, 2, 2], [3, 4, 4, 4]], f"the call's eos/pad must win, got {named.tolist()}"
    off = _greedy(layout, eos_token_id=[], pad_token_id=None)
    assert off.tolist() == [[2, 2, 2, 2], [3, 3, 3, 3]], f"eos_token_id=[] must not stop, got {off.tolist()}"


def test_generation_defaults_read_the_config() -> None:
    """An int or a list eos id, and no config at all."""
    model = torch.nn.Linear(2, 2)
    assert generation_defaults(model) == ((), None)
    model.generation_config = type("Config", (), {"eos_token_id": [2, 7], "pad_token_id": 0})()
    assert generation_defaults(model) == ((2, 7), 0)
    model.generation_config.eos_token_id = 2
    assert generation_defaults(model) == ((2,), 0)
