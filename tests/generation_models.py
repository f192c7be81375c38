"""Tiny causal LMs for generation tests, beyond tests/models.py: Gemma (MQA, one kv head), Phi, GPT-NeoX, StarCoder2.

Same conventions as :mod:`models`: random weights from a seed, eval mode, ``(model, (ids,), kwargs)``;
vocabulary 1000, 2 layers, hidden 256, batch 2, sequence 16, float32.
"""

from __future__ import annotations

from models import BATCH, SEQ_LEN, VOCAB_SIZE, ModelAndInputs, _build, _token_ids

__all__ = ["tiny_gemma", "tiny_gpt_neox", "tiny_phi", "tiny_starcoder2"]


def tiny_gemma(num_heads: int = 4, hidden: int = 256, *, layers: int = 2, intermediate: int = 512,
               vocab_size: int = VOCAB_SIZE, batch: int = BATCH, seq_len: int = SEQ_LEN, seed: int = 0) -> ModelAndInputs:
    """GemmaForCausalLM: multi-query attention (1 kv head), GeGLU MLP, scaled embeddings, tied lm head."""
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=num_heads, num_key_value_heads=1, head_dim=hidden // num_heads,
        max_position_embeddings=max(64, seq_len), attn_implementation="sdpa", use_cache=False,
    )
    model = _build(lambda: GemmaForCausalLM(config), seed, "cpu")
    return model, (_token_ids(seed, batch, seq_len, vocab_size),), {"use_cache": False}


def tiny_phi(num_heads: int = 8, hidden: int = 256, *, layers: int = 2, intermediate: int = 512,
             vocab_size: int = VOCAB_SIZE, batch: int = BATCH, seq_len: int = SEQ_LEN, seed: int = 0) -> ModelAndInputs:
    """PhiForCausalLM: parallel attention and MLP blocks, partial rotary embedding, biased projections."""
    from transformers import PhiConfig, PhiForCausalLM

    config = PhiConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=num_heads, max_position_embeddings=max(64, seq_len), attn_implementation="sdpa",
        use_cache=False,
    )
    model = _build(lambda: PhiForCausalLM(config), seed, "cpu")
    return model, (_token_ids(seed, batch, seq_len, vocab_size),), {"use_cache": False}


def tiny_gpt_neox(num_heads: int = 8, hidden: int = 256, *, layers: int = 2, intermediate: int = 512,
                  vocab_size: int = VOCAB_SIZE, batch: int = BATCH, seq_len: int = SEQ_LEN,
                  seed: int = 0) -> ModelAndInputs:
    """GPTNeoXForCausalLM: fused query-key-value projection, partial rotary embedding, parallel residual."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=num_heads, max_position_embeddings=max(64, seq_len), attn_implementation="sdpa",
        use_cache=False,
    )
    model = _build(lambda: GPTNeoXForCausalLM(config), seed, "cpu")
    return model, (_token_ids(seed, batch, seq_len, vocab_size),), {"use_cache": False}


def tiny_starcoder2(num_heads: int = 8, num_kv_heads: int = 2, hidden: int = 256, *, layers: int = 2,
                    intermediate: int = 512, vocab_size: int = VOCAB_SIZE, batch: int = BATCH,
                    seq_len: int = SEQ_LEN, seed: int = 0) -> ModelAndInputs:
    """Starcoder2ForCausalLM: grouped-query attention with biases, LayerNorm, a GELU MLP, tied lm head."""
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    config = Starcoder2Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_position_embeddings=max(64, seq_len),
        attn_implementation="sdpa", use_cache=False,
    )
    model = _build(lambda: Starcoder2ForCausalLM(config), seed, "cpu")
    return model, (_token_ids(seed, batch, seq_len, vocab_size),), {"use_cache": False}
