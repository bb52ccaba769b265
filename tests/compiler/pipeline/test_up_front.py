"""Every check of options and data runs before the model is loaded: one line, exit 2, the factory never called."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from compiler.cli import cli
from compiler.core.manifest import read_manifest

FACTORY = textwrap.dedent('''
    from pathlib import Path

    import numpy as np
    from torch import nn


    def small():
        Path("factory-called").write_text("yes")
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


    def bad_loader():
        yield {"x": np.zeros((1, 4), np.float32)}
        raise ValueError("the loader is broken")
''')


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with a factory that leaves ``factory-called`` behind when it runs, and data files:
    ``ok.npz`` (5 samples) and ``nan.npz`` (6 samples, a NaN in the last)."""
    (tmp_path / "upfront_models.py").write_text(FACTORY)
    x = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    np.savez(tmp_path / "ok.npz", x=x[:5])
    x[5, 1] = np.nan
    np.savez(tmp_path / "nan.npz", x=x)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("upfront_models", None)


def build(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["build", "-q", "--model-factory", "upfront_models:small", "--input", "x:Bx4",
                                      "--engine", "none", "--out", "out", *args])
    return result.exit_code, result.output


@pytest.mark.parametrize(("args", "needle"), [
    (["--int8", "--calib-data", "ok.npz", "--calib-samples", "0"], "--calib-samples 0"),
    (["--int8", "--calib-data", "ok.npz", "--calib-batch", "0"], "--calib-batch 0"),
    (["--int8", "--calib-data", "ok.npz", "--min-cosine", "2"], "--min-cosine 2: a cosine lies in [-1, 1]"),
    (["--int8", "--calib-data", "ok.npz", "--max-accuracy-drop", "101"], "--max-accuracy-drop 101"),
    (["--int8"], "--int8 needs calibration data"),
    (["--fp8"], "--fp8 needs calibration data"),
    (["--int4-weights"], "--int4-method awq needs calibration data"),
    (["--int8", "--calib-data", "nan.npz"], "nan.npz[5]: input 'x' holds NaN or Inf"),
    (["--int8", "--calib-data", "ok.npz", "--eval-data", "nan.npz"], "nan.npz[5]: input 'x' holds NaN or Inf"),
    (["--buckets", "1,100000000000"], "--buckets 100000000000: a batch of 100000000000 holds"),
    (["--int8", "--calib-loader", "upfront_models:bad_loader"],
     "--calib-loader upfront_models:bad_loader raised ValueError: the loader is broken (at upfront_models.py:"),
])
def test_refused_before_the_model_is_loaded(project: Path, args: list[str], needle: str) -> None:
    """Each bad option or data set: exit 2, one error line naming it, no output directory and the factory never
    called (no ``factory-called`` file): refused before the model is loaded, let alone exported."""
    code, output = build(*args)
    lines = [line for line in output.splitlines() if line.strip()]
    assert code == 2, output
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], output
    assert not (project / "out").exists()
    assert not (project / "factory-called").exists()


def test_a_calibration_batch_larger_than_the_samples_shrinks_with_a_note(project: Path) -> None:
    """--calib-batch 64 on 5 samples: the build succeeds, says that batches hold 5, and the manifest records a
    calibration of 5 samples in batches of 5."""
    result = CliRunner().invoke(cli, ["build", "--model-factory", "upfront_models:small", "--input", "x:Bx4",
                                      "--engine", "none", "--out", "out", "--int8", "--calib-data", "ok.npz",
                                      "--calib-batch", "64"])
    assert result.exit_code == 0, result.output
    assert "fewer than --calib-batch 64: batches of 5" in " ".join(result.output.split())
    data = read_manifest(project / "out").data["int8"]["calibration"]
    assert data["samples"] == 5 and data["batch_size"] == 5


def test_a_fixed_shape_onnx_builds_int8_from_its_own_shapes(tmp_path: Path) -> None:
    """An ONNX file of fixed input shape 1x4 (no batch dimension): `trtc build --int8` with calibration data of 6
    samples shaped 1x4 and no --input exits 0, the manifest reads the shape from the file, and the INT8 model's
    outputs are close to the FP32 model's in ONNX Runtime."""
    import torch

    from compiler.core.onnx_io import ort_session

    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    torch.onnx.export(model, (torch.randn(1, 4),), str(tmp_path / "fixed.onnx"), dynamo=False, input_names=["x"])
    x = np.random.default_rng(1).normal(size=(6, 1, 4)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["build", "-q", str(tmp_path / "fixed.onnx"), "--int8", "--calib-data",
                                      str(tmp_path / "calib.npz"), "--engine", "none", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert read_manifest(out).inputs == ("x:1x4:float32",)
    fp32 = ort_session(out / "model.onnx").run(None, {"x": x[0]})[0]
    int8 = ort_session(out / "model.int8.onnx").run(None, {"x": x[0]})[0]
    np.testing.assert_allclose(int8, fp32, rtol=0.1, atol=0.1)
