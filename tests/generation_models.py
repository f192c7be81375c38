"""Tiny causal LMs for generation tests, beyond tests/models.py: Gemma (MQA, one kv head), Phi, GPT-NeoX, StarCoder2,
DeepSeek-V3 (multi-head latent attention), GPT-OSS (attention sinks, sliding window layers), and the families whose
state is not a KV cache (Mamba, Mamba2, Jamba, Qwen3-Next, Falcon-H1, RecurrentGemma: :data:`RECURRENT_STATE`).

Same conventions as :mod:`models`: random weights from a seed, eval mode, ``(model, (ids,), kwargs)``;
vocabulary 1000, 2 layers, hidden 256, batch 2, sequence 16, float32.
"""

from __future__ import annotations

from typing import Any

from models import BATCH, SEQ_LEN, VOCAB_SIZE, ModelAndInputs, _build, _token_ids

__all__ = ["RECURRENT_GENERATES", "RECURRENT_STATE", "tiny_deepseek_v3", "tiny_gemma", "tiny_gpt_neox", "tiny_gpt_oss", "tiny_phi",
           "tiny_recurrent", "tiny_starcoder2"]


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


def tiny_deepseek_v3(num_heads: int = 4, hidden: int = 128, *, layers: int = 2, dense_layers: int = 1,
                     vocab_size: int = VOCAB_SIZE, batch: int = BATCH, seq_len: int = SEQ_LEN,
                     seed: int = 0) -> ModelAndInputs:
    """DeepseekV3ForCausalLM: multi-head latent attention (keys 16 + 8 rope dims, values 32 dims per head, a
    48-dim latent), ``dense_layers`` dense layers, then MoE layers (4 routed experts, top 2, a shared expert)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=num_heads, num_key_value_heads=num_heads, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=dense_layers, kv_lora_rank=48, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=32, max_position_embeddings=max(64, seq_len),
        attn_implementation="sdpa", use_cache=False,
    )
    model = _build(lambda: DeepseekV3ForCausalLM(config), seed, "cpu")
    return model, (_token_ids(seed, batch, seq_len, vocab_size),), {"use_cache": False}


def tiny_gpt_oss(num_heads: int = 4, hidden: int = 64, *, layers: int = 2, vocab_size: int = VOCAB_SIZE,
                 batch: int = BATCH, seq_len: int = SEQ_LEN, seed: int = 0) -> ModelAndInputs:
    """GptOssForCausalLM: attention sinks (a learned logit per head), a sliding window of 4 on layer 0 and full
    attention on layer 1, 2 kv heads, a MoE of 2 experts (top 1) with clamped SwiGLU."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
        num_attention_heads=num_heads, num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        max_position_embeddings=max(64, seq_len), attn_implementation="eager", use_cache=False,
    )
    model = _build(lambda: GptOssForCausalLM(config), seed, "cpu")
    return model, (_token_ids(seed, batch, seq_len, vocab_size),), {"use_cache": False}


def _recurrent_config(family: str) -> tuple[Any, type]:
    import transformers as hf

    common = {"vocab_size": VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 2, "use_cache": False}
    attention = {"intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "max_position_embeddings": 64, "attn_implementation": "sdpa"}
    configs = {
        "mamba": lambda: hf.MambaConfig(**common, state_size=8),
        "mamba2": lambda: hf.Mamba2Config(**common, state_size=8, num_heads=8, head_dim=16, n_groups=1),
        "jamba": lambda: hf.JambaConfig(**common, **attention, attn_layer_period=2, attn_layer_offset=1,
                                        expert_layer_period=2, expert_layer_offset=1, num_experts=2, mamba_d_state=8,
                                        mamba_dt_rank=8),
        "qwen3_next": lambda: hf.Qwen3NextConfig(**common, **attention, head_dim=16, linear_num_value_heads=4,
                                                 linear_num_key_heads=2, linear_key_head_dim=16,
                                                 linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1,
                                                 moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                                 layer_types=["linear_attention", "full_attention"]),
        "falcon_h1": lambda: hf.FalconH1Config(**common, **attention, mamba_d_ssm=64, mamba_n_heads=4,
                                               mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1),
        "recurrent_gemma": lambda: hf.RecurrentGemmaConfig(**{**common, "num_hidden_layers": 3}, **{
            **attention, "num_key_value_heads": 1, "attn_implementation": "eager"}, lru_width=64,
            attention_window_size=16),  # no SDPA before transformers 5.24
    }
    classes = {"mamba": "MambaForCausalLM", "mamba2": "Mamba2ForCausalLM", "jamba": "JambaForCausalLM",
               "qwen3_next": "Qwen3NextForCausalLM", "falcon_h1": "FalconH1ForCausalLM",
               "recurrent_gemma": "RecurrentGemmaForCausalLM"}
    return configs[family](), getattr(hf, classes[family])


RECURRENT_STATE = ("mamba", "mamba2", "jamba", "qwen3_next", "falcon_h1", "recurrent_gemma")
"""Families that keep a convolution and recurrent (SSM / linear attention) state, all or some of their layers."""

RECURRENT_GENERATES = ("mamba", "mamba2")
"""Of :data:`RECURRENT_STATE`, the families that generate (every layer a convolution and an SSM state, held as graph
state); the others are refused with ``UnsupportedModelError``."""


def tiny_recurrent(family: str, *, batch: int = BATCH, seq_len: int = SEQ_LEN, seed: int = 0) -> ModelAndInputs:
    """``family`` of :data:`RECURRENT_STATE`, hidden 64, 2 layers (RecurrentGemma 3: recurrent, recurrent, attention)."""
    config, model_class = _recurrent_config(family)
    model = _build(lambda: model_class(config), seed, "cpu")
    return model, (_token_ids(seed, batch, seq_len, VOCAB_SIZE),), {"use_cache": False}
