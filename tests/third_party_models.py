"""Model code as people write it outside transformers, written here from the projects' public designs.

Not copies: each module follows the published architecture (layer order, shapes, how the forward returns)
at tiny sizes, so autotp meets the code shapes those projects use — a fused ``c_attn`` and a
``(logits, None)`` return (nanoGPT), BatchNorm and strided downsampling (torchvision's ResNet), shifted
windows with a relative-position bias table and an attention mask (Swin), depthwise convolutions with a
channels-last LayerNorm and a layer scale (ConvNeXt). Builders as in :mod:`models`: ``(model, args, kwargs)``,
eval mode, weights and inputs from ``seed``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from models import ModelAndInputs, _build
from torch import nn

__all__ = ["convnext", "nanogpt", "resnet18", "swin"]


def _images(seed: int, batch: int = 2, size: int = 32) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed + 1))  # (batch, 3, h, w)


# --------------------------------------------------------------------------- nanoGPT-style

class _CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)  # query, key and value in one projection
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, channels = x.shape
        q, k, v = self.c_attn(x).split(channels, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (batch, heads, seq, head_dim)
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, seq, channels))


class _GPTBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = _CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """Token and learned position embeddings, pre-LayerNorm blocks, a head tied to the token embedding;
    ``forward(idx, targets=None)`` returns ``(logits, loss)``: without targets, the last position's logits and None."""

    def __init__(self, vocab_size: int = 256, block_size: int = 32, n_layer: int = 2, n_head: int = 4,
                 n_embd: int = 64) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList(_GPTBlock(n_embd, n_head) for _ in range(n_layer)), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None  # (batch, 1, vocab): inference needs the last position only
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def nanogpt(seed: int = 0) -> ModelAndInputs:
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed + 1))
    return _build(NanoGPT, seed, "cpu"), (ids,), {}


# --------------------------------------------------------------------------- torchvision-style ResNet-18

class _BasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = (nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))
                           if stride != 1 or inplanes != planes else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """7x7 stem, max pool, four stages of two basic blocks (strided 1x1 downsampling), average pool, classifier."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64, 128), num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = widths[0]
        stages = []
        for index, planes in enumerate(widths):
            stride = 1 if index == 0 else 2
            stages.append(nn.Sequential(_BasicBlock(inplanes, planes, stride), _BasicBlock(planes, planes, 1)))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(seed: int = 0) -> ModelAndInputs:
    model = _build(ResNet18, seed, "cpu")
    with torch.no_grad(), torch.random.fork_rng(devices=[]):  # running statistics other than the defaults
        torch.manual_seed(seed + 2)
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.copy_(0.1 * torch.randn(module.num_features))
                module.running_var.copy_(1.0 + 0.1 * torch.rand(module.num_features))
    return model, (_images(seed),), {}


# --------------------------------------------------------------------------- Swin-style

def _windows(x: torch.Tensor, window: int) -> torch.Tensor:
    """(batch, h, w, c) -> (batch * windows, window * window, c)."""
    batch, height, width, channels = x.shape
    x = x.view(batch, height // window, window, width // window, window, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window * window, channels)


def _unwindow(x: torch.Tensor, window: int, height: int, width: int) -> torch.Tensor:
    """(batch * windows, window * window, c) -> (batch, h, w, c)."""
    channels = x.shape[-1]
    x = x.view(-1, height // window, width // window, window, window, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, height, width, channels)


class _WindowAttention(nn.Module):
    """Multi-head attention inside each window, with a learned bias per relative position and head."""

    def __init__(self, dim: int, window: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.relative_position_bias_table = nn.Parameter(0.02 * torch.randn((2 * window - 1) ** 2, heads))
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)  # (w*w, w*w, 2)
        self.register_buffer("relative_position_index", relative[..., 0] * (2 * window - 1) + relative[..., 1])
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        windows, tokens, channels = x.shape
        qkv = self.qkv(x).reshape(windows, tokens, 3, self.heads, channels // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (windows, heads, tokens, head_dim)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        attn = attn + bias.view(tokens, tokens, -1).permute(2, 0, 1).unsqueeze(0)
        if mask is not None:  # (windows per image, tokens, tokens): -100 between tokens of different shifted regions
            groups = mask.shape[0]
            attn = attn.view(-1, groups, self.heads, tokens, tokens) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.heads, tokens, tokens)
        out = attn.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(windows, tokens, channels))


class _SwinBlock(nn.Module):
    def __init__(self, dim: int, resolution: int, heads: int, window: int, shift: int) -> None:
        super().__init__()
        self.resolution, self.window, self.shift = resolution, window, shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = _WindowAttention(dim, window, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        mask = None
        if shift:
            regions = torch.zeros(1, resolution, resolution, 1)
            label = 0
            for rows in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
                for cols in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
                    regions[:, rows, cols, :] = label
                    label += 1
            labels = _windows(regions, window).squeeze(-1)  # (windows, tokens)
            mask = (labels[:, None, :] - labels[:, :, None]).ne(0).float() * -100.0
        self.register_buffer("attn_mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, h*w, c)
        batch, _, channels = x.shape
        size = self.resolution
        shortcut = x
        x = self.norm1(x).view(batch, size, size, channels)
        if self.shift:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        x = _unwindow(self.attn(_windows(x, self.window), self.attn_mask), self.window, size, size)
        if self.shift:
            x = torch.roll(x, shifts=(self.shift, self.shift), dims=(1, 2))
        x = shortcut + x.reshape(batch, size * size, channels)
        return x + self.mlp(self.norm2(x))


class _PatchMerging(nn.Module):
    def __init__(self, dim: int, resolution: int) -> None:
        super().__init__()
        self.resolution = resolution
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, channels = x.shape
        x = x.view(batch, self.resolution, self.resolution, channels)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduction(self.norm(x.view(batch, -1, 4 * channels)))


class Swin(nn.Module):
    """Patch embedding, stages of (regular, shifted) window-attention blocks with patch merging between them,
    a final norm, average pool and classifier. Stage heads (2, 4): at world size 3 the first stage's two heads
    cannot give every rank one."""

    def __init__(self, image: int = 32, patch: int = 4, dim: int = 32, heads: tuple[int, ...] = (2, 4),
                 window: int = 4, num_classes: int = 10) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.patch_norm = nn.LayerNorm(dim)
        resolution = image // patch
        layers: list[nn.Module] = []
        for index, stage_heads in enumerate(heads):
            layers += [_SwinBlock(dim, resolution, stage_heads, window, 0),
                       _SwinBlock(dim, resolution, stage_heads, window, window // 2)]
            if index < len(heads) - 1:
                layers.append(_PatchMerging(dim, resolution))
                dim, resolution = 2 * dim, resolution // 2
        self.layers = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (batch, patches, dim)
        x = self.norm(self.layers(self.patch_norm(x)))
        return self.head(x.mean(dim=1))


def swin(seed: int = 0) -> ModelAndInputs:
    return _build(Swin, seed, "cpu"), (_images(seed),), {}


# --------------------------------------------------------------------------- ConvNeXt-style

class _ChannelsFirstNorm(nn.Module):
    """LayerNorm over the channel dim of (batch, channels, h, w)."""

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(1, keepdim=True)
        var = (x - mean).pow(2).mean(1, keepdim=True)
        x = (x - mean) / torch.sqrt(var + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class _ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)  # depthwise
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)  # pointwise convolutions as Linear, channels last
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-1 * torch.ones(dim))  # layer scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.dwconv(x).permute(0, 2, 3, 1)  # (batch, h, w, channels)
        x = self.gamma * self.pwconv2(self.act(self.pwconv1(self.norm(x))))
        return shortcut + x.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """4x4 patchify stem, stages of ConvNeXt blocks with norm + 2x2 strided downsampling, pooled norm, classifier."""

    def __init__(self, dims: tuple[int, ...] = (16, 32), depths: tuple[int, ...] = (1, 1), num_classes: int = 10) -> None:
        super().__init__()
        self.downsample_layers = nn.ModuleList([nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), _ChannelsFirstNorm(dims[0]))])
        for index in range(1, len(dims)):
            self.downsample_layers.append(nn.Sequential(_ChannelsFirstNorm(dims[index - 1]),
                                                        nn.Conv2d(dims[index - 1], dims[index], 2, stride=2)))
        self.stages = nn.ModuleList(nn.Sequential(*(_ConvNeXtBlock(dim) for _ in range(depth)))
                                    for dim, depth in zip(dims, depths))
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images
        for downsample, stage in zip(self.downsample_layers, self.stages):
            x = stage(downsample(x))
        return self.head(self.norm(x.mean([-2, -1])))


def convnext(seed: int = 0) -> ModelAndInputs:
    return _build(ConvNeXt, seed, "cpu"), (_images(seed),), {}

