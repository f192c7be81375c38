"""The one repeated-block detector (autotp.base.module_paths): the block a path lies in, a model's layer
blocks and layer lists, and which layers are identical.

Tier (a): modules built on the meta device and real tiny HF models from configs; no process group.
"""

from __future__ import annotations

import torch
from models import tiny_llama
from torch import nn

from autotp.base.module_paths import (
    block_name,
    block_of,
    block_path,
    differing_layer,
    layer_blocks,
    layer_lists,
    layer_signature,
    within,
)


class _Block(nn.Module):
    def __init__(self, width: int, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # differs between otherwise equal layers: not part of the signature
        self.proj = nn.Linear(width, width)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(2))


class _Stack(nn.Module):
    def __init__(self, layers: int = 3, width: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.layers = nn.ModuleList(_Block(width, i) for i in range(layers))
        self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU())


def test_block_path_and_within() -> None:
    """block_path inverts block_of; within matches whole segments only."""
    for path in ("model.layers.3.mlp.up_proj", "0.weight", "a.1b.2.c"):
        block = block_of(path)
        assert block is not None and block_path(*block) == block_name(path), (path, block)
    assert within("model.layers.1.mlp", "model.layers.1") and within("model.layers.1", "model.layers.1")
    assert not within("model.layers.10.mlp", "model.layers.1"), "layer 10 is not inside layer 1"


def test_layer_blocks_are_the_longest_numbered_container() -> None:
    """Three layers beat the head's two-module Sequential and each layer's two experts."""
    with torch.device("meta"):
        model = _Stack(layers=3)
    assert layer_blocks(model) == ["layers.0", "layers.1", "layers.2"], layer_blocks(model)
    assert layer_blocks(nn.Linear(2, 2)) == [], "a model without numbered containers has no layer blocks"
    with torch.device("meta"):
        top = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert layer_blocks(top) == ["0", "1", "2"], layer_blocks(top)


def test_layer_lists_outermost_first_and_identical_layers() -> None:
    """Two layers of two experts each: both lengths match 2, the layer list first; layer_idx is ignored,
    a wider projection is not."""
    with torch.device("meta"):
        model = _Stack(layers=2)
    assert layer_lists(model, 2) == ["layers", "layers.0.experts", "layers.1.experts"], layer_lists(model, 2)
    assert layer_lists(model, 5) == []
    assert differing_layer(model.layers) is None, "layers differing only in layer_idx are identical"
    with torch.device("meta"):
        model.layers.append(_Block(4, 2))
        model.layers[2].proj = nn.Linear(4, 8)
    assert differing_layer(model.layers) == 2, layer_signature(model.layers[2])
    model.layers[2].proj = nn.Linear(4, 4, device="meta")
    assert differing_layer(model.layers) is None, "the same projection again: identical"
    model.layers[2].register_forward_hook(lambda *_: None)
    assert differing_layer(model.layers) == 2, "a hook on one layer makes it differ"


def test_hf_decoder_layers() -> None:
    """A tiny Llama from its config: the decoder layers are the model's layer blocks, its one layer list."""
    model, _, _ = tiny_llama(layers=4, device="meta")
    blocks = layer_blocks(model)
    assert blocks == [f"model.layers.{i}" for i in range(4)], blocks
    assert layer_lists(model, model.config.num_hidden_layers) == ["model.layers"]
    assert differing_layer(model.get_submodule("model.layers")) is None
