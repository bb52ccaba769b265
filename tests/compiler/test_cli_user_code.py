"""Failures in the user's own code (a factory, a forward, a state dict): one line, exit 2, the user's frame only."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from compiler.cli import cli

USER_MODULE = textwrap.dedent('''
    import torch
    from torch import nn


    def broken():
        raise ValueError("factory is broken")


    class Raises(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            raise RuntimeError("forward is broken")


    def raises():
        return Raises()


    class NoneOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            self.l(x)
            return None


    def none_out():
        return NoneOut()


    class Picky(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 3)

        def forward(self, x):
            if bool((x > 100).any()) or bool((x <= 100).any()):
                return self.l(x.reshape(x.shape[0], 7, -1))
            return self.l(x)


    def picky():
        return Picky()


    def small():
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
''')


def line_of(text: str) -> int:
    """The line number of ``text`` in the user's module."""
    return next(n for n, line in enumerate(USER_MODULE.splitlines(), 1) if text in line)


@pytest.fixture
def user_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding the user's module ``usermods.py``, importable as the CLI imports factories."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "usermods.py").write_text(USER_MODULE)
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    yield project
    sys.modules.pop("usermods", None)


def one_line_failure(args: list[str], out: Path) -> str:
    """Run ``trtc`` quietly; assert exit 2, one ``error:`` line without a traceback and no output directory left."""
    result = CliRunner().invoke(cli, [args[0], "-q", *args[1:], "--out", str(out)])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert not out.exists(), "a failed run must not create the output directory"
    return lines[0]


def test_a_factory_that_raises_is_one_line_at_the_users_frame(user_project: Path) -> None:
    """A --model-factory function that raises: exit 2, one line naming the factory, the exception and the user's
    file:line, and no frame of trtc or torch."""
    line = one_line_failure(["export", "--model-factory", "usermods:broken", "--input", "x:Bx4"],
                            user_project / "out")
    assert "--model-factory usermods:broken raised ValueError: factory is broken" in line
    assert f"usermods.py:{line_of('factory is broken')} in broken" in line
    assert "compiler/" not in line and "torch/" not in line


def test_a_forward_that_raises_says_so_at_the_users_frame(user_project: Path) -> None:
    """A forward whose own code raises: the line says the forward raised, with the exception and its file:line, and
    asks to fix the forward first."""
    line = one_line_failure(["build", "--model-factory", "usermods:raises", "--input", "x:Bx4", "--engine", "none"],
                            user_project / "out")
    assert ("the model's forward raised RuntimeError: forward is broken "
            f"(at usermods.py:{line_of('forward is broken')} in forward)") in line
    assert "fix the model's forward" in line


def test_a_forward_that_returns_none_is_named_not_the_onnx_file(user_project: Path) -> None:
    """A forward returning None: the line says so and where the forward is, instead of an invalid ONNX file and an
    operator to replace."""
    line = one_line_failure(["export", "--model-factory", "usermods:none_out", "--input", "x:Bx4"],
                            user_project / "out")
    assert "forward returned None" in line and "NoneOut.forward at usermods.py:" in line
    assert "ONNX" not in line and "operator" not in line


def test_a_model_that_fails_on_every_input_blames_the_model_not_the_data(user_project: Path) -> None:
    """A model that raises in eager PyTorch whatever it is given, built with calibration data: the line says it
    fails in eager PyTorch on generated inputs too, names the user's frame, and does not ask to fix the data."""
    import numpy as np

    np.savez(user_project / "calib.npz", x=np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32))
    line = one_line_failure(["build", "--model-factory", "usermods:picky", "--input", "x:Bx4", "--int8",
                             "--calib-data", str(user_project / "calib.npz"), "--engine", "none"],
                            user_project / "out")
    assert "fails in eager PyTorch" in line and "usermods.py:" in line and "in forward" in line
    assert "fix that data" not in line and "fix the model" in line


def test_a_state_dict_that_does_not_fit_names_its_keys(user_project: Path) -> None:
    """--weights of another architecture: the line names the first missing and unexpected keys, not a cut-off
    PyTorch message."""
    torch.save({"0.weight": torch.zeros(8, 4), "0.bias": torch.zeros(8), "extra.weight": torch.zeros(1)},
               user_project / "state.pt")
    line = one_line_failure(["export", "--model-factory", "usermods:small", "--weights", "state.pt",
                             "--input", "x:Bx4"], user_project / "out")
    assert "2 missing key(s): 2.weight, 2.bias" in line
    assert "1 unexpected key(s): extra.weight" in line


def test_a_forward_that_raises_at_a_larger_batch_is_one_line(user_project: Path) -> None:
    """A forward that raises only above batch 4, built with --buckets 1,8: the export check's eager run at batch 8
    fails in one line naming the batch, the exception at the user's frame and --buckets."""
    (user_project / "batchmods.py").write_text(textwrap.dedent('''
        from torch import nn


        class BigBatch(nn.Module):
            def __init__(self):
                super().__init__()
                self.l = nn.Linear(4, 4)

            def forward(self, x):
                if x.shape[0] > 4:
                    raise RuntimeError("batch too large for this model")
                return self.l(x)


        def bigbatch():
            return BigBatch()
    '''))
    line = one_line_failure(["export", "--model-factory", "batchmods:bigbatch", "--input", "x:Bx4", "--buckets", "1,8"],
                            user_project / "out")
    assert "the model's forward raised RuntimeError: batch too large for this model (at batchmods.py:" in line
    assert "at batch 8 in eager PyTorch" in line and "--buckets" in line
    sys.modules.pop("batchmods", None)
