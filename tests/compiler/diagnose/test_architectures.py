"""`trtc inspect` and `trtc diff` on real architectures: a MiniLM-like encoder (a small BERT from
``transformers.BertConfig``, random weights) and a detection model (a conv backbone with box and class heads),
each calibrated INT8 and then broken in one layer (one activation Q/DQ scale coarsened, the manifest's digest
updated): diff must list exactly that layer first and worst."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from compiler.cli import cli
from tests.compiler.diagnose.helpers import coarsen_activation_scale, export, single_consumer_layers

pytestmark = pytest.mark.slow


class SmallBert(torch.nn.Module):
    """BERT of 2 layers, width 64, 4 heads (MiniLM's shape, smaller), random weights: the last hidden state."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=256, max_position_embeddings=64, attn_implementation="eager")
        self.bert = BertModel(config, add_pooling_layer=False).eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class Detector(torch.nn.Module):
    """A small conv backbone with a box head (4 numbers per anchor) and a class head (5 classes per anchor)."""

    def __init__(self, anchors: int = 3, classes: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        conv = torch.nn.Conv2d
        self.backbone = torch.nn.Sequential(conv(3, 32, 3, 2, 1), torch.nn.ReLU(), conv(32, 32, 3, 1, 1),
                                            torch.nn.ReLU(), conv(32, 64, 3, 2, 1), torch.nn.ReLU(),
                                            conv(64, 64, 3, 1, 1), torch.nn.ReLU())
        self.boxes = conv(64, 4 * anchors, 1)
        self.scores = conv(64, classes * anchors, 1)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.backbone(images)
        return self.boxes(features).flatten(2), torch.sigmoid(self.scores(features).flatten(2))


def small_bert() -> torch.nn.Module:
    return SmallBert().eval()


def detector() -> torch.nn.Module:
    return Detector().eval()


def calibrated(tmp: Path, factory: str, inputs: list[str], dims: dict[str, str], data: dict[str, np.ndarray]) -> Path:
    np.savez(tmp / "data.npz", **data)
    directory = export(tmp / "m", factory, inputs, dims)
    data_file = str(tmp / "data.npz")
    result = CliRunner().invoke(cli, ["calibrate", str(directory), "-q", "--int8", "--calib-data", data_file,
                                      "--eval-data", data_file, "--min-cosine", "0.5", "--max-fallback", "0"])
    assert result.exit_code == 0, result.output
    return directory


def check_break_found(directory: Path, op_types: tuple[str, ...]) -> None:
    inspect = CliRunner().invoke(cli, ["inspect", str(directory)])
    assert inspect.exit_code == 0, inspect.output
    assert "accuracy gate, int8: PASS" in inspect.output and " INT8" in inspect.output
    layers = single_consumer_layers(directory / "model.int8.onnx", op_types)
    assert layers, "no layer to break"
    layer = layers[len(layers) // 2]
    coarsen_activation_scale(directory, layer, factor=32.0)
    result = CliRunner().invoke(cli, ["diff", str(directory), "-q", "--no-plot"])
    assert result.exit_code == 0, result.output
    rows = json.loads((directory / "report" / "diff.json").read_text())["layers"]
    assert rows[0]["layer"] == layer, [(r["layer"], r["isolated"]) for r in rows[:4]]
    assert all(r["isolated"]["relative"] < rows[0]["isolated"]["relative"] for r in rows[1:])


def test_minilm_like_encoder(tmp_path: Path) -> None:
    """On the small BERT, inspect shows INT8 layers and a passing gate, and diff ranks the broken MatMul first."""
    rng = np.random.default_rng(0)
    data = {"input_ids": rng.integers(0, 1000, (32, 16)).astype(np.int64),
            "attention_mask": np.ones((32, 16), np.int64)}
    directory = calibrated(tmp_path, "tests.compiler.diagnose.test_architectures:small_bert",
                           ["input_ids:BxS:int64", "attention_mask:BxS:int64"], {"S": "1:16:32"}, data)
    check_break_found(directory, ("MatMul", "Gemm"))


def test_detection_model(tmp_path: Path) -> None:
    """On the detector (two outputs), inspect shows INT8 layers and diff ranks the broken Conv first."""
    images = np.random.default_rng(0).standard_normal((32, 3, 32, 32)).astype(np.float32)
    directory = calibrated(tmp_path, "tests.compiler.diagnose.test_architectures:detector", ["images:Bx3x32x32"], {},
                           {"images": images})
    check_break_found(directory, ("Conv",))
