"""Acceptance suite for a machine with TensorRT (10.12+ or 11.x) and an NVIDIA GPU: ``make test-tensorrt``.

TensorRT cannot be installed where trtc is developed, so the engine path is proven here, on first contact
with a real TensorRT: every test builds real engines through ``trtc build`` / ``trtc rebuild`` and checks
them against ONNX Runtime. Each test's docstring says, in one line, what it proves. Everything is
skipped with the reason elsewhere (tests/conftest.py). Buckets and models are small: the suite is about
behaviour, not speed.

Unproven until this suite has run on a TensorRT machine (the code was checked against TensorRT's headers,
its Python stubs and Polygraphy's source, and the parts without TensorRT are unit-tested): that the inspector
reports precisions with a context attached; that USER_MANAGED contexts sharing one buffer run correctly;
that a refused enqueue is seen during capture; that a version-compatible engine needs
``engine_host_code_allowed``; that TensorRT's timing-cache combine and an unreadable cache behave as
handled; that INT8/FP16 engines pass the accuracy gate that ONNX Runtime passed.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from calibration.accuracy import row_cosines
from compiler.core.settings import BuildSettings, ExportSettings, GateSettings, ModelSource
from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec

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
    """``trtc build`` of an example model into ``out``; the manifest. INT8/FP16 calibrate on seeded random data."""
    from compiler.core.settings import CalibrationSettings
    from compiler.pipeline.build import build_directory

    calibration = None if precision == "fp32" else CalibrationSettings(precision, data="random", samples=64)
    export = ExportSettings(ModelSource(factory=model[0]), out, _spec(model), buckets)
    return build_directory(export, calibration, BuildSettings(buckets=buckets, precision=precision, **build))


def _fp32_reference(out: Path, feed: dict[str, np.ndarray]) -> np.ndarray:
    """The FP32 ONNX of ``out`` on ONNX Runtime's CPU provider: the reference every accuracy gate compares to."""
    from compiler.core.onnx_io import ort_session

    session = ort_session(out / "model.onnx", ["CPUExecutionProvider"])
    return np.asarray(session.run(None, feed)[0])


def _first_output(result: Any) -> np.ndarray:
    value = next(iter(result.values())) if isinstance(result, dict) else result
    return np.asarray(value.cpu().numpy() if hasattr(value, "cpu") else value)


@pytest.mark.parametrize("precision", ["int8", "fp16"])
@pytest.mark.parametrize("model", [CNN, TRANSFORMER], ids=["cnn", "transformer"])
def test_reduced_precision_engines_show_their_precision_and_pass_the_gate(
        tmp_path: Path, model: Model, precision: str) -> None:
    """Proves: INT8 Q/DQ and FP16 engines run their layers in INT8/FP16 per layers.json (shapes resolved, not
    "N/A due to dynamic shapes") and meet the accuracy gate that ONNX Runtime met, against the FP32 model."""
    from compiler.serve.load import load

    out = tmp_path / "m"
    manifest = _build(out, model, precision)
    wanted = precision.upper()
    for entry in manifest["engines"]:
        text = (out / entry["layers"]["file"]).read_text()
        assert "N/A due to dynamic shapes" not in text
        assert entry["layers"]["output_types"].get(wanted, 0) > 0, entry["layers"]
        assert entry["layers"]["output_types"].get("unknown", 0) < entry["layers"]["count"]
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
    with (caplog.at_level(logging.WARNING, logger="compiler.backends.tensorrt.runtime"),
          load(out, backend="tensorrt") as engines):
        assert all(state.graph is None for state in engines._contexts[0]._buckets.values())
        x = rng.standard_normal((5, 64)).astype(np.float32)
        np.testing.assert_allclose(engines(x), _fp32_reference(out, {"x": x}), rtol=1e-3, atol=1e-4)
    said = [r for r in caplog.records if "running without CUDA graphs" in r.getMessage()]
    assert len(said) == 1


def test_contexts_share_one_activation_buffer_and_concurrent_callers_get_their_own_results(tmp_path: Path) -> None:
    """Proves: a multi-profile engine's bucket contexts share one buffer sized for the largest profile, and two
    threads (the second context made on demand, warmed up under the compute order) both get correct outputs."""
    from compiler.serve.load import load

    out = tmp_path / "m"
    _build(out, MLP, buckets=(1, 4, 8), multi_profile=True, tf32=False)
    with load(out, backend="tensorrt", contexts=2) as engines:
        backend = engines._backend
        engine = next(iter(backend.profiles.values()))[0]
        assert backend.scratch_bytes == max(engine.get_device_memory_size_for_profile_v2(k) for k in range(3))
        assert engines._contexts[0]._scratch.numel() == max(backend.scratch_bytes, 1)
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
        assert len(engines._contexts) == 2


def test_version_compatible_engine_needs_and_loads_with_host_code_allowed(tmp_path: Path) -> None:
    """Proves: a --version-compatible engine (lean runtime inside) loads only with engine_host_code_allowed, which
    trtc's runtime sets, and then runs correctly."""
    import tensorrt as trt

    from compiler.serve.load import load

    out = tmp_path / "m"
    manifest = _build(out, MLP, buckets=(4,), version_compatible=True)
    assert manifest["build"]["version_compatible"] is True
    data = (out / manifest["engines"][0]["file"]).read_bytes()
    strict = trt.Runtime(trt.Logger(trt.Logger.ERROR))
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


def test_rebuild_if_stale_rebuilds_only_stale_engines_from_the_stored_onnx(tmp_path: Path) -> None:
    """Proves: `trtc rebuild --if-stale` leaves fresh engines alone, rebuilds engines recorded for another
    TensorRT into engines `trtc check` passes, reusing the directory's timing cache, with no lock file left."""
    from click.testing import CliRunner

    from compiler.cli import cli
    from compiler.core.manifest import read_manifest, write_manifest
    from compiler.serve.load import load

    out = tmp_path / "m"
    _build(out, MLP, buckets=(1, 4))
    built = (out / "engines/b4.engine").stat().st_mtime_ns
    result = CliRunner().invoke(cli, ["rebuild", str(out), "--if-stale"])
    assert result.exit_code == 0 and "nothing rebuilt" in result.output
    assert (out / "engines/b4.engine").stat().st_mtime_ns == built
    manifest = read_manifest(out)
    manifest["environment"] = {**manifest["environment"], "tensorrt": "10.99.0.1"}
    write_manifest(out / "manifest.json", manifest)
    assert CliRunner().invoke(cli, ["check", str(out)]).exit_code == 1
    result = CliRunner().invoke(cli, ["rebuild", str(out), "--if-stale"])
    assert result.exit_code == 0 and "rebuilt 2 engine(s)" in result.output, result.output
    assert CliRunner().invoke(cli, ["check", str(out)]).exit_code == 0
    assert not list(out.rglob("*.lock"))
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    with load(out, backend="tensorrt") as engines:
        np.testing.assert_allclose(engines(x), _fp32_reference(out, {"x": x}), rtol=1e-2, atol=1e-3)


def test_shared_timing_cache_is_keyed_checked_and_survives_an_unreadable_directory_cache(tmp_path: Path) -> None:
    """Proves: a real shared timing cache is written with its TensorRT/GPU key, grows across builds with TensorRT's
    combine checked, leaves no lock file in the build directory, and an unreadable DIR/timing.cache only warns."""
    from compiler.backends.tensorrt.environment import environment
    from compiler.backends.tensorrt.timing_cache import timing_cache_key
    from compiler.pipeline.check import rebuild_directory

    shared = tmp_path / "caches" / "shared.cache"
    out = tmp_path / "m"
    _build(out, MLP, buckets=(1, 4), timing_cache=shared)
    assert shared.stat().st_size > 0
    assert json.loads((tmp_path / "caches" / "shared.cache.key.json").read_text()) == timing_cache_key(environment())
    assert not list(out.rglob("*.lock"))
    (out / "timing.cache").write_bytes(b"not a timing cache")
    result = rebuild_directory(out, if_stale=False)
    assert result.rebuilt and (out / "timing.cache").read_bytes() != b"not a timing cache"
    assert not list(out.rglob("*.lock"))


def test_tf32_policy_is_recorded_and_both_policies_are_accurate(tmp_path: Path) -> None:
    """Proves: TF32 is on by default and --no-tf32 is recorded as build.tf32, and both engines match FP32 ONNX
    Runtime (strict FP32 to 1e-3 relative, as the other FP32 engine tests)."""
    from compiler.serve.load import load

    x = np.random.default_rng(4).standard_normal((8, 64)).astype(np.float32)
    for tf32, rtol in ((True, 1e-2), (False, 1e-3)):
        out = tmp_path / f"tf32_{tf32}"
        manifest = _build(out, MLP, buckets=(8,), tf32=tf32)
        assert manifest["build"]["tf32"] is tf32
        with load(out, backend="tensorrt") as engines:
            np.testing.assert_allclose(engines(x), _fp32_reference(out, {"x": x}), rtol=rtol, atol=rtol / 10)


def test_export_triton_writes_a_multi_profile_plan_with_its_tensorrt_version(tmp_path: Path) -> None:
    """Proves: `trtc export-triton` of a --multi-profile build writes the real plan (not the ONNX Runtime fallback),
    one instance profile per bucket, and the TensorRT version Triton must run beside model.plan."""
    import tensorrt as trt
    from click.testing import CliRunner

    from compiler.backends.tensorrt.build_step import deserialize_engine
    from compiler.cli import cli

    out = tmp_path / "m"
    _build(out, MLP, buckets=(1, 4, 8), multi_profile=True)
    result = CliRunner().invoke(cli, ["export-triton", str(out), "--repo", str(tmp_path / "repo"), "--backend",
                                      "tensorrt", "--name", "mlp"])
    assert result.exit_code == 0, result.output
    folder = tmp_path / "repo" / "mlp"
    config = (folder / "config.pbtxt").read_text()
    assert 'platform: "tensorrt_plan"' in config and 'profile: [ "0", "1", "2" ]' in config
    assert "max_batch_size: 8" in config
    assert deserialize_engine((folder / "1" / "model.plan").read_bytes()).num_optimization_profiles == 3
    assert (folder / "1" / "tensorrt_version.txt").read_text().splitlines()[0] == trt.__version__
    assert f"exactly {trt.__version__}" in result.output
