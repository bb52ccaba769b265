"""The TensorRT folder (compiler/backends/tensorrt/) where TensorRT is absent: the parts of the engine path that run
without it, each against the rule it keeps.

TensorRT's own objects are replaced only where a test says so, by small doubles passed in explicitly (an engine
whose inspector holds its context's address and no reference, a timing cache that combines sets, an nvidia-smi
script on PATH): the code under test is trtc's, unchanged. ``tests/compiler/backends/tensorrt/test_acceptance.py``
proves the rest on a machine with TensorRT and a GPU."""

from __future__ import annotations

import ast
import importlib.machinery
import json
import logging
import os
import stat
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from compiler.backends.tensorrt import environment as environments
from compiler.backends.tensorrt.build import build_engine_files
from compiler.backends.tensorrt.compat import gpus_that_run, later_runtimes
from compiler.backends.tensorrt.layers import inspect_profiles, layer_io_types, layer_summary, layers_reading
from compiler.backends.tensorrt.runtime import EnginesNotRunnable, tensorrt_backend
from compiler.backends.tensorrt.timing_cache import drop_unreadable_timing_cache, merge_timing_cache, timing_cache_key
from compiler.core.errors import BuildError, InputError
from compiler.core.files import staging_dir
from compiler.core.manifest import Manifest, read_manifest
from compiler.core.settings import BuildSettings
from compiler.pipeline.triton import plan_requirement
from tests.conftest import H200_ENV, fake_engine_build_step_for_tests
from tests.manifests import manifest_json, write_manifest_json
from tests.project import ROOT

# --- the engine inspector -----------------------------------------------------------------------------------------

class _Context:
    """An execution context as the inspector sees it: a selected profile and input shapes."""

    def __init__(self) -> None:
        self.profile = 0
        self.shapes: dict[str, tuple[int, ...]] = {}

    def set_optimization_profile_async(self, index: int, stream_handle: int) -> bool:
        self.profile = index
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self.shapes[name] = tuple(shape)
        return True


class _Inspector:
    """As TensorRT's bindings make it: ``execution_context = c`` keeps c's address, not a reference to c."""

    def __init__(self, engine: _Engine) -> None:
        self._context: Any = None
        self.context_id: int | None = None
        engine.inspectors.add(self)

    @property
    def execution_context(self) -> _Context | None:
        return self._context() if self._context is not None else None

    @execution_context.setter
    def execution_context(self, context: _Context) -> None:
        self._context, self.context_id = weakref.ref(context), id(context)

    def get_engine_information(self, layer_format: str) -> str:
        context = self.execution_context
        assert context is not None, "inspected through a context that is gone"
        return json.dumps({"format": layer_format, "profile": context.profile, "shapes": context.shapes})


class _Engine:
    """Records what an inspection does with contexts and inspectors; ``dangling``: inspectors that outlived the
    context they were given (TensorRT would read freed memory through them)."""

    def __init__(self, profiles: int) -> None:
        self.num_optimization_profiles = profiles
        self.inspectors: weakref.WeakSet[_Inspector] = weakref.WeakSet()
        self.contexts: weakref.WeakSet[_Context] = weakref.WeakSet()
        self.alive_at_creation: list[int] = []
        self.dangling: list[int] = []

    def create_execution_context(self) -> _Context:
        self.alive_at_creation.append(len(self.contexts))
        context = _Context()
        self.contexts.add(context)
        weakref.finalize(context, self._context_gone, id(context))
        return context

    def _context_gone(self, context_id: int) -> None:
        self.dangling += [id(i) for i in list(self.inspectors) if i.context_id == context_id]

    def create_engine_inspector(self) -> _Inspector:
        return _Inspector(self)


def test_each_profile_is_inspected_by_an_inspector_that_goes_before_its_context() -> None:
    """Profile k is inspected through a context with k selected and the opt shapes set; no inspector outlives its
    context (TensorRT's setter keeps a raw pointer), and each context is gone before the next one is made."""
    engine = _Engine(profiles=3)
    profiles = [{"x": ((1, 64), (b, 64), (b, 64))} for b in (1, 4, 8)]
    synced: list[int] = []
    infos = inspect_profiles(engine, profiles, "JSON", 7, lambda: synced.append(1))  # type: ignore[arg-type]
    assert [json.loads(i) for i in infos] == [
        {"format": "JSON", "profile": k, "shapes": {"x": [b, 64]}} for k, b in enumerate((1, 4, 8))]
    assert engine.dangling == []
    assert engine.alive_at_creation == [0, 0, 0]  # one profile's activation memory at a time
    assert len(synced) == 3 and not list(engine.contexts) and not list(engine.inspectors)


def test_an_opt_shape_the_engine_refuses_is_a_build_error_that_leaves_nothing_dangling() -> None:
    class Refuses(_Context):
        def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
            return False

    engine = _Engine(profiles=1)
    engine.create_execution_context = lambda: Refuses()  # type: ignore[method-assign]
    with pytest.raises(BuildError, match=r"profile 0 of the engine does not take x shaped \(4, 64\)"):
        inspect_profiles(engine, [{"x": ((4, 64),) * 3}], "JSON", 0, lambda: None)  # type: ignore[arg-type]
    assert engine.dangling == []


# --- what the layer information says about precision ----------------------------------------------------------------

# an INT8 convolution whose fused dequantize writes FP32, and the quantize before it: TensorRT 10's layout
TRT10_LAYERS = {"Layers": [
    {"Name": "/conv/input_quantizer/QuantizeLinear",
     "Inputs": [{"Name": "x", "Format/Datatype": "Row major linear FP32"}],
     "Outputs": [{"Name": "xq", "Format/Datatype": "Channel major INT8 format where channel % 32 == 0"}]},
    {"Name": "/conv/Conv + /relu/Relu", "Inputs": [{"Name": "xq", "Format/Datatype": "Channel major Int8 format"}],
     "Outputs": [{"Name": "y", "Format/Datatype": "Row major linear FP32"}]},
]}
TRT11_LAYERS = {"Layers": [  # TensorRT 11 names the type in a field of its own
    {"Name": "/fc/MatMul", "Inputs": [{"Name": "x", "DataType": "Half"}, {"Name": "w", "DataType": "Half"}],
     "Outputs": [{"Name": "y", "DataType": "Float"}]},
    "a layer given by name only",
]}


def test_a_layers_precision_is_read_from_its_inputs_not_its_first_output() -> None:
    assert layer_io_types(TRT10_LAYERS["Layers"][1]) == (["INT8"], ["FP32"])  # type: ignore[arg-type]
    assert layer_summary(json.dumps(TRT10_LAYERS))["output_types"] == {"FP32": 1, "INT8": 1}
    assert layers_reading(json.dumps(TRT10_LAYERS), "INT8") == ["/conv/Conv + /relu/Relu"]  # the quantize reads FP32
    assert layers_reading(json.dumps(TRT11_LAYERS), "FP16") == ["/fc/MatMul"]
    assert layer_summary(json.dumps(TRT11_LAYERS)) == {"count": 2, "output_types": {"FP32": 1, "unknown": 1}}
    assert layers_reading("not json", "INT8") == []


# --- timing caches --------------------------------------------------------------------------------------------------

class _Cache:
    """A timing cache double: a set of timings; combining adds another cache's (unless told to refuse)."""

    refuse = False

    def __init__(self, entries: list[str]) -> None:
        self.entries = set(entries)

    def combine(self, input_cache: _Cache, ignore_mismatch: bool) -> bool:
        assert ignore_mismatch is False  # timings of another device must not be mixed in
        if self.refuse:
            return False
        self.entries |= input_cache.entries
        return True

    def serialize(self) -> bytes:
        return json.dumps(sorted(self.entries)).encode()


def _read(path: Path) -> _Cache | None:
    """Reads what ``_Cache.serialize`` wrote; None for anything else, as TensorRT returns for bytes it cannot read."""
    try:
        return _Cache(json.loads(path.read_bytes()))
    except ValueError:
        return None


def _entries(path: Path) -> list[str]:
    return sorted(json.loads(path.read_bytes()))


def test_a_shared_timing_cache_is_created_then_grows_by_combining(tmp_path: Path) -> None:
    source, shared = tmp_path / "timing.cache", tmp_path / "shared" / "trt.cache"
    source.write_bytes(b'["b1"]')
    assert merge_timing_cache(source, shared, H200_ENV, read=_read) is True
    assert _entries(shared) == ["b1"]
    assert json.loads((tmp_path / "shared" / "trt.cache.key.json").read_text()) == timing_cache_key(H200_ENV)
    source.write_bytes(b'["b4"]')
    assert merge_timing_cache(source, shared, H200_ENV, read=_read) is True
    assert _entries(shared) == ["b1", "b4"]


def test_a_build_cache_tensorrt_cannot_read_is_not_merged_and_says_so(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """``create_timing_cache`` may give None (as the directory's cache check already handles): the merge must not
    call ``combine`` on it."""
    source, shared = tmp_path / "timing.cache", tmp_path / "shared.cache"
    source.write_bytes(b"not a timing cache")
    shared.write_bytes(b'["b1"]')
    shared.with_name("shared.cache.key.json").write_text(json.dumps(timing_cache_key(H200_ENV)))
    with caplog.at_level(logging.WARNING):
        assert merge_timing_cache(source, shared, H200_ENV, read=_read) is False
    assert _entries(shared) == ["b1"]
    assert any("TensorRT cannot read this build's" in r.getMessage() for r in caplog.records)


def test_an_unreadable_shared_cache_is_replaced_and_a_refused_combine_leaves_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    source, shared = tmp_path / "timing.cache", tmp_path / "shared.cache"
    source.write_bytes(b'["b4"]')
    shared.write_bytes(b"garbage")
    shared.with_name("shared.cache.key.json").write_text(json.dumps(timing_cache_key(H200_ENV)))
    with caplog.at_level(logging.WARNING):
        assert merge_timing_cache(source, shared, H200_ENV, read=_read) is True
    assert _entries(shared) == ["b4"] and "is unreadable; replacing it" in caplog.text
    monkeypatch.setattr(_Cache, "refuse", True)
    source.write_bytes(b'["b8"]')
    with caplog.at_level(logging.WARNING):
        assert merge_timing_cache(source, shared, H200_ENV, read=_read) is False
    assert _entries(shared) == ["b4"] and "could not combine" in caplog.text


def test_a_shared_cache_of_another_gpu_is_left_alone(tmp_path: Path) -> None:
    source, shared = tmp_path / "timing.cache", tmp_path / "shared.cache"
    source.write_bytes(b'["b4"]')
    shared.write_bytes(b'["a100"]')
    other = {**H200_ENV, "gpu": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0"}
    shared.with_name("shared.cache.key.json").write_text(json.dumps(timing_cache_key(other)))
    assert merge_timing_cache(source, shared, H200_ENV, read=_read) is False
    assert _entries(shared) == ["a100"]


def test_an_unreadable_seeded_cache_is_dropped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b'["b1"]')
    drop_unreadable_timing_cache(cache, read=_read)
    assert cache.is_file()
    cache.write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING):
        drop_unreadable_timing_cache(cache, read=_read)
    assert not cache.exists() and "unreadable; starting a fresh one" in caplog.text


# --- which device environment() describes ----------------------------------------------------------------------------

def _fake_nvidia_smi(directory: Path, gpus: dict[str, str]) -> None:
    """An ``nvidia-smi`` on PATH that knows ``gpus`` (its id -> "name, compute capability") and, like the real one,
    ignores CUDA_VISIBLE_DEVICES and exits 6 for an id it does not have."""
    directory.mkdir(exist_ok=True)
    script = directory / "nvidia-smi"
    cases = "\n".join(f'    --id={gpu}) echo "{facts}, 580.159.04"; exit 0;;' for gpu, facts in gpus.items())
    indices = "\\n".join(gpus)
    script.write_text(f"""#!/bin/sh
case "$1" in
{cases}
    --id=*) echo "No devices were found"; exit 6;;
    --query-gpu=index) printf '{indices}\\n'; exit 0;;
    "") echo "| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0 |"; exit 0;;
esac
exit 2
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def mixed_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-smi of a host with an H200 (GPU 0) and an A100 (GPU 1); no CUDA torch or cuda-python answers first."""
    monkeypatch.setattr(environments, "_gpu_from_cuda_python", lambda device: {})
    monkeypatch.setattr(environments, "_gpu_from_torch", lambda device: {})
    _fake_nvidia_smi(tmp_path / "bin", {"0": "NVIDIA H200, 9.0", "1": "NVIDIA A100-SXM4-80GB, 8.0"})
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.usefixtures("mixed_host")
def test_environment_describes_the_device_asked_for_through_cuda_visible_devices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert environments.environment()["gpu"] == "NVIDIA H200"  # the current device: 0
    assert environments.environment(device=1)["gpu"] == "NVIDIA A100-SXM4-80GB"
    assert environments.environment(device=1)["compute_capability"] == "8.0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")  # cuda:0 of this process is GPU 1
    assert environments.environment(device=0)["gpu"] == "NVIDIA A100-SXM4-80GB"
    assert environments.environment(device=1)["gpu"] == "NVIDIA H200"
    missing = environments.environment(device=2)
    assert missing["gpu"] is None and missing["compute_capability"] is None  # no such device: nothing to run on
    assert environments.visible_gpus() == ["1", "0"]


def test_environment_asks_torch_about_the_device_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    names, capabilities = ["NVIDIA H200", "NVIDIA L40S"], [(9, 0), (8, 9)]
    monkeypatch.setattr(environments, "_gpu_from_cuda_python", lambda device: {})
    monkeypatch.setattr(environments, "_gpu_from_nvidia_smi", lambda device: {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: names[index])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capabilities[index])
    assert environments.environment(device=0)["gpu"] == "NVIDIA H200"
    here = environments.environment()  # torch's current device
    assert (here["gpu"], here["compute_capability"]) == ("NVIDIA L40S", "8.9")


def _engines_dir(exported_dir: Path, inputs: list[str] | None = None) -> tuple[Path, Manifest]:
    """``exported_dir`` with a manifest naming engines built on an H200 (their files absent: stale)."""
    manifest = manifest_json(exported_dir)
    manifest.update(engines=[{"bucket": b, "file": f"engines/b{b}.engine", "sha256": "0" * 64, "profile": 0}
                             for b in (1, 4)], environment=H200_ENV, build={"buckets": [1, 4]})
    if inputs is not None:
        manifest["inputs"] = inputs
    write_manifest_json(exported_dir / "manifest.json", manifest)
    return exported_dir, read_manifest(exported_dir)


def test_the_runtime_checks_staleness_on_the_device_it_will_run_on(exported_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import compiler.backends.tensorrt.runtime as runtime

    directory, manifest = _engines_dir(exported_dir)
    asked: list[int | None] = []

    def environment(settings: Any = None, device: int | None = None) -> dict[str, Any]:
        asked.append(device)
        return H200_ENV

    monkeypatch.setattr(runtime, "require_tensorrt", lambda directory=None: "10.13.0.35")
    monkeypatch.setattr(runtime, "environment", environment)
    for device in ("cuda:1", None):
        with pytest.raises(EnginesNotRunnable, match="engine file missing"):
            tensorrt_backend(directory, manifest, manifest.spec, device, cuda_graphs=True)
    assert asked == [1, 0]  # cuda:1; then the current device (0 where torch sees no GPU)
    with pytest.raises(InputError, match="device='cpu': TensorRT engines run on a CUDA device"):
        tensorrt_backend(directory, manifest, manifest.spec, "cpu", cuda_graphs=True)


@pytest.mark.usefixtures("mixed_host")
def test_parallel_builds_refuse_a_worker_on_another_gpu_model(exported_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest records one environment (an H200's) and the engines share one timing cache: a worker pinned to
    the A100 of a mixed host stops the build, naming both GPUs and the fix."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    spec = read_manifest(exported_dir).spec
    with pytest.raises(BuildError) as err, staging_dir(exported_dir) as stage:
        build_engine_files(exported_dir, stage, "model.onnx", spec, BuildSettings(buckets=(1, 4), jobs=2),
                           fake_engine_build_step_for_tests, env=H200_ENV)
    message = str(err.value)
    assert "NVIDIA A100-SXM4-80GB" in message and "NVIDIA H200" in message and "CUDA_VISIBLE_DEVICES" in message
    _fake_nvidia_smi(Path(os.environ["PATH"].split(os.pathsep)[0]), {"0": "NVIDIA H200, 9.0", "1": "NVIDIA H200, 9.0"})
    with staging_dir(exported_dir) as stage:
        entries = build_engine_files(exported_dir, stage, "model.onnx", spec, BuildSettings(buckets=(1, 4), jobs=2),
                                     fake_engine_build_step_for_tests, env=H200_ENV)
    assert [e.bucket for e in entries] == [1, 4]


# --- what the runtime refuses -----------------------------------------------------------------------------------------

def test_bfloat16_inputs_are_refused_at_load_in_one_line(exported_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before anything is read: the pinned staging of a bfloat16 input would fail (numpy has no bfloat16)."""
    import compiler.backends.tensorrt.runtime as runtime
    from compiler.serve.load import load

    directory, _ = _engines_dir(exported_dir, inputs=["x:Bx64:bfloat16"])
    monkeypatch.setattr(runtime, "require_tensorrt", lambda directory=None: "10.13.0.35")
    with pytest.raises(EnginesNotRunnable) as err:
        load(directory, backend="tensorrt")
    message = str(err.value)
    assert "\n" not in message and "outputs x are bfloat16" in message and "cast them to float32" in message


# --- one TensorRT logger ----------------------------------------------------------------------------------------------

def test_trtc_creates_no_tensorrt_logger_of_its_own() -> None:
    """Every builder, parser and runtime takes ``tensorrt_logger()`` (Polygraphy's): TensorRT keeps the first
    logger of a process and ignores, with a warning, a second one given while a builder or runtime lives."""
    made = []
    for path in sorted((ROOT / "compiler").rglob("*.py")) + sorted((ROOT / "calibration").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in ("Logger", "ILogger"):
                    made.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert made == []


# --- the type stub ----------------------------------------------------------------------------------------------------

def test_the_tensorrt_stub_cannot_be_imported() -> None:
    """typings/tensorrt.pyi is what mypy checks the TensorRT modules against; with typings/ on sys.path a folder
    named tensorrt would import as a namespace package, a .pyi file never does."""
    stub = ROOT / "typings" / "tensorrt.pyi"
    ast.parse(stub.read_text(), str(stub))
    assert not (ROOT / "typings" / "tensorrt").exists()
    assert importlib.machinery.PathFinder.find_spec("tensorrt", [str(ROOT / "typings")]) is None
    assert 'mypy_path = "$MYPY_CONFIG_FILE_DIR/typings"' in (ROOT / "pyproject.toml").read_text()


# --- what Triton is told about a plan ---------------------------------------------------------------------------------

def test_the_plan_message_names_the_tensorrt_releases_and_the_gpus_that_load_it() -> None:
    built = {**H200_ENV, "tensorrt": "10.13.0.35"}
    assert later_runtimes("10.13.0.35") == "TensorRT 10.13.0.35 or a later 10.x or 11.x"
    assert later_runtimes("11.4.0.106") == "TensorRT 11.4.0.106 or a later 11.x"
    _, exact = plan_requirement(Manifest.from_json({"environment": built, "build": {"hardware_compat": "none"}}))
    assert "exactly 10.13.0.35" in exact and "only on the GPU model that built it, NVIDIA H200" in exact
    _, compatible = plan_requirement(Manifest.from_json({"environment": built, "build": {
        "version_compatible": True, "hardware_compat": "same-compute-capability"}}))
    assert "or a later 10.x or 11.x when started with --backend-config=tensorrt,version-compatible=true" in compatible
    assert "any GPU of compute capability 9.0" in compatible
    assert "8.0 or later" in gpus_that_run(built, "ampere-plus") and "8.0 or later" in gpus_that_run(built, True)
    assert "\n" not in exact + compatible


def test_staleness_says_a_version_compatible_tensorrt_10_engine_runs_on_11_too(exported_dir: Path) -> None:
    from compiler.backends.tensorrt.compat import stale_in

    directory, manifest = _engines_dir(exported_dir)
    assert manifest.build is not None
    manifest = replace(manifest, build=replace(manifest.build, version_compatible=True))
    older = stale_in(directory, manifest, {**H200_ENV, "tensorrt": "10.12.0.36"})
    assert "runs on TensorRT 10.13.0.35 or a later 10.x or 11.x" in older[0].reason
    later = stale_in(directory, manifest, {**H200_ENV, "tensorrt": "11.4.0.106"})
    assert "TensorRT" not in later[0].reason.replace("engine file missing", "")
