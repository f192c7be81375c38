"""Tiny models with random weights for tests: built from configs, nothing downloaded.

Every builder returns ``(model, example_args, example_kwargs)`` with the model in eval mode, so
a test calls ``model(*example_args, **example_kwargs)``. Weights and inputs depend only on
``seed``: every rank of a multi-process test that calls the same builder gets identical weights
and inputs. The caller's global RNG state is left as it was.

Sizes are kept small so that a forward pass takes milliseconds on one CPU thread: vocabulary
1000, 2 layers, hidden size 256, batch 2, sequence 16, float32. ``device="meta"`` builds the model
without storage, for planning tests; the example inputs stay real CPU tensors.

``transformers`` is imported lazily, so this module imports (and ``tiny_mlp`` works) without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["BUILDERS", "ModelAndInputs", "tiny_bert", "tiny_gpt2", "tiny_llama", "tiny_mlp"]

ModelAndInputs = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]

VOCAB_SIZE = 1000
BATCH = 2
SEQ_LEN = 16


def _token_ids(seed: int, batch: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + 1)  # independent of the weights' stream
    return torch.randint(0, vocab_size, (batch, seq_len), generator=generator)  # (batch, seq)


def _build(factory: Callable[[], nn.Module], seed: int, device: str | torch.device) -> nn.Module:
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG untouched
        torch.manual_seed(seed)
        with torch.device(device):
            model = factory()
    return model.eval()


def tiny_llama(num_heads: int = 8, num_kv_heads: int = 4, hidden: int = 256, *, layers: int = 2,
               intermediate: int = 512, vocab_size: int = VOCAB_SIZE, batch: int = BATCH,
               seq_len: int = SEQ_LEN, seed: int = 0, device: str | torch.device = "cpu") -> ModelAndInputs:
    """LlamaForCausalLM: RMSNorm, RoPE, grouped-query attention (SDPA), gated SiLU MLP, untied lm head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max(64, seq_len), attn_implementation="sdpa", use_cache=False,
        tie_word_embeddings=False,
    )
    model = _build(lambda: LlamaForCausalLM(config), seed, device)
    return model, (_token_ids(seed, batch, seq_len, vocab_size),), {"use_cache": False}


def tiny_gpt2(num_heads: int = 8, hidden: int = 256, *, layers: int = 2, vocab_size: int = VOCAB_SIZE,
              batch: int = BATCH, seq_len: int = SEQ_LEN, seed: int = 0,
              device: str | torch.device = "cpu") -> ModelAndInputs:
    """GPT2LMHeadModel: LayerNorm, fused QKV Conv1D, GELU MLP, learned positions, lm head tied to wte."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size, n_positions=max(64, seq_len), n_embd=hidden, n_layer=layers,
        n_head=num_heads, attn_implementation="sdpa", use_cache=False,
    )
    model = _build(lambda: GPT2LMHeadModel(config), seed, device)
    return model, (_token_ids(seed, batch, seq_len, vocab_size),), {"use_cache": False}


def tiny_bert(num_heads: int = 8, hidden: int = 256, *, layers: int = 2, intermediate: int = 512,
              vocab_size: int = VOCAB_SIZE, batch: int = BATCH, seq_len: int = SEQ_LEN, seed: int = 0,
              device: str | torch.device = "cpu") -> ModelAndInputs:
    """BertModel (encoder + pooler): post-LayerNorm, bidirectional SDPA attention, GELU MLP."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=num_heads,
        intermediate_size=intermediate, max_position_embeddings=max(64, seq_len),
        attn_implementation="sdpa",
    )
    model = _build(lambda: BertModel(config), seed, device)
    return model, (_token_ids(seed, batch, seq_len, vocab_size),), {}


def tiny_mlp(hidden: int = 256, *, intermediate: int = 1024, batch: int = BATCH, seq_len: int = SEQ_LEN,
             seed: int = 0, device: str | torch.device = "cpu") -> ModelAndInputs:
    """Plain torch: Sequential(Linear(hidden, intermediate), GELU, Linear(intermediate, hidden))."""

    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(hidden, intermediate), nn.GELU(), nn.Linear(intermediate, hidden))

    model = _build(factory, seed, device)
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, seq_len, hidden, generator=generator)  # (batch, seq, hidden)
    return model, (x,), {}


BUILDERS: dict[str, Callable[..., ModelAndInputs]] = {
    "llama": tiny_llama,
    "gpt2": tiny_gpt2,
    "bert": tiny_bert,
    "mlp": tiny_mlp,
}
"""Name -> builder, for ``pytest.mark.parametrize("name", list(BUILDERS))``."""
