"""Acceptance suite for a machine with TensorRT (10.12+ or 11.x) and an NVIDIA GPU: ``make test-tensorrt``.

TensorRT cannot be installed where trtc is developed, so the engine path is proven here, on first contact
with a real TensorRT: every test but the type stub's builds real engines through ``trtc build`` /
``trtc rebuild`` and checks them against ONNX Runtime. Each test's docstring says what its assertions prove,
no more. Everything is skipped with the reason elsewhere (tests/conftest.py). Buckets and models are small: the
suite is about behaviour, not speed.

Unproven until this suite has run on a TensorRT machine (the code was checked against the TensorRT 11.4 bindings,
TensorRT's documentation and Polygraphy's source, and the parts without TensorRT are tested in
tests/compiler/backends/tensorrt/test_engine_path.py): that the inspector reports per-layer types with a context
attached; that USER_MANAGED contexts sharing one buffer run correctly; that a refused enqueue is seen during
capture; that a version-compatible engine needs ``engine_host_code_allowed``; that TensorRT's timing-cache combine
and an unreadable cache behave as handled; that INT8/FP16 engines pass the accuracy gate that ONNX Runtime passed;
that typings/tensorrt.pyi names only what the installed TensorRT has."""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from calibration.accuracy import row_cosines
from compiler.core.settings import BuildSettings, ExportSettings, GateSettings, ModelSource
from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec
from tests.project import ROOT

pytestmark = pytest.mark.tensorrt

Model = tuple[str, list[str], dict[str, str]]  # factory, input specs, dim ranges
CNN: Model = ("examples.models:resnet_digits", ["images:Bx1x8x8"], {})
TRANSFORMER: Model = ("examples.models:transformer_encoder", ["input_ids:BxS:int64", "attention_mask:BxS:int64"],
               {"S": "1:16:32"})
MLP: Model = ("examples.models:mlp", ["x:Bx64"], {})


def _spec(model: Model) -> ModelSpec:
    _, inputs, dims = model
    return ModelSpec(tuple(parse_input_spec(i) for i in inputs),
                     dict(parse_dim_range(f"{k}={v}") for k, v in dims.items()))


def _build(out: Path, model: Model, precision: str = "fp32",
           buckets: tuple[int, ...] = (1, 4, 8), **build: Any) -> dict[str, Any]:
    """``trtc build`` of an example model into ``out``; the manifest as the JSON it writes. INT8/FP16 calibrate on
    seeded random data."""
    from compiler.core.settings import CalibrationSettings
    from compiler.pipeline.build import build_directory

    calibration = None if precision == "fp32" else CalibrationSettings(precision, data="random", samples=64)
    export = ExportSettings(ModelSource(factory=model[0]), out, _spec(model), buckets)
    return build_directory(export, calibration, BuildSettings(buckets=buckets, precision=precision, **build)).to_json()


def _fp32_reference(out: Path, feed: dict[str, np.ndarray]) -> np.ndarray:
    """The FP32 ONNX of ``out`` on ONNX Runtime's CPU provider: the reference every accuracy gate compares to."""
    from compiler.core.onnx_io import ort_session

    session = ort_session(out / "model.onnx", ["CPUExecutionProvider"])
    return np.asarray(session.run(None, feed)[0])


@contextlib.contextmanager
def _captured(caplog: pytest.LogCaptureFixture, logger: str, level: int = logging.INFO) -> Any:
    """caplog for ``logger``: trtc's CLI gives the ``compiler`` loggers a handler of their own and stops them
    propagating (to pytest's handler too), so propagation is restored while capturing."""
    top = logging.getLogger("compiler")
    before = top.propagate
    top.propagate = True
    try:
        with caplog.at_level(level, logger=logger):
            yield
    finally:
        top.propagate = before


def _first_output(result: Any) -> np.ndarray:
    value = next(iter(result.values())) if isinstance(result, dict) else result
    return np.asarray(value.cpu().numpy() if hasattr(value, "cpu") else value)


@pytest.mark.parametrize("precision", ["int8", "fp16"])
@pytest.mark.parametrize("model", [CNN, TRANSFORMER], ids=["cnn", "transformer"])
def test_reduced_precision_engines_show_their_precision_and_pass_the_gate(
        tmp_path: Path, model: Model, precision: str) -> None:
    """Proves, from each engine's layers.json (the inspector's per-layer input and output types, shapes resolved:
    no "N/A due to dynamic shapes", most layers typed): in the CNN's engines a layer named after one of the ONNX
    graph's Conv nodes reads INT8 (FP16) inputs; in the transformer's, some layer reads or writes INT8 (FP16)
    tensors (TensorRT may fuse the encoder into layers whose inner precision the inspector does not show). And
    every engine meets the accuracy gate that ONNX Runtime met, against the FP32 model."""
    import onnx

    from compiler.backends.tensorrt.layers import layer_io_types, layers_reading
    from compiler.serve.load import load

    out = tmp_path / "m"
    manifest = _build(out, model, precision)
    wanted = precision.upper()
    graph = onnx.load(out / manifest["onnx"][precision]["file"], load_external_data=False).graph
    convs = [n.name for n in graph.node if n.op_type == "Conv"]
    for entry in manifest["engines"]:
        text = (out / entry["layers"]["file"]).read_text()
        assert "N/A due to dynamic shapes" not in text
        assert entry["layers"]["output_types"].get("unknown", 0) < entry["layers"]["count"]
        if convs:
            reading = layers_reading(text, wanted)
            named = [name for name in reading
                     if any(re.search(rf"(?<![\w/]){re.escape(c)}(?!\w)", name) for c in convs)]
            assert named, reading  # TensorRT names a layer after the ONNX nodes it runs
        else:
            typed = [layer_io_types(layer) for layer in json.loads(text)["Layers"] if isinstance(layer, dict)]
            assert any(wanted in inputs + outputs for inputs, outputs in typed), typed
    spec = _spec(model)
    with load(out, backend="tensorrt") as engines:
        for batch in (1, 3, 8):
            feed = spec.example_feed(batch, seed=batch)
            got = _first_output(engines(feed if len(feed) > 1 else feed[spec.input_names[0]]))
            cosine = float(row_cosines(got, _fp32_reference(out, feed)).mean())
            assert cosine >= GateSettings().min_cosine, f"batch {batch}: cosine {cosine:.5f}"


def test_multi_profile_engine_answers_every_batch_and_records_its_profiles(tmp_path: Path) -> None:
    """Proves: each profile k of a --multi-profile engine takes every batch from bucket k-1 + 1 to bucket k, and
    the manifest's shapes are exactly the engine's profile shapes."""
    from polygraphy.backend.trt import TrtRunner

    from compiler.backends.tensorrt.build_step import deserialize_engine

    out = tmp_path / "m"
    manifest = _build(out, MLP, buckets=(1, 4, 8), multi_profile=True)
    engine_bytes = (out / manifest["engines"][0]["file"]).read_bytes()
    engine = deserialize_engine(engine_bytes)
    assert engine.num_optimization_profiles == 3
    spec = _spec(MLP)
    low = 1
    for entry in manifest["engines"]:
        profile = entry["profile"]
        recorded = entry["shapes"]["x"]
        built = [tuple(d[i] for i in range(len(d))) for d in engine.get_tensor_profile_shape("x", profile)]
        assert built == [tuple(recorded["min"]), tuple(recorded["opt"]), tuple(recorded["max"])]
        with TrtRunner(engine, optimization_profile=profile) as runner:
            for batch in range(low, entry["bucket"] + 1):
                feed = spec.example_feed(batch, seed=batch)
                got = np.asarray(next(iter(runner.infer(feed).values())))
                np.testing.assert_allclose(got, _fp32_reference(out, feed), rtol=1e-2, atol=1e-3)
        low = entry["bucket"] + 1


def test_cuda_graphs_replay_fresh_outputs_and_fall_back_when_an_enqueue_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Proves: the runtime's CUDA graphs give each call's own outputs, and a refused enqueue during capture leaves
    that bucket without a graph (said once) and still correct."""
    from compiler.backends.tensorrt import runtime as runtime_tensorrt
    from compiler.serve.load import load

    out = tmp_path / "m"
    _build(out, MLP, buckets=(1, 4, 8), tf32=False)
    rng = np.random.default_rng(3)
    with load(out, backend="tensorrt") as engines:
        context = engines._contexts[0]
        assert all(state.graph is not None for state in context._buckets.values())
        for batch in (1, 3, 8, 3):
            x = rng.standard_normal((batch, 64)).astype(np.float32)
            np.testing.assert_allclose(engines(x), _fp32_reference(out, {"x": x}), rtol=1e-3, atol=1e-4)

    class RefusesTheCapture(runtime_tensorrt._CheckedLaunch):
        def __call__(self) -> bool:
            accepted = super().__call__()
            if self.calls == 4:  # three warm-ups, then the captured call
                self.all_accepted = False
                return False
            return accepted

    monkeypatch.setattr(runtime_tensorrt, "_CheckedLaunch", RefusesTheCapture)
    with (_captured(caplog, "compiler.backends.tensorrt.runtime", logging.WARNING),
          load(out, backend="tensorrt") as engines):
        assert all(state.graph is None for state in engines._contexts[0]._buckets.values())
        x = rng.standard_normal((5, 64)).astype(np.float32)
        np.testing.assert_allclose(engines(x), _fp32_reference(out, {"x": x}), rtol=1e-3, atol=1e-4)
    said = [r for r in caplog.records if "running without CUDA graphs" in r.getMessage()]
    assert len(said) == 1


def test_contexts_share_one_activation_buffer_and_concurrent_callers_get_their_own_results(tmp_path: Path) -> None:
    """Proves: with contexts=2 both pooled contexts exist once load() returns, each with a scratch buffer of its
    own sized for the multi-profile engine's largest profile (TensorRT's per-profile sizes); and two threads
    calling at once with batches 1-8, which move each pooled context between its bucket contexts (they take
    turns on that one buffer), all get ONNX Runtime's outputs."""
    from compiler.serve.load import load

    out = tmp_path / "m"
    _build(out, MLP, buckets=(1, 4, 8), multi_profile=True, tf32=False)
    with load(out, backend="tensorrt", contexts=2) as engines:
        assert len(engines._contexts) == 2  # made at load, before any call
        backend = engines._backend
        engine = next(iter(backend.profiles.values()))[0]
        assert backend.scratch_bytes == max(engine.get_device_memory_size_for_profile_v2(k) for k in range(3))
        scratch = [context._scratch for context in engines._contexts]
        assert all(buffer.numel() == max(backend.scratch_bytes, 1) for buffer in scratch)
        assert scratch[0].data_ptr() != scratch[1].data_ptr()  # concurrent contexts never share activations
        errors: list[BaseException] = []

        def caller(seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                for _ in range(50):
                    x = rng.standard_normal((int(rng.integers(1, 9)), 64)).astype(np.float32)
                    np.testing.assert_allclose(engines(x), _fp32_reference(out, {"x": x}), rtol=1e-3, atol=1e-4)
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=caller, args=(seed,)) for seed in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors[0]


def test_version_compatible_engine_needs_and_loads_with_host_code_allowed(tmp_path: Path) -> None:
    """Proves: a --version-compatible engine (lean runtime inside) loads only with engine_host_code_allowed, which
    trtc's runtime sets, and then runs correctly."""
    import tensorrt as trt

    from compiler.backends.tensorrt.logger import tensorrt_logger
    from compiler.serve.load import load

    out = tmp_path / "m"
    manifest = _build(out, MLP, buckets=(4,), version_compatible=True)
    assert manifest["build"]["version_compatible"] is True
    data = (out / manifest["engines"][0]["file"]).read_bytes()
    strict = trt.Runtime(tensorrt_logger())  # engine_host_code_allowed stays False
    assert strict.deserialize_cuda_engine(data) is None
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    with load(out, backend="tensorrt") as engines:
        np.testing.assert_allclose(engines(x), _fp32_reference(out, {"x": x}), rtol=1e-2, atol=1e-3)


def test_check_calls_engines_stale_on_another_tensorrt_or_gpu_model(tmp_path: Path) -> None:
    """Proves: `trtc check` passes engines built here, and calls them stale on another TensorRT version or another
    GPU model of the same compute capability unless built --hardware-compat same-compute-capability."""
    from click.testing import CliRunner

    from compiler.backends.tensorrt.environment import environment
    from compiler.cli import cli
    from compiler.pipeline.check import check_directory

    out = tmp_path / "m"
    _build(out, MLP, buckets=(1, 4))
    result = CliRunner().invoke(cli, ["check", str(out)])
    assert result.exit_code == 0, result.output
    here = environment()
    assert check_directory(out, env={**here, "tensorrt": "10.99.0.1"}).exit_code == 1
    other_model = {**here, "gpu": f"not {here['gpu']}"}
    stale = check_directory(out, env=other_model)
    assert stale.exit_code == 1 and "--hardware-compat same-compute-capability" in stale.stale[0].reason
    compatible = tmp_path / "compatible"
    _build(compatible, MLP, buckets=(1, 4), hardware_compat="same-compute-capability")
    assert check_directory(compatible, env=other_model).exit_code == 0
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    from compiler.serve.load import load

    with load(compatible, backend="tensorrt") as engines:
        np.testing.assert_allclose(engines(x), _fp32_reference(compatible, {"x": x}), rtol=1e-2, atol=1e-3)


def test_rebuild_if_stale_rebuilds_stale_engines_from_the_directory_and_its_timing_cache(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Proves: `trtc rebuild --if-stale` leaves fresh engines alone (their bytes unchanged); an engine file that no
    longer matches the manifest makes the directory stale, and the rebuild starts from DIR/timing.cache: the
    cache it writes holds every timing DIR's cache held, here the CNN's convolution timings that no build of the MLP
    makes, and "not reusing" is not logged. Engines recorded for another TensorRT are rebuilt too, and there the
    directory's cache is not reused (said); after each rebuild `trtc check` passes, no lock file is left and the
    engines match ONNX Runtime."""
    from click.testing import CliRunner

    from compiler.backends.tensorrt.timing_cache import timing_cache_keys
    from compiler.cli import cli
    from compiler.pipeline.check import rebuild_directory
    from compiler.serve.load import load
    from tests.manifests import manifest_json, write_manifest_json

    out, cnn = tmp_path / "m", tmp_path / "cnn"
    _build(out, MLP, buckets=(1, 4))
    built = (out / "engines/b4.engine").read_bytes()
    result = CliRunner().invoke(cli, ["rebuild", str(out), "--if-stale"])
    assert result.exit_code == 0 and "nothing rebuilt" in result.output
    assert (out / "engines/b4.engine").read_bytes() == built

    _build(cnn, CNN, buckets=(1,))
    foreign = timing_cache_keys(cnn / "timing.cache") or set()
    assert foreign - (timing_cache_keys(out / "timing.cache") or set()), "the CNN has timings of its own"
    shutil.copyfile(cnn / "timing.cache", out / "timing.cache")  # same TensorRT and GPU: DIR's cache is used
    (out / "engines/b4.engine").write_bytes(built[:-1])
    assert CliRunner().invoke(cli, ["check", str(out)]).exit_code == 1
    with _captured(caplog, "compiler.backends.tensorrt.timing_cache"):
        rebuilt = rebuild_directory(out, if_stale=True)
    assert rebuilt.rebuilt and [e.bucket for e in rebuilt.engines] == [1, 4]
    assert foreign <= (timing_cache_keys(out / "timing.cache") or set())
    assert "not reusing" not in caplog.text
    assert CliRunner().invoke(cli, ["check", str(out)]).exit_code == 0

    manifest = manifest_json(out)
    manifest["environment"] = {**manifest["environment"], "tensorrt": "10.99.0.1"}
    write_manifest_json(out / "manifest.json", manifest)
    assert CliRunner().invoke(cli, ["check", str(out)]).exit_code == 1
    caplog.clear()
    with _captured(caplog, "compiler.backends.tensorrt.timing_cache"):
        rebuilt = rebuild_directory(out, if_stale=True)
    assert rebuilt.rebuilt and [e.bucket for e in rebuilt.engines] == [1, 4]
    assert "not reusing" in caplog.text and "10.99.0.1" in caplog.text
    assert CliRunner().invoke(cli, ["check", str(out)]).exit_code == 0
    assert not list(out.rglob("*.lock"))
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    with load(out, backend="tensorrt") as engines:
        np.testing.assert_allclose(engines(x), _fp32_reference(out, {"x": x}), rtol=1e-2, atol=1e-3)


def test_shared_timing_cache_is_keyed_grows_by_combining_and_an_unreadable_directory_cache_is_dropped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Proves: a real shared timing cache is written with its TensorRT/GPU key; a rebuild of another model, whose
    build starts from its own directory's cache (the CNN's timings only), merges into it through TensorRT's
    combine: the shared cache then holds every timing it held and the CNN's (TensorRT reads it back), which a
    merge that replaced it would not; no lock file is left in a build directory; and a DIR/timing.cache of garbage
    bytes is dropped with its warning before the rebuild, which then writes a cache TensorRT reads."""
    from dataclasses import replace

    from compiler.backends.tensorrt.environment import environment
    from compiler.backends.tensorrt.timing_cache import timing_cache_key, timing_cache_keys
    from compiler.core.manifest import read_manifest
    from compiler.pipeline.check import rebuild_directory

    shared = tmp_path / "caches" / "shared.cache"
    out, cnn = tmp_path / "m", tmp_path / "cnn"
    _build(out, MLP, buckets=(1, 4), timing_cache=shared)
    assert json.loads((tmp_path / "caches" / "shared.cache.key.json").read_text()) == timing_cache_key(environment())
    first = timing_cache_keys(shared)
    assert first
    _build(cnn, CNN, buckets=(1,))  # its own timing.cache: the CNN's timings, none of the MLP's
    own = timing_cache_keys(cnn / "timing.cache")
    assert own and first - own  # the MLP's timings are not in it
    settings = replace(read_manifest(cnn).rebuild_settings(), timing_cache=shared)
    assert rebuild_directory(cnn, if_stale=False, settings_override=settings).rebuilt
    second = timing_cache_keys(shared)
    assert second is not None and first | own <= second
    assert not list(out.rglob("*.lock")) and not list(cnn.rglob("*.lock"))
    (out / "timing.cache").write_bytes(b"not a timing cache")
    with _captured(caplog, "compiler.backends.tensorrt.timing_cache", logging.WARNING):
        result = rebuild_directory(out, if_stale=False)
    assert result.rebuilt
    assert "unreadable; starting a fresh one" in caplog.text
    assert timing_cache_keys(out / "timing.cache")
    assert not list(out.rglob("*.lock"))


def test_tf32_policy_is_recorded_and_both_policies_are_accurate(tmp_path: Path) -> None:
    """Proves: a build without a TF32 option records build.tf32 = true and one with tf32=False (--no-tf32) records
    false; the TF32 engine matches FP32 ONNX Runtime to 1e-2 relative, the strict one to 1e-3."""
    from compiler.serve.load import load

    x = np.random.default_rng(4).standard_normal((8, 64)).astype(np.float32)
    for tf32, rtol in ((None, 1e-2), (False, 1e-3)):
        out = tmp_path / f"tf32_{tf32}"
        manifest = _build(out, MLP, buckets=(8,), **({} if tf32 is None else {"tf32": tf32}))
        assert manifest["build"]["tf32"] is (tf32 is None)
        with load(out, backend="tensorrt") as engines:
            np.testing.assert_allclose(engines(x), _fp32_reference(out, {"x": x}), rtol=rtol, atol=rtol / 10)


def test_export_triton_writes_a_multi_profile_plan_with_its_tensorrt_version(tmp_path: Path) -> None:
    """Proves: `trtc export-triton` of a --multi-profile build writes the real plan (not the ONNX Runtime fallback),
    one instance profile per bucket, the TensorRT version Triton must run beside model.plan, and says that the plan
    runs only on this GPU model."""
    import tensorrt as trt
    from click.testing import CliRunner

    from compiler.backends.tensorrt.build_step import deserialize_engine
    from compiler.cli import cli

    out = tmp_path / "m"
    _build(out, MLP, buckets=(1, 4, 8), multi_profile=True)
    result = CliRunner().invoke(cli, ["export-triton", str(out), "--repo", str(tmp_path / "repo"), "--platform",
                                      "tensorrt_plan", "--name", "mlp"])
    assert result.exit_code == 0, result.output
    folder = tmp_path / "repo" / "mlp"
    config = (folder / "config.pbtxt").read_text()
    assert 'platform: "tensorrt_plan"' in config and 'profile: [ "0", "1", "2" ]' in config
    assert "max_batch_size: 8" in config
    assert deserialize_engine((folder / "1" / "model.plan").read_bytes()).num_optimization_profiles == 3
    assert (folder / "1" / "tensorrt_version.txt").read_text().splitlines()[0] == trt.__version__
    assert f"exactly {trt.__version__}" in result.output
    assert "only on the GPU model that built it" in result.output


def _signatures(doc: str, name: str) -> list[list[str]]:
    """The parameter names of each signature pybind writes at the top of ``name``'s docstring (one per overload)."""
    found = []
    for match in re.finditer(rf"(?m)^(?:\d+\. )?{re.escape(name)}\((.*)\) ->", doc or ""):
        params, depth, current = [], 0, ""
        for char in match.group(1) + ",":
            depth += char in "([{"
            depth -= char in ")]}"
            if char == "," and depth == 0:
                params.append(current.split(":")[0].split("=")[0].strip())
                current = ""
            else:
                current += char
        found.append([p for p in params if p and p != "self"])
    return found


def test_the_type_stub_matches_the_installed_tensorrt() -> None:
    """Proves: every class, enum value, attribute and method typings/tensorrt.pyi declares (mypy checks trtc's
    TensorRT modules against it) exists in the installed TensorRT, and each method's parameter names are those of
    one of its pybind signatures."""
    import tensorrt as trt

    stub = ast.parse((ROOT / "typings" / "tensorrt.pyi").read_text())
    missing, wrong = [], []
    for node in stub.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and not hasattr(trt, node.target.id):
            missing.append(node.target.id)
        if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
            continue
        real = getattr(trt, node.name, None)
        if real is None:
            missing.append(node.name)
            continue
        for member in node.body:
            if isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
                if not hasattr(real, member.target.id):
                    missing.append(f"{node.name}.{member.target.id}")
            elif isinstance(member, ast.FunctionDef) and not member.name.startswith("__"):
                attribute = getattr(real, member.name, None)
                if attribute is None:
                    missing.append(f"{node.name}.{member.name}")
                elif not any(isinstance(d, ast.Name) and d.id == "property" for d in member.decorator_list):
                    declared = [a.arg for a in member.args.args + member.args.kwonlyargs if a.arg != "self"]
                    signatures = _signatures(getattr(attribute, "__doc__", "") or "", member.name)
                    if signatures and declared not in signatures:
                        wrong.append(f"{node.name}.{member.name}{tuple(declared)} vs {signatures}")
    assert not missing and not wrong, (missing, wrong)
