"""The wide zoo: the architectures a user brings, as tiny models with random weights (nothing downloaded).

Two kinds of entry:

- **transformers families** built from configs: dense decoders of many vendors, mixtures of experts
  (Qwen3-MoE, OLMoE, DeepSeek-V3 with multi-head latent attention, GPT-OSS with attention sinks,
  Llama-4 text), state-space and hybrid stacks (Mamba, Mamba2, Jamba, Falcon-H1), encoder-decoder (T5,
  BART), encoders (RoBERTa, ModernBERT) and vision (ViT, ConvNeXt, ResNet with BatchNorm, Swin with
  windowed attention);
- **model code written outside transformers** (:mod:`third_party_models`, :mod:`own_state_models`): nanoGPT-,
  torchvision-ResNet-, Swin-, ConvNeXt- and gpt-fast-style modules, written here from their public designs.

:data:`ZOO` maps a name to a :class:`ZooEntry`: its builder (``(model, args, kwargs)``, eval mode, weights and
inputs from ``seed``, as :mod:`models`) and whether ``tp.generate`` applies (a causal LM with a cache that
transformers' ``generate`` uses). Sizes: hidden 64, 2 layers, 4 query heads / 2 KV heads, vocabulary 256,
batch 2, sequence 8 (images 2x3x32x32): a forward takes milliseconds, and 4 heads split 2/1/1 at world size 3.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import third_party_models as third_party
import torch
from models import ModelAndInputs, _build
from own_state_models import tiny_cached_transformer

__all__ = ["LOOPED_MOE", "MORE_MOE", "ZOO", "ZooEntry"]

VOCAB = 256
HIDDEN = 64
BATCH = 2
SEQ = 8


EQUAL = "equal"
REFUSED = "refused"


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    build: Callable[..., ModelAndInputs]
    generation: str | None = None
    """A causal LM's ``tp.generate``: :data:`EQUAL` (greedy tokens equal ``model.generate``'s) or :data:`REFUSED`
    (a hybrid of attention and SSM state: ``UnsupportedModelError`` naming the model); None: not a causal LM."""
    family: str = ""
    """What kind of architecture it stands for, as the zoo table shows it."""


def _ids(seed: int, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed + 1))  # (batch, seq)


def _images(seed: int, size: int = 32) -> torch.Tensor:
    return torch.randn(BATCH, 3, size, size, generator=torch.Generator().manual_seed(seed + 1))  # (batch, 3, h, w)


def _hf(config_name: str, model_name: str, *, inputs: str = "ids", **config: Any) -> Callable[..., ModelAndInputs]:
    """A builder of ``transformers.<model_name>(transformers.<config_name>(**config))`` with tiny defaults."""

    def build(seed: int = 0) -> ModelAndInputs:
        import transformers

        values = {"use_cache": False, **config}
        if inputs in ("ids", "seq2seq"):  # special tokens inside the tiny vocabulary
            values = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **values}
        made = getattr(transformers, config_name)(**values)
        model = _build(lambda: getattr(transformers, model_name)(made), seed, "cpu")
        if inputs == "images":
            return model, (_images(seed, config.get("image_size", 32)),), {}
        if inputs == "seq2seq":
            return model, (_ids(seed),), {"decoder_input_ids": _ids(seed + 7, seq=SEQ // 2)}
        return model, (_ids(seed),), ({"use_cache": False} if "use_cache" in values else {})

    return build


_DECODER = dict(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

ZOO: dict[str, ZooEntry] = {
    # dense decoders
    "qwen3": ZooEntry(_hf("Qwen3Config", "Qwen3ForCausalLM", head_dim=16, **_DECODER), EQUAL, "dense, QK-norm"),
    "gemma2": ZooEntry(_hf("Gemma2Config", "Gemma2ForCausalLM", head_dim=16, sliding_window=4, **_DECODER), EQUAL,
                       "dense, soft-capping, sliding window"),
    "gemma3": ZooEntry(_hf("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=16, sliding_window=4, **_DECODER), EQUAL,
                       "dense, local/global layers"),
    "phi3": ZooEntry(_hf("Phi3Config", "Phi3ForCausalLM", pad_token_id=0, **_DECODER), EQUAL, "dense, fused QKV"),
    "gpt_neox": ZooEntry(_hf("GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_size=HIDDEN, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64), EQUAL,
                         "dense, parallel residual"),
    "olmo2": ZooEntry(_hf("Olmo2Config", "Olmo2ForCausalLM", **_DECODER), EQUAL, "dense, post-norm"),
    "granite": ZooEntry(_hf("GraniteConfig", "GraniteForCausalLM", **_DECODER), EQUAL, "dense, scaled residuals"),
    "starcoder2": ZooEntry(_hf("Starcoder2Config", "Starcoder2ForCausalLM", **_DECODER), EQUAL, "dense, biased MLP"),
    "cohere": ZooEntry(_hf("CohereConfig", "CohereForCausalLM", **_DECODER), EQUAL, "dense, LayerNorm, parallel"),
    "glm4": ZooEntry(_hf("Glm4Config", "Glm4ForCausalLM", head_dim=16, **_DECODER), EQUAL, "dense, partial RoPE"),
    "smollm3": ZooEntry(_hf("SmolLM3Config", "SmolLM3ForCausalLM", **_DECODER), EQUAL, "dense, NoPE layers"),
    # mixtures of experts
    "qwen3_moe": ZooEntry(_hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", head_dim=16, **_DECODER, **_MOE), EQUAL,
                          "MoE, top-2 of 4"),
    "olmoe": ZooEntry(_hf("OlmoeConfig", "OlmoeForCausalLM", **{**_DECODER, "intermediate_size": 32},
                          num_experts=4, num_experts_per_tok=2), EQUAL, "MoE"),
    "deepseek_v3": ZooEntry(_hf("DeepseekV3Config", "DeepseekV3ForCausalLM", hidden_size=HIDDEN, intermediate_size=128,
                                moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, max_position_embeddings=64),
                            EQUAL, "MoE, latent attention"),
    "gpt_oss": ZooEntry(_hf("GptOssConfig", "GptOssForCausalLM", head_dim=16, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=4, **_DECODER), EQUAL, "MoE, attention sinks"),
    "llama4_text": ZooEntry(_hf("Llama4TextConfig", "Llama4ForCausalLM", head_dim=16, num_local_experts=4,
                                num_experts_per_tok=1, intermediate_size_mlp=128,
                                **{k: v for k, v in _DECODER.items()}), EQUAL, "MoE, chunked attention"),
    # state-space and hybrid
    "mamba": ZooEntry(_hf("MambaConfig", "MambaForCausalLM", hidden_size=HIDDEN, state_size=8, num_hidden_layers=2,
                          expand=2, conv_kernel=4), EQUAL, "SSM"),
    "mamba2": ZooEntry(_hf("Mamba2Config", "Mamba2ForCausalLM", hidden_size=HIDDEN, state_size=8, num_hidden_layers=2,
                           expand=2, conv_kernel=4, num_heads=8, head_dim=16, n_groups=1, chunk_size=8), EQUAL,
                       "SSM (chunked scan)"),
    "jamba": ZooEntry(_hf("JambaConfig", "JambaForCausalLM", hidden_size=HIDDEN, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=2,
                          num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
                          attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                          use_mamba_kernels=False), REFUSED, "hybrid SSM + attention"),
    # encoders, encoder-decoders
    "roberta": ZooEntry(_hf("RobertaConfig", "RobertaModel", hidden_size=HIDDEN, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64), None, "encoder"),
    "modernbert": ZooEntry(_hf("ModernBertConfig", "ModernBertModel", hidden_size=HIDDEN, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, global_attn_every_n_layers=2,
                               local_attention=4, max_position_embeddings=64, cls_token_id=1,
                               sep_token_id=2), None, "encoder, local/global"),
    "t5": ZooEntry(_hf("T5Config", "T5ForConditionalGeneration", inputs="seq2seq", d_model=HIDDEN, d_ff=128, d_kv=16,
                       num_layers=2, num_decoder_layers=2, num_heads=4), None, "encoder-decoder"),
    "bart": ZooEntry(_hf("BartConfig", "BartForConditionalGeneration", inputs="seq2seq", d_model=HIDDEN,
                         encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                         encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64), None,
                     "encoder-decoder"),
    # vision
    "vit": ZooEntry(_hf("ViTConfig", "ViTModel", inputs="images", hidden_size=HIDDEN, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8), None, "vision"),
    "hf_convnext": ZooEntry(_hf("ConvNextConfig", "ConvNextModel", inputs="images", hidden_sizes=[16, 32],
                                depths=[1, 1], num_stages=2), None, "vision, depthwise conv"),
    "hf_resnet": ZooEntry(_hf("ResNetConfig", "ResNetModel", inputs="images", embedding_size=16, hidden_sizes=[16, 32],
                              depths=[1, 1], layer_type="basic"), None, "vision, BatchNorm"),
    "hf_swin": ZooEntry(_hf("SwinConfig", "SwinModel", inputs="images", image_size=32, patch_size=4, embed_dim=16,
                            depths=[2, 2], num_heads=[2, 4], window_size=4), None, "vision, windowed attention"),
    # model code from outside transformers, written from public designs
    "nanogpt": ZooEntry(third_party.nanogpt, None, "nanoGPT-style"),
    "resnet18": ZooEntry(third_party.resnet18, None, "torchvision-style ResNet-18"),
    "swin": ZooEntry(third_party.swin, None, "Swin-style, shifted windows"),
    "convnext": ZooEntry(third_party.convnext, None, "ConvNeXt-style"),
    "gpt_fast": ZooEntry(lambda seed=0: _gpt_fast(seed), None, "gpt-fast-style, KV cache in its own buffers"),
}


_SMALL_MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
"""Multi-head latent attention at the zoo's size (DeepSeek-V2, GLM-4-MoE-lite)."""

MORE_MOE: dict[str, Callable[..., ModelAndInputs]] = {
    "qwen2_moe": _hf("Qwen2MoeConfig", "Qwen2MoeForCausalLM", **_DECODER, **_MOE, shared_expert_intermediate_size=32),
    "glm4_moe": _hf("Glm4MoeConfig", "Glm4MoeForCausalLM", head_dim=16, **_DECODER, n_routed_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1),
    "glm4_moe_lite": _hf("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", **{**_DECODER, "num_key_value_heads": 4},
                         n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                         first_k_dense_replace=1, **_SMALL_MLA),
    "deepseek_v2": _hf("DeepseekV2Config", "DeepseekV2ForCausalLM", **{**_DECODER, "num_key_value_heads": 4},
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                       first_k_dense_replace=1, n_group=1, topk_group=1, **_SMALL_MLA),
    "dots1": _hf("Dots1Config", "Dots1ForCausalLM", head_dim=16, **_DECODER, n_routed_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1),
    "ernie4_5_moe": _hf("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", **_DECODER, moe_num_experts=4, moe_k=2,
                        moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_start_index=1),
    "exaone_moe": _hf("ExaoneMoeConfig", "ExaoneMoeForCausalLM", head_dim=16, **_DECODER, **_MOE, num_shared_experts=1,
                      first_k_dense_replace=1),
    "afmoe": _hf("AfmoeConfig", "AfmoeForCausalLM", head_dim=16, **_DECODER, **_MOE, num_shared_experts=1,
                 num_dense_layers=1),
    "lfm2_moe": _hf("Lfm2MoeConfig", "Lfm2MoeForCausalLM", **_DECODER, **_MOE, num_dense_layers=1,
                    layer_types=["conv", "full_attention"]),
    "flex_olmo": _hf("FlexOlmoConfig", "FlexOlmoForCausalLM", **{**_DECODER, "intermediate_size": 32}, num_experts=4,
                     num_experts_per_tok=2),
    "granitemoe": _hf("GraniteMoeConfig", "GraniteMoeForCausalLM", **_DECODER, num_local_experts=4,
                      num_experts_per_tok=2),
    "granitemoeshared": _hf("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", **_DECODER, num_local_experts=4,
                            num_experts_per_tok=2, shared_intermediate_size=32),
    "hunyuan_v1_moe": _hf("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", head_dim=16, **_DECODER, num_experts=4,
                          moe_topk=2),
    "minimax": _hf("MiniMaxConfig", "MiniMaxForCausalLM", head_dim=16, **_DECODER, num_local_experts=4,
                   num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"]),
    "minimax_m2": _hf("MiniMaxM2Config", "MiniMaxM2ForCausalLM", head_dim=16, **_DECODER, num_local_experts=4,
                      num_experts_per_tok=2),
    "cohere2_moe": _hf("Cohere2MoeConfig", "Cohere2MoeForCausalLM", head_dim=16, **_DECODER, num_experts=4,
                       num_experts_per_tok=2),
    "phimoe": _hf("PhimoeConfig", "PhimoeForCausalLM", **_DECODER, num_local_experts=4, num_experts_per_tok=2),
}
"""More mixture-of-experts families transformers ships, beyond the wide zoo's five (the zoo's sizes, 4 experts, top 2;
a dense first layer and a shared expert where the family has them): for the expert-placement matrix
(tests/test_expert_placement.py, zoo tier), forward at tp=2 with experts placed and with experts split.
DBRX and JetMoE run their experts as a loop over the experts hit (data-dependent sizes) and are refused instead
(:data:`LOOPED_MOE`). Qwen3-Next is not here: its linear attention's reference kernel (no ``flash-linear-attention``
on CPU) unrolls a loop over a 64-token chunk into the trace, minutes of tracing on a loaded 2-core machine."""

LOOPED_MOE: dict[str, Callable[..., ModelAndInputs]] = {
    "dbrx": _hf("DbrxConfig", "DbrxForCausalLM", d_model=HIDDEN, n_heads=4, n_layers=2, max_seq_len=64,
                attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
    "jetmoe": _hf("JetMoeConfig", "JetMoeForCausalLM", hidden_size=HIDDEN, num_hidden_layers=2, num_key_value_heads=2,
                  kv_channels=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=64),
}
"""MoE families whose experts are a Python loop over the experts the router hit, or rows counted at run time: their
sizes depend on the data, which a plan made at example sizes cannot follow, so autotp refuses them."""


def _gpt_fast(seed: int) -> ModelAndInputs:
    """A gpt-fast-style decoder (tests/own_state_models.py) and its prefill call: ``(ids, arange(T))``, which writes
    its cache buffers (the whole loop is tests/test_own_state.py's)."""
    model = tiny_cached_transformer(max_batch=BATCH, max_seq=2 * SEQ, seed=seed)
    return model, (_ids(seed), torch.arange(SEQ)), {}
