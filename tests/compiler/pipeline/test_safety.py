"""Build directories that are safe to share: confined paths, readable files, no leftovers, one snapshot
of the weights, one-line errors for a bad ``--out``, and messages and records that match the directory.

One real directory is built once for the module (a tiny MLP from a factory that initialises randomly, INT8 on
random calibration data, ``--engine none``); engines are added by the build step's test double (conftest.py),
as in test_check.py. Tests work on copies of it.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result

import compiler
from compiler.cli import cli
from compiler.core.errors import DirectoryLocked, InputError
from compiler.core.files import directory_lock, directory_transaction, file_mode
from compiler.core.manifest import Manifest
from compiler.core.settings import BuildSettings
from compiler.pipeline.check import rebuild_directory
from tests.conftest import H200_ENV, fake_engine_build_step_for_tests
from tests.manifests import write_manifest_json

FACTORY = "tests.compiler.pipeline.test_safety:random_mlp"


def random_mlp() -> torch.nn.Module:
    """A factory that initialises randomly (no seed): every call gives other weights, like resnet50() unweighted."""
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def trtc(*args: str) -> Result:
    return CliRunner().invoke(cli, [args[0], "-q", *args[1:]])


def one_line_error(result: Result) -> str:
    """The single ``error:`` line of a failed command; fails the test on a traceback or a second error line."""
    assert isinstance(result.exception, (SystemExit, type(None))), repr(result.exception)
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def manifest_of(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "manifest.json").read_text())


def files_in(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``trtc build`` of the random-init factory (INT8, buckets 1,2) plus a bucket-1 engine from the test double."""
    out = tmp_path_factory.mktemp("safety") / "m"
    result = trtc("build", "--model-factory", FACTORY, "--input", "x:Bx16", "--buckets", "1,2", "--int8",
                  "--calib-data", "random", "--engine", "none", "--out", str(out))
    assert result.exit_code == 0, result.output
    rebuild_directory(out, if_stale=False, settings_override=BuildSettings(buckets=(1,), precision="int8"),
                      build_step=fake_engine_build_step_for_tests, env=H200_ENV)
    return out


@pytest.fixture
def copy(built: Path, tmp_path: Path) -> Path:
    target = tmp_path / "m"
    shutil.copytree(built, target, symlinks=True)
    return target


def other_job(built: Path, tmp_path: Path) -> Path:
    """A second CI job's directory: the same export, the engine of bucket 2."""
    job = tmp_path / "job2"
    shutil.copytree(built, job)
    rebuild_directory(job, if_stale=False, settings_override=BuildSettings(buckets=(2,), precision="int8"),
                      build_step=fake_engine_build_step_for_tests, env=H200_ENV)
    return job


# --- 1. paths from the manifest stay inside the directory -------------------------------------------------------

@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_merge_never_reads_or_writes_outside_the_directories(built: Path, tmp_path: Path, copy: Path,
                                                             how: str) -> None:
    job = other_job(built, tmp_path)
    outside = tmp_path / "esc"
    outside.mkdir()
    (outside / "b2.engine").write_bytes((job / "engines/b2.engine").read_bytes())
    if how == "dotdot":
        name = "engines/../../esc/b2.engine"
    elif how == "absolute":
        name = str(outside / "b2.engine")
    else:
        (job / "engines/b2.engine").unlink()
        (job / "engines/b2.engine").symlink_to(outside / "b2.engine")
        name = "engines/b2.engine"
    manifest = manifest_of(job)
    manifest["engines"][0]["file"] = name
    write_manifest_json(job / "manifest.json", manifest)
    around = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    before = files_in(copy)

    result = trtc("merge", str(copy), str(job))

    assert result.exit_code == 2
    assert "leaves the directory" in one_line_error(result)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == around  # nothing written
    assert files_in(copy) == before


def test_every_command_and_load_refuse_an_onnx_outside_the_directory(copy: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copyfile(copy / "model.int8.onnx", outside / "model.int8.onnx")  # same bytes: the sha256 matches
    manifest = manifest_of(copy)
    manifest["onnx"]["int8"]["file"] = manifest["onnx"]["int8"]["files"][0] = "../elsewhere/model.int8.onnx"
    write_manifest_json(copy / "manifest.json", manifest)
    for args in (["rebuild", str(copy)], ["bench", str(copy), "--backends", "onnxruntime", "-n", "1"],
                 ["export-triton", str(copy), "--repo", str(tmp_path / "repo")]):
        result = trtc(*args)
        assert result.exit_code == 2, (args, result.output)
        assert "'../elsewhere/model.int8.onnx'" in one_line_error(result)
    with pytest.raises(InputError, match="leaves the directory"):
        compiler.load(copy, backend="onnxruntime")
    assert not (tmp_path / "repo").exists()


def test_check_refuses_an_absolute_engine_path(copy: Path, tmp_path: Path) -> None:
    manifest = manifest_of(copy)
    manifest["engines"][0]["file"] = str((copy / "engines/b1.engine").resolve())
    write_manifest_json(copy / "manifest.json", manifest)
    result = trtc("check", str(copy))
    assert result.exit_code == 2
    assert "leaves the directory" in one_line_error(result)


def test_rebuild_never_deletes_a_file_outside_the_directory(copy: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.json"
    victim.write_text("keep me")
    manifest = manifest_of(copy)
    manifest["engines"][0]["layers"] = {"file": "../victim.json"}  # rebuild removes files of buckets it drops
    write_manifest_json(copy / "manifest.json", manifest)
    with pytest.raises(InputError, match="leaves the directory"):
        rebuild_directory(copy, if_stale=False, settings_override=BuildSettings(buckets=(2,), precision="int8"),
                          build_step=fake_engine_build_step_for_tests, env=H200_ENV)
    assert victim.read_text() == "keep me"


def test_a_timing_cache_symlinked_out_of_the_directory_is_not_read(copy: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"not for this build")
    (copy / "timing.cache").unlink()
    (copy / "timing.cache").symlink_to(secret)
    with pytest.raises(InputError, match=r"timing cache 'timing\.cache'"):
        rebuild_directory(copy, if_stale=False, settings_override=BuildSettings(buckets=(1,), precision="int8"),
                          build_step=fake_engine_build_step_for_tests, env=H200_ENV)


def test_an_onnx_is_read_only_after_its_sha256_matches(copy: Path) -> None:
    graph = copy / "model.int8.onnx"
    data = bytearray(graph.read_bytes())
    data[-1] ^= 0x01  # still a loadable graph, no longer the verified one
    graph.write_bytes(bytes(data))
    with pytest.raises(InputError, match="does not match"):
        compiler.load(copy, backend="onnxruntime")


def test_inside_accepts_plain_relative_paths_only(copy: Path) -> None:
    from compiler.core.files import inside

    assert inside(copy, "engines/b1.engine") == copy / "engines/b1.engine"
    for bad in ("", "/etc/passwd", "../m/model.onnx", "engines/../../x", "a//b", "C:/x", "a\\..\\b", None, 3):
        with pytest.raises(InputError):
            inside(copy, bad)


# --- 2. files readable by others, 3. no leftovers, 4. --out naming a file ----------------------------------------

def test_every_file_of_a_build_has_the_usual_mode_and_no_leftovers(built: Path) -> None:
    hidden = [p.name for p in built.rglob(".*")]
    assert hidden == []  # no .trtc.lock, no staging folder
    modes = {p.relative_to(built).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in built.rglob("*") if p.is_file()}
    assert {"manifest.json", "model.onnx", "model.onnx.data", "calibration.json", "report/accuracy.json",
            "source/state_dict.pt", "engines/b1.engine"} <= set(modes)
    assert set(modes.values()) == {0o666 & ~0o022}, modes  # the umask of the test run


@pytest.fixture
def umask_027() -> Iterator[None]:
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def test_files_follow_the_process_umask(tmp_path: Path, umask_027: None) -> None:
    out = tmp_path / "m"
    result = trtc("export", "--model-factory", FACTORY, "--input", "x:Bx16", "--buckets", "1,2", "--out", str(out))
    assert result.exit_code == 0, result.output
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    assert {"manifest.json", "model.onnx", "model.onnx.data", "state_dict.pt"} <= set(modes)
    assert set(modes.values()) == {0o640}, modes


def test_bench_leaves_no_lock_behind(copy: Path) -> None:
    result = trtc("bench", str(copy), "--backends", "onnxruntime", "-n", "1", "--min-seconds", "0", "--warmup", "0",
                  "--warmup-seconds", "0", "--no-plot")
    assert result.exit_code == 0, result.output
    assert (copy / "report" / "bench.json").is_file() and list(copy.rglob(".*")) == []


def test_the_lock_still_excludes_a_second_writer_and_is_gone_after(tmp_path: Path) -> None:
    with directory_lock(tmp_path, "first"), pytest.raises(DirectoryLocked, match=r"pid \d+ .*\(first\)"), \
            directory_lock(tmp_path, "second"):
        pass
    assert list(tmp_path.iterdir()) == []
    with directory_lock(tmp_path, "third"):
        assert (tmp_path / ".trtc.lock").is_file()


def test_a_transaction_commits_manifest_last_then_removes_obsolete_files(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "manifest.json").write_text("old")
    (tmp_path / "model_b8.engine").write_text("old engine")
    events: list[str] = []
    real_replace, real_unlink = os.replace, Path.unlink

    def replace(src: Any, dst: Any) -> None:
        events.append(f"move {Path(dst).name}")
        real_replace(src, dst)

    def unlink(self: Path, missing_ok: bool = False) -> None:
        events.append(f"remove {self.name}")
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(Path, "unlink", unlink)
    with directory_transaction(tmp_path, "trtc test") as transaction:
        with pytest.raises(DirectoryLocked, match=r"\(trtc test\)"), directory_transaction(tmp_path, "second"):
            pass
        (transaction.stage / "manifest.json").write_text("new")
        (transaction.stage / "a" / "model_b1.engine").parent.mkdir()
        (transaction.stage / "a" / "model_b1.engine").write_text("new engine")
        transaction.remove_after_commit(["model_b8.engine"])
    assert events == ["move model_b1.engine", "move manifest.json", "remove model_b8.engine", "remove .trtc.lock"]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "a", "a/model_b1.engine", "manifest.json"]
    assert (tmp_path / "manifest.json").read_text() == "new"
    assert stat.S_IMODE((tmp_path / "a" / "model_b1.engine").stat().st_mode) == file_mode()


def test_a_failed_transaction_leaves_the_directory_as_it_was(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("old")
    with pytest.raises(InputError, match="bad"), directory_transaction(tmp_path, "trtc test") as transaction:
        (transaction.stage / "manifest.json").write_text("new")
        transaction.remove_after_commit(["manifest.json"])
        raise InputError("bad")
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
    assert (tmp_path / "manifest.json").read_text() == "old"
    new_dir = tmp_path / "new"
    with pytest.raises(InputError), directory_transaction(new_dir, "trtc test") as transaction:
        (transaction.stage / "model.onnx").write_text("half")
        raise InputError("bad")
    assert not new_dir.exists()


def test_out_naming_a_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    existing = tmp_path / "notes.txt"
    existing.write_text("mine")
    result = trtc("export", "--model-factory", FACTORY, "--input", "x:Bx16", "--out", str(existing))
    assert result.exit_code == 2
    assert one_line_error(result) == (f"error: {existing} exists and is not a directory; choose a directory for the "
                                      "output (--out)")
    assert existing.read_text() == "mine"


def test_other_outputs_naming_a_file_are_one_line_and_exit_2(copy: Path, tmp_path: Path) -> None:
    existing = tmp_path / "notes.txt"
    existing.write_text("mine")
    for args, option in ((["export-triton", str(copy), "--repo", str(existing)], "--repo"),
                         (["bench", str(copy), "--report-dir", str(existing), "-n", "1"], "--report-dir"),
                         (["build", "--model-factory", FACTORY, "--input", "x:Bx16", "--out", str(existing / "m")],
                          "--out")):
        result = trtc(*args)
        assert result.exit_code == 2, result.output
        assert one_line_error(result).endswith(f"({option})")
    assert existing.read_text() == "mine"


# --- 5. the same weights everywhere ---------------------------------------------------------------------------------

def test_torch_backend_and_bench_run_the_weights_the_build_exported(built: Path) -> None:
    from compiler.bench.reference import eager_model

    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    manifest = manifest_of(built)
    assert manifest["source"]["snapshot"]["file"] == "source/state_dict.pt"
    manifest["precision"] = "fp32"  # compare with the FP32 ONNX, exactly
    fp32_dir = built.parent / "fp32-view"
    shutil.copytree(built, fp32_dir)
    write_manifest_json(fp32_dir / "manifest.json", manifest)
    with compiler.load(fp32_dir, backend="onnxruntime") as ort, compiler.load(built, backend="torch") as eager:
        onnx_out, torch_out = ort(x), eager(x)
    np.testing.assert_allclose(torch_out, onnx_out, rtol=1e-5, atol=1e-5)
    module, _ = eager_model(Manifest.from_json(manifest), directory=built)
    with torch.no_grad():
        np.testing.assert_allclose(module(torch.from_numpy(x)).numpy(), onnx_out, rtol=1e-5, atol=1e-5)
    fresh = random_mlp()  # what calling the factory again gives: other weights
    assert not np.allclose(fresh(torch.from_numpy(x)).detach().numpy(), onnx_out, atol=1e-3)


def test_a_changed_snapshot_is_refused(copy: Path) -> None:
    snapshot = copy / "source" / "state_dict.pt"
    snapshot.write_bytes(snapshot.read_bytes()[:-8])
    with pytest.raises(InputError, match="does not match"):
        compiler.load(copy, backend="torch")


# --- 7. messages and records that match the directory ----------------------------------------------------------------

def test_fp16_on_random_data_is_recorded_in_the_manifest(copy: Path) -> None:
    result = trtc("calibrate", str(copy), "--fp16", "--calib-data", "random")
    assert result.exit_code == 0, result.output
    data = manifest_of(copy)["data"]
    assert data["fp16"]["calibration"]["random"] is True and data["fp16"]["calibration"]["samples"] > 0
    assert data["int8"]["calibration"]["random"] is True  # the INT8 record stays


def test_a_missed_gate_names_the_report_where_it_is(tmp_path: Path) -> None:
    out = tmp_path / "m"
    result = trtc("build", "--model-factory", FACTORY, "--input", "x:Bx16", "--buckets", "1", "--int8",
                  "--calib-data", "random", "--min-cosine", "0.9999999", "--max-fallback", "0", "--engine", "none",
                  "--out", str(out))
    assert result.exit_code == 3, result.output
    line = one_line_error(result)
    named = line.split("; see ")[1].split(" ")[0]
    assert named == str(out / "failed" / "report" / "accuracy.json") and Path(named).is_file()
