"""`trtc diff --engines` with real TensorRT engines: their outputs against the FP32 ONNX graph."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from compiler.cli import cli
from tests.compiler.diagnose.conftest import DigitsBuild

pytestmark = [pytest.mark.tensorrt, pytest.mark.gpu]


def test_engines_outputs_are_compared_with_fp32(digits_int8: DigitsBuild, tmp_path: Path) -> None:
    """After `trtc rebuild` builds the INT8 engines, `trtc diff --engines` exits 0 and diff.json holds each output's
    comparison of the engines with the FP32 graph, at a cosine the gate would pass (0.99) and the same order of
    error as the INT8 graph's own output row."""
    directory = tmp_path / "m"
    shutil.copytree(digits_int8.directory, directory)
    rebuilt = CliRunner().invoke(cli, ["rebuild", str(directory), "-q"])
    assert rebuilt.exit_code == 0, rebuilt.output
    result = CliRunner().invoke(cli, ["diff", str(directory), "--engines", "--no-plot", "-q"])
    assert result.exit_code == 0, result.output
    report = json.loads((directory / "report" / "diff.json").read_text())
    engines = report["engines"][0]["outputs"]
    (name,) = json.loads((directory / "manifest.json").read_text())["output_names"]
    assert set(engines) == set(report["outputs"]) == {name}
    assert engines[name]["cosine"] > 0.99
    assert engines[name]["relative"] < 10 * report["outputs"][name]["relative"] + 1e-3
    assert f"engine bucket all vs FP32 ONNX: {name}: cosine" in result.output
