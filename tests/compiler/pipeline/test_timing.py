"""Every second of a build is in its time record: report/timing.json and the summary's table, stages in order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from compiler.cli import cli

ROOT = Path(__file__).resolve().parents[3]
BUILD = ["build", "--model-factory", "examples.models:mlp", "--input", "x:Bx64", "--buckets", "1,4", "--int8",
         "--calib-data", "random", "--calib-samples", "16", "--engine", "none"]
STAGES = ["interpreter start, torch import, options", "imports", "checks before export", "calibration worker start",
          "model loading", "model fingerprint", "export inputs from the data", "export", "export check setup",
          "writing the exported ONNX", "graph passes", "writing model.onnx", "export check", "pass check",
          "export cleanup", "source snapshot", "model.onnx digest", "freeing the PyTorch model", "INT8 calibration"]


def test_the_build_records_and_prints_every_stage(tmp_path: Path) -> None:
    """`trtc build --int8 --engine none`: report/timing.json lists exactly the build's stages in the order they ran,
    their seconds and the process's add up with what no stage holds, and the summary prints the same table."""
    out = tmp_path / "m"
    result = CliRunner().invoke(cli, [*BUILD, "--out", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads((out / "report" / "timing.json").read_text())
    assert record["command"] == "trtc build" and list(record["stages"]) == STAGES
    assert all(seconds >= 0 for seconds in record["stages"].values())
    assert abs(sum(record["stages"].values()) + record["unaccounted_seconds"] - record["process_seconds"]) < 0.05
    printed = " ".join(result.output.split())
    assert "(outside every stage)" in printed and all(name in printed for name in STAGES)


@pytest.mark.slow
def test_the_stages_sum_to_the_wall_time_of_the_command(tmp_path: Path) -> None:
    """`python -m compiler.cli build` in a fresh process: the stages of its record sum to the wall time the caller
    measures within a second (start-up, the commit, the summary and the exit are all that is left outside)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "compiler.cli", *BUILD, "--out", str(tmp_path / "m")], env=env,
                          capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "m" / "report" / "timing.json").read_text())
    assert list(record["stages"]) == STAGES
    assert abs(wall - sum(record["stages"].values())) < 1.0, (wall, record)
