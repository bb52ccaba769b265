"""`trtc build` end to end on the digits CNN: artifacts, exit codes, bad input, atomicity under SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from compiler.cli import cli
from compiler.core.capabilities import tensorrt_version
from compiler.core.files import directory_lock, sha256_files
from examples.digits import train_digits
from tests.project import ROOT

pytestmark = pytest.mark.slow
TRT_MISSING = ("TensorRT is not installed: engines not built; install trtc[tensorrt] on a machine with an NVIDIA "
               "GPU and run `trtc rebuild {}`")


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's inputs, trained briefly: model.pt (ExportedProgram, batch <= 32), calib.npz, eval.npz."""
    d = tmp_path_factory.mktemp("digits")
    model, splits = train_digits(epochs=3)
    batch = torch.export.Dim("batch", min=1, max=32)
    program = torch.export.export(model, (torch.from_numpy(splits.test_x[:2]),), dynamic_shapes=({0: batch},))
    torch.export.save(program, d / "model.pt")
    np.savez(d / "calib.npz", images=splits.calib_x[:128])
    np.savez(d / "eval.npz", images=splits.test_x, labels=splits.test_y)
    return d


def build(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["build", "-q", *args])
    return result.exit_code, result.output


def int8_args(digits: Path, out: Path) -> list[str]:
    return [str(digits / "model.pt"), "--int8", "--buckets", "1,4,8,16", "--calib-data", str(digits / "calib.npz"),
            "--eval-data", str(digits / "eval.npz"), "--out", str(out)]


def files_of(out: Path) -> dict[str, bytes]:
    """The build's files; hidden ones (the lock, a killed run's staging folder) are not part of it."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(out).parts)}


def test_build_writes_every_artifact_and_says_when_engines_were_not_built(digits: Path, tmp_path: Path) -> None:
    out = tmp_path / "m"
    code, output = build(int8_args(digits, out))
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"fp32", "int8"} <= set(manifest["onnx"]) and manifest["precision"] == "int8"
    for entry in manifest["onnx"].values():
        assert entry["sha256"] == sha256_files([out / f for f in entry["files"]])
    assert manifest["calibration"]["samples"] == 128 and manifest["calibration"]["random_data"] is False
    assert manifest["build"]["buckets"] == [1, 4, 8, 16]
    report = json.loads((out / "report" / "accuracy.json").read_text())
    assert report["int8"]["accuracy"]["passed"] and report["int8"]["accuracy"]["drop_points"] <= 0.5
    if tensorrt_version() is None:
        assert code == 4
        assert output.strip().splitlines()[-1] == "error: " + TRT_MISSING.format(out)
        assert manifest["engines"] == [] and "TensorRT is not installed" in manifest["engines_note"]
    else:
        assert code == 0, output
        assert [e["bucket"] for e in manifest["engines"]] == [1, 4, 8, 16]
    code, output = build([*int8_args(digits, out), "--engine", "none"])
    assert code == 0, output
    assert json.loads((out / "manifest.json").read_text())["engines_note"] == "not built: --engine none"
    # CI's view of that directory: stale (exit 1), and a rebuild needs TensorRT
    result = CliRunner().invoke(cli, ["check", str(out)])
    assert result.exit_code == 1 and "engines never built" in result.output
    assert f"trtc rebuild {out} --if-stale" in result.output
    result = CliRunner().invoke(cli, ["rebuild", str(out), "--if-stale", "-q"])
    if tensorrt_version() is None:
        assert result.exit_code == 4 and TRT_MISSING.format(out) in result.output
    else:
        assert result.exit_code == 0, result.output
    result = CliRunner().invoke(cli, ["check", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "no manifest.json" in result.output


@pytest.mark.parametrize(("extra", "needle"), [
    (["--buckets", "0,4"], "bucket 0 is not a positive integer"),
    (["--buckets", "1,x"], "bucket 'x' is not a positive integer"),
    (["--buckets", "1,64"], "bucket 64 is larger than the model allows"),
    (["--opt-level", "9"], "--opt-level"),
    (["--int8", "--calib-data", "nowhere.npz"], "no such calibration data"),
])
def test_build_rejects_bad_input_before_writing(digits: Path, tmp_path: Path, extra: list[str], needle: str) -> None:
    out = tmp_path / "bad"
    code, output = build([str(digits / "model.pt"), "--out", str(out), "--engine", "none", *extra])
    assert code == 2, output
    assert needle in output and "Traceback" not in output
    assert not out.exists()


def test_unsorted_buckets_are_normalized_and_said(digits: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["build", str(digits / "model.pt"), "--buckets", "8,1,4,4", "--engine",
                                      "none", "--out", str(tmp_path / "n"), "-q"])
    assert result.exit_code == 0, result.output
    assert "normalized to 1,4,8" in result.output
    assert json.loads((tmp_path / "n" / "manifest.json").read_text())["buckets"] == [1, 4, 8]


def test_dims_that_contradict_the_model_are_refused(tmp_path: Path) -> None:
    from examples.models import transformer_encoder

    s = torch.export.Dim("S", min=1, max=64)
    b = torch.export.Dim("B", min=1, max=16)
    ids = torch.zeros(2, 8, dtype=torch.int64)
    program = torch.export.export(transformer_encoder(), (ids, torch.ones_like(ids)),
                                  dynamic_shapes=({0: b, 1: s}, {0: b, 1: s}))
    torch.export.save(program, tmp_path / "tr.pt2")
    code, output = build([str(tmp_path / "tr.pt2"), "--input", "input_ids:BxS:int64", "--input",
                          "attention_mask:BxS:int64", "--dim", "S=1:16:128", "--buckets", "1,4", "--engine", "none",
                          "--out", str(tmp_path / "o")])
    assert code == 2 and "--dim S=1:16:128 contradicts the model" in output, output


def test_another_models_directory_needs_force(digits: Path, tmp_path: Path) -> None:
    out = tmp_path / "shared"
    assert export_mlp(out) == 0
    code, output = build([str(digits / "model.pt"), "--engine", "none", "--out", str(out)])
    assert code == 2 and "holds the build of another model" in output and "--force" in output
    code, output = build([str(digits / "model.pt"), "--engine", "none", "--out", str(out), "--force"])
    assert code == 0, output


def export_mlp(out: Path) -> int:
    return CliRunner().invoke(cli, ["export", "-q", "--model-factory", "examples.models:mlp", "--input", "x:Bx64",
                                    "--out", str(out)]).exit_code


def test_a_second_build_into_a_locked_directory_says_who_holds_it(digits: Path, tmp_path: Path) -> None:
    out = tmp_path / "locked"
    with directory_lock(out, "trtc build (the first one)"):
        code, output = build([str(digits / "model.pt"), "--engine", "none", "--out", str(out)])
    assert code == 2
    assert f"pid {os.getpid()}" in output and "trtc build (the first one)" in output


# A SIGKILL test needs the build to be at a known point when the signal lands. The wrapper below runs the real
# CLI in a subprocess and, through a slow calibration loader or a patched manifest write, touches a marker file and
# sleeps at that point; the test then kills it.
WRAPPER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    marker = Path(os.environ["MARKER"])
    if os.environ.get("PAUSE_AT") == "manifest":
        import compiler.core.files as files
        real = files.atomic_write_bytes
        def paused(path, data):
            if Path(path).name == "manifest.json":
                tmp = Path(path).with_name(".manifest.json.partial.tmp")
                tmp.write_bytes(data[: len(data) // 2])
                marker.touch()
                time.sleep(60)
            real(path, data)
        files.atomic_write_bytes = paused
    from compiler.cli import main
    sys.argv = ["trtc", *sys.argv[1:]]
    main()
""")

SLOW_LOADER = textwrap.dedent("""
    import os, time
    from pathlib import Path
    import numpy as np
    def batches():
        data = np.load(os.environ["CALIB"])["images"]
        for i in range(0, len(data), 16):
            if i == 32:
                Path(os.environ["MARKER"]).touch()
                time.sleep(60)
            yield {"images": data[i:i + 16]}
""")


@pytest.mark.slow
@pytest.mark.parametrize("pause_at", ["calibration", "manifest"])
def test_sigkill_mid_build_leaves_the_previous_build_intact(digits: Path, tmp_path: Path, pause_at: str) -> None:
    out = tmp_path / "atomic"
    code, output = build([*int8_args(digits, out), "--engine", "none"])
    assert code == 0, output
    before = files_of(out)
    (tmp_path / "slowcalib.py").write_text(SLOW_LOADER)
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    marker = tmp_path / "marker"
    env = {**os.environ, "MARKER": str(marker), "PAUSE_AT": pause_at, "CALIB": str(digits / "calib.npz"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    args = [sys.executable, str(tmp_path / "wrapper.py"), "build", "-q", str(digits / "model.pt"), "--int8",
            "--buckets", "1,4,8,16", "--engine", "none", "--out", str(out), "--calib-samples", "96",
            "--eval-data", str(digits / "eval.npz")]
    args += ["--calib-loader", "slowcalib:batches"] if pause_at == "calibration" else \
        ["--calib-data", str(digits / "calib.npz"), "--percentile", "99.9"]  # a change, so the build is new
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "the build never reached the pause point"
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert files_of(out) == before  # the previous build, byte for byte
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["onnx"].values():
        assert entry["sha256"] == sha256_files([out / f for f in entry["files"]])
    # the next build clears what the killed one left behind
    code, output = build([*int8_args(digits, out), "--engine", "none"])
    assert code == 0, output
    assert not list(out.glob(".staging-*"))


NOISY = '''
import torch


class Head(torch.nn.Module):
    def __init__(self, noisy: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.noisy = torch.nn.Linear(8, 4), noisy

    def forward(self, x):
        y = self.fc(x)
        return y + torch.rand_like(y) if self.noisy else y


def steady():
    return Head(False)


def noisy():
    return Head(True)
'''


def test_a_failed_export_check_ends_the_calibration_beside_it(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Proves: `trtc build --int8` of a model whose ONNX export differs from eager PyTorch (random noise in forward)
    fails its export check with exit 3 while the calibration worker already has model.onnx; the directory then
    holds the previous build byte for byte (no calibration file of the abandoned attempt, no staging folder) and
    no spawned worker process is left running."""
    import psutil

    (tmp_path / "noisy_heads.py").write_text(NOISY)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    args = ["--input", "x:Bx8", "--buckets", "1,4", "--int8", "--calib-data", "random", "--calib-samples", "16",
            "--engine", "none", "--out", str(out)]
    code, output = build(["--model-factory", "noisy_heads:steady", *args])
    assert code == 0, output
    before = files_of(out)
    code, output = build(["--model-factory", "noisy_heads:noisy", "--force", *args])
    assert code == 3 and "export check" in output, output
    assert files_of(out) == before
    assert not [p for p in out.iterdir() if p.name.startswith(".") and p.is_dir()]

    def workers() -> list[Any]:
        return [c for c in psutil.Process().children(recursive=True)
                if "spawn_main" in " ".join(c.cmdline()) and c.is_running()]

    deadline = time.monotonic() + 10
    while workers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not workers()
