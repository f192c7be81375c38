"""Tier (c): splits that leave a rank an empty shard run, and equal the single-process model.

A split of ``n`` units over more than ``n`` ranks gives some ranks none (2 heads over 3 ranks:
1/1/0, ``passes/uneven.py``). Each case pins the split with ``constraints`` so the solver cannot
avoid it, asserts that some rank's local shard really is empty, then compares the output of every
rank with the single-process model (tolerance as ``tests/test_equivalence.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp

TOLERANCE = 1e-4
WORLD_SIZE = 3


class TwoUnitMLP(nn.Module):
    """Linear family: 2 intermediate features, fewer than ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 2), nn.Linear(2, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, 16)
        return self.down(F.gelu(self.up(x)) * 2.0 + 1.0)


class TwoHeadAttention(nn.Module):
    """Attention family (sdpa): 2 heads of 16, split by heads."""

    def __init__(self, hidden: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, hidden)
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (batch, heads, seq, head_dim)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class WindowAttention(nn.Module):
    """View/reshape family: windowed attention as in torchvision's Swin (a relative-position bias per head,
    a shift mask per window, ``view(-1, heads, N, N)``), with 2 heads."""

    def __init__(self, hidden: int = 32, heads: int = 2, windows: int = 4, tokens: int = 16) -> None:
        super().__init__()
        self.heads, self.windows = heads, windows
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.bias = nn.Parameter(torch.randn(heads, tokens, tokens))
        self.register_buffer("mask", torch.randn(windows, tokens, tokens))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch * windows, tokens, hidden)
        b_, n, c = x.shape
        qkv = self.qkv(x).reshape(b_, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (batch * windows, heads, tokens, head_dim)
        attn = (q * 0.25) @ k.transpose(-2, -1) + self.bias.unsqueeze(0)
        attn = attn.view(b_ // self.windows, self.windows, self.heads, n, n) + self.mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, self.heads, n, n).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b_, n, c))


class TwoChannelCNN(nn.Module):
    """Conv and norm families: 2 channels (convolution, batch norm, depthwise convolution, max pooling,
    upsampling), fewer than ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 2, 3, padding=1)
        self.norm = nn.BatchNorm2d(2)
        self.depthwise = nn.Conv2d(2, 2, 3, padding=1, groups=2)
        self.conv2 = nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # images: (batch, 3, 8, 8)
        h = F.max_pool2d(torch.relu(self.norm(self.conv1(images))), 2)
        h = F.interpolate(self.depthwise(h), scale_factor=2.0)
        return self.conv2(h)


class BatchStatsTwoChannels(nn.Module):
    """Norm family: batch norm with batch statistics (training mode) of 2 channels."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 2, 3, padding=1)
        self.norm = nn.BatchNorm2d(2, track_running_stats=False)
        self.conv2 = nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # images: (batch, 3, 8, 8)
        return self.conv2(self.norm(self.conv1(images)))


class QueryKeyNorm(nn.Module):
    """Norm family: layer norm of each head's query and key (over head_dim), 2 heads split by heads."""

    def __init__(self, hidden: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden // heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, hidden)
        b, s, _ = x.shape
        q = self.norm(self.q(x).view(b, s, self.heads, -1)).transpose(1, 2)  # (batch, heads, seq, head_dim)
        k = self.norm(self.k(x).view(b, s, self.heads, -1)).transpose(1, 2)
        return (q @ k.transpose(-2, -1)).softmax(-1).sum(1)  # (batch, seq, seq)


class NarrowEmbeddings(nn.Module):
    """Embedding family: 2-wide embeddings (split by columns), beside a 2-row vocabulary (kept whole: the
    vocabulary split is offered when every rank can hold a row, ``rules/embedding.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = nn.Embedding(2, 16)
        self.cols = nn.Embedding(10, 2)
        self.out = nn.Linear(2, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (batch, seq) in [0, 2)
        return self.rows(ids) + self.out(self.cols(ids * 4 + 1))


def _mlp() -> tuple[nn.Module, tuple, dict]:
    return TwoUnitMLP(), (torch.randn(2, 5, 16),), {}


def _attention() -> tuple[nn.Module, tuple, dict]:
    return TwoHeadAttention(), (torch.randn(2, 6, 32),), {}


def _window_attention() -> tuple[nn.Module, tuple, dict]:
    return WindowAttention(), (torch.randn(8, 16, 32),), {}


def _cnn() -> tuple[nn.Module, tuple, dict]:
    model = TwoChannelCNN().eval()
    with torch.no_grad():  # running statistics that are not the identity
        model.norm.running_mean.uniform_(-1.0, 1.0)
        model.norm.running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(2, 3, 8, 8),), {}


def _batch_stats() -> tuple[nn.Module, tuple, dict]:
    return BatchStatsTwoChannels().train(), (torch.randn(2, 3, 8, 8),), {}


def _query_key_norm() -> tuple[nn.Module, tuple, dict]:
    return QueryKeyNorm(), (torch.randn(2, 6, 32),), {}


def _embeddings() -> tuple[nn.Module, tuple, dict]:
    return NarrowEmbeddings(), (torch.randint(0, 2, (2, 5)),), {}


CASES: dict[str, tuple[Callable[[], tuple[nn.Module, tuple, dict]], dict[str, str], str]] = {
    # name: (builder, constraints, the parameter whose shard is empty on some rank)
    "linear": (_mlp, {"up.weight": "S(0)", "down.weight": "S(1)"}, "up.weight"),
    "sdpa": (_attention, {"q.weight": "S(0)", "k.weight": "S(0)", "v.weight": "S(0)", "o.weight": "S(1)"}, "q.weight"),
    "window_attention": (_window_attention, {"bias": "S(0)", "proj.weight": "S(1)"}, "bias"),
    "conv_norm_pool": (_cnn, {"conv1.weight": "S(0)", "norm.weight": "S(0)", "depthwise.weight": "S(0)",
                              "conv2.weight": "S(1)"}, "conv1.weight"),
    "batch_stats": (_batch_stats, {"conv1.weight": "S(0)", "norm.weight": "S(0)", "conv2.weight": "S(1)"},
                    "norm.weight"),
    "query_key_norm": (_query_key_norm, {"q.weight": "S(0)", "k.weight": "S(0)"}, "q.weight"),
    "embedding": (_embeddings, {"cols.weight": "S(1)", "out.weight": "S(1)"}, "cols.weight"),
}


def _run_case(rank: int, world_size: int, name: str, runtime_mode: str = "eager") -> dict:
    builder, constraints, _ = CASES[name]
    torch.manual_seed(0)
    model, args, kwargs = builder()
    # the same model at another batch size too: a -1 spelled out on an empty shard stays symbolic
    other = (torch.cat([args[0], args[0][: args[0].shape[0] // 2]]),)
    with torch.no_grad():
        expected = [model(*args, **kwargs), model(*other, **kwargs)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp_model = autotp.compile(model, example_inputs=args, example_kwargs=kwargs,
                                  options=autotp.PlanOptions(constraints=constraints),
                                  runtime=autotp.RuntimeOptions(runtime_mode=runtime_mode))
        got = [tp_model(*args, **kwargs), tp_model(*other, **kwargs)]
    local_shapes = {fqn: tuple(p.shape) for fqn, p in tp_model.named_parameters()}
    return {"max_diff": max((g - e).abs().max().item() for g, e in zip(got, expected)), "local_shapes": local_shapes}


@pytest.mark.parametrize("name", sorted(CASES))
def test_empty_shard_runs_and_matches(gloo, name: str) -> None:
    """tp=3, a split of 2 units (heads, channels, features, rows): one rank holds none; two batch sizes."""
    _check(gloo.run(WORLD_SIZE, _run_case, name), name)


@pytest.mark.parametrize("name", ["window_attention", "conv_norm_pool"])
def test_empty_shard_runs_compiled(gloo, name: str) -> None:
    """tp=3, 2 heads / 2 channels, runtime_mode="compiled" (Inductor): the rank with none runs its graph too."""
    _check(gloo.run(WORLD_SIZE, _run_case, name, "compiled"), name)


def _check(results: list[dict], name: str) -> None:
    _, _, param = CASES[name]
    if param is not None:
        shapes = [r["local_shapes"][param] for r in results]
        assert any(0 in shape for shape in shapes), f"{param}: expected some rank's shard to be empty, got {shapes}"
    diffs = [r["max_diff"] for r in results]
    assert max(diffs) < TOLERANCE, f"{name}: max abs difference per rank {diffs}, expected < {TOLERANCE}"
