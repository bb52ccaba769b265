"""Acceptance tests of the FP8 and INT4 weight-only engine path, for a machine with TensorRT and an NVIDIA GPU
(skipped elsewhere, tests/conftest.py): ``trtc build --fp8`` / ``--int4-weights`` through real TensorRT builds of
the strongly typed graphs, checked against ONNX Runtime's FP32 reference as the accuracy gate checked the graphs.

Unproven until they run there: that TensorRT's ONNX parser takes FP8 Q/DQ with ``float8e4m3fn`` zero points and
FP8 weights behind a DequantizeLinear, and INT4 weights behind a blocked DequantizeLinear (opset 21, block 32,
FP16 scales) followed by MatMul/Gemm, and builds kernels for them; that such engines meet the gate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from calibration.accuracy import row_cosines
from compiler.core.settings import BuildSettings, CalibrationSettings, ExportSettings, GateSettings, ModelSource
from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec

pytestmark = pytest.mark.tensorrt

CNN = ("examples.models:resnet_digits", ["images:Bx1x8x8"], {})
TRANSFORMER = ("examples.models:transformer_encoder", ["input_ids:BxS:int64", "attention_mask:BxS:int64"],
               {"S": "1:16:32"})


def _spec(model: tuple[str, list[str], dict[str, str]]) -> ModelSpec:
    return ModelSpec(tuple(parse_input_spec(i) for i in model[1]),
                     dict(parse_dim_range(f"{k}={v}") for k, v in model[2].items()))


def _build(out: Path, model: tuple[str, list[str], dict[str, str]], precision: str) -> dict[str, Any]:
    from compiler.pipeline.build import build_directory

    buckets = (1, 4, 8)
    export = ExportSettings(ModelSource(factory=model[0]), out, _spec(model), buckets)
    calibration = CalibrationSettings(precision, data="random", samples=64)
    return build_directory(export, calibration, BuildSettings(buckets=buckets, precision=precision))


def _gpu_capability() -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(0)


def _engines_meet_the_gate(out: Path, model: tuple[str, list[str], dict[str, str]]) -> None:
    from compiler.core.onnx_io import ort_session
    from compiler.serve.load import load

    spec = _spec(model)
    reference = ort_session(out / "model.onnx", ["CPUExecutionProvider"])
    with load(out, backend="tensorrt") as engines:
        for batch in (1, 3, 8):
            feed = spec.example_feed(batch, seed=batch)
            result = engines(feed if len(feed) > 1 else feed[spec.input_names[0]])
            value = next(iter(result.values())) if isinstance(result, dict) else result
            got = np.asarray(value.cpu().numpy() if hasattr(value, "cpu") else value)
            cosine = float(row_cosines(got, np.asarray(reference.run(None, feed)[0])).mean())
            assert cosine >= GateSettings().min_cosine, f"batch {batch}: cosine {cosine:.5f}"


@pytest.mark.parametrize("model", [CNN, TRANSFORMER], ids=["cnn", "transformer"])
def test_fp8_engines_read_fp8_and_meet_the_gate(tmp_path: Path, model: tuple[str, list[str], dict[str, str]]) -> None:
    """Proves, on a GPU of compute capability 8.9+: ``trtc build --fp8`` builds every bucket's engine from
    model.fp8.onnx, some layer of each engine's layers.json reads or writes FP8 tensors, the manifest records 8.9
    on the graph, and the engines meet the accuracy gate against the FP32 ONNX at batches 1, 3 and 8."""
    import json

    from compiler.backends.tensorrt.layers import layer_io_types

    if _gpu_capability() < (8, 9):
        pytest.skip("FP8 engines need compute capability 8.9+; the refusal is test_fp8_build_refuses_an_older_gpu")
    out = tmp_path / "m"
    manifest = _build(out, model, "fp8")
    assert manifest["onnx"]["fp8"]["requires_compute_capability"] == "8.9"
    assert {e["onnx"] for e in manifest["engines"]} == {manifest["onnx"]["fp8"]["file"]}
    for entry in manifest["engines"]:
        layers = json.loads((out / entry["layers"]["file"]).read_text())["Layers"]
        typed = [layer_io_types(layer) for layer in layers if isinstance(layer, dict)]
        assert any("FP8" in inputs + outputs for inputs, outputs in typed), typed
    _engines_meet_the_gate(out, model)


def test_fp8_build_refuses_an_older_gpu(tmp_path: Path) -> None:
    """Proves, on a GPU below compute capability 8.9: ``trtc build --fp8`` stops in one InputError naming 8.9 and
    this GPU before exporting (the directory gets no manifest)."""
    from compiler.core.errors import InputError

    if _gpu_capability() >= (8, 9):
        pytest.skip("this GPU runs FP8: test_fp8_engines_read_fp8_and_meet_the_gate covers it")
    with pytest.raises(InputError, match=r"compute capability 8\.9\+"):
        _build(tmp_path / "m", CNN, "fp8")
    assert not (tmp_path / "m" / "manifest.json").exists()


def test_int4_weight_only_engines_meet_the_gate(tmp_path: Path) -> None:
    """Proves: ``trtc build --int4-weights`` of the transformer builds its engines from model.int4.onnx (INT4 weights
    behind blocked DequantizeLinear nodes, FP16 activations) and they meet the accuracy gate at batches 1, 3, 8."""
    out = tmp_path / "m"
    manifest = _build(out, TRANSFORMER, "int4")
    assert manifest["int4"]["layers"] > 0
    assert {e["onnx"] for e in manifest["engines"]} == {manifest["onnx"]["int4"]["file"]}
    _engines_meet_the_gate(out, TRANSFORMER)
