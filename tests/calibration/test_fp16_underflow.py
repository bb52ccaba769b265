"""FP16 underflow: a layer whose values all lie below FP16's smallest normal stays FP32 by itself when calibration
measured its range, and a gate that fails on an underflowing output says so (the output, FP16's limits, the layer
to keep in FP32) instead of asking for more calibration data or another --calib-method."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from onnx import helper
from torch import nn

import compiler
from calibration.fp16 import fp16_model_from
from calibration.fp16_policy import FP16_MIN_NORMAL, Fp16Policy
from compiler.cli import cli
from compiler.core.errors import InputError
from tests.onnx_helpers import make_model, tensor

RNG = np.random.default_rng(0)


class TinyHead(nn.Module):
    """Outputs around 1e-22: (h * 1e-11) squared, h a linear layer's output. In FP16 both products flush to zero."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return (h * 1e-11) * (h * 1e-11)


def tiny_head() -> nn.Module:
    return TinyHead().eval()


def _build(tmp_path: Path, *flags: str) -> tuple[int, str, Path]:
    np.savez(tmp_path / "calib.npz", x=RNG.standard_normal((32, 16)).astype(np.float32))
    np.savez(tmp_path / "eval.npz", x=RNG.standard_normal((16, 16)).astype(np.float32))
    out = tmp_path / "m"
    result = CliRunner().invoke(cli, ["build", "-q", "--model-factory", f"{__name__}:tiny_head", "--input", "x:Bx16",
                                      "--fp16", "--buckets", "1,4", "--eval-data", str(tmp_path / "eval.npz"), *flags,
                                      "--engine", "none", "--out", str(out)])
    return result.exit_code, result.output, out


def test_layers_below_fp16s_smallest_normal_stay_fp32_at_defaults(tmp_path: Path) -> None:
    """With calibration data, the two products (max |x| 1.9e-11 and 3.5e-22) are kept in FP32 by the range rule,
    with the reason naming FP16's smallest normal; the gate passes on its first candidate (nothing kept by the
    fallback), and the FP16 graph served through ``compiler.load`` gives eager PyTorch's outputs (cosine 0.99+)."""
    code, output, out = _build(tmp_path, "--calib-data", str(tmp_path / "calib.npz"))
    assert code == 0, output
    report = json.loads((out / "report" / "accuracy.json").read_text())["fp16"]
    kept = report["fp16"]["fp32_nodes"]
    assert sum("below FP16's smallest normal" in why for why in kept.values()) == 2, kept
    assert report["accuracy"]["passed"] and report["kept_in_fp32"] == {}
    x = np.load(tmp_path / "eval.npz")["x"][:4]
    with torch.no_grad():
        want = tiny_head()(torch.from_numpy(x)).numpy().astype(np.float64).ravel()
    got = np.asarray(compiler.load(out, backend="onnxruntime", device="cpu", precision="fp16")(x), np.float64).ravel()
    assert float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want))) >= 0.99


def test_an_underflowing_output_is_named_with_its_fix(tmp_path: Path) -> None:
    """Without calibration data (no ranges, so no range rule) and no fallback, the FP16 gate fails (exit 3) with one
    line that names the output, its FP32 maximum, FP16's smallest normal and subnormal, and --keep-fp32 with the
    node that produces it, and not --calib-method."""
    code, output, _ = _build(tmp_path, "--max-fallback", "0")
    assert code == 3, output
    last = output.strip().splitlines()[-1]
    assert last.startswith("error: the fp16 model misses the accuracy gate") and "Traceback" not in output
    assert "below FP16's smallest normal 6.1e-05 (smallest subnormal 6e-08)" in last
    assert "--keep-fp32 node_mul" in last and "--calib-method" not in last


def test_the_underflow_rule_reads_only_nonzero_maxima_below_its_threshold() -> None:
    """A Mul whose output max |x| is 1e-9 is kept in FP32 for underflow; at exactly 0 (nothing to lose) or above
    the threshold it converts; threshold 0 turns the rule off; a threshold at or above the overflow one is
    refused."""
    model = make_model([helper.make_node("Mul", ["x", "x"], ["y"], name="square")],
                       [tensor("x", ["B", 4])], [tensor("y", ["B", 4])], {})
    for value, policy, kept in ((1e-9, Fp16Policy(), True), (0.0, Fp16Policy(), False),
                                (2 * FP16_MIN_NORMAL, Fp16Policy(), False), (1e-9, Fp16Policy(underflow_threshold=0),
                                                                             False)):
        _, report = fp16_model_from(model, policy, {"x": 1.0, "y": value})
        assert ("square" in report.fp32_nodes) is kept, (value, policy)
    with pytest.raises(InputError, match="underflow_threshold"):
        Fp16Policy(underflow_threshold=Fp16Policy().overflow_threshold)
