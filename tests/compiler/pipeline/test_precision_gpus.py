"""The GPUs a precision needs: FP8 engines need compute capability 8.9+. A directory whose FP8 engines were built
on an H200 (by the test double of the build step, conftest.py) is checked and rebuilt against other GPUs' records;
no TensorRT is needed."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from compiler.core.errors import InputError
from compiler.core.manifest import MANIFEST, FileRecord, read_manifest, write_manifest
from compiler.core.settings import BuildSettings
from compiler.pipeline.build import refuse_unsupported_precision
from compiler.pipeline.check import check_directory, rebuild_directory
from tests.conftest import H200_ENV, fake_engine_build_step_for_tests

A100 = {**H200_ENV, "gpu": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0"}
L4 = {**H200_ENV, "gpu": "NVIDIA L4", "compute_capability": "8.9"}


def _fp8_directory(exported_dir: Path) -> Path:
    """The exported directory with an ``onnx.fp8`` entry (a copy of its graph: the check reads the manifest, not
    the Q/DQ) and FP8 engines of buckets 1 and 4 built on an H200 with --hardware-compat ampere-plus."""
    shutil.copy2(exported_dir / "model.onnx", exported_dir / "model.fp8.onnx")
    shutil.copy2(exported_dir / "model.onnx.data", exported_dir / "model.fp8.onnx.data")
    manifest = read_manifest(exported_dir)
    entry = replace(FileRecord.for_onnx(exported_dir, exported_dir / "model.fp8.onnx"),
                    extra={"requires_compute_capability": "8.9"})
    write_manifest(exported_dir / MANIFEST, replace(manifest, onnx={**manifest.onnx, "fp8": entry}, precision="fp8"))
    rebuild_directory(exported_dir, if_stale=False, build_step=fake_engine_build_step_for_tests, env=H200_ENV,
                      settings_override=BuildSettings(buckets=(1, 4), precision="fp8", hardware_compat="ampere-plus"))
    return exported_dir


def test_check_calls_fp8_engines_stale_on_a_gpu_below_compute_capability_89(exported_dir: Path) -> None:
    """Engines that an ampere-plus build lets an A100 load are still stale there when they are FP8 (exit 1, one line
    each naming compute capability 8.9 and the GPU); on an L4 (8.9) and the H200 they can run."""
    directory = _fp8_directory(exported_dir)
    on_a100 = check_directory(directory, env=A100)
    assert on_a100.exit_code == 1 and len(on_a100.stale) == 2
    assert all("FP8 engines need compute capability 8.9+" in s.reason and "8.0" in s.reason for s in on_a100.stale)
    assert check_directory(directory, env=L4).exit_code == 0
    assert check_directory(directory, env=H200_ENV).exit_code == 0


def test_fp8_builds_and_rebuilds_stop_in_one_line_on_an_older_gpu(exported_dir: Path) -> None:
    """``trtc rebuild`` of FP8 engines on an A100 raises one InputError naming the requirement and the way out,
    before building anything (the engines of the H200 stay); the build's own check passes on 8.9 and says
    nothing where the capability is unknown (no GPU seen)."""
    directory = _fp8_directory(exported_dir)
    before = read_manifest(directory).engines
    with pytest.raises(InputError, match=r"FP8 engines need a GPU of compute capability 8\.9\+ .*this one, NVIDIA "
                                         r"A100-SXM4-80GB, is 8\.0: build --int8 or --fp16"):
        rebuild_directory(directory, if_stale=False, build_step=fake_engine_build_step_for_tests, env=A100)
    assert read_manifest(directory).engines == before
    refuse_unsupported_precision("fp8", L4)
    refuse_unsupported_precision("fp8", {"compute_capability": None})
    refuse_unsupported_precision("int8", A100)
