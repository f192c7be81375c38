"""The model families the cost model's accuracy is measured on, by name (shared by the cost-model benchmarks).

Every family the project supports: the zoo of ``tests/models.py`` (with a CNN and a mixture of experts), the
generation families of ``tests/generation_models.py`` and two more causal LMs of ``tests/heldout_models.py``;
all tiny, random weights from a seed, nothing downloaded. ``DESIGN`` are the four the profile's terms were
designed on (each term was added to close a gap on one of them); ``WIDE`` are wider versions of two of them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

TESTS = str(Path(__file__).resolve().parent.parent / "tests")

DESIGN = ("mlp", "llama", "gpt2", "bert")
"""The families the profile's terms were designed on (the accuracy benchmark's default)."""
ZOO = ("mistral", "qwen2", "mixtral", "tied_lm", "cnn")
"""The rest of ``tests/models.py``."""
GENERATION = ("gemma", "phi", "gpt_neox", "starcoder2")
"""``tests/generation_models.py``."""
EXTRA = ("falcon", "opt")
"""``tests/heldout_models.py``."""
FAMILIES = DESIGN + ZOO + GENERATION + EXTRA
"""Every family, in the order tables list them."""
WIDE = {
    "llama_wide": dict(builder="llama", hidden=1024, intermediate=2816, num_heads=16, num_kv_heads=8, seq_len=64),
    "gpt2_wide": dict(builder="gpt2", hidden=768, num_heads=12, seq_len=128),
}
"""Wider versions of two zoo models: kernels far larger than any the calibration graphs' fit is tuned on."""
ORDER = FAMILIES + tuple(WIDE)


def build(name: str) -> tuple[Any, tuple, dict]:
    """``(model, args, kwargs)`` of the family (or wide model) ``name``."""
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    import generation_models
    import heldout_models
    from models import BUILDERS

    builders = {**BUILDERS, **{name: getattr(generation_models, f"tiny_{name}") for name in GENERATION},
                **{name: getattr(heldout_models, f"tiny_{name}") for name in EXTRA}}
    if name in WIDE:
        options = dict(WIDE[name])
        return builders[options.pop("builder")](**options)
    if name not in builders:
        raise ValueError(f"unknown model family {name!r}; choose from {', '.join(ORDER)}")
    return builders[name]()
