"""A zoo of real architectures at small sizes: each builds INT8 and FP16 at default settings.

`trtc build --int8|--fp16 --engine none` on plausible calibration data (smooth images; token
batches with padding and sentence pairs) for a YOLO-style detector with its decode, a ViT, a BERT
with three integer inputs, a GPT-2-style decoder, a segmentation net at 512x512, a T5 encoder (whose
relative-position buckets take a masked log(0)) and a SegFormer (whose decoder concatenates upsampled
stages) (tests/zoo_models.py). Passing means: the export check accepts FP32 kernel noise, calibration and
the accuracy gate run, the written graph computes in ONNX Runtime what the model computes in PyTorch,
and the reduced graph loads through ``compiler.load`` and computes close to it.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner

import compiler
from compiler.cli import cli
from tests.zoo_models import ZOO

CALIB_SAMPLES = 64
pytest.importorskip("transformers")


def _params() -> list[object]:
    return [pytest.param(name, precision, marks=[pytest.mark.slow], id=f"{name}-{precision}")
            for name in ZOO for precision in ("int8", "fp16")]


@pytest.fixture(scope="module")
def calib(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One calibration .npz per zoo model, written on first use."""
    folder = tmp_path_factory.mktemp("zoo-data")
    return {name: folder / f"{name}.npz" for name in ZOO}


def _data(name: str, path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        np.savez(path, **ZOO[name].data(CALIB_SAMPLES, np.random.default_rng(0)))
    return dict(np.load(path))


@pytest.mark.parametrize(("name", "precision"), _params())
def test_zoo_model_builds_at_defaults(name: str, precision: str, calib: dict[str, Path], tmp_path: Path) -> None:
    zoo = ZOO[name]
    data = _data(name, calib[name])
    out = tmp_path / name
    result = CliRunner().invoke(cli, ["build", "-q", "--model-factory", zoo.factory, *zoo.flags, f"--{precision}",
                                      "--calib-data", str(calib[name]), "--engine", "none", "--out", str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["precision"] == precision
    assert manifest["export"]["exporter"] == "dynamo", manifest["export"]["fallback_reason"]
    verification = manifest["verification"]
    assert "calib" in verification["inputs"] or str(calib[name]) in verification["inputs"]
    for check in verification["export"] + verification["passes"]:
        assert check["mismatched"] == 0 and check["cosine"] >= verification["min_cosine"], check
    accuracy = json.loads((out / "report" / "accuracy.json").read_text())[precision]
    assert accuracy["accuracy"] is not None, "the accuracy gate did not run"

    # the FP32 graph computes what the model computes, on calibration samples it was not traced with
    module_path, fn = zoo.factory.split(":")
    model = getattr(importlib.import_module(module_path), fn)()
    feed = {k: v[-3:] for k, v in data.items()}
    with torch.inference_mode():
        want = model(*(torch.from_numpy(feed[k]) for k in feed)).numpy()
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, feed)[0]
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * max(1.0, float(np.abs(want).max())))
    # the reduced graph as trtc serves it (its session options: SESSION_POLICY), through compiler.load
    reduced = compiler.load(out, backend="onnxruntime", device="cpu", precision=precision)
    low = np.asarray(next(iter(reduced(feed).values()))).astype(np.float64)  # a dict in, a dict of outputs out
    cosine = float(np.dot(low.ravel(), want.ravel()) / (np.linalg.norm(low) * np.linalg.norm(want)))
    assert cosine > 0.98, f"{precision} graph drifted from the model: cosine {cosine:.4f}"
