"""Engine builds: profile shapes, the Polygraphy loader chain, engine files and manifest entries.

TensorRT cannot be installed on this project's machines. Everything up to the build itself is
tested for real (the loader chain is constructed and inspected, not built); the build step alone
is replaced by ``fake_engine_build_step_for_tests`` (conftest.py). The ``tensorrt``-marked tests
build real engines and are skipped, with the reason, where TensorRT or a GPU is missing.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from compiler.backends.tensorrt.build import build_engine_files, build_workers
from compiler.backends.tensorrt.build_step import describe_parser_errors
from compiler.backends.tensorrt.environment import environment
from compiler.backends.tensorrt.layers import layer_summary
from compiler.backends.tensorrt.loaders import StronglyTypedNetworkFromOnnxPath, TensorRTEnumOptions, engine_loader
from compiler.backends.tensorrt.profiles import engine_profile_shapes, multi_profile_shapes, profile_shapes
from compiler.backends.tensorrt.timing_cache import shared_timing_cache_problem, timing_cache_key
from compiler.backends.tensorrt.versions import NOT_INSTALLED, require_tensorrt, tensorrt_version_problem
from compiler.core.capabilities import tensorrt_version
from compiler.core.errors import BuildError, InputError, TensorRTNotInstalled
from compiler.core.files import sha256_file, staging_dir
from compiler.core.manifest import read_manifest, settings_from_dict, settings_to_dict
from compiler.core.settings import BuildSettings
from compiler.core.specs import DimRange, ModelSpec, parse_input_spec
from tests.conftest import FAKE_ENGINE_HEADER, H200_ENV, fake_engine_build_step_for_tests
from tests.manifests import manifest_json
from tests.project import ROOT

ENV = H200_ENV

TRANSFORMER = ModelSpec((parse_input_spec("input_ids:BxS:int64"), parse_input_spec("attention_mask:BxS:int64")),
                        {"S": DimRange(1, 16, 64)})


def test_profile_shapes_fix_the_batch_and_span_the_other_dims() -> None:
    shapes = profile_shapes(TRANSFORMER, 4)
    assert shapes == {"input_ids": ((4, 1), (4, 16), (4, 64)), "attention_mask": ((4, 1), (4, 16), (4, 64))}
    static = ModelSpec((parse_input_spec("images:Bx3x8x8"), parse_input_spec("scale:1x3")))
    assert profile_shapes(static, 8) == {"images": ((8, 3, 8, 8),) * 3, "scale": ((1, 3),) * 3}


def test_multi_profile_shapes_one_profile_per_bucket_in_order() -> None:
    profiles = multi_profile_shapes(TRANSFORMER, [1, 8])
    # together the profiles take every batch from 1 to 8: a server that does not pad can use the engine
    assert [p["input_ids"] for p in profiles] == [((1, 1), (1, 16), (1, 64)), ((2, 1), (8, 16), (8, 64))]


def _chain(loader: Any) -> tuple[Any, Any, TensorRTEnumOptions]:
    """The parts of a Polygraphy loader chain (Polygraphy keeps them in private attributes)."""
    return loader._network, loader._config._config, loader._config._func


def test_engine_loader_carries_profiles_settings_and_timing_cache(tmp_path: Path) -> None:
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, PostprocessConfig

    cache = tmp_path / "timing.cache"
    settings = BuildSettings(buckets=(1, 4), workspace_mib=512, opt_level=5, hardware_compat="ampere-plus",
                             version_compatible=True)
    loader = engine_loader(tmp_path / "model.onnx", TRANSFORMER, [4], settings, cache)
    assert isinstance(loader, EngineBytesFromNetwork) and isinstance(loader._config, PostprocessConfig)
    network, config, options = _chain(loader)
    assert isinstance(network, StronglyTypedNetworkFromOnnxPath) and isinstance(config, CreateConfig)
    assert network.path == str(tmp_path / "model.onnx")
    assert len(config.profiles) == 1
    ids = config.profiles[0]["input_ids"]
    assert (tuple(ids.min), tuple(ids.opt), tuple(ids.max)) == ((4, 1), (4, 16), (4, 64))
    assert config.builder_optimization_level == 5
    assert config.version_compatible is True and not config.exclude_lean_runtime  # the engine is self-contained
    assert (config.fp16, config.int8) == (False, False)  # precision comes from the graph
    assert config.tf32 is True  # FP32 layers may use TF32, as in TensorRT's own default (Polygraphy's is off)
    assert options == TensorRTEnumOptions(workspace_bytes=512 << 20, hardware_compat="ampere-plus")
    assert config.timing_cache_path is None  # nothing to load yet: no warning about a missing file
    assert loader.timing_cache_path == str(cache)  # saved (merged into) after the build

    cache.write_bytes(b"timings")
    defaults = engine_loader(tmp_path / "model.onnx", TRANSFORMER, [1, 4, 8], BuildSettings(), cache)
    _, config, options = _chain(defaults)
    assert config.timing_cache_path == str(cache)  # loaded before the build
    assert [tuple(p["attention_mask"].max) for p in config.profiles] == [(1, 64), (4, 64), (8, 64)]
    assert config.builder_optimization_level == 3 and not config.version_compatible
    assert options == TensorRTEnumOptions(workspace_bytes=None, hardware_compat="none")
    strict = engine_loader(tmp_path / "model.onnx", TRANSFORMER, [1], BuildSettings(tf32=False), cache)
    assert _chain(strict)[1].tf32 is False
    same_cc = engine_loader(tmp_path / "model.onnx", TRANSFORMER, [1],
                            BuildSettings(hardware_compat="same-compute-capability"), cache)
    assert _chain(same_cc)[2].hardware_compat == "same-compute-capability"


def test_the_loader_chain_asks_whether_to_type_strongly_only_when_its_network_is_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Constructing the chain tries no import of TensorRT (a finder first on sys.meta_path records every attempt);
    calling its network asks ``strongly_typed_flag()`` then and gives the answer to Polygraphy's loader."""
    import importlib.abc
    import sys

    import polygraphy.backend.trt as polygraphy_trt

    attempts: list[str] = []

    class RecordsTensorRTImports(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
            if fullname.split(".")[0] in ("tensorrt", "tensorrt_bindings", "tensorrt_libs"):
                attempts.append(fullname)
            return None

    monkeypatch.setattr(sys, "meta_path", [RecordsTensorRTImports(), *sys.meta_path])
    for name in [m for m in sys.modules if m.split(".")[0] == "tensorrt"]:
        monkeypatch.delitem(sys.modules, name)
    loader = engine_loader(tmp_path / "model.onnx", TRANSFORMER, [1, 4], BuildSettings(buckets=(1, 4)),
                           tmp_path / "timing.cache")
    assert attempts == []
    made: list[tuple[str, bool]] = []

    def network_from_onnx_path(path: str, strongly_typed: bool) -> Any:
        made.append((path, strongly_typed))
        return lambda: ("builder", "network", "parser")

    monkeypatch.setattr(polygraphy_trt, "NetworkFromOnnxPath", network_from_onnx_path)
    monkeypatch.setattr("compiler.backends.tensorrt.loaders.strongly_typed_flag", lambda: False)
    assert _chain(loader)[0]() == ("builder", "network", "parser")
    assert made == [(str(tmp_path / "model.onnx"), False)]


def _build(directory: Path, settings: BuildSettings, step: Any = fake_engine_build_step_for_tests,
           env: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], dict[str, bytes]]:
    """Run build_engine_files into a staging folder; the engine records as the manifest writes them, and the staged
    files' bytes."""
    spec = read_manifest(directory).spec
    with staging_dir(directory) as stage:
        entries = build_engine_files(directory, stage, "model.onnx", spec, settings, step, env=env or ENV)
        files = {p.relative_to(stage).as_posix(): p.read_bytes() for p in stage.rglob("*") if p.is_file()}
    return [e.to_json() for e in entries], files


def test_one_engine_per_bucket_with_layer_files_and_entries(exported_dir: Path) -> None:
    entries, files = _build(exported_dir, BuildSettings(buckets=(4, 1)))
    assert sorted(files) == ["engines/b1.engine", "engines/b1.layers.json", "engines/b4.engine",
                             "engines/b4.layers.json", "timing.cache"]
    assert [e["bucket"] for e in entries] == [1, 4]
    onnx_sha = read_manifest(exported_dir).onnx["fp32"].sha256
    for entry in entries:
        data = files[entry["file"]]
        assert data.startswith(FAKE_ENGINE_HEADER)
        assert entry["file"] == f"engines/b{entry['bucket']}.engine" and entry["profile"] == 0
        assert entry["bytes"] == len(data) and entry["sha256"] == _sha(data)
        b = entry["bucket"]
        assert entry["shapes"] == {"x": {"min": [b, 64], "opt": [b, 64], "max": [b, 64]}}
        assert entry["onnx"] == "model.onnx" and entry["onnx_sha256"] == onnx_sha
        assert entry["layers"] == {"file": f"engines/b{b}.layers.json", "count": 1, "output_types": {"FP32": 1}}
        assert json.loads(files[entry["layers"]["file"]])["Layers"][0]["Name"] == "fc + relu"
        assert entry["build_seconds"] >= 0
    assert len(files["timing.cache"].splitlines()) == 2  # one cache, grown by both builds


def test_multi_profile_builds_one_engine_with_a_profile_per_bucket(exported_dir: Path) -> None:
    entries, files = _build(exported_dir, BuildSettings(buckets=(1, 4, 8), multi_profile=True))
    assert [(e["bucket"], e["file"], e["profile"]) for e in entries] == [
        (1, "engines/profiles_b1_4_8.engine", 0), (4, "engines/profiles_b1_4_8.engine", 1),
        (8, "engines/profiles_b1_4_8.engine", 2)]
    record = json.loads(files["engines/profiles_b1_4_8.engine"][len(FAKE_ENGINE_HEADER):])
    assert [p["x"][0] for p in record["profiles"]] == [[1, 64], [2, 64], [5, 64]]  # min shapes: 1, 2-4, 5-8
    # the manifest records the shapes the builder was given, profile by profile
    assert [e["shapes"]["x"] for e in entries] == [
        {"min": p["x"][0], "opt": p["x"][1], "max": p["x"][2]} for p in record["profiles"]]
    assert [e["layers"]["file"] for e in entries] == [f"engines/profiles_b1_4_8.p{k}.layers.json" for k in range(3)]
    assert all(e["layers"]["file"] in files for e in entries)


def test_engine_profile_shapes_is_the_one_plan_for_builder_and_manifest() -> None:
    assert engine_profile_shapes(TRANSFORMER, [8, 1], multi_profile=True) == multi_profile_shapes(TRANSFORMER, [1, 8])
    assert engine_profile_shapes(TRANSFORMER, [4], multi_profile=False) == [profile_shapes(TRANSFORMER, 4)]


def test_a_multi_profile_build_exports_to_triton_as_a_plan(exported_dir: Path, tmp_path: Path) -> None:
    from compiler.core.manifest import write_manifest
    from compiler.pipeline.triton import PLAN_VERSION_FILE, triton_repository

    settings = BuildSettings(buckets=(1, 4), multi_profile=True)
    manifest = read_manifest(exported_dir)
    with staging_dir(exported_dir) as stage:
        entries = build_engine_files(exported_dir, stage, "model.onnx", manifest.spec, settings,
                                     fake_engine_build_step_for_tests, env=ENV)
        (exported_dir / "engines").mkdir()
        (exported_dir / entries[0].file).write_bytes((stage / entries[0].file).read_bytes())
    write_manifest(exported_dir / "manifest.json", manifest.with_engines(settings, ENV, entries))
    folder = triton_repository(exported_dir, tmp_path / "repo", platform="tensorrt_plan")  # the profiles cover 1..4
    assert (folder / "1" / "model.plan").read_bytes() == (exported_dir / entries[0].file).read_bytes()
    version, requirement = (folder / "1" / PLAN_VERSION_FILE).read_text().splitlines()
    assert version == ENV["tensorrt"] and f"exactly {ENV['tensorrt']}" in requirement


def test_jobs_build_buckets_in_processes_pinned_to_one_gpu_each(exported_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    entries, files = _build(exported_dir, BuildSettings(buckets=(1, 4), jobs=2))
    serial, _ = _build(exported_dir, BuildSettings(buckets=(1, 4)))
    pinned = {json.loads(files[e["file"]][len(FAKE_ENGINE_HEADER):])["cuda_visible_devices"] for e in entries}
    assert pinned <= {"0", "1"}  # each worker sees exactly one GPU
    assert [(e["bucket"], e["file"], e["shapes"]) for e in entries] == [
        (e["bucket"], e["file"], e["shapes"]) for e in serial]


def test_build_workers_one_per_gpu_and_one_without_a_gpu_list() -> None:
    assert build_workers(4, 4, []) == 1  # unpinned builds on one GPU would time tactics under contention
    assert build_workers(4, 4, ["0", "1"]) == 2
    assert build_workers(2, 4, ["0", "1", "2"]) == 2 and build_workers(8, 3, ["0"] * 8) == 3
    assert build_workers(1, 4, ["0", "1"]) == 1 and build_workers(4, 1, ["0", "1"]) == 1


def test_jobs_without_a_gpu_list_builds_in_this_process(exported_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr("compiler.backends.tensorrt.build._build_in_parallel", None)  # calling it would fail the test
    entries, _ = _build(exported_dir, BuildSettings(buckets=(1, 4), jobs=4))
    assert [e["bucket"] for e in entries] == [1, 4]


def test_timing_cache_key_is_tensorrt_version_and_gpu() -> None:
    key = timing_cache_key({**ENV, "driver": "1", "platform": "x"})
    assert key == {"tensorrt": "10.13.0.35", "gpu": "NVIDIA H200", "compute_capability": "9.0"}
    assert timing_cache_key({**ENV, "gpu": "NVIDIA H100 80GB HBM3"}) != key  # same compute capability, other GPU


def test_a_shared_timing_cache_of_another_tensorrt_or_gpu_is_refused(exported_dir: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared.cache"
    assert shared_timing_cache_problem(shared, ENV) is None  # a new one
    shared.write_bytes(b"timings of unknown origin\n")
    with pytest.raises(InputError, match=r"does not record which TensorRT and GPU.*--timing-cache another path"):
        _build(exported_dir, BuildSettings(buckets=(1,), timing_cache=shared))
    (tmp_path / "shared.cache.key.json").write_text(json.dumps(timing_cache_key({**ENV, "tensorrt": "10.12.0.36"})))
    with pytest.raises(InputError, match=r"TensorRT 10\.12\.0\.36 on NVIDIA H200, this build is TensorRT 10\.13"):
        _build(exported_dir, BuildSettings(buckets=(1,), timing_cache=shared))
    assert not list(exported_dir.glob(".staging-*")) and not (exported_dir / "engines").exists()


def test_timing_cache_comes_from_the_directory_else_the_shared_one(exported_dir: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared.cache"
    shared.write_bytes(b"shared timings\n")
    (tmp_path / "shared.cache.key.json").write_text(json.dumps(timing_cache_key(ENV)))
    settings = BuildSettings(buckets=(1,), timing_cache=shared)
    _, files = _build(exported_dir, settings)
    assert files["timing.cache"].startswith(b"shared timings\n")  # no DIR/timing.cache yet

    manifest = manifest_json(exported_dir)
    (exported_dir / "manifest.json").write_text(json.dumps({**manifest, "environment": ENV}))
    (exported_dir / "timing.cache").write_bytes(b"this directory's timings\n")
    _, files = _build(exported_dir, settings)
    assert files["timing.cache"].startswith(b"this directory's timings\n")
    a100 = {**ENV, "gpu": "NVIDIA A100", "compute_capability": "8.0"}
    shared_a100 = tmp_path / "a100.cache"
    shared_a100.write_bytes(b"A100 timings\n")
    (tmp_path / "a100.cache.key.json").write_text(json.dumps(timing_cache_key(a100)))
    _, files = _build(exported_dir, replace(settings, timing_cache=shared_a100), env=a100)
    assert files["timing.cache"].startswith(b"A100 timings\n")  # DIR's was timed on another GPU
    assert shared.read_bytes() == b"shared timings\n"  # only a real build merges into the shared cache


def test_hardware_compat_needs_an_ampere_or_newer_gpu_to_build_on(exported_dir: Path) -> None:
    with pytest.raises(BuildError, match=r"Ampere or newer GPU.*7\.5"):
        _build(exported_dir, BuildSettings(buckets=(1,), hardware_compat="ampere-plus"),
               env={**ENV, "gpu": "Tesla T4", "compute_capability": "7.5"})


def test_engine_none_builds_nothing(exported_dir: Path) -> None:
    entries, files = _build(exported_dir, BuildSettings(engine="none"))
    assert entries == [] and files == {}


@pytest.mark.skipif(tensorrt_version() is not None, reason="TensorRT is installed here: the message is for its absence")
def test_without_tensorrt_the_default_build_step_refuses_with_the_exact_message(exported_dir: Path) -> None:
    expected = ("TensorRT is not installed: engines not built; install trtc[tensorrt] on a machine with an NVIDIA "
                f"GPU and run `trtc rebuild {exported_dir}`")
    with pytest.raises(TensorRTNotInstalled) as caught:
        _build(exported_dir, BuildSettings(buckets=(1,)), step=None)
    assert str(caught.value) == expected and caught.value.exit_code == 4
    assert NOT_INSTALLED.format(directory="DIR").endswith("run `trtc rebuild DIR`")
    with pytest.raises(TensorRTNotInstalled, match=r"run `trtc rebuild DIR`$"):
        require_tensorrt()


def test_layer_summary_reads_tensorrt_10_and_11_layouts() -> None:
    trt10 = {"Layers": [{"Name": "conv", "Outputs": [{"Format/Datatype": "Channel major INT8 format where ..."}]},
                        {"Name": "head", "Outputs": [{"Format/Datatype": "Row major linear FP16 format"}]},
                        {"Name": "softmax", "Outputs": [{"Format/Datatype": "Row major linear FP32"}]}],
             "Bindings": ["x", "y"]}
    trt11 = {"Layers": [{"Name": "q", "Outputs": [{"DataType": "Int8", "Format": "Row major linear"}]},
                        {"Name": "mm", "Outputs": [{"DataType": "Half"}]}], "I/O Tensors": []}
    assert layer_summary(json.dumps(trt10)) == {"count": 3, "output_types": {"FP16": 1, "FP32": 1, "INT8": 1}}
    assert layer_summary(json.dumps(trt11)) == {"count": 2, "output_types": {"FP16": 1, "INT8": 1}}
    assert layer_summary(json.dumps({"Layers": ["conv + relu"]})) == {"count": 1, "output_types": {"unknown": 1}}


class _ErrorCodeDouble:
    name = "UNSUPPORTED_NODE"


class _ParserErrorDouble:
    """Test double of one ``tensorrt.ParserError`` (only the methods describe_parser_errors reads)."""

    def __init__(self, node: int, name: str, op: str, desc: str) -> None:
        self._node, self._name, self._op, self._desc = node, name, op, desc

    def node(self) -> int:
        return self._node

    def node_name(self) -> str:
        return self._name

    def node_operator(self) -> str:
        return self._op

    def desc(self) -> str:
        return self._desc

    def code(self) -> _ErrorCodeDouble:
        return _ErrorCodeDouble()

    def local_function_stack(self) -> list[str]:
        return []


class _ParserDouble:
    def __init__(self, errors: list[_ParserErrorDouble]) -> None:
        self.errors = errors
        self.num_errors = len(errors)

    def get_error(self, index: int) -> _ParserErrorDouble:
        return self.errors[index]


def test_parser_errors_name_the_node_and_operator() -> None:
    parser = _ParserDouble([_ParserErrorDouble(7, "/blocks.0/attn/Foo", "FooOp", "No importer registered"),
                            _ParserErrorDouble(-1, "", "", "graph has no outputs")])
    text = describe_parser_errors(parser)  # type: ignore[arg-type]
    assert text == ("node /blocks.0/attn/Foo (FooOp): No importer registered [UNSUPPORTED_NODE]; "
                    "the graph: graph has no outputs [UNSUPPORTED_NODE]")


def test_environment_answers_without_failing_and_records_the_compat_settings() -> None:
    env = environment(BuildSettings(hardware_compat="ampere-plus"))
    assert set(env) >= {"tensorrt", "cuda_runtime", "cuda_driver", "driver", "gpu", "compute_capability",
                        "platform", "hardware_compat", "version_compatible"}
    assert env["tensorrt"] == tensorrt_version()
    assert env["hardware_compat"] == "ampere-plus" and env["version_compatible"] is False
    json.dumps(env)  # goes into the manifest as it is


def test_build_settings_round_trip_through_the_manifest() -> None:
    settings = BuildSettings(buckets=(1, 8), precision="int8", multi_profile=True, workspace_mib=64, opt_level=4,
                             hardware_compat="same-compute-capability", version_compatible=True,
                             timing_cache=Path("/tmp/t.cache"), jobs=2, tf32=False)
    stored = json.loads(json.dumps(settings_to_dict(settings)))
    assert stored["buckets"] == [1, 8] and stored["timing_cache"] == "/tmp/t.cache"
    assert stored["tf32"] is False and stored["hardware_compat"] == "same-compute-capability"
    assert settings_from_dict({**stored, "from_a_newer_trtc": 1}) == settings
    older = {k: v for k, v in stored.items() if k != "tf32"}
    assert settings_from_dict({**older, "hardware_compat": True}).tf32 is False  # built with TF32 off back then
    assert settings_from_dict({**older, "hardware_compat": True}).hardware_compat == "ampere-plus"
    assert BuildSettings().tf32 is True and BuildSettings().hardware_compat == "none"
    with pytest.raises(InputError, match="use one of none, same-compute-capability, ampere-plus"):
        BuildSettings(hardware_compat="turing-plus")


def test_tensorrt_older_than_10_12_is_refused_in_one_line() -> None:
    assert tensorrt_version_problem("10.12.0.36") is None and tensorrt_version_problem("11.0.0.5") is None
    for old in ("10.11.0.33", "10.8.0.43", "8.6.1"):
        problem = tensorrt_version_problem(old)
        assert problem == (f"TensorRT {old} is too old: trtc needs 10.12 or later (strongly typed networks are "
                           "complete from 10.12); install trtc[tensorrt] to get a supported version")


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


# --- with TensorRT and a GPU --------------------------------------------------------------------------------------

@pytest.mark.tensorrt
def test_real_engines_for_two_buckets_match_onnxruntime(tmp_path: Path) -> None:
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    from compiler.backends.onnxrt_runner import OnnxRuntimeRunner
    from compiler.core.settings import ExportSettings, ModelSource
    from compiler.pipeline.export import export_directory

    out = tmp_path / "mlp"
    export_directory(ExportSettings(ModelSource(factory="examples.models:mlp"), out,
                                    ModelSpec((parse_input_spec("x:Bx64"),)), buckets=(1, 4)))
    shared = tmp_path / "shared.cache"
    settings = BuildSettings(buckets=(1, 4), timing_cache=shared)
    spec = read_manifest(out).spec
    with staging_dir(out) as stage:
        entries = [e.to_json() for e in build_engine_files(out, stage, "model.onnx", spec, settings)]
        assert [e["file"] for e in entries] == ["engines/b1.engine", "engines/b4.engine"]
        assert (stage / "timing.cache").stat().st_size > 0 and shared.stat().st_size > 0
        reference = OnnxRuntimeRunner(out / "model.onnx", ["CPUExecutionProvider"])
        reference.activate()
        for entry in entries:
            engine = (stage / entry["file"]).read_bytes()
            assert sha256_file(stage / entry["file"]) == entry["sha256"]
            layers = json.loads((stage / entry["layers"]["file"]).read_text())
            assert len(layers["Layers"]) == entry["layers"]["count"] > 0
            assert entry["layers"]["output_types"].get("FP32", 0) > 0  # an FP32 graph runs in FP32
            feed = spec.example_feed(entry["bucket"], seed=1)
            with TrtRunner(EngineFromBytes(engine)) as runner:
                got = runner.infer(feed)
            want = reference.infer(feed)
            for name, value in want.items():
                np.testing.assert_allclose(np.asarray(got[name]), value, rtol=1e-3, atol=1e-4)


@pytest.mark.tensorrt
def test_real_parser_error_names_the_rejected_node(tmp_path: Path) -> None:
    from onnx import helper

    from compiler.core.manifest import MANIFEST, FileRecord, Manifest, write_manifest
    from compiler.core.onnx_io import save_onnx
    from tests.onnx_helpers import make_model, tensor

    out = tmp_path / "custom"
    model = make_model([helper.make_node("NoSuchOp", ["x"], ["y"], name="mystery", domain="com.example")],
                       [tensor("x", ["B", 4])], [tensor("y", ["B", 4])])
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    save_onnx(model, out / "model.onnx")
    write_manifest(out / MANIFEST, Manifest(inputs=("x:Bx4:float32",), buckets=(1,),
                                            onnx={"fp32": FileRecord.for_onnx(out, out / "model.onnx")}))
    with pytest.raises(BuildError, match=r"node mystery \(NoSuchOp\)"), staging_dir(out) as stage:
        build_engine_files(out, stage, "model.onnx", read_manifest(out).spec,
                           BuildSettings(buckets=(1,)))


def test_gpu_facts_from_nvidia_smi_as_an_h200_prints_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from compiler.backends.tensorrt import environment as engines

    printed = {  # captured from nvidia-smi 580.159.04 on an H200 (`--id` takes an index or a UUID)
        "--id=0 --query-gpu=name,compute_cap,driver_version --format=csv,noheader": ["NVIDIA H200, 9.0, 580.159.04"],
        "--query-gpu=index --format=csv,noheader": ["0"],
        "": ["| NVIDIA-SMI 580.159.04             Driver Version: 580.159.04     CUDA Version: 13.0     |"],
    }
    monkeypatch.setattr(engines, "_nvidia_smi", lambda args: printed.get(" ".join(args), []))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert engines._gpu_from_nvidia_smi(None) == {"gpu": "NVIDIA H200", "driver": "580.159.04",
                                                  "compute_capability": "9.0", "cuda_driver": "13.0"}
    assert engines.visible_gpus() == ["0"]
    assert engines._gpu_from_nvidia_smi(1) == {}  # "No devices were found" (exit code 6): no such GPU


def _build_settings_from_command_line(*args: str) -> BuildSettings:
    from compiler.cli import cli
    from compiler.core.profile import build_settings

    command = cli.commands["build"]
    context = command.make_context("build", ["model.onnx", *args])
    return build_settings(context.params, (1,), "fp32")


def test_build_options_for_tf32_and_hardware_compat_levels() -> None:
    assert _build_settings_from_command_line().tf32 is True
    assert _build_settings_from_command_line("--no-tf32").tf32 is False
    assert _build_settings_from_command_line("--hardware-compat").hardware_compat == "ampere-plus"
    assert _build_settings_from_command_line("--hardware-compat", "same-compute-capability").hardware_compat == (
        "same-compute-capability")
    assert _build_settings_from_command_line().hardware_compat == "none"
    from compiler.cli import cli

    result = CliRunner().invoke(cli, ["build", "--help"], terminal_width=200)
    assert "--tf32 / --no-tf32" in result.output and "same-compute-" in result.output


def test_a_graph_is_kept_only_when_tensorrt_accepted_every_enqueue() -> None:
    from compiler.backends.tensorrt.runtime import _CheckedLaunch

    answers = iter([True, True, False, True])  # warm-up x3, then the capture: the third was refused
    launch = _CheckedLaunch(lambda stream: next(answers), stream_handle=7)
    assert [launch() for _ in range(4)] == [True, True, False, True]
    assert launch.calls == 4 and launch.all_accepted is False
    accepted = _CheckedLaunch(lambda stream: stream == 7, stream_handle=7)
    accepted()
    assert accepted.all_accepted is True


def test_the_build_step_inspects_each_profile_at_the_shapes_the_engine_was_built_for(exported_dir: Path) -> None:
    given: list[Any] = []

    def recording_step(loader: Any, profiles: list[Any]) -> tuple[bytes, list[str]]:
        given.append(profiles)
        return fake_engine_build_step_for_tests(loader, profiles)

    spec = read_manifest(exported_dir).spec
    _build(exported_dir, BuildSettings(buckets=(1, 4, 8), multi_profile=True), step=recording_step)
    assert given == [engine_profile_shapes(spec, (1, 4, 8), multi_profile=True)]  # opt shapes per profile from here


def test_the_declared_tensorrt_and_polygraphy_floors_are_the_checked_ones() -> None:
    from compiler.backends.tensorrt.versions import MIN_TENSORRT

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["tensorrt"] == [f"tensorrt>={MIN_TENSORRT[0]}.{MIN_TENSORRT[1]},<12"]
    assert "polygraphy>=0.53" in project["dependencies"]  # 0.49.0-0.49.5 set EXPLICIT_BATCH, gone in TensorRT 11
