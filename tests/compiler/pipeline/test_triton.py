"""`trtc export-triton`: the model repository, and config.pbtxt parsed back with Triton's schema.

Validation: the fields trtc writes, transcribed from Triton's ``model_config.proto``
(triton-inference-server/common, ``protobuf/model_config.proto``: names, numbers, types, enums),
are built into a ``FileDescriptorProto`` with ``descriptor_pb2`` and loaded into a private
``DescriptorPool``; ``google.protobuf.text_format`` then parses ``config.pbtxt`` into that
``inference.ModelConfig``. Text-format syntax, field names, scalar types and enum values are
thereby checked exactly as Triton's own parser would (for this subset of its fields).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format

from compiler.cli import cli
from compiler.core.errors import InputError
from compiler.core.files import sha256_file
from compiler.core.manifest import read_manifest
from compiler.core.onnx_io import ort_session
from compiler.pipeline.triton import triton_repository
from tests.builds import build_directory
from tests.manifests import write_manifest_json

F = descriptor_pb2.FieldDescriptorProto
OPTIONAL, REPEATED = F.LABEL_OPTIONAL, F.LABEL_REPEATED
DATA_TYPES = ["TYPE_INVALID", "TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32", "TYPE_UINT64", "TYPE_INT8",
              "TYPE_INT16", "TYPE_INT32", "TYPE_INT64", "TYPE_FP16", "TYPE_FP32", "TYPE_FP64", "TYPE_STRING",
              "TYPE_BF16"]
DATA_TYPE, RESHAPE = ".inference.DataType", ".inference.ModelTensorReshape"
# message -> [(field, number, type, label, type_name)], as in Triton's model_config.proto
MESSAGES: dict[str, list[tuple[str, int, int, int, str]]] = {
    "ModelTensorReshape": [("shape", 1, F.TYPE_INT64, REPEATED, "")],
    "ModelInput": [("name", 1, F.TYPE_STRING, OPTIONAL, ""), ("data_type", 2, F.TYPE_ENUM, OPTIONAL, DATA_TYPE),
                   ("format", 3, F.TYPE_ENUM, OPTIONAL, ".inference.ModelInput.Format"),
                   ("dims", 4, F.TYPE_INT64, REPEATED, ""), ("reshape", 5, F.TYPE_MESSAGE, OPTIONAL, RESHAPE),
                   ("is_shape_tensor", 6, F.TYPE_BOOL, OPTIONAL, ""),
                   ("allow_ragged_batch", 7, F.TYPE_BOOL, OPTIONAL, ""), ("optional", 8, F.TYPE_BOOL, OPTIONAL, "")],
    "ModelOutput": [("name", 1, F.TYPE_STRING, OPTIONAL, ""), ("data_type", 2, F.TYPE_ENUM, OPTIONAL, DATA_TYPE),
                    ("dims", 3, F.TYPE_INT64, REPEATED, ""), ("label_filename", 4, F.TYPE_STRING, OPTIONAL, ""),
                    ("reshape", 5, F.TYPE_MESSAGE, OPTIONAL, RESHAPE),
                    ("is_shape_tensor", 6, F.TYPE_BOOL, OPTIONAL, "")],
    "ModelDynamicBatching": [("preferred_batch_size", 1, F.TYPE_INT32, REPEATED, ""),
                             ("max_queue_delay_microseconds", 2, F.TYPE_UINT64, OPTIONAL, ""),
                             ("preserve_ordering", 3, F.TYPE_BOOL, OPTIONAL, ""),
                             ("priority_levels", 4, F.TYPE_UINT64, OPTIONAL, ""),
                             ("default_priority_level", 5, F.TYPE_UINT64, OPTIONAL, "")],
    "ModelInstanceGroup": [("name", 1, F.TYPE_STRING, OPTIONAL, ""), ("count", 2, F.TYPE_INT32, OPTIONAL, ""),
                           ("gpus", 3, F.TYPE_INT32, REPEATED, ""),
                           ("kind", 4, F.TYPE_ENUM, OPTIONAL, ".inference.ModelInstanceGroup.Kind"),
                           ("profile", 5, F.TYPE_STRING, REPEATED, ""), ("passive", 7, F.TYPE_BOOL, OPTIONAL, ""),
                           ("host_policy", 9, F.TYPE_STRING, OPTIONAL, "")],
    "ModelParameter": [("string_value", 1, F.TYPE_STRING, OPTIONAL, "")],
    "ModelConfig": [("name", 1, F.TYPE_STRING, OPTIONAL, ""), ("platform", 2, F.TYPE_STRING, OPTIONAL, ""),
                    ("backend", 17, F.TYPE_STRING, OPTIONAL, ""), ("max_batch_size", 4, F.TYPE_INT32, OPTIONAL, ""),
                    ("input", 5, F.TYPE_MESSAGE, REPEATED, ".inference.ModelInput"),
                    ("output", 6, F.TYPE_MESSAGE, REPEATED, ".inference.ModelOutput"),
                    ("instance_group", 7, F.TYPE_MESSAGE, REPEATED, ".inference.ModelInstanceGroup"),
                    ("default_model_filename", 8, F.TYPE_STRING, OPTIONAL, ""),
                    ("dynamic_batching", 11, F.TYPE_MESSAGE, OPTIONAL, ".inference.ModelDynamicBatching"),
                    ("parameters", 14, F.TYPE_MESSAGE, REPEATED, ".inference.ModelConfig.ParametersEntry")],
}
NESTED_ENUMS = {"ModelInput": ("Format", ["FORMAT_NONE", "FORMAT_NHWC", "FORMAT_NCHW"]),
                "ModelInstanceGroup": ("Kind", ["KIND_AUTO", "KIND_GPU", "KIND_CPU", "KIND_MODEL"])}


def _model_config_class() -> Any:
    proto = descriptor_pb2.FileDescriptorProto(name="model_config_subset.proto", package="inference", syntax="proto3")
    enum = proto.enum_type.add(name="DataType")
    for number, name in enumerate(DATA_TYPES):
        enum.value.add(name=name, number=number)
    for message_name, fields in MESSAGES.items():
        message = proto.message_type.add(name=message_name)
        if message_name in NESTED_ENUMS:
            nested_name, values = NESTED_ENUMS[message_name]
            nested = message.enum_type.add(name=nested_name)
            for number, value in enumerate(values):
                nested.value.add(name=value, number=number)
        if message_name == "ModelConfig":
            message.oneof_decl.add(name="scheduling_choice")
            entry = message.nested_type.add(name="ParametersEntry")  # map<string, ModelParameter> parameters = 14
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=OPTIONAL)
            entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, label=OPTIONAL,
                            type_name=".inference.ModelParameter")
        for name, number, kind, label, type_name in fields:
            field = message.field.add(name=name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = type_name
            if message_name == "ModelConfig" and name == "dynamic_batching":
                field.oneof_index = 0
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("inference.ModelConfig"))


ModelConfig = _model_config_class()


def parse_config(path: Path) -> Any:
    config = ModelConfig()
    text_format.Parse(path.read_text(), config)
    return config


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("triton")
    return {name: build_directory(root / name, name) for name in ("mlp", "transformer_encoder")}


def with_engines(source: Path, target: Path, ranged: bool, one_file: bool = True) -> Path:
    """A copy of ``source`` whose manifest lists engines (a stand-in plan file: Triton is not run here)."""
    shutil.copytree(source, target)
    (target / "engines").mkdir()
    buckets = [1, 4, 8, 16]
    entries = []
    for profile, bucket in enumerate(buckets):
        low = (buckets[profile - 1] + 1 if profile else 1) if ranged else bucket
        file = "engines/profiles_b1_4_8_16.engine" if one_file else f"engines/b{bucket}.engine"
        (target / file).write_bytes(b"plan bytes " + file.encode())
        entries.append({"bucket": bucket, "file": file, "profile": profile if one_file else 0,
                        "sha256": sha256_file(target / file),
                        "shapes": {"x": {"min": [low, 64], "opt": [bucket, 64], "max": [bucket, 64]}}})
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["engines"] = entries
    manifest["environment"] = {"tensorrt": "10.13.0.35"}
    write_manifest_json(target / "manifest.json", manifest)
    return target


def test_onnx_runtime_repository_parses_and_runs(dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = triton_repository(dirs["mlp"], tmp_path / "repo", name="mlp", instances=2, max_wait_ms=2.5)
    assert folder == tmp_path / "repo" / "mlp"
    config = parse_config(folder / "config.pbtxt")
    assert config.name == "mlp" and config.platform == "onnxruntime_onnx" and config.max_batch_size == 16
    assert [(i.name, ModelConfig.DESCRIPTOR.file.pool.FindEnumTypeByName("inference.DataType")
             .values_by_number[i.data_type].name, list(i.dims)) for i in config.input] == [("x", "TYPE_FP32", [64])]
    assert [(o.name, list(o.dims)) for o in config.output] == [("out", [10])]
    assert config.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert list(config.dynamic_batching.preferred_batch_size) == [1, 4, 8, 16]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2500
    group = config.instance_group[0]
    assert len(config.instance_group) == 1 and group.count == 2 and group.kind == 0  # KIND_AUTO
    assert config.default_model_filename == "model.onnx"
    assert sorted(p.name for p in (folder / "1").iterdir()) == ["model.onnx", "model.onnx.data"]
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    got = ort_session(folder / "1" / "model.onnx").run(None, {"x": x})[0]  # external data found beside it
    want = ort_session(dirs["mlp"] / "model.onnx").run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)


def test_dynamic_dimensions_are_minus_one(dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = triton_repository(dirs["transformer_encoder"], tmp_path / "repo")
    config = parse_config(folder / "config.pbtxt")
    assert config.name == "transformer_encoder"
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("input_ids", 9, [-1]),
                                                                           ("attention_mask", 9, [-1])]
    assert [list(o.dims) for o in config.output] == [[-1, 64]]


def test_plan_with_a_profile_per_bucket(dirs: dict[str, Path], tmp_path: Path) -> None:
    directory = with_engines(dirs["mlp"], tmp_path / "m", ranged=True)
    folder = triton_repository(directory, tmp_path / "repo", name="mlp")
    config = parse_config(folder / "config.pbtxt")
    assert config.platform == "tensorrt_plan" and config.max_batch_size == 16
    assert config.default_model_filename == "model.plan"
    group = config.instance_group[0]
    assert group.kind == 1 and list(group.profile) == ["0", "1", "2", "3"]  # KIND_GPU
    assert (folder / "1" / "model.plan").read_bytes() == (directory / "engines/profiles_b1_4_8_16.engine").read_bytes()
    assert sorted(p.name for p in (folder / "1").iterdir()) == ["model.plan", "tensorrt_version.txt"]
    version, requirement = (folder / "1" / "tensorrt_version.txt").read_text().splitlines()
    assert version == "10.13.0.35" and "only if its TensorRT is exactly 10.13.0.35" in requirement


def test_a_version_compatible_plan_names_the_triton_option(dirs: dict[str, Path], tmp_path: Path) -> None:
    directory = with_engines(dirs["mlp"], tmp_path / "m", ranged=True)
    manifest = json.loads((directory / "manifest.json").read_text())
    write_manifest_json(directory / "manifest.json", {**manifest, "build": {"version_compatible": True}})
    result = CliRunner().invoke(cli, ["export-triton", str(directory), "--repo", str(tmp_path / "repo")])
    assert result.exit_code == 0, result.output
    assert ("built version-compatible with TensorRT 10.13.0.35: Triton loads it with TensorRT 10.13.0.35 or a later "
            "10.x or 11.x when started with --backend-config=tensorrt,version-compatible=true") in result.output


def test_plans_triton_cannot_serve_are_refused_or_replaced(dirs: dict[str, Path], tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    fixed = with_engines(dirs["mlp"], tmp_path / "fixed", ranged=False)
    with pytest.raises(InputError, match=r"take batches 1, 4, 8, 16 only \(e\.g\. not 2\)"):
        triton_repository(fixed, tmp_path / "repo", platform="tensorrt_plan")
    split = with_engines(dirs["mlp"], tmp_path / "split", ranged=True, one_file=False)
    with pytest.raises(InputError, match=r"one engine per bucket .* --multi-profile"):
        triton_repository(split, tmp_path / "repo", platform="tensorrt_plan")
    with pytest.raises(InputError, match=r"no TensorRT engines .*`trtc rebuild"):
        triton_repository(dirs["mlp"], tmp_path / "repo", platform="tensorrt_plan")
    for engines in (fixed, split):  # auto: trtc's runtime in Triton's Python backend (it pads), and why
        folder = triton_repository(engines, tmp_path / "repo", force=True)
        config = parse_config(folder / "config.pbtxt")
        assert config.backend == "python" and not config.platform
    reasons = [r.getMessage() for r in caplog.records if "writing the trtc platform" in r.getMessage()]
    assert len(reasons) == 2 and "(e.g. not 2)" in reasons[0] and "one engine per bucket" in reasons[1]
    folder = triton_repository(dirs["mlp"], tmp_path / "repo", force=True)  # no engines: ONNX Runtime's variant
    assert parse_config(folder / "config.pbtxt").platform == "onnxruntime_onnx"


def test_a_tensor_of_shape_b_gets_dims_1_reshaped(tmp_path: Path) -> None:
    from compiler.pipeline.triton import TritonModel, TritonTensor, model_config_text

    model = TritonModel("m", "onnxruntime_onnx", 8, (TritonTensor("ids", "TYPE_INT64", ()),),
                        (TritonTensor("score", "TYPE_FP32", ()),), (8,), 100, 1, "KIND_CPU")
    (tmp_path / "config.pbtxt").write_text(model_config_text(model))
    config = parse_config(tmp_path / "config.pbtxt")
    assert list(config.input[0].dims) == [1] and config.input[0].HasField("reshape")
    assert list(config.input[0].reshape.shape) == [] and config.instance_group[0].kind == 2


def test_the_schema_rejects_what_triton_would() -> None:
    with pytest.raises(text_format.ParseError, match="max_batch"):
        text_format.Parse("max_batch: 4", ModelConfig())
    with pytest.raises(text_format.ParseError):
        text_format.Parse('instance_group [ { kind: KIND_TPU } ]', ModelConfig())
    with pytest.raises(text_format.ParseError):
        text_format.Parse('max_batch_size: "16"', ModelConfig())


def test_a_trtc_entry_holds_the_build_and_the_path_its_model_imports_from(dirs: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    """Proves: `--platform trtc` writes a Python-backend config (dynamic batching with the buckets preferred,
    max_batch_size 4x the largest bucket, KIND_AUTO instances, the python path and serving backend as
    parameters), 1/model.py, and 1/build/ holding exactly the manifest and the files it names, byte for byte."""
    from compiler.pipeline.triton import TRTC_MAX_BATCH_FACTOR, build_files, default_python_path
    from compiler.serve.triton_model import MODEL_PY

    source = with_engines(dirs["mlp"], tmp_path / "m", ranged=False, one_file=False)
    folder = triton_repository(source, tmp_path / "repo", name="m", platform="trtc", instances=3, max_wait_ms=4)
    config = parse_config(folder / "config.pbtxt")
    assert config.backend == "python" and config.default_model_filename == "model.py"
    assert config.max_batch_size == 16 * TRTC_MAX_BATCH_FACTOR
    assert list(config.dynamic_batching.preferred_batch_size) == [1, 4, 8, 16]
    assert config.dynamic_batching.max_queue_delay_microseconds == 4000
    assert config.instance_group[0].count == 3 and config.instance_group[0].kind == 0  # KIND_AUTO
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    assert parameters == {"trtc_python_path": os.pathsep.join(default_python_path()), "trtc_backend": "auto"}
    assert (folder / "1" / "model.py").read_text() == MODEL_PY
    copied = sorted(p.relative_to(folder / "1" / "build").as_posix() for p in (folder / "1" / "build").rglob("*")
                    if p.is_file())
    assert copied == sorted(build_files(source, read_manifest(source))) and "engines/b16.engine" in copied
    for name in copied:
        assert (folder / "1" / "build" / name).read_bytes() == (source / name).read_bytes()


def test_a_trtc_entry_imports_from_pythonpath_before_site_packages(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """Proves: the folders of PYTHONPATH (which Triton's server does not inherit) follow the folder of the running
    ``compiler`` package in the entry's path, in their order and before this interpreter's site-packages, so a
    package that the exporting process imports from PYTHONPATH (an ONNX Runtime build) is the model's too."""
    import sysconfig

    from compiler.pipeline.triton import default_python_path

    first, second = tmp_path / "ort", tmp_path / "site"
    first.mkdir()
    second.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(first), "", str(second)]))
    folders = default_python_path()
    assert folders[1:3] == (str(first), str(second))
    assert folders.index(str(second)) < folders.index(sysconfig.get_paths()["purelib"])


def test_cli_writes_the_repository_and_refuses_to_overwrite(dirs: dict[str, Path], tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    result = CliRunner().invoke(cli, ["export-triton", str(dirs["mlp"]), "--repo", str(repo), "--name", "m", "-q"])
    assert result.exit_code == 0, result.output
    assert "config.pbtxt" in result.output and "model.onnx" in result.output
    assert parse_config(repo / "m" / "config.pbtxt").name == "m"
    again = CliRunner().invoke(cli, ["export-triton", str(dirs["mlp"]), "--repo", str(repo), "--name", "m", "-q"])
    assert again.exit_code == 2 and "exists; pass --force" in again.output
    forced = CliRunner().invoke(cli, ["export-triton", str(dirs["mlp"]), "--repo", str(repo), "--name", "m",
                                      "--instances", "3", "--force", "-q"])
    assert forced.exit_code == 0, forced.output
    assert parse_config(repo / "m" / "config.pbtxt").instance_group[0].count == 3
    assert sorted(p.name for p in repo.iterdir()) == ["m"]
    assert not list(tmp_path.glob(".trtc-triton-*")), "the staging folder was left behind"
