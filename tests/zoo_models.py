"""Small versions of real architectures for tests/test_zoo.py, built from code or `transformers` configs.

Random weights from a fixed seed, no downloads. Each factory is what ``trtc build --model-factory
tests.zoo_models:NAME`` calls; ``ZOO`` says which ``--input``/``--dim`` flags each takes and how to make
plausible calibration data for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

__all__ = ["ZOO", "ZooModel", "yolo", "vit", "bert", "gpt", "segmentation", "t5_encoder", "segformer", "token_types",
           "one_based_ids", "varargs"]

VOCAB = 1000


class _YoloHead(nn.Module):
    """A YOLOv5-style detector: three strides, per-cell anchors, and the decode into pixels.

    Outputs (batch, boxes, 5 + classes): centre x/y and width/height in pixels, objectness and
    class scores after the sigmoid, as the exported YOLO models give them.
    """

    def __init__(self, classes: int = 8, size: int = 320) -> None:
        super().__init__()
        self.classes, self.size, self.outputs = classes, size, 5 + classes
        self.strides = (8, 16, 32)
        anchors = torch.tensor([[[10, 13], [16, 30], [33, 23]], [[30, 61], [62, 45], [59, 119]],
                                [[116, 90], [156, 198], [373, 326]]], dtype=torch.float32)
        self.register_buffer("anchors", anchors)

        def block(c_in: int, c_out: int, stride: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.SiLU())

        self.stem = nn.Sequential(block(3, 8, 2), block(8, 16, 2), block(16, 16, 1), block(16, 24, 2))  # /8
        self.down16 = nn.Sequential(block(24, 32, 2), block(32, 32, 1))
        self.down32 = nn.Sequential(block(32, 48, 2), block(48, 48, 1))
        self.heads = nn.ModuleList(nn.Conv2d(c, 3 * self.outputs, 1) for c in (24, 32, 48))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        p8 = self.stem(images)
        p16 = self.down16(p8)
        p32 = self.down32(p16)
        decoded = []
        for level, (feature, head, stride) in enumerate(zip((p8, p16, p32), self.heads, self.strides)):
            cells = self.size // stride
            raw = head(feature).view(-1, 3, self.outputs, cells, cells).permute(0, 1, 3, 4, 2)
            ys, xs = torch.meshgrid(torch.arange(cells, dtype=torch.float32), torch.arange(cells, dtype=torch.float32),
                                    indexing="ij")
            grid = torch.stack((xs, ys), dim=-1).view(1, 1, cells, cells, 2)
            anchor = self.anchors[level].view(1, 3, 1, 1, 2)
            y = raw.sigmoid()
            xy = (y[..., :2] * 2 - 0.5 + grid) * stride
            wh = (y[..., 2:4] * 2) ** 2 * anchor
            decoded.append(torch.cat((xy, wh, y[..., 4:]), dim=-1).reshape(-1, 3 * cells * cells, self.outputs))
        return torch.cat(decoded, dim=1)


class _Segmenter(nn.Module):
    """A DeepLab-style net: a stride-8 encoder, atrous context, and bilinear upsampling to full resolution."""

    def __init__(self, classes: int = 6) -> None:
        super().__init__()

        def block(c_in: int, c_out: int, stride: int = 1, dilation: int = 1) -> nn.Module:
            return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, dilation, dilation, bias=False),
                                 nn.BatchNorm2d(c_out), nn.ReLU())

        self.encoder = nn.Sequential(block(3, 8, 2), block(8, 16, 2), block(16, 16, 2))
        self.context = nn.ModuleList([block(16, 16, dilation=d) for d in (1, 2, 4)])
        self.classifier = nn.Conv2d(48, classes, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.encoder(images)
        context = torch.cat([branch(features) for branch in self.context], dim=1)
        return nn.functional.interpolate(self.classifier(context), size=images.shape[-2:], mode="bilinear",
                                         align_corners=False)


class _Vit(nn.Module):
    """A `transformers` classifier that returns its logits tensor instead of an output dataclass."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=images).logits


class _Bert(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits


class _Gpt(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


class _T5Encoder(nn.Module):
    """A `transformers` T5 encoder returning its last hidden state: its relative-position buckets take log(0) = -inf
    on the diagonal and mask it away (the outputs are finite)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class _Segformer(nn.Module):
    """A `transformers` SegFormer returning its logits: its decoder concatenates four upsampled stages."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=images).logits


class _TokenTypes(nn.Module):
    """The embedding layer of a BERT in miniature: token ids, a 2-row token type table, and the mask."""

    def __init__(self) -> None:
        super().__init__()
        self.words, self.types, self.out = nn.Embedding(VOCAB, 16), nn.Embedding(2, 16), nn.Linear(16, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        hidden = (self.words(input_ids) + self.types(token_type_ids)) * attention_mask.unsqueeze(-1)
        return self.out(hidden.sum(dim=1) / attention_mask.sum(dim=1, keepdim=True))


def token_types() -> nn.Module:
    return _seeded(_TokenTypes)


class _OneBasedIds(nn.Module):
    """Ids counted from 1 (0 is not a valid id): zeros as example values fail, real data does not."""

    def __init__(self) -> None:
        super().__init__()
        self.words, self.out = nn.Embedding(VOCAB - 1, 16), nn.Linear(16, 4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.words(input_ids - 1).mean(dim=1))


def one_based_ids() -> nn.Module:
    return _seeded(_OneBasedIds)


class _VarArgs(nn.Module):
    """A wrapper whose forward takes ``*inputs``, as generic model wrappers do."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(6, 4)

    def forward(self, first: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return self.a(first) + self.b(rest[0]) * rest[1]


def varargs() -> nn.Module:
    return _seeded(_VarArgs)


def _seeded(build: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return build().eval()


def yolo() -> nn.Module:
    return _seeded(_YoloHead)


def segmentation() -> nn.Module:
    return _seeded(_Segmenter)


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=64, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, num_labels=10, attn_implementation="eager")
    return _seeded(lambda: _Vit(ViTForImageClassification(config)))


def bert() -> nn.Module:
    """A BERT classifier with the three integer inputs and the 2-row token type embedding of bert-base."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, type_vocab_size=2, num_labels=3,
                        attn_implementation="eager")
    return _seeded(lambda: _Bert(BertForSequenceClassification(config)))


def gpt() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                        attn_implementation="eager")
    return _seeded(lambda: _Gpt(GPT2LMHeadModel(config)))


def t5_encoder() -> nn.Module:
    """A T5 encoder of t5-small's layout (relative position buckets, ReLU feed-forward, RMS norms) at small size."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=32, relative_attention_max_distance=128,
                      attn_implementation="eager")
    return _seeded(lambda: _T5Encoder(T5EncoderModel(config)))


def segformer() -> nn.Module:
    """SegFormer-b0's layout (four stages with spatial-reduction attention, an all-MLP decoder) at small widths."""
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    config = SegformerConfig(depths=(1, 1, 1, 1), hidden_sizes=(32, 64, 96, 128), num_attention_heads=(1, 2, 3, 4),
                             decoder_hidden_size=64, num_labels=6, attn_implementation="eager")
    return _seeded(lambda: _Segformer(SegformerForSemanticSegmentation(config)))


def _images(size: int) -> Callable[[int, np.random.Generator], dict[str, np.ndarray]]:
    def make(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        # smooth images normalised like ImageNet inputs: low-resolution noise, upsampled
        coarse = rng.standard_normal((n, 3, size // 16, size // 16)).astype(np.float32)
        return {"images": np.repeat(np.repeat(coarse, 16, axis=2), 16, axis=3)}
    return make


def _tokens(length: int, with_types: bool | None) -> Callable[[int, np.random.Generator], dict[str, np.ndarray]]:
    def make(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        ids = rng.integers(1, VOCAB, (n, length)).astype(np.int64)
        if with_types is False:
            return {"input_ids": ids}
        real = rng.integers(length // 2, length + 1, n)  # right padding after each sentence pair
        mask = (np.arange(length)[None, :] < real[:, None]).astype(np.int64)
        types = (np.arange(length)[None, :] >= (real // 2)[:, None]).astype(np.int64) * mask
        if with_types is None:
            return {"input_ids": ids * mask, "attention_mask": mask}
        return {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": types}
    return make


@dataclass(frozen=True)
class ZooModel:
    factory: str
    flags: tuple[str, ...]
    data: Callable[[int, np.random.Generator], dict[str, np.ndarray]]


ZOO = {
    "yolo": ZooModel("tests.zoo_models:yolo", ("--input", "images:Bx3x320x320:float32"), _images(320)),
    "vit": ZooModel("tests.zoo_models:vit", ("--input", "images:Bx3x64x64:float32"), _images(64)),
    "bert": ZooModel("tests.zoo_models:bert", ("--input", "input_ids:BxS:int64", "--input", "attention_mask:BxS:int64",
                                               "--input", "token_type_ids:BxS:int64", "--dim", "S=4:16:32"),
                     _tokens(16, with_types=True)),
    "gpt": ZooModel("tests.zoo_models:gpt", ("--input", "input_ids:BxS:int64", "--dim", "S=4:16:32"),
                    _tokens(16, with_types=False)),
    "segmentation": ZooModel("tests.zoo_models:segmentation", ("--input", "images:Bx3x512x512:float32"),
                             _images(512)),
    # with_types=None: ids and the padding mask, no token types
    "t5_encoder": ZooModel("tests.zoo_models:t5_encoder", ("--input", "input_ids:BxS:int64", "--input",
                                                           "attention_mask:BxS:int64", "--dim", "S=4:16:32"),
                           _tokens(16, with_types=None)),
    "segformer": ZooModel("tests.zoo_models:segformer", ("--input", "images:Bx3x64x64:float32"), _images(64)),
}
