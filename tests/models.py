"""Tiny models with random weights for tests: built from configs, nothing downloaded.

Every builder returns ``(model, example_args, example_kwargs)`` with the model in eval mode, so
a test calls ``model(*example_args, **example_kwargs)``. Weights and inputs depend only on
``seed``: every rank of a multi-process test that calls the same builder gets identical weights
and inputs. The caller's global RNG state is left as it was.

Sizes are kept small so that a forward pass takes milliseconds on one CPU thread: vocabulary
1000, 2 layers, hidden size 256, batch 2, sequence 16, float32 (the CNN: batch 2, 3x16x16 images). ``device="meta"`` builds the model
without storage, for planning tests; the example inputs stay real CPU tensors.

``transformers`` is imported lazily, so this module imports (and ``tiny_mlp`` works) without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "BUILDERS", "ModelAndInputs", "tiny_bert", "tiny_bert_mlm", "tiny_cnn", "tiny_gpt2", "tiny_llama", "tiny_mistral", "tiny_mixtral",
    "tiny_mlp", "tiny_qwen2", "tiny_tied_lm",
]

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


def _bert_config(num_heads: int, hidden: int, layers: int, intermediate: int, vocab_size: int, seq_len: int) -> Any:
    """The BertConfig both BERT factories build (SDPA attention, positions for at least 64 tokens)."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=num_heads,
        intermediate_size=intermediate, max_position_embeddings=max(64, seq_len),
        attn_implementation="sdpa",
    )


def tiny_bert(num_heads: int = 8, hidden: int = 256, *, layers: int = 2, intermediate: int = 512,
              vocab_size: int = VOCAB_SIZE, batch: int = BATCH, seq_len: int = SEQ_LEN, seed: int = 0,
              device: str | torch.device = "cpu") -> ModelAndInputs:
    """BertModel (encoder + pooler): post-LayerNorm, bidirectional SDPA attention, GELU MLP."""
    from transformers import BertModel

    config = _bert_config(num_heads, hidden, layers, intermediate, vocab_size, seq_len)
    model = _build(lambda: BertModel(config), seed, device)
    return model, (_token_ids(seed, batch, seq_len, vocab_size),), {}


def tiny_bert_mlm(num_heads: int = 8, hidden: int = 256, *, layers: int = 2, intermediate: int = 512,
                  vocab_size: int = VOCAB_SIZE, batch: int = BATCH, seq_len: int = SEQ_LEN, seed: int = 0,
                  device: str | torch.device = "cpu") -> ModelAndInputs:
    """BertForMaskedLM (a loss from ``labels=``, for training tests): BERT encoder + MLM head tied to the embedding."""
    from transformers import BertForMaskedLM

    config = _bert_config(num_heads, hidden, layers, intermediate, vocab_size, seq_len)
    model = _build(lambda: BertForMaskedLM(config), seed, device)
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


def tiny_mistral(num_heads: int = 8, num_kv_heads: int = 4, hidden: int = 256, *, layers: int = 2,
                 intermediate: int = 512, sliding_window: int = 8, vocab_size: int = VOCAB_SIZE, batch: int = BATCH,
                 seq_len: int = SEQ_LEN, seed: int = 0, device: str | torch.device = "cpu") -> ModelAndInputs:
    """MistralForCausalLM: Llama-like with a sliding-window causal mask (window 8 < sequence 16, so it bites)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=hidden // num_heads,
        max_position_embeddings=max(64, seq_len), sliding_window=sliding_window, attn_implementation="sdpa",
        use_cache=False, tie_word_embeddings=False,
    )
    model = _build(lambda: MistralForCausalLM(config), seed, device)
    return model, (_token_ids(seed, batch, seq_len, vocab_size),), {"use_cache": False}


def tiny_qwen2(num_heads: int = 8, num_kv_heads: int = 2, hidden: int = 256, *, layers: int = 2,
               intermediate: int = 512, vocab_size: int = VOCAB_SIZE, batch: int = BATCH, seq_len: int = SEQ_LEN,
               seed: int = 0, device: str | torch.device = "cpu") -> ModelAndInputs:
    """Qwen2ForCausalLM: GQA (8 query heads, 2 kv heads) with biased q/k/v projections, tied lm head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_position_embeddings=max(64, seq_len),
        attn_implementation="sdpa", use_cache=False, tie_word_embeddings=True,
    )
    model = _build(lambda: Qwen2ForCausalLM(config), seed, device)
    return model, (_token_ids(seed, batch, seq_len, vocab_size),), {"use_cache": False}


def tiny_mixtral(num_heads: int = 8, num_kv_heads: int = 4, hidden: int = 256, *, layers: int = 2,
                 intermediate: int = 256, experts: int = 4, top_k: int = 2, experts_implementation: str = "grouped_mm",
                 vocab_size: int = VOCAB_SIZE, batch: int = BATCH, seq_len: int = SEQ_LEN, seed: int = 0,
                 device: str | torch.device = "cpu") -> ModelAndInputs:
    """MixtralForCausalLM: sparse mixture of experts (router top-2 of 4 experts), GQA attention.

    ``experts_implementation``: how transformers runs the experts. ``"grouped_mm"`` (its default)
    sorts tokens by expert and calls one grouped GEMM per projection (under ``torch.export`` on
    float32 that is the custom op ``transformers::grouped_mm_fallback``); ``"batched_mm"`` gathers
    each token's expert weights (``weight[expert_ids]``) and runs ``bmm``. ``"eager"`` loops over
    the experts that were hit, which is data-dependent control flow and cannot be traced.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, num_local_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=max(64, seq_len), attn_implementation="sdpa",
        experts_implementation=experts_implementation, use_cache=False, tie_word_embeddings=False,
    )
    model = _build(lambda: MixtralForCausalLM(config), seed, device)
    return model, (_token_ids(seed, batch, seq_len, vocab_size),), {"use_cache": False}


class _TiedLM(nn.Module):
    """Embedding -> pre-LayerNorm residual MLP block -> logits with the embedding's own weight."""

    def __init__(self, vocab_size: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, intermediate)
        self.down = nn.Linear(intermediate, hidden)
        self.final_norm = nn.LayerNorm(hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # (batch, seq, hidden)
        h = h + self.down(torch.relu(self.up(self.norm(h))))
        return nn.functional.linear(self.final_norm(h), self.embed.weight)  # (batch, seq, vocab)


def tiny_tied_lm(hidden: int = 128, *, intermediate: int = 256, vocab_size: int = VOCAB_SIZE, batch: int = BATCH,
                 seq_len: int = SEQ_LEN, seed: int = 0, device: str | torch.device = "cpu") -> ModelAndInputs:
    """Plain torch: an embedding whose weight is also the output projection (tied), around one MLP block."""
    model = _build(lambda: _TiedLM(vocab_size, hidden, intermediate), seed, device)
    return model, (_token_ids(seed, batch, seq_len, vocab_size),), {}


class _SmallCNN(nn.Module):
    """conv-BN-ReLU, strided conv, depthwise conv, max pool, global average pool, linear classifier."""

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(2 * channels, 2 * channels, 3, padding=1, groups=2 * channels), nn.GELU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * channels, 2 * channels, 1, bias=False), nn.ReLU(),
        )
        self.classifier = nn.Linear(2 * channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.features(images)  # (batch, 2 * channels, 4, 4)
        x = nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)  # (batch, 2 * channels)
        return self.classifier(x)  # (batch, classes)


def tiny_cnn(channels: int = 32, *, classes: int = 10, batch: int = BATCH, image_size: int = 16, seed: int = 0,
             device: str | torch.device = "cpu") -> ModelAndInputs:
    """Plain torch CNN on (batch, 3, 16, 16) images: convolutions split over channels, BatchNorm in eval mode."""
    model = _build(lambda: _SmallCNN(channels, classes), seed, device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 2)  # non-trivial running statistics, as after training
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.copy_(0.1 * torch.randn(module.num_features))
                module.running_var.copy_(1.0 + 0.1 * torch.rand(module.num_features))
    generator = torch.Generator().manual_seed(seed + 1)
    images = torch.randn(batch, 3, image_size, image_size, generator=generator)  # (batch, channels, height, width)
    return model, (images,), {}


BUILDERS: dict[str, Callable[..., ModelAndInputs]] = {
    "llama": tiny_llama,
    "gpt2": tiny_gpt2,
    "bert": tiny_bert,
    "mlp": tiny_mlp,
    "mistral": tiny_mistral,
    "qwen2": tiny_qwen2,
    "mixtral": tiny_mixtral,
    "tied_lm": tiny_tied_lm,
    "cnn": tiny_cnn,
}
"""Name -> builder, for ``pytest.mark.parametrize("name", list(BUILDERS))``."""
