"""Models that keep their own state in module buffers and update it in place in ``forward``.

:class:`CachedTransformer` is a small decoder in the style of gpt-fast's ``Transformer`` (written from its
public design, not copied): RMSNorm, rotary embeddings as complex rotations, grouped-query attention, a
gated SiLU MLP, and per layer a KV cache of ``(max_batch, kv_heads, max_seq, head_dim)`` in two
``register_buffer`` tensors written with ``cache[:, :, input_pos] = new`` (``index_put``); q, k and v come
from three projections, or from one fused ``wqkv`` as in gpt-fast (``TransformerArgs.fused_qkv``). ``forward(idx,
input_pos)`` runs the tokens ``idx`` at positions ``input_pos``; the caller's loop does prefill on
``arange(T)`` and then one token per call. :func:`run_loop` is that loop.

:class:`RollingConv` keeps a convolution state (the last inputs of a causal depthwise convolution, as a
Mamba block does in decoding) and replaces it with ``state.copy_(...)`` every call.

Weights depend only on ``seed``, so every rank of a multi-process test builds the same model.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CachedTransformer", "RollingConv", "TransformerArgs", "run_loop", "tiny_cached_transformer"]


@dataclasses.dataclass(frozen=True)
class TransformerArgs:
    """Sizes of :class:`CachedTransformer`."""

    vocab_size: int = 256
    dim: int = 48
    n_layer: int = 2
    n_head: int = 6
    n_kv_head: int = 3
    intermediate: int = 96
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    fused_qkv: bool = False
    """One ``wqkv`` projection split into q, k and v (gpt-fast's layout) instead of three."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class KVCache(nn.Module):
    """Keys and values of one layer for ``max_batch`` rows and ``max_seq`` positions, as buffers."""

    def __init__(self, max_batch: int, max_seq: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (max_batch, kv_heads, max_seq, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype))

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # input_pos: (S,); k, v: (batch, kv_heads, S, head_dim)
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, input_pos] = k
        v_out[:, :, input_pos] = v
        return k_out, v_out


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``x`` (batch, S, heads, head_dim) rotated by ``freqs`` (S, head_dim // 2, 2): cos and sin per pair."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs = freqs.view(1, pairs.size(1), 1, pairs.size(3), 2)
    out = torch.stack([pairs[..., 0] * freqs[..., 0] - pairs[..., 1] * freqs[..., 1],
                       pairs[..., 1] * freqs[..., 0] + pairs[..., 0] * freqs[..., 1]], -1)
    return out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.args = args
        q_size, kv_size = args.n_head * args.head_dim, args.n_kv_head * args.head_dim
        if args.fused_qkv:
            self.wqkv = nn.Linear(args.dim, q_size + 2 * kv_size, bias=False)
        else:
            self.wq = nn.Linear(args.dim, q_size, bias=False)
            self.wk = nn.Linear(args.dim, kv_size, bias=False)
            self.wv = nn.Linear(args.dim, kv_size, bias=False)
        self.wo = nn.Linear(args.n_head * args.head_dim, args.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, mask: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        a = self.args
        batch, seq, _ = x.shape
        q_size, kv_size = a.n_head * a.head_dim, a.n_kv_head * a.head_dim
        if a.fused_qkv:
            q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(batch, seq, a.n_head, a.head_dim)
        k = k.view(batch, seq, a.n_kv_head, a.head_dim)
        v = v.view(batch, seq, a.n_kv_head, a.head_dim)
        q, k = rotate(q, freqs), rotate(k, freqs)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, S, head_dim)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)  # (batch, kv_heads, max_seq, head_dim)
        repeat = a.n_head // a.n_kv_head
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(batch, seq, a.n_head * a.head_dim))


class FeedForward(nn.Module):
    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.intermediate, bias=False)
        self.w3 = nn.Linear(args.dim, args.intermediate, bias=False)
        self.w2 = nn.Linear(args.intermediate, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, freqs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class CachedTransformer(nn.Module):
    """A gpt-fast-style decoder whose KV cache lives in its layers' buffers (see the module docstring)."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.max_seq = -1

    def setup_caches(self, max_batch: int, max_seq: int) -> None:
        """Empty caches of ``max_batch`` rows and ``max_seq`` positions, with the rotations and causal mask for them."""
        a = self.args
        dtype = self.output.weight.dtype
        self.max_seq = max_seq
        for block in self.layers:
            block.attention.kv_cache = KVCache(max_batch, max_seq, a.n_kv_head, a.head_dim, dtype)
        inv = 1.0 / a.rope_base ** (torch.arange(0, a.head_dim, 2).float() / a.head_dim)
        angles = torch.outer(torch.arange(max_seq).float(), inv)  # (max_seq, head_dim // 2)
        self.register_buffer("freqs", torch.stack([angles.cos(), angles.sin()], -1), persistent=False)
        self.register_buffer("causal_mask", torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool)),
                             persistent=False)

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        # idx: (batch, S) token ids; input_pos: (S,) their positions -> logits (batch, S, vocab)
        mask = self.causal_mask[None, None, input_pos]  # (1, 1, S, max_seq)
        freqs = self.freqs[input_pos]  # (S, head_dim // 2, 2)
        x = self.tok_embeddings(idx)
        for block in self.layers:
            x = block(x, input_pos, freqs, mask)
        return self.output(self.norm(x))


def tiny_cached_transformer(args: TransformerArgs | None = None, *, max_batch: int = 1, max_seq: int = 16,
                            seed: int = 0) -> CachedTransformer:
    """A :class:`CachedTransformer` with random weights from ``seed`` and empty caches, in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CachedTransformer(args or TransformerArgs())
        for name, p in model.named_parameters():  # larger weights than the default init: heads differ visibly
            if "norm" not in name:
                nn.init.normal_(p, std=0.2)
    model.setup_caches(max_batch, max_seq)
    return model.eval()


def run_loop(model: nn.Module, prompt: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """gpt-fast's loop: prefill ``prompt`` (batch, T) at ``arange(T)``, then ``steps`` greedy tokens, one per
    call at position ``T + i``. Returns every call's logits (prefill's first)."""
    seq = prompt.shape[1]
    with torch.no_grad():
        logits = [model(prompt, torch.arange(seq))]
        for i in range(steps):
            token = logits[-1][:, -1:].argmax(-1)  # (batch, 1)
            logits.append(model(token, torch.tensor([seq + i])))
    return logits


class RollingConv(nn.Module):
    """One decoding step of a causal depthwise convolution between two projections; the last ``kernel - 1``
    inputs of each channel are a buffer that every call reads and then replaces (``state.copy_``)."""

    def __init__(self, dim: int = 8, channels: int = 10, kernel: int = 4, batch: int = 2) -> None:
        super().__init__()
        self.up = nn.Linear(dim, channels)
        self.down = nn.Linear(channels, dim)
        self.weight = nn.Parameter(torch.randn(channels, kernel))
        self.register_buffer("state", torch.zeros(batch, channels, kernel - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, dim), one step
        h = self.up(x)  # (batch, channels)
        window = torch.cat([self.state, h.unsqueeze(-1)], -1)  # (batch, channels, kernel)
        self.state.copy_(window[:, :, 1:])
        return self.down(F.silu((window * self.weight).sum(-1)))
