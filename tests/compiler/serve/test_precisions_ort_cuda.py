"""FP8 and INT4 weight-only graphs on ONNX Runtime's CUDA provider: what `trtc calibrate --fp8` and
`--int4-weights` write loads through ``compiler.load(..., device="cuda")`` and gives what the CPU provider gives
on the same graph. Skipped where onnxruntime is its CPU build or there is no GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from compiler.cli import cli
from compiler.core.manifest import read_manifest
from compiler.serve.load import load
from tests.builds import build_directory
from tests.compiler.serve.helpers import eager


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    return float(np.min((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-30)))


@pytest.mark.gpu
@pytest.mark.ort_cuda
@pytest.mark.parametrize("name", ["mlp", "transformer_encoder"])
@pytest.mark.parametrize("flag, precision", [("--fp8", "fp8"), ("--int4-weights", "int4")])
def test_fp8_and_int4_graphs_run_on_the_cuda_provider_as_on_the_cpu(name: str, flag: str, precision: str,
                                                                    tmp_path: Path) -> None:
    """`trtc calibrate` with ``flag`` exits 0; the graph it writes loads on the CUDA provider (the engines' device
    is a CUDA device), and for 5 rows its outputs agree with the CPU provider's run of the same graph (per-row
    cosine >= 0.999: both dequantize the same FP8/INT4 values, FP16 arithmetic differs) and with eager PyTorch
    FP32 (per-row cosine >= 0.98: the gate held the mean over its data to 0.99)."""
    directory = build_directory(tmp_path / name, name)
    result = CliRunner().invoke(cli, ["calibrate", str(directory), flag, "--calib-data", "random"])
    assert result.exit_code == 0, result.output
    spec = read_manifest(directory).spec
    feed = spec.example_feed(5, seed=5)
    with load(directory, backend="onnxruntime", device="cuda", precision=precision) as gpu, \
            load(directory, backend="onnxruntime", device="cpu", precision=precision) as cpu:
        assert str(gpu.device).startswith("cuda")
        on_gpu, on_cpu = gpu(feed)["out"], cpu(feed)["out"]
    assert _cosine(on_gpu, on_cpu) >= 0.999
    assert _cosine(on_gpu, eager(name, feed)) >= 0.98
