"""``trtc check`` / ``trtc rebuild`` / merging: staleness rules, rebuilds from the directory alone, atomicity.

Engines are made by ``fake_engine_build_step_for_tests`` (conftest.py), a double of the build step
only; the environment a check runs in is passed explicitly, so every rule is exercised here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from compiler.core.capabilities import tensorrt_version
from compiler.core.errors import BuildError, InputError, TensorRTNotInstalled, TrtcError
from compiler.core.files import read_json
from compiler.core.manifest import read_manifest
from compiler.core.settings import BuildSettings
from compiler.pipeline.check import (
    NEVER_BUILT,
    check_directory,
    gpu_can_run,
    merge_manifests,
    rebuild_directory,
    stale_engines,
    tensorrt_can_run,
)
from tests.conftest import H200_ENV, fake_engine_build_step_for_tests
from tests.manifests import manifest_json

H200 = H200_ENV
A100 = {**H200, "gpu": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0"}
T4 = {**H200, "gpu": "Tesla T4", "compute_capability": "7.5"}


def _built(directory: Path, env: dict[str, Any] = H200, **settings: Any) -> Path:
    rebuild_directory(directory, if_stale=False, settings_override=BuildSettings(**{"buckets": (1, 4), **settings}),
                      build_step=fake_engine_build_step_for_tests, env=env)
    return directory


def _snapshot(directory: Path) -> dict[str, bytes]:
    """Every file but the lock (which records who held it last)."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != ".trtc.lock"}


def test_engines_built_here_are_fresh(exported_dir: Path) -> None:
    _built(exported_dir)
    result = check_directory(exported_dir, env=H200)
    assert result.exit_code == 0 and result.stale == []
    assert [e.bucket for e in result.fresh] == [1, 4]
    manifest = read_manifest(exported_dir)
    assert manifest.environment is not None and manifest.build is not None
    assert manifest.environment["gpu"] == "NVIDIA H200" and manifest.build.buckets == (1, 4)


def test_another_tensorrt_version_makes_every_engine_stale(exported_dir: Path) -> None:
    _built(exported_dir)
    result = check_directory(exported_dir, env={**H200, "tensorrt": "10.14.1.48"})
    assert result.exit_code == 1
    assert [s.bucket for s in result.stale] == [1, 4]
    assert "built with TensorRT 10.13.0.35, this is TensorRT 10.14.1.48" in result.stale[0].reason
    assert any("trtc rebuild" in line for line in result.lines())


def test_version_compatible_engines_run_on_later_tensorrt_of_the_same_major() -> None:
    assert tensorrt_can_run("10.13.0.35", "10.13.0.35", version_compatible=False)
    assert not tensorrt_can_run("10.13.0.35", "10.13.3.9", version_compatible=False)
    assert tensorrt_can_run("10.13.0.35", "10.16.1.11", version_compatible=True)
    assert not tensorrt_can_run("10.13.0.35", "10.12.0.36", version_compatible=True)  # older runtime
    assert tensorrt_can_run("10.13.0.35", "11.4.0.106", version_compatible=True)  # the one cross-major pair
    assert not tensorrt_can_run("11.0.0.1", "12.0.0.1", version_compatible=True)


def test_version_compatible_directory_is_fresh_on_a_newer_tensorrt(exported_dir: Path) -> None:
    _built(exported_dir, version_compatible=True)
    assert stale_engines(exported_dir, env={**H200, "tensorrt": "10.16.1.11"}) == []
    assert len(stale_engines(exported_dir, env={**H200, "tensorrt": "10.12.0.36"})) == 2


H100 = {**H200, "gpu": "NVIDIA H100 80GB HBM3"}  # compute capability 9.0, like the H200
GH200 = {**H200, "gpu": "NVIDIA GH200 480GB"}


def test_the_gpu_compatibility_rule_per_hardware_compat_level() -> None:
    assert gpu_can_run(H200, H200, "none") and not gpu_can_run(H100, H200, "none")  # same capability, other model
    assert not gpu_can_run(H200, GH200, "none") and not gpu_can_run(A100, H200, "none")
    assert gpu_can_run(H100, H200, "same-compute-capability") and gpu_can_run(H100, GH200, "same-compute-capability")
    assert not gpu_can_run(A100, H200, "same-compute-capability")
    assert gpu_can_run(A100, H200, "ampere-plus") and not gpu_can_run(A100, T4, "ampere-plus")
    assert gpu_can_run(A100, H200, True) and not gpu_can_run(A100, H200, False)  # older manifests' bools
    unnamed = {**H200, "gpu": None}
    assert gpu_can_run(unnamed, H100, "none")  # without a recorded name the compute capability decides


def test_another_gpu_model_of_the_same_compute_capability_makes_engines_stale(exported_dir: Path) -> None:
    _built(exported_dir)
    stale = stale_engines(exported_dir, env=H100)
    assert len(stale) == 2 and "built on NVIDIA H200 (compute capability 9.0), this is NVIDIA H100" in stale[0].reason
    assert "--hardware-compat same-compute-capability" in stale[0].reason
    _built(exported_dir, hardware_compat="same-compute-capability")
    assert stale_engines(exported_dir, env=H100) == [] and stale_engines(exported_dir, env=GH200) == []
    assert len(stale_engines(exported_dir, env=A100)) == 2
    assert manifest_json(exported_dir)["build"]["hardware_compat"] == "same-compute-capability"


def test_another_gpu_makes_engines_stale_unless_hardware_compatible(exported_dir: Path) -> None:
    _built(exported_dir)
    stale = stale_engines(exported_dir, env=A100)
    assert len(stale) == 2 and "compute capability 9.0" in stale[0].reason and "8.0" in stale[0].reason
    _built(exported_dir, hardware_compat=True)
    assert stale_engines(exported_dir, env=A100) == []
    assert len(stale_engines(exported_dir, env=T4)) == 2  # Ampere+ engines do not run on Turing


def test_missing_tensorrt_or_gpu_here_is_a_reason(exported_dir: Path) -> None:
    _built(exported_dir)
    stale = stale_engines(exported_dir, env={**H200, "tensorrt": None, "gpu": None, "compute_capability": None})
    assert stale[0].reason == ("TensorRT is not installed here (built with TensorRT 10.13.0.35); "
                               "no CUDA GPU visible here")


def test_changed_or_missing_engine_files_are_stale(exported_dir: Path) -> None:
    _built(exported_dir)
    (exported_dir / "engines/b4.engine").write_bytes(b"truncated")
    (exported_dir / "engines/b1.engine").unlink()
    stale = {s.bucket: s.reason for s in stale_engines(exported_dir, env=H200)}
    assert stale == {1: "engine file missing", 4: "engine file differs from the manifest's sha256 (changed or "
                                                   "truncated)"}


def test_a_directory_without_engines_was_never_built(exported_dir: Path) -> None:
    result = check_directory(exported_dir, env=H200)
    assert result.exit_code == 1 and [str(s) for s in result.stale] == [NEVER_BUILT]
    assert NEVER_BUILT == "engines never built (TensorRT was not available at build time)"


def test_a_bad_manifest_is_a_user_error_with_exit_code_2(exported_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TrtcError) as caught:
        check_directory(tmp_path / "nowhere", env=H200)
    assert caught.value.exit_code == 2
    manifest = manifest_json(exported_dir)
    (exported_dir / "manifest.json").write_text(json.dumps({**manifest, "engines": [{"bucket": 1}]}))
    with pytest.raises(InputError, match=r"engines\[0\] lacks bucket, file or sha256"):
        check_directory(exported_dir, env=H200)


def test_rebuild_if_stale_does_nothing_when_every_engine_runs_here(exported_dir: Path) -> None:
    _built(exported_dir)
    before = _snapshot(exported_dir)
    result = rebuild_directory(exported_dir, if_stale=True, build_step=fake_engine_build_step_for_tests, env=H200)
    assert not result.rebuilt and result.stale_before == []
    assert _snapshot(exported_dir) == before


def test_rebuild_if_stale_rebuilds_with_the_recorded_settings(exported_dir: Path) -> None:
    _built(exported_dir, buckets=(1, 4, 8), multi_profile=True, opt_level=4)
    result = rebuild_directory(exported_dir, if_stale=True, build_step=fake_engine_build_step_for_tests, env=A100)
    assert result.rebuilt and len(result.stale_before) == 3
    manifest = read_manifest(exported_dir)
    assert manifest.environment is not None and manifest.build is not None
    assert manifest.environment["gpu"] == "NVIDIA A100-SXM4-80GB" and manifest.engines_built is not None
    assert manifest.build.multi_profile is True and manifest.build.opt_level == 4
    assert {e.file for e in manifest.engines} == {"engines/profiles_b1_4_8.engine"}
    assert "engines_built" in manifest_json(exported_dir)
    assert check_directory(exported_dir, env=A100).exit_code == 0
    assert not list(exported_dir.glob(".staging-*"))


def test_rebuild_with_fewer_buckets_removes_the_engines_no_longer_built(exported_dir: Path) -> None:
    _built(exported_dir)
    rebuild_directory(exported_dir, if_stale=False, settings_override=BuildSettings(buckets=(1,)),
                      build_step=fake_engine_build_step_for_tests, env=H200)
    assert sorted(p.name for p in (exported_dir / "engines").iterdir()) == ["b1.engine", "b1.layers.json"]
    assert [e.bucket for e in read_manifest(exported_dir).engines] == [1]


def test_rebuild_refuses_an_onnx_changed_after_export(exported_dir: Path) -> None:
    _built(exported_dir)
    with (exported_dir / "model.onnx.data").open("r+b") as data:
        data.write(b"\0\0\0\0")  # a "small fix" to the weights, which the manifest's verification never saw
    before = _snapshot(exported_dir)
    with pytest.raises(InputError, match=r"model\.onnx\.data does not match the sha256 in the manifest"):
        rebuild_directory(exported_dir, if_stale=False, build_step=fake_engine_build_step_for_tests, env=A100)
    assert _snapshot(exported_dir) == before


def test_a_failing_build_leaves_the_previous_engines_and_manifest_byte_identical(exported_dir: Path) -> None:
    _built(exported_dir)
    before = _snapshot(exported_dir)
    calls = []

    def fails_on_the_second_engine(loader: Any, profiles: list[Any]) -> tuple[bytes, list[str]]:
        calls.append(loader)
        if len(calls) == 2:
            raise BuildError("TensorRT failed to build the engine (test double of a failing build)")
        return fake_engine_build_step_for_tests(loader, profiles)

    with pytest.raises(BuildError, match="test double"):
        rebuild_directory(exported_dir, if_stale=False, build_step=fails_on_the_second_engine, env=A100)
    assert len(calls) == 2  # the first engine was built into the staging folder, then dropped
    assert _snapshot(exported_dir) == before
    assert not list(exported_dir.glob(".staging-*"))


@pytest.mark.skipif(tensorrt_version() is not None, reason="TensorRT is installed here: the message is for its absence")
def test_rebuild_without_tensorrt_says_so_and_changes_nothing(exported_dir: Path) -> None:
    before = _snapshot(exported_dir)
    with pytest.raises(TensorRTNotInstalled) as caught:
        rebuild_directory(exported_dir, if_stale=True)
    assert str(caught.value) == ("TensorRT is not installed: engines not built; install trtc[tensorrt] on a machine "
                                 f"with an NVIDIA GPU and run `trtc rebuild {exported_dir}`")
    assert _snapshot(exported_dir) == before


def test_merge_combines_buckets_built_by_separate_jobs(exported_dir: Path, tmp_path: Path) -> None:
    job_b = tmp_path / "job_b"
    shutil.copytree(exported_dir, job_b)
    _built(exported_dir, buckets=(1,))
    _built(job_b, buckets=(4,))
    merged = merge_manifests(exported_dir, [job_b])
    assert [e.bucket for e in merged.engines] == [1, 4] and merged.build is not None and merged.build.buckets == (1, 4)
    assert (exported_dir / "engines/b4.engine").read_bytes() == (job_b / "engines/b4.engine").read_bytes()
    assert (exported_dir / "engines/b4.layers.json").is_file()
    assert read_json(exported_dir / "manifest.json") == merged.to_json()
    assert merged.merged_from == [str(job_b)]
    assert check_directory(exported_dir, env=H200).exit_code == 0


def test_merge_refuses_another_model_or_another_environment(exported_dir: Path, tmp_path: Path) -> None:
    other_gpu, other_model = tmp_path / "other_gpu", tmp_path / "other_model"
    shutil.copytree(exported_dir, other_gpu)
    shutil.copytree(exported_dir, other_model)
    _built(exported_dir, buckets=(1,))
    _built(other_gpu, env=A100, buckets=(4,))
    _built(other_model, buckets=(8,))
    manifest = manifest_json(other_model)
    manifest["onnx"]["fp32"]["sha256"] = "f" * 64  # as if exported from another model
    (other_model / "manifest.json").write_text(json.dumps(manifest))
    before = _snapshot(exported_dir)
    with pytest.raises(InputError, match=r"compute capability 8\.0"):
        merge_manifests(exported_dir, [other_gpu])
    with pytest.raises(InputError, match="built from another fp32 ONNX"):
        merge_manifests(exported_dir, [other_model])
    assert _snapshot(exported_dir) == before
