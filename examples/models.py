"""Small models defined in the repo, used by the demo, the tests and the benchmarks.

No torchvision and no downloads: each factory builds a fresh, randomly initialised
model. Use them with ``trtc export --model-factory examples.models:resnet_cnn``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["ResNetCNN", "MLP", "TransformerEncoder", "TwoInput", "Segmenter", "resnet_cnn", "resnet_digits", "mlp",
           "transformer_encoder", "two_input", "segmenter"]


class BasicBlock(nn.Module):
    """Conv-BN-ReLU-Conv-BN with a residual add, as in ResNet-18/34."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + self.shortcut(x))


class ResNetCNN(nn.Module):
    """A ResNet-style classifier: stem, stages of basic blocks, global pool, linear head."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, widths: tuple[int, ...] = (32, 64, 128),
                 blocks_per_stage: int = 1, stem_stride: int = 1) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, stem_stride, 1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers: list[nn.Module] = []
        c_in = widths[0]
        for i, width in enumerate(widths):
            for j in range(blocks_per_stage):
                layers.append(BasicBlock(c_in, width, stride=2 if (i > 0 and j == 0) else 1))
                c_in = width
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(images))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class MLP(nn.Module):
    def __init__(self, in_features: int = 64, hidden: int = 128, out_features: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class EncoderBlock(nn.Module):
    """Pre-norm transformer encoder block: multi-head attention with a padding mask, then a GELU MLP."""

    def __init__(self, d_model: int, heads: int, d_ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q = q.reshape(b, s, h, d // h).transpose(1, 2)
        k = k.reshape(b, s, h, d // h).transpose(1, 2)
        v = v.reshape(b, s, h, d // h).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(d // h)) + mask_bias
        attn = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(attn)
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class TransformerEncoder(nn.Module):
    """Token embedding + positional embedding + encoder blocks; returns one embedding per token.

    Inputs: ``input_ids`` (int64, B x S) and ``attention_mask`` (int64, B x S, 1 = real token, 0 = padding).
    Padding enters the scores as a large negative bias, as BERT-style encoders do.
    """

    def __init__(self, vocab: int = 1000, d_model: int = 64, heads: int = 4, d_ff: int = 128, layers: int = 2,
                 max_len: int = 512) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(EncoderBlock(d_model, heads, d_ff) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.tok(input_ids) + self.pos(positions)
        mask_bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        for block in self.blocks:
            x = block(x, mask_bias)
        return self.ln(x)


class TwoInput(nn.Module):
    """An image branch and a feature-vector branch joined before the head."""

    def __init__(self, features: int = 16, num_classes: int = 5) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.dense = nn.Sequential(nn.Linear(features, 16), nn.ReLU())
        self.head = nn.Linear(32, num_classes)

    def forward(self, image: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.conv(image), self.dense(features)], dim=1))


class Segmenter(nn.Module):
    """A fully convolutional per-pixel classifier, B x classes x H x W out of B x 3 x H x W: its output is seven
    times its input, and handing it back to the host (the GPU's copy, then the copy into the caller's arrays) takes
    longer than the model runs (its ``map`` figures are in docs/benchmarks.md)."""

    def __init__(self, width: int = 64, layers: int = 3, num_classes: int = 21) -> None:
        super().__init__()
        convs: list[nn.Module] = []
        for c_in in (3, *(width,) * layers):
            convs += [nn.Conv2d(c_in, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        self.body = nn.Sequential(*convs)
        self.head = nn.Conv2d(width, num_classes, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(images))


def _randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give BatchNorm layers non-trivial statistics so that folding them is actually tested."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
            m.weight.data.copy_(torch.rand(n, generator=gen) + 0.5)
            m.bias.data.copy_(torch.randn(n, generator=gen) * 0.1)
    return model.eval()


def resnet_cnn(in_channels: int = 3, num_classes: int = 10, widths: tuple[int, ...] = (32, 64, 128),
               blocks_per_stage: int = 1, stem_stride: int = 1) -> ResNetCNN:
    """Input ``images``: B x in_channels x H x W (any H, W >= 8)."""
    torch.manual_seed(0)
    return _randomize_bn(ResNetCNN(in_channels, num_classes, widths, blocks_per_stage, stem_stride))  # type: ignore[return-value]


def resnet_digits() -> ResNetCNN:
    """The demo's classifier for scikit-learn's 8x8 digits: input ``images``: B x 1 x 8 x 8."""
    return resnet_cnn(in_channels=1, num_classes=10, widths=(16, 32, 64))


def resnet50_like() -> ResNetCNN:
    """A CNN of ResNet-50-like cost at 3x224x224 (ResNet-34-style basic blocks: ~20 M params), for benchmarks."""
    return resnet_cnn(in_channels=3, num_classes=1000, widths=(64, 128, 256, 512), blocks_per_stage=3,
                      stem_stride=4)


def mlp() -> MLP:
    torch.manual_seed(0)
    return MLP().eval()


def transformer_encoder() -> TransformerEncoder:
    torch.manual_seed(0)
    return TransformerEncoder().eval()


def two_input() -> TwoInput:
    torch.manual_seed(0)
    return _randomize_bn(TwoInput())  # type: ignore[return-value]


def segmenter() -> Segmenter:
    """Input ``images``: B x 3 x H x W; output B x 21 x H x W (class scores per pixel), for benchmarks."""
    torch.manual_seed(0)
    return _randomize_bn(Segmenter())  # type: ignore[return-value]
