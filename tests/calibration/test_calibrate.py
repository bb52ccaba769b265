"""`trtc calibrate` end to end on real data: the digits CNN trained in a fixture, INT8 and FP16 checked in ORT.

Accuracy is measured here independently of the gate: each test loads the written ONNX into its own ONNX
Runtime session (Q/DQ executed exactly, as TensorRT does) and scores it on the held-out digits.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner, Result

import calibration.calibrate as calibrate_module
from calibration.data import calibration_data
from calibration.fp16 import float_tensors
from calibration.observe import collect_max_abs
from calibration.qdq import tensors_to_calibrate
from compiler.cli import cli
from compiler.core.files import sha256_file, sha256_files
from compiler.core.onnx_io import load_onnx, ort_session
from compiler.core.settings import ExportSettings, ModelSource
from compiler.core.specs import ModelSpec, parse_input_spec
from compiler.pipeline.export import export_directory
from examples.digits import DigitsSplits, digits_splits, train_digits
from examples.models import MLP

MAX_DROP_POINTS = 0.5


@dataclass(frozen=True)
class Exported:
    directory: Path  # FP32 export, never modified: tests calibrate copies of it
    calib: Path
    eval: Path
    test_x: np.ndarray
    test_y: np.ndarray
    input_name: str
    fp32_top1: float


def _export(tmp: Path, module: torch.nn.Module, factory: str, spec: str, splits: DigitsSplits,
            flatten: bool = False) -> Exported:
    torch.save(module.state_dict(), tmp / "weights.pt")
    name = spec.split(":")[0]
    calib_x, test_x = (splits.calib_x, splits.test_x) if not flatten else (splits.calib_x.reshape(-1, 64),
                                                                            splits.test_x.reshape(-1, 64))
    np.savez(tmp / "calib.npz", **{name: calib_x})
    np.savez(tmp / "eval.npz", **{name: test_x, "labels": splits.test_y})
    export_directory(ExportSettings(ModelSource(factory=factory, weights=tmp / "weights.pt"), tmp / "fp32",
                                    spec=ModelSpec((parse_input_spec(spec),)), buckets=(1, 16)))
    exported = Exported(tmp / "fp32", tmp / "calib.npz", tmp / "eval.npz", test_x, splits.test_y, name, 0.0)
    return Exported(**{**exported.__dict__, "fp32_top1": top1(exported, tmp / "fp32" / "model.onnx")})


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Train and export on one thread: on a busy 2-core machine two threads spin and take 5x the CPU time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cnn(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """The bundled Conv-BN-ReLU ResNet trained on scikit-learn digits (5 epochs, ~99% test accuracy)."""
    model, splits = train_digits(epochs=5)
    return _export(tmp_path_factory.mktemp("cnn"), model, "examples.models:resnet_digits", "images:Bx1x8x8", splits)


@pytest.fixture(scope="module")
def outlier_mlp(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """An MLP trained on digits whose second Linear sees one hidden channel 1000x larger than the rest.

    The function is unchanged (the channel's weights are scaled up, its outgoing weights down by the same
    factor, and ReLU commutes with that), but a per-tensor INT8 scale for that Linear's input is set by the
    outlier channel, so every other channel rounds to zero: only that layer must stay in FP32.
    """
    splits = digits_splits()
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.from_numpy(splits.train_x.reshape(-1, 64)), torch.from_numpy(splits.train_y)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(20):
        perm = torch.randperm(len(x))
        for i in range(0, len(x), 64):
            loss = torch.nn.functional.cross_entropy(model(x[perm[i:i + 64]]), y[perm[i:i + 64]])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    first, second = model.net[0], model.net[2]
    assert isinstance(first, torch.nn.Linear) and isinstance(second, torch.nn.Linear)
    with torch.no_grad():
        channel = int(torch.relu(first(torch.from_numpy(splits.calib_x.reshape(-1, 64)))).mean(0).argmax())
        first.weight[channel] *= 1000
        first.bias[channel] *= 1000
        second.weight[:, channel] /= 1000
    return _export(tmp_path_factory.mktemp("mlp"), model, "examples.models:mlp", "x:Bx64", splits, flatten=True)


@pytest.fixture
def workdir(cnn: Exported, tmp_path: Path) -> Path:
    shutil.copytree(cnn.directory, tmp_path / "m")
    return tmp_path / "m"


def calibrate(directory: Path, *args: str | Path) -> Result:
    return CliRunner().invoke(cli, ["calibrate", str(directory), "-q", *map(str, args)])


def top1(exported: Exported, onnx_path: Path) -> float:
    """Top-1 on the held-out digits in a fresh ORT session, Q/DQ run exactly as written."""
    session = ort_session(onnx_path)
    logits = session.run(None, {exported.input_name: exported.test_x})[0]
    return float((logits.argmax(axis=1) == exported.test_y).mean())


def read(path: Path) -> Any:
    return json.loads(path.read_text())


def fingerprints(directory: Path) -> dict[str, str]:
    """sha256 of every file but the lock (which records the last command's pid)."""
    return {p.relative_to(directory).as_posix(): sha256_file(p) for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != ".trtc.lock"}


def check_onnx_file(path: Path) -> onnx.ModelProto:
    """Loads with its weights beside it, passes the full checker and strict shape inference."""
    assert path.is_file() and Path(f"{path}.data").is_file()
    onnx.checker.check_model(str(path), full_check=True)
    model = load_onnx(path)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    return model


# --- INT8 and FP16 on the digits CNN ---------------------------------------------------------------------------

@dataclass
class Calibrated:
    directory: Path
    int8: Result
    fp16: Result
    manifest_after_int8: dict[str, Any]
    fp32_files: dict[str, str]


@pytest.fixture(scope="module")
def calibrated(cnn: Exported, tmp_path_factory: pytest.TempPathFactory) -> Calibrated:
    directory = tmp_path_factory.mktemp("calibrated") / "m"
    shutil.copytree(cnn.directory, directory)
    before = fingerprints(directory)
    int8 = calibrate(directory, "--int8", "--calib-data", cnn.calib, "--eval-data", cnn.eval)
    manifest = read(directory / "manifest.json")
    fp16 = calibrate(directory, "--fp16", "--calib-data", cnn.calib, "--eval-data", cnn.eval)
    return Calibrated(directory, int8, fp16, manifest, before)


def test_int8_top1_within_half_a_point_of_fp32(cnn: Exported, calibrated: Calibrated) -> None:
    assert calibrated.int8.exit_code == 0, calibrated.int8.output
    assert cnn.fp32_top1 > 0.95  # the fixture trained a real classifier
    int8_top1 = top1(cnn, calibrated.directory / "model.int8.onnx")
    assert 100 * (cnn.fp32_top1 - int8_top1) <= MAX_DROP_POINTS, (cnn.fp32_top1, int8_top1)


def test_fp16_top1_within_half_a_point_of_fp32(cnn: Exported, calibrated: Calibrated) -> None:
    assert calibrated.fp16.exit_code == 0, calibrated.fp16.output
    fp16_top1 = top1(cnn, calibrated.directory / "model.fp16.onnx")
    assert 100 * (cnn.fp32_top1 - fp16_top1) <= MAX_DROP_POINTS, (cnn.fp32_top1, fp16_top1)


def test_int8_onnx_is_valid_quantized_and_runs_on_cpu(cnn: Exported, calibrated: Calibrated) -> None:
    model = check_onnx_file(calibrated.directory / "model.int8.onnx")
    ops = Counter(n.op_type for n in model.graph.node)
    fp32 = Counter(n.op_type for n in load_onnx(cnn.directory / "model.onnx").graph.node)
    # 9 Conv + 1 Gemm, less the 1-channel stem conv and the head Gemm (PLACEMENT keeps both out of INT8)
    weighted = fp32["Conv"] + fp32["Gemm"] - 2
    # activations: the 6 distinct inputs of the quantized convs and the 2 conv shortcuts of the residual adds
    # (the third shortcut is a block input, already quantized for its conv); weights: INT8 behind a DQ only
    assert ops["QuantizeLinear"] == 8 and ops["DequantizeLinear"] == 8 + weighted
    int8 = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8 and t.dims}
    assert sum(n.op_type == "DequantizeLinear" and n.input[0] in int8 for n in model.graph.node) == weighted
    assert ops["Conv"] == fp32["Conv"] and ops["Gemm"] == fp32["Gemm"]
    out = ort_session(calibrated.directory / "model.int8.onnx").run(None, {"images": cnn.test_x[:5]})[0]
    assert out.shape == (5, 10) and np.isfinite(out).all()


def test_int8_rest_runs_in_fp16_with_fp32_interface(cnn: Exported, calibrated: Calibrated) -> None:
    """--int8's default: INT8 where quantized, FP16 for the rest (Q/DQ with FP16 scales), FP32 graph I/O."""
    model = check_onnx_file(calibrated.directory / "model.int8.onnx")
    typed = onnx.shape_inference.infer_shapes(model)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*typed.graph.value_info, *typed.graph.output,
                                                                 *typed.graph.input]}
    assert typed.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert typed.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm", "Relu", "Add"):
            assert types[node.output[0]] == onnx.TensorProto.FLOAT16, node.name
        if node.op_type == "DequantizeLinear":
            assert types[node.output[0]] == onnx.TensorProto.FLOAT16, node.name
    entry = read(calibrated.directory / "report" / "accuracy.json")["int8"]
    counts = entry["node_precisions"]["counts"]
    # 8 convs and the 3 residual adds fused into them
    assert entry["remainder"] == "fp16" and counts["int8"] == 8 + 3 and counts["fp16"] > 0 and counts["fp32"] == 0
    assert calibrated.manifest_after_int8["calibration"]["remainder"] == "fp16"
    assert calibrated.manifest_after_int8["calibration"]["node_precisions"] == counts
    assert "max_abs" in read(calibrated.directory / "calibration.json")  # the FP16 range check's data, reused


@pytest.mark.slow
def test_fp32_rest_keeps_the_old_fp32_remainder(cnn: Exported, workdir: Path) -> None:
    result = calibrate(workdir, "--int8", "--fp32-rest", "--calib-data", cnn.calib, "--eval-data", cnn.eval)
    assert result.exit_code == 0, result.output
    model = check_onnx_file(workdir / "model.int8.onnx")
    typed = onnx.shape_inference.infer_shapes(model)
    elem_types = {vi.type.tensor_type.elem_type for vi in [*typed.graph.value_info, *typed.graph.output]}
    assert onnx.TensorProto.FLOAT16 not in elem_types
    assert not any(n.op_type == "Cast" for n in model.graph.node)
    entry = read(workdir / "report" / "accuracy.json")["int8"]
    assert entry["remainder"] == "fp32" and entry["node_precisions"]["counts"]["fp16"] == 0
    assert read(workdir / "manifest.json")["calibration"]["remainder"] == "fp32"
    assert 100 * (cnn.fp32_top1 - top1(cnn, workdir / "model.int8.onnx")) <= MAX_DROP_POINTS


def test_fp32_rest_with_fp16_is_a_user_error(cnn: Exported, workdir: Path) -> None:
    before = fingerprints(workdir)
    result = calibrate(workdir, "--fp16", "--fp32-rest", "--calib-data", cnn.calib)
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1].startswith("error: --fp32-rest applies to --int8 only")
    assert fingerprints(workdir) == before


@pytest.mark.slow
def test_entropy_without_fallback_within_a_point(cnn: Exported, workdir: Path) -> None:
    """TensorRT's KL method on the digits input (17 distinct values) and the activations, no layer kept out."""
    result = calibrate(workdir, "--int8", "--calib-method", "entropy", "--max-fallback", "0",
                       "--calib-data", cnn.calib, "--eval-data", cnn.eval)
    assert result.exit_code == 0, result.output
    amax = read(workdir / "calibration.json")["amax"]
    spec_input = np.abs(np.load(cnn.calib)["images"]).max()
    assert "images" not in amax or amax["images"] == pytest.approx(spec_input, rel=1e-3)  # no clipping of 17 levels
    assert 100 * (cnn.fp32_top1 - top1(cnn, workdir / "model.int8.onnx")) <= 1.0


def test_fp16_onnx_is_valid_with_fp16_weights(calibrated: Calibrated) -> None:
    model = check_onnx_file(calibrated.directory / "model.fp16.onnx")
    types = Counter(t.data_type for t in model.graph.initializer)
    assert types[onnx.TensorProto.FLOAT16] >= 10
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # the interface stays FP32


def test_calibration_json_records_amax_method_and_data(cnn: Exported, calibrated: Calibrated) -> None:
    record = read(calibrated.directory / "calibration.json")
    expected = tensors_to_calibrate(load_onnx(cnn.directory / "model.onnx"))
    assert sorted(record["amax"]) == sorted(expected) and len(expected) == 8
    assert all(np.isfinite(v) and v > 0 for v in record["amax"].values())
    assert record["method"] == "percentile" and record["percentile"] == 99.99
    assert (record["provider"], record["binned_on"]) == ("CPUExecutionProvider", "host")  # no GPU here
    assert record["model_sha256"] == sha256_file(cnn.directory / "model.onnx")
    spec = ModelSpec((parse_input_spec("images:Bx1x8x8"),))
    fingerprint = calibration_data(cnn.calib, spec).fingerprint
    assert record["data"] == {"source": str(cnn.calib), "samples": 300, "batch_size": 16, "sha256": fingerprint,
                              "random": False}


def test_accuracy_report_has_both_precisions(cnn: Exported, calibrated: Calibrated) -> None:
    report = read(calibrated.directory / "report" / "accuracy.json")
    assert set(report) == {"int8", "fp16"}
    for precision, entry in report.items():
        acc = entry["accuracy"]
        assert entry["precision"] == precision and acc["metric"] == "top1" and acc["passed"]
        assert acc["fp32_top1"] == pytest.approx(cnn.fp32_top1)
        assert acc["drop_points"] <= MAX_DROP_POINTS and acc["cosine_mean"] > 0.999
        assert entry["kept_in_fp32"] == {} and len(entry["gate_history"]) == 1
        assert entry["eval_data"]["source"] == str(cnn.eval) and entry["eval_data"]["samples"] == 300
    assert report["int8"]["calibration"]["reused_cache"] is False
    assert report["int8"]["qdq"]["qdq_pairs"] == len(read(calibrated.directory / "calibration.json")["amax"])


def test_manifest_records_the_int8_onnx_and_its_calibration(calibrated: Calibrated) -> None:
    directory = calibrated.directory
    after_int8 = calibrated.manifest_after_int8
    entry = after_int8["onnx"]["int8"]
    assert entry["files"] == ["model.int8.onnx", "model.int8.onnx.data"]
    assert entry["sha256"] == sha256_files([directory / f for f in entry["files"]])
    assert after_int8["precision"] == "int8"
    calib = after_int8["calibration"]
    assert calib["data_sha256"] == read(directory / "calibration.json")["data"]["sha256"]
    assert calib["method"] == "percentile" and calib["samples"] == 300 and calib["random_data"] is False
    assert after_int8["accuracy"]["int8"]["kept_in_fp32"] == []
    # FP16 added its own entry without touching the FP32 and INT8 ones
    final = read(directory / "manifest.json")
    assert final["onnx"]["int8"] == entry and final["onnx"]["fp32"] == after_int8["onnx"]["fp32"]
    assert final["onnx"]["fp16"]["sha256"] == sha256_files([directory / f for f in final["onnx"]["fp16"]["files"]])
    assert {k: v for k, v in calibrated.fp32_files.items() if k.startswith("model.onnx")} == \
        {k: v for k, v in fingerprints(directory).items() if k.startswith("model.onnx")}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["max", "entropy", "mse"])
def test_each_calibration_method_passes(cnn: Exported, workdir: Path, method: str) -> None:
    result = calibrate(workdir, "--int8", "--calib-method", method, "--calib-data", cnn.calib, "--eval-data", cnn.eval)
    assert result.exit_code == 0, result.output
    assert read(workdir / "calibration.json")["method"] == method
    assert read(workdir / "manifest.json")["calibration"]["method"] == method
    assert 100 * (cnn.fp32_top1 - top1(cnn, workdir / "model.int8.onnx")) <= MAX_DROP_POINTS


@pytest.mark.slow
def test_calib_samples_caps_calibration_not_the_gates_evaluation(cnn: Exported, workdir: Path) -> None:
    result = calibrate(workdir, "--int8", "--calib-samples", "100", "--calib-data", cnn.calib, "--eval-data", cnn.eval)
    assert result.exit_code == 0, result.output
    report = read(workdir / "report" / "accuracy.json")["int8"]
    assert report["calibration_data"]["samples"] == 100 and read(workdir / "calibration.json")["data"]["samples"] == 100
    assert report["eval_data"]["samples"] == 300  # every held-out sample is scored


# --- reusing calibration.json ----------------------------------------------------------------------------------

@pytest.fixture
def histogram_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts calls of collect_histograms, the expensive pass over the calibration data."""
    calls: list[int] = []
    real = calibrate_module.collect_histograms
    monkeypatch.setenv("TRTC_IN_PROCESS", "1")  # the spy lives in this process

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(calibrate_module, "collect_histograms", spy)
    yield calls


def test_same_data_reuses_calibration_json_and_changed_data_recalibrates(
        cnn: Exported, workdir: Path, histogram_calls: list[int], tmp_path: Path) -> None:
    args: list[str | Path] = ["--int8", "--calib-data", cnn.calib, "--eval-data", cnn.eval]
    assert calibrate(workdir, *args).exit_code == 0 and len(histogram_calls) == 1
    first = read(workdir / "calibration.json")

    result = calibrate(workdir, *args)
    assert result.exit_code == 0, result.output
    assert len(histogram_calls) == 1, "the same model, data and method must not collect histograms again"
    assert read(workdir / "calibration.json") == first
    assert read(workdir / "report" / "accuracy.json")["int8"]["calibration"]["reused_cache"] is True
    assert read(workdir / "manifest.json")["calibration"]["reused_cache"] is True

    fewer = tmp_path / "fewer.npz"
    np.savez(fewer, images=np.load(cnn.calib)["images"][:200])
    result = calibrate(workdir, "--int8", "--calib-data", fewer, "--eval-data", cnn.eval)
    assert result.exit_code == 0, result.output
    assert len(histogram_calls) == 2
    second = read(workdir / "calibration.json")
    assert second["data"]["samples"] == 200 and second["data"]["sha256"] != first["data"]["sha256"]
    assert read(workdir / "manifest.json")["calibration"]["reused_cache"] is False

    result = calibrate(workdir, "--int8", "--calib-method", "max", "--calib-data", fewer, "--eval-data", cnn.eval)
    assert result.exit_code == 0 and len(histogram_calls) == 3  # another method: recalibrated


def test_int8_measures_the_fp16_ranges_in_the_calibration_pass(
        cnn: Exported, workdir: Path, histogram_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """One pass over the data: the histograms' run also reduces max |x| of every float tensor in-graph."""
    second_passes: list[int] = []
    monkeypatch.setattr(calibrate_module, "collect_max_abs", lambda *a, **k: second_passes.append(1) or {})
    assert calibrate(workdir, "--int8", "--calib-data", cnn.calib, "--max-fallback", "0").exit_code == 0
    assert len(histogram_calls) == 1 and not second_passes
    max_abs = read(workdir / "calibration.json")["max_abs"]
    model = load_onnx(cnn.directory / "model.onnx")
    assert set(max_abs) == set(float_tensors(model))
    # the same numbers as a separate pass over the same data (the in-graph reduction either way)
    data = calibration_data(cnn.calib, ModelSpec((parse_input_spec("images:Bx1x8x8"),)), batch_size=16,
                            max_samples=512)
    expected = collect_max_abs(cnn.directory / "model.onnx", list(max_abs), data.batches())
    assert max_abs == pytest.approx(expected, rel=1e-6)


def test_calib_cache_from_another_directory_needs_no_data(
        cnn: Exported, workdir: Path, histogram_calls: list[int], tmp_path: Path) -> None:
    assert calibrate(workdir, "--int8", "--calib-data", cnn.calib).exit_code == 0
    cache = tmp_path / "saved-calibration.json"
    shutil.copy(workdir / "calibration.json", cache)
    fresh = tmp_path / "fresh"
    shutil.copytree(cnn.directory, fresh)
    result = calibrate(fresh, "--int8", "--calib-cache", cache, "--eval-data", cnn.eval)
    assert result.exit_code == 0, result.output
    assert len(histogram_calls) == 1
    assert read(fresh / "calibration.json")["amax"] == read(cache)["amax"]
    assert read(fresh / "manifest.json")["calibration"]["reused_cache"] is True
    result = calibrate(fresh, "--int8", "--calib-cache", tmp_path / "missing.json")
    assert result.exit_code == 2 and "--calib-cache" in result.output and "no such file" in result.output
    (tmp_path / "list.json").write_text("[1, 2]")
    result = calibrate(fresh, "--int8", "--calib-cache", tmp_path / "list.json")
    assert result.exit_code == 2 and "not a calibration.json" in result.output and "Traceback" not in result.output


# --- the accuracy gate ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("gate", "metric", "labelled"), [
    (["--max-accuracy-drop", "-1"], "top1", True),  # INT8 would have to beat FP32 by a point
    (["--min-cosine", "0.999999"], "cosine", False),  # without labels the gate is on cosine
])
@pytest.mark.slow
def test_gate_failure_exits_3_keeps_fp32_and_reports_the_fallback(
        cnn: Exported, workdir: Path, gate: list[str], metric: str, labelled: bool) -> None:
    before = fingerprints(workdir)
    eval_data = cnn.eval if labelled else cnn.calib
    result = calibrate(workdir, "--int8", "--calib-data", cnn.calib, "--eval-data", eval_data, "--max-fallback", "2",
                       *gate)
    assert result.exit_code == 3, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output
    assert "misses the accuracy gate" in errors[0] and "2 layer(s) kept in FP16" in errors[0]
    assert "--max-fallback" in errors[0] and "report/accuracy.json" in errors[0]

    entry = read(workdir / "report" / "accuracy.json")["int8"]
    assert entry["accuracy"]["metric"] == metric and entry["accuracy"]["passed"] is False
    kept = entry["kept_in_fp32"]
    assert entry["kept_as"] == "fp16"  # INT8's remainder is FP16, so layers the gate takes out of INT8 go there
    assert len(kept) == 2 and all("kept in FP16 by the accuracy gate: sensitivity rank" in why for why in kept.values())
    history = entry["gate_history"]
    assert [row["excluded"] for row in history] == [[], list(kept)[:1], list(kept)]
    assert not any(row["passed"] for row in history)

    after = fingerprints(workdir)
    assert not (workdir / "model.int8.onnx").exists() and not (workdir / "model.int8.onnx.data").exists()
    assert {k: after[k] for k in before} == before, "manifest and FP32 files must not change"
    assert set(after) - set(before) == {"calibration.json", "report/accuracy.json"}
    assert not list(workdir.glob(".staging-*"))


@pytest.mark.slow
def test_fallback_search_logs_one_ranking_line_and_one_summary(cnn: Exported, workdir: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """No line per trial (they read as if the final model were unquantized): the ranking, then a summary."""
    from calibration.calibrate import calibrate_directory
    from compiler.core.errors import AccuracyGateError
    from compiler.core.settings import CalibrationSettings, GateSettings

    settings = CalibrationSettings("int8", data=str(cnn.calib), eval_data=str(cnn.eval),
                                   gate=GateSettings(max_accuracy_drop=-1.0, max_fallback=3))
    with caplog.at_level(logging.INFO, logger="calibration"), pytest.raises(AccuracyGateError):
        calibrate_directory(workdir, settings)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert not [m for m in lines if "nodes quantized" in m or "kept in higher precision" in m]
    assert len([m for m in lines if m.startswith("ranked ")]) == 1
    summaries = [m for m in lines if m.startswith("INT8 with 3 layer(s) kept in FP16")]
    assert len(summaries) == 1 and summaries[0].endswith("FAIL")
    assert len(lines) < 20, lines


def test_gate_fallback_keeps_exactly_the_layer_with_the_outlier_channel(outlier_mlp: Exported, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "mlp"
    shutil.copytree(outlier_mlp.directory, directory)
    monkeypatch.setenv("TRTC_IN_PROCESS", "1")  # the spy below lives in this process, not in a worker
    evaluations: list[int] = []
    evaluate = calibrate_module.Evaluator.evaluate
    monkeypatch.setattr(calibrate_module.Evaluator, "evaluate",
                        lambda self, *a, **k: evaluations.append(1) or evaluate(self, *a, **k))
    result = calibrate(directory, "--int8", "--calib-data", outlier_mlp.calib, "--eval-data", outlier_mlp.eval)
    assert result.exit_code == 0, result.output
    # one-pass ranking: the gate ran the full model and then the model with one layer out, and no model per
    # layer (the ranking's single run measures every layer beside its FP32 twin)
    assert len(evaluations) == 2

    fp32 = load_onnx(directory / "model.onnx")
    linears = [n for n in fp32.graph.node if n.op_type in ("Gemm", "MatMul")]
    assert len(linears) == 3
    outlier_layer = linears[1].name  # net[2], the Linear after the scaled channel
    entry = read(directory / "report" / "accuracy.json")["int8"]
    assert list(entry["kept_in_fp32"]) == [outlier_layer]
    assert [row["passed"] for row in entry["gate_history"]] == [False, True]
    assert entry["gate_history"][0]["drop_points"] > 50  # fully quantized, the model is ruined
    assert read(directory / "manifest.json")["accuracy"]["int8"]["kept_in_fp32"] == [outlier_layer]

    # in the written graph that layer alone reads FP32 values; the other two read dequantized INT8
    int8 = load_onnx(directory / "model.int8.onnx")
    producers = {o: n.op_type for n in int8.graph.node for o in n.output}
    dequantized = {n.name: all(producers.get(i) == "DequantizeLinear" for i in n.input[:2])
                   for n in int8.graph.node if n.op_type in ("Gemm", "MatMul")}
    # the head (linears[2]) feeds the graph output: PLACEMENT keeps it out of INT8 from the start
    assert dequantized == {linears[0].name: True, outlier_layer: False, linears[2].name: False}
    int8_top1 = top1(outlier_mlp, directory / "model.int8.onnx")
    assert 100 * (outlier_mlp.fp32_top1 - int8_top1) <= MAX_DROP_POINTS, (outlier_mlp.fp32_top1, int8_top1)


# --- random data ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_random_calibration_data_is_flagged_everywhere(cnn: Exported, workdir: Path) -> None:
    result = calibrate(workdir, "--int8", "--calib-data", "random", "--calib-samples", "64", "--eval-data", cnn.eval)
    assert result.exit_code == 0, result.output
    assert "RANDOM data" in result.output and "smoke tests only" in result.output
    manifest = read(workdir / "manifest.json")
    assert manifest["calibration"]["calibration_data"]["random"] is True
    assert manifest["calibration"]["random_data"] is True
    report = read(workdir / "report" / "accuracy.json")["int8"]
    assert report["calibration_data"]["random"] is True and report["calibration_data"]["samples"] == 64
    assert read(workdir / "calibration.json")["data"]["random"] is True


@pytest.mark.parametrize("precision", ["int8", "fp16"])
def test_the_gate_reference_beside_the_calibration_pass_scores_as_after_it(tmp_path: Path, precision: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the gate's FP32 reference runs beside the calibration pass (on CUDA; forced here), it is computed in
    the pool's thread, not the calling one, and the gate's report equals that of the reference computed after the
    pass: the same cosines, max abs error and verdict (the two paths differ only in when the reference runs)."""
    import threading

    from onnx import TensorProto, helper, numpy_helper

    from calibration import accuracy, calibrate
    from compiler.core.onnx_io import save_onnx
    from compiler.core.settings import CalibrationSettings

    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 4])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc1"), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2")], "mlp", [x], [y],
        [numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal((32, 4)).astype(np.float32), "w2")]),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    model_path = tmp_path / "model.onnx"
    save_onnx(model, model_path)
    spec = ModelSpec((parse_input_spec("x:Bx16"),))
    threads: list[str] = []
    original = accuracy.Evaluator.from_model.__func__  # type: ignore[attr-defined]

    def recording(cls: Any, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(accuracy.Evaluator, "from_model", classmethod(recording))
    reports = {}
    for beside in (False, True):
        monkeypatch.setattr(calibrate, "_reference_beside", lambda data, beside=beside: beside)
        stage = tmp_path / f"stage-{beside}"
        stage.mkdir()
        outcome = calibrate._calibrated_into(stage, model_path, spec,
                                             CalibrationSettings(precision, data="random", samples=32))
        assert outcome.record is not None, outcome.message
        reports[beside] = json.loads((stage / "report" / "accuracy.json").read_text())[precision]["accuracy"]
    assert threads[0] == threading.current_thread().name and threads[1].startswith("trtc-fp32-reference")
    for key in ("cosine_mean", "cosine_min", "max_abs", "passed", "per_output"):
        assert reports[True][key] == reports[False][key], key
