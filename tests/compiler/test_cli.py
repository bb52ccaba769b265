"""Bad input: one line that names the problem and the fix, a non-zero exit, no traceback, nothing written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from compiler.cli import cli
from examples import models


def run_export(args: list[str], out: Path) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["export", "-q", *args, "--out", str(out)])
    return result.exit_code, result.output


def assert_clean_failure(code: int, output: str, out: Path, *needles: str) -> None:
    lines = [line for line in output.splitlines() if line.strip()]
    assert code != 0
    assert "Traceback" not in output
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not out.exists(), "a failed run must not create the output directory"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("inputs")
    model = models.mlp()
    (d / "random.bin").write_bytes(bytes(range(256)) * 20)
    (d / "notes.txt").write_text("this is not a model\n")
    torch.jit.save(torch.jit.trace(model, torch.randn(2, 64)), d / "mlp.ts")
    data = (d / "mlp.ts").read_bytes()
    (d / "truncated.ts").write_bytes(data[: len(data) // 2])
    torch.save(model, d / "pickled.pt")
    torch.save(model.state_dict(), d / "state.pt")
    (d / "bad.toml").write_text('[model]\nfactory = "examples.models:mlp"\nshapes = ["x:Bx64"]\n')
    (d / "badtype.toml").write_text('[model]\nfactory = "examples.models:mlp"\n[build]\nbuckets = "1,2"\n')
    return {p.name: p for p in d.iterdir()}


@pytest.mark.parametrize(("args", "needles"), [
    (["missing.pt", "--input", "x:Bx64"], ("no such file", "check the path")),
    (["{random.bin}", "--input", "x:Bx64"], ("not a model file",)),
    (["{notes.txt}", "--input", "x:Bx64"], ("not a model file",)),
    (["{truncated.ts}", "--input", "x:Bx64"], ("notes",)),  # replaced below
    (["{pickled.pt}", "--input", "x:Bx64"], ("arbitrary code", "--trust-pickle")),
    (["{state.pt}", "--input", "x:Bx64"], ("state dict", "--model-factory")),
    (["{mlp.ts}"], ("no input shapes", "--input")),
    (["{mlp.ts}", "--input", "x:Bx65"], ("model rejects", "fix the --input")),
    (["--model-factory", "examples.models:nope", "--input", "x:Bx64"], ("no callable",)),
    (["--profile", "{bad.toml}"], ("unknown key model.shapes",)),
    (["--profile", "{badtype.toml}"], ("build.buckets", "expected list")),
])
def test_bad_input_fails_cleanly(args: list[str], needles: tuple[str, ...], files: dict[str, Path],
                                 tmp_path: Path) -> None:
    args = [files[a[1:-1]].as_posix() if a.startswith("{") else a for a in args]
    if any("truncated" in a for a in args):
        needles = ("truncated.ts",)
    code, output = run_export(args, tmp_path / "out")
    assert_clean_failure(code, output, tmp_path / "out", *needles)


def test_shape_spec_that_does_not_parse_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["export", "x.pt", "--input", "images:Bx3xQQ!", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "dimension 'QQ!'" in lines[0] and "NAME:SHAPE" in lines[0]
    assert not (tmp_path / "o").exists()


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "compiler.cli", "--debug", "export", "missing.pt", "--input",
                           "x:Bx64", "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "InputError" in proc.stderr


