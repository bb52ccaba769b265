"""Models at the sizes of public architectures, defined here (no torchvision, no downloads), random weights; and
torchvision's own ViT-B/16 where torchvision is installed.

* ``resnet50``: ResNet-50's bottleneck layout (3, 4, 6, 3 blocks, widths 256-2048), 25.6 M parameters, 224x224.
* ``vit_b16``: ViT-B/16 (patch 16, 12 layers, width 768, 12 heads, MLP 3072, 197 tokens), 86 M parameters.
* ``gpt2_small``: GPT-2 small (vocabulary 50257, 12 layers, width 768, causal), 124 M parameters; input_ids BxS.
* ``torchvision_vit_b16``: ``torchvision.models.vit_b_16`` (needs torchvision), its head drawn at random.
* ``big_mlp``: 40 Linear(4096, 4096) layers, 2.5 GiB of FP32 weights (over protobuf's 2 GiB limit).

The classifier heads are initialised randomly, not to zero, so that the accuracy gate has outputs to compare.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["resnet50", "vit_b16", "torchvision_vit_b16", "gpt2_small", "big_mlp", "INPUTS"]

# --input specs for each factory (trtc export --model-factory benchmarks.sized_models:NAME --input ...)
INPUTS = {
    "resnet50": ["images:Bx3x224x224"],
    "vit_b16": ["images:Bx3x224x224"],
    "torchvision_vit_b16": ["images:Bx3x224x224"],
    "gpt2_small": ["input_ids:Bx128:int64"],
    "big_mlp": ["x:Bx4096"],
}


class Bottleneck(nn.Module):
    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                                   nn.MaxPool2d(3, 2, 1)]
        c_in = 64
        for i, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
            for j in range(blocks):
                layers.append(Bottleneck(c_in, width, 2 if j == 0 and i > 0 else 1))
                c_in = width * 4
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean((2, 3)))


class Block(nn.Module):
    """Pre-norm transformer block: attention and MLP, each behind a LayerNorm and a residual add."""

    def __init__(self, dim: int, heads: int, causal: bool = False, max_len: int = 1024) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.causal = causal
        if causal:
            self.register_buffer("mask", torch.full((max_len, max_len), float("-inf")).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5
        if self.causal:
            scores = scores + self.mask[:s, :s]
        x = x + self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    def __init__(self, dim: int = 768, depth: int = 12, heads: int = 12, classes: int = 1000) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 16, 16)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, 197, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(t.shape[0], -1, -1), t], 1) + self.pos  # not len(t): it fixes the batch
        return self.head(self.norm(self.blocks(t))[:, 0])


class GPT2(nn.Module):
    def __init__(self, vocab: int = 50257, dim: int = 768, depth: int = 12, heads: int = 12, max_len: int = 1024,
                 ) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads, causal=True, max_len=max_len) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.norm(self.blocks(self.wte(input_ids) + self.wpe(positions)))
        return h @ self.wte.weight.T  # tied LM head: logits over the vocabulary


def resnet50() -> nn.Module:
    torch.manual_seed(0)
    return ResNet50().eval()


def vit_b16() -> nn.Module:
    torch.manual_seed(0)
    return ViT().eval()


def torchvision_vit_b16() -> nn.Module:
    """torchvision's ViT-B/16, random weights, where torchvision is installed (the GPU machine). Its classification
    head is drawn like its other layers: torchvision starts it at zeros, an output the accuracy gate cannot score."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.vit_b_16()
    nn.init.normal_(model.heads.head.weight, std=0.02)
    return model.eval()


def gpt2_small() -> nn.Module:
    torch.manual_seed(0)
    return GPT2().eval()


def big_mlp(layers: int = 40, width: int = 4096) -> nn.Module:
    torch.manual_seed(0)
    body: list[nn.Module] = []
    for _ in range(layers):
        linear = nn.Linear(width, width)
        nn.init.normal_(linear.weight, std=width ** -0.5)
        body += [linear, nn.ReLU()]
    return nn.Sequential(*body, nn.Linear(width, 10)).eval()
