"""No silent surprises: a directory of the user's own files, two precisions at once, a triton/ folder in the working
directory, a manifest missing a key: each is one line (or, for triton/, a working export that says why)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from compiler.cli import cli
from compiler.core.files import sha256_file
from tests.manifests import manifest_json, write_manifest_json

ROOT = Path(__file__).resolve().parents[3]
MLP = ["--model-factory", "examples.models:mlp", "--input", "x:Bx64", "--buckets", "1,2"]


def one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in output, output
    return lines[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An FP32 build of the example MLP without engines."""
    out = tmp_path_factory.mktemp("built") / "m"
    result = CliRunner().invoke(cli, ["build", "-q", *MLP, "--engine", "none", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("command", ["build", "export"])
def test_a_directory_of_the_users_files_is_refused_without_force(tmp_path: Path, command: str) -> None:
    """--out holding the user's own model.onnx (no manifest): exit 2, one line naming the directory, the file and
    --force, the user's file untouched; with --force the build is written there."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "model.onnx").write_bytes(b"the user's own model")
    extra = ["--engine", "none"] if command == "build" else []
    result = CliRunner().invoke(cli, [command, "-q", *MLP, *extra, "--out", str(out)])
    assert result.exit_code == 2, result.output
    line = one_error_line(result.output)
    assert str(out) in line and "model.onnx" in line and "--force" in line and "holds no trtc build" in line
    assert (out / "model.onnx").read_bytes() == b"the user's own model" and sorted(os.listdir(out)) == ["model.onnx"]
    forced = CliRunner().invoke(cli, [command, "-q", *MLP, *extra, "--force", "--out", str(out)])
    assert forced.exit_code == 0, forced.output
    assert (out / "manifest.json").is_file() and (out / "model.onnx").read_bytes() != b"the user's own model"


@pytest.mark.parametrize(("flags", "needle"), [
    (["--int8", "--fp16"], "--int8 alone already runs what is not INT8 in FP16"),
    (["--fp16", "--fp8"], "--fp8 alone already runs what is not FP8 in FP16"),
    (["--int8", "--int4-weights"], "--int8 and --int4-weights given together"),
])
def test_two_precisions_at_once_are_refused(tmp_path: Path, flags: list[str], needle: str) -> None:
    """Two precision flags: exit 2, one line naming both and what the single flag already does; nothing written."""
    result = CliRunner().invoke(cli, ["build", "-q", *MLP, *flags, "--calib-data", "random", "--engine", "none",
                                      "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    assert needle in one_error_line(result.output)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_a_triton_folder_in_the_working_directory_does_not_stop_the_dynamo_exporter(tmp_path: Path) -> None:
    """A triton/ model repository in the working directory (as `trtc export-triton --repo triton` writes it) would
    import as an empty `triton` package and break torch's dynamo exporter: in a fresh `python -m compiler.cli`
    process there, the export uses the dynamo exporter, records no fallback, and says which folder it stepped
    around."""
    (tmp_path / "triton" / "m" / "1").mkdir(parents=True)
    (tmp_path / "triton" / "m" / "config.pbtxt").write_text('name: "m"\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "compiler.cli", "export", *MLP, "--out", "out"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    export = json.loads((tmp_path / "out" / "manifest.json").read_text())["export"]
    assert export["exporter"] == "dynamo" and export["fallback_reason"] is None
    assert "shadows the triton package" in " ".join((proc.stdout + proc.stderr).split())


@pytest.mark.parametrize("key", ["onnx", "buckets"])
@pytest.mark.parametrize("command", [["check"], ["bench", "--backends", "torch"], ["rebuild"],
                                     ["calibrate", "--fp16", "--calib-data", "random"],
                                     ["export-triton", "--repo", "{repo}"]])
def test_a_manifest_missing_a_key_is_one_line_in_every_command(built: Path, tmp_path: Path, key: str,
                                                               command: list[str]) -> None:
    """A manifest with ``key`` deleted: every command that reads the directory exits 2 with one line naming the file
    and the key, and changes no file of the directory."""
    directory = tmp_path / "m"
    shutil.copytree(built, directory)
    data = manifest_json(directory)
    del data[key]
    write_manifest_json(directory / "manifest.json", data)
    before = {p.name: sha256_file(p) for p in directory.rglob("*") if p.is_file()}
    args = [a.replace("{repo}", str(tmp_path / "repo")) for a in command]
    result = CliRunner().invoke(cli, [args[0], "-q", str(directory), *args[1:]])
    assert result.exit_code == 2, result.output
    line = one_error_line(result.output)
    assert f"the key '{key}' is missing" in line and str(directory / "manifest.json") in line
    assert {p.name: sha256_file(p) for p in directory.rglob("*") if p.is_file()} == before


def test_load_refuses_a_manifest_missing_a_key(built: Path, tmp_path: Path) -> None:
    """compiler.load on a manifest without 'onnx': InputError naming the key."""
    import compiler
    from compiler.core.errors import InputError

    directory = tmp_path / "m"
    shutil.copytree(built, directory)
    data = manifest_json(directory)
    del data["onnx"]
    write_manifest_json(directory / "manifest.json", data)
    with pytest.raises(InputError, match="the key 'onnx' is missing"):
        compiler.load(directory, backend="onnxruntime")


def test_a_changed_data_file_is_named_itself(built: Path, tmp_path: Path) -> None:
    """Four bytes of model.onnx.data changed: `trtc calibrate` exits 2 with one line naming model.onnx.data (not the
    graph, not another precision's file) as the file whose sha256 differs; the directory is left as it was."""
    directory = tmp_path / "m"
    shutil.copytree(built, directory)
    with (directory / "model.onnx.data").open("r+b") as data:
        data.write(b"\0\0\0\0")
    before = {p.name: sha256_file(p) for p in directory.rglob("*") if p.is_file()}
    result = CliRunner().invoke(cli, ["calibrate", "-q", str(directory), "--fp16", "--calib-data", "random"])
    assert result.exit_code == 2, result.output
    line = one_error_line(result.output)
    assert f"{directory / 'model.onnx.data'} does not match the sha256" in line
    assert {p.name: sha256_file(p) for p in directory.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("path", ["../elsewhere/model.onnx", "/tmp/model.onnx"])
def test_a_manifest_path_out_of_the_directory_says_it_leaves_it(built: Path, tmp_path: Path, path: str) -> None:
    """The fp32 entry's graph moved to a path with '..' or an absolute one (its files list untouched): `trtc check`
    exits 2 with one line saying that path leaves the directory."""
    directory = tmp_path / "m"
    shutil.copytree(built, directory)
    data = manifest_json(directory)
    data["onnx"]["fp32"]["file"] = path
    write_manifest_json(directory / "manifest.json", data)
    result = CliRunner().invoke(cli, ["check", "-q", str(directory)])
    assert result.exit_code == 2, result.output
    line = one_error_line(result.output)
    assert f"{path!r} named in its records leaves the directory" in line


def test_calibrate_int8_without_data_is_refused_first(built: Path, tmp_path: Path) -> None:
    """`trtc calibrate DIR --int8` with no data and no calibration cache: exit 2, one line saying INT8 needs
    calibration data, and the directory as it was."""
    directory = tmp_path / "m"
    shutil.copytree(built, directory)
    before = {p.name: sha256_file(p) for p in directory.rglob("*") if p.is_file()}
    result = CliRunner().invoke(cli, ["calibrate", "-q", str(directory), "--int8"])
    assert result.exit_code == 2, result.output
    assert "--int8 needs calibration data" in one_error_line(result.output)
    assert {p.name: sha256_file(p) for p in directory.rglob("*") if p.is_file()} == before
