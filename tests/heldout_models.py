"""Tiny causal LMs the cost model's accuracy is checked on and nothing else uses: Falcon and OPT.

Same conventions as :mod:`models`: random weights from a seed, eval mode, ``(model, (ids,), kwargs)``;
vocabulary 1000, 2 layers, hidden 256, batch 2, sequence 16, float32.
"""

from __future__ import annotations

from models import BATCH, SEQ_LEN, VOCAB_SIZE, ModelAndInputs, _build, _token_ids

__all__ = ["tiny_falcon", "tiny_opt"]


def tiny_falcon(num_heads: int = 8, hidden: int = 256, *, layers: int = 2, vocab_size: int = VOCAB_SIZE,
                batch: int = BATCH, seq_len: int = SEQ_LEN, seed: int = 0) -> ModelAndInputs:
    """FalconForCausalLM: fused query-key-value projection, multi-query attention, parallel attention and MLP."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=num_heads,
        multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False,
        max_position_embeddings=max(64, seq_len), attn_implementation="sdpa", use_cache=False,
    )
    model = _build(lambda: FalconForCausalLM(config), seed, "cpu")
    return model, (_token_ids(seed, batch, seq_len, vocab_size),), {"use_cache": False}


def tiny_opt(num_heads: int = 8, hidden: int = 256, *, layers: int = 2, ffn_dim: int = 1024,
             vocab_size: int = VOCAB_SIZE, batch: int = BATCH, seq_len: int = SEQ_LEN, seed: int = 0) -> ModelAndInputs:
    """OPTForCausalLM: learned positions (offset 2), pre-LayerNorm, ReLU MLP, biased projections, tied lm head."""
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=num_heads,
        ffn_dim=ffn_dim, word_embed_proj_dim=hidden, max_position_embeddings=max(64, seq_len),
        attn_implementation="sdpa", use_cache=False,
    )
    model = _build(lambda: OPTForCausalLM(config), seed, "cpu")
    return model, (_token_ids(seed, batch, seq_len, vocab_size),), {"use_cache": False}
