"""The digits CNN's INT8 build, trained and calibrated once for the diagnosis tests, and a copy per test."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from compiler.cli import cli
from examples.digits import train_digits
from tests.compiler.diagnose.helpers import export


@dataclass(frozen=True)
class DigitsBuild:
    directory: Path  # an INT8 build (FP16 rest), never modified: tests work on copies
    calib: Path
    eval: Path


@pytest.fixture(scope="module")
def digits_int8(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DigitsBuild]:
    """The bundled ResNet-style CNN trained on scikit-learn's digits (3 epochs), exported and calibrated INT8 with
    the held-out split as evaluation data (labels: the gate is on top-1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("digits")
    model, splits = train_digits(epochs=3)
    torch.save(model.state_dict(), tmp / "weights.pt")
    np.savez(tmp / "calib.npz", images=splits.calib_x)
    np.savez(tmp / "eval.npz", images=splits.test_x, labels=splits.test_y)
    directory = export(tmp / "m", "examples.models:resnet_digits", ["images:Bx1x8x8"], weights=tmp / "weights.pt")
    result = CliRunner().invoke(cli, ["calibrate", str(directory), "-q", "--int8", "--calib-data",
                                      str(tmp / "calib.npz"), "--eval-data", str(tmp / "eval.npz")])
    assert result.exit_code == 0, result.output
    torch.set_num_threads(threads)
    yield DigitsBuild(directory, tmp / "calib.npz", tmp / "eval.npz")


@pytest.fixture
def digits_copy(digits_int8: DigitsBuild, tmp_path: Path) -> Path:
    shutil.copytree(digits_int8.directory, tmp_path / "m")
    return tmp_path / "m"
