"""`trtc bench`: backends, accuracy columns, report files, baselines and skipped backends, on the CPU.

One TorchScript export of the bundled digits CNN (plus its FP16 graph) serves every test; each
bench runs a handful of iterations, so the numbers are noise and only their shape is checked.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from onnx import numpy_helper

from compiler.backends.base import Runner
from compiler.bench.accuracy import accuracy_of
from compiler.bench.baseline import find_regressions, parse_percent
from compiler.bench.harness import bench_directory
from compiler.bench.inputs import input_feeds
from compiler.bench.reference import eager_model
from compiler.bench.report import BenchReport
from compiler.bench.table import bench_renderables, short_runner
from compiler.bench.timing import time_runner
from compiler.cli import cli
from compiler.core.errors import InputError
from compiler.core.manifest import EngineRecord, FileRecord, Manifest, SourceRecord, read_manifest, write_manifest
from compiler.core.onnx_io import load_onnx, save_onnx
from compiler.core.settings import BenchSettings, ExportSettings, ModelSource
from compiler.core.specs import DimRange, ModelSpec, parse_input_spec
from compiler.pipeline.export import export_directory
from examples import models
from tests.manifests import manifest_json

# Tiny counts, and the CPU everywhere so that these tests read the same on a GPU machine (test_cuda_* is for GPUs).
FP16_CPU = "onnxruntime/fp16 (accuracy row)"  # ONNX Runtime's CPU provider emulates FP16
FAST = dict(iterations=3, min_seconds=0.0, warmup=1, warmup_seconds=0.0, device="cpu",
            ort_providers=("CPUExecutionProvider",))
FAST_ARGS = ["-q", "-n", "3", "--min-seconds", "0", "--warmup", "1", "--warmup-seconds", "0", "--device", "cpu",
             "--ort-providers", "CPUExecutionProvider"]
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An export directory of the digits CNN with model.onnx and model.fp16.onnx, buckets 1 and 4."""
    from calibration.calibrate import calibrate_directory
    from compiler.core.settings import CalibrationSettings

    root = tmp_path_factory.mktemp("bench")
    source = root / "digits.ts"
    torch.jit.save(torch.jit.trace(models.resnet_digits(), torch.randn(2, 1, 8, 8)), source)
    spec = ModelSpec((parse_input_spec("images:Bx1x8x8"),))
    export_directory(ExportSettings(ModelSource(source), root / "build", spec, buckets=(1, 4)))
    calibrate_directory(root / "build", CalibrationSettings("fp16", data="random", samples=16))
    return root / "build"


@pytest.fixture(scope="module")
def bench(build: Path, tmp_path_factory: pytest.TempPathFactory) -> BenchReport:
    """One library run over every backend, written to its own report directory."""
    out = tmp_path_factory.mktemp("report")
    result = bench_directory(build, BenchSettings(**FAST, report_dir=out))  # type: ignore[arg-type]
    assert result.json_path == out / "bench.json" and result.csv_path == out / "bench.csv"
    assert json.loads(result.json_path.read_text()) == json.loads(json.dumps(result.data))
    return result


@pytest.fixture(scope="module")
def report(bench: BenchReport) -> dict[str, Any]:
    return bench.data


def rows(data: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["name"], r["bucket"]): r for r in data["results"]}


def test_torch_and_onnxruntime_run_every_onnx_at_every_bucket(report: dict[str, Any]) -> None:
    assert set(rows(report)) == {(name, b) for name in ("torch/fp32", "onnxruntime/fp32", FP16_CPU)
                                 for b in (1, 4)}
    for r in report["results"]:
        assert r["iterations"] >= 3 and r["device"] == "cpu" and r["clock"] == "perf_counter_ns"
        lat = r["latency_ms"]
        assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
        # one statistic, the P50, for throughput and speed-up alike (the end-to-end ones from the end-to-end P50)
        assert r["throughput"] == pytest.approx(r["bucket"] * 1000 / lat["p50"])
        assert r["e2e_ms"]["p50"] > 0 and r["e2e_throughput"] == pytest.approx(r["bucket"] * 1000 / r["e2e_ms"]["p50"])
        if r["accuracy_only"]:  # an emulated precision's time is no speed figure
            assert r["speedup"] is None and r["e2e_speedup"] is None
            continue
        assert r["speedup"] == pytest.approx(rows(report)[("torch/fp32", r["bucket"])]["latency_ms"]["p50"]
                                             / lat["p50"])
    assert report["reference"].startswith("torch/fp32")


def test_accuracy_columns_against_the_eager_reference(report: dict[str, Any]) -> None:
    by = rows(report)
    for b in (1, 4):
        assert by[("torch/fp32", b)]["accuracy"] == {"max_abs": 0.0, "max_rel": 0.0, "cosine": pytest.approx(1.0),
                                                     "top1_agreement": 1.0, "data": report["inputs"]["source"]}
        fp32 = by[("onnxruntime/fp32", b)]["accuracy"]
        assert fp32["max_abs"] < 1e-4 and fp32["cosine"] > 0.99999 and fp32["top1_agreement"] == 1.0
        fp16 = by[(FP16_CPU, b)]["accuracy"]
        assert 0 < fp16["max_abs"] < 0.05 and fp16["cosine"] > 0.999


def test_a_perturbed_model_shows_its_error(build: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(build, broken, ignore=shutil.ignore_patterns("report", ".trtc.lock"))
    model = load_onnx(broken / "model.onnx")
    head = next(i for i in model.graph.initializer if tuple(i.dims) == (10, 64))  # the classifier's weight
    rng = np.random.default_rng(0)
    head.CopyFrom(numpy_helper.from_array(rng.standard_normal((10, 64)).astype(np.float32), head.name))
    save_onnx(model, broken / "model.onnx")
    manifest = read_manifest(broken)  # as if the build had produced this model: bench reads only verified files
    onnx = {**manifest.onnx, "fp32": FileRecord.for_onnx(broken, broken / "model.onnx")}
    write_manifest(broken / "manifest.json", dataclasses.replace(manifest, onnx=onnx))
    data = bench_directory(broken, BenchSettings(**FAST, backends=("onnxruntime",), buckets=(4,),  # type: ignore[arg-type]
                                                 plot=False)).data
    acc = rows(data)[("onnxruntime/fp32", 4)]["accuracy"]
    assert acc["cosine"] < 0.99 and acc["top1_agreement"] < 1.0 and acc["max_abs"] > 0.1
    # the unchanged FP16 graph still agrees: the reference is the eager model, not the perturbed ONNX
    assert rows(data)[(FP16_CPU, 4)]["accuracy"]["top1_agreement"] == 1.0


@pytest.mark.skipif(HAS_CUDA, reason="the reasons checked here are this CPU machine's")
def test_backends_that_cannot_run_are_listed_with_reasons(report: dict[str, Any]) -> None:
    skipped = {(s["backend"], s["precision"]): s for s in report["skipped"]}
    if importlib.util.find_spec("tensorrt") is None:
        assert "TensorRT is not installed" in skipped[("tensorrt", None)]["reason"]
    for precision in ("fp32", "fp16"):
        assert "no CUDA device" in skipped[("torch-cudagraph", precision)]["reason"]
    assert "CUDA only" in skipped[("torch", "fp16")]["reason"]
    assert not any(s["failed"] for s in report["skipped"])


def test_json_layout(report: dict[str, Any]) -> None:
    assert {"kind", "schema", "created", "build", "machine", "versions", "settings", "device", "reference", "inputs",
            "results", "skipped", "warnings", "baseline", "plot"} <= set(report)
    assert report["kind"] == "trtc-bench" and report["schema"] == 1
    assert set(report["build"]["onnx"]) == {"fp32", "fp16"} and report["build"]["source"]["format"] == "torchscript"
    assert {"cpu", "cpu_count", "gpu", "platform"} <= set(report["machine"])
    assert {"torch", "onnxruntime", "tensorrt", "trtc"} <= set(report["versions"])
    assert report["settings"]["iterations"] == 3 and report["settings"]["backends"][0] == "torch"
    feed = report["inputs"]["buckets"]["4"]
    assert feed["tensors"] == {"images": {"shape": [4, 1, 8, 8], "dtype": "float32"}} and len(feed["sha256"]) == 64
    r = report["results"][0]
    assert {"backend", "precision", "name", "bucket", "runner", "device", "clock", "iterations", "seconds",
            "latency_ms", "e2e_ms", "throughput", "e2e_throughput", "spread", "cv", "spread_wide",
            "peak_memory_bytes", "memory_method", "accuracy", "speedup", "e2e_speedup"} <= set(r)
    assert set(r["latency_ms"]) == {"p50", "p90", "p99", "mean", "std", "min", "max"}
    assert r["peak_memory_bytes"] is None  # not measured on the CPU
    assert set(report["skipped"][0]) == {"backend", "precision", "bucket", "reason", "failed"}


def test_csv_has_a_row_per_result_and_per_skipped_backend(bench: BenchReport) -> None:
    report = bench.data
    table = list(csv.DictReader(bench.csv_path.open()))
    ok = [r for r in table if r["status"] == "ok"]
    assert len(ok) == len(report["results"]) and len(table) == len(report["results"]) + len(report["skipped"])
    first = ok[0]
    assert first["backend"] == "torch" and float(first["p50_ms"]) > 0 and float(first["cosine"]) > 0.9999
    assert all(r["reason"] for r in table if r["status"] != "ok")


def test_png_is_written_when_matplotlib_is_present(bench: BenchReport) -> None:
    pytest.importorskip("matplotlib")
    assert bench.png_path is not None and bench.data["plot"]["file"] == str(bench.png_path)
    assert bench.png_path.name == "bench.png" and bench.png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_is_skipped_with_a_note_without_matplotlib(build: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # type: ignore[arg-type]
    result = bench_directory(build, BenchSettings(**FAST, backends=("onnxruntime",), buckets=(1,),  # type: ignore[arg-type]
                                                  report_dir=tmp_path))
    assert result.png_path is None and not (tmp_path / "bench.png").exists()
    assert "trtc[plot]" in result.data["plot"]["note"] and (tmp_path / "bench.json").is_file()


def _run_cli(args: list[str]) -> Any:
    return CliRunner().invoke(cli, ["bench", *args, *FAST_ARGS])


def test_baseline_regression_exit_codes(build: Path, tmp_path: Path) -> None:
    first = _run_cli([str(build), "--backends", "onnxruntime,tensorrt", "--buckets", "1", "--no-plot", "--wide",
                      "--report-dir", str(tmp_path / "first")])
    assert first.exit_code == 0, first.output
    assert "onnxruntime/fp32" in first.output and "CPU EP" in first.output and "│ torch/fp32" not in first.output
    if importlib.util.find_spec("tensorrt") is None:
        assert "skipped: tensorrt: TensorRT is not installed" in first.output
    data = json.loads((tmp_path / "first" / "bench.json").read_text())

    def scaled(factor: float, name: str) -> Path:
        crafted = json.loads(json.dumps(data))
        for r in crafted["results"]:
            r["latency_ms"]["p50"] *= factor
            r["throughput"] /= factor
        (tmp_path / name).write_text(json.dumps(crafted))
        return tmp_path / name

    faster = _run_cli([str(build), "--backends", "onnxruntime", "--buckets", "1", "--no-plot", "--report-dir",
                       str(tmp_path / "second"), "--baseline", str(scaled(0.01, "faster.json")),
                       "--max-regression", "5%"])
    assert faster.exit_code == 1, faster.output
    assert "regressed: onnxruntime/fp32 bucket 1: P50" in faster.output
    assert "error: performance regression beyond 5%" in faster.output
    slower = _run_cli([str(build), "--backends", "onnxruntime", "--buckets", "1", "--no-plot", "--report-dir",
                       str(tmp_path / "third"), "--baseline", str(scaled(100.0, "slower.json"))])
    assert slower.exit_code == 0, slower.output
    assert "no regression beyond 5%" in slower.output
    assert json.loads((tmp_path / "third" / "bench.json").read_text())["baseline"]["compared"] == 2
    # the same run as its own baseline: nothing regressed
    assert find_regressions(data, data, 0.05) == ([], 2, [])


def test_baseline_of_another_model_is_refused(build: Path, tmp_path: Path, report: dict[str, Any]) -> None:
    other = json.loads(json.dumps(report))
    other["build"]["source"]["sha256"] = "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(other))
    result = _run_cli([str(build), "--backends", "onnxruntime", "--baseline", str(tmp_path / "other.json")])
    assert result.exit_code == 2 and "measured another model" in result.output


def test_model_file_benches_eager_pytorch_and_onnxruntime_alone(tmp_path: Path) -> None:
    model = tmp_path / "mlp.ts"
    torch.jit.save(torch.jit.trace(models.mlp(), torch.randn(2, 64)), model)
    result = _run_cli([str(model), "--input", "x:Bx64", "--buckets", "1,2", "--report-dir", str(tmp_path / "r"),
                       "--no-plot"])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r" / "bench.json").read_text())
    assert set(rows(data)) == {(n, b) for n in ("torch/fp32", "onnxruntime/fp32") for b in (1, 2)}
    assert data["build"]["directory"] is None
    skipped = {s["backend"]: s["reason"] for s in data["skipped"]}
    assert "eager PyTorch and ONNX Runtime only" in skipped["tensorrt"]
    assert "eager PyTorch and ONNX Runtime only" in skipped["torch-cudagraph"]


def test_a_build_directory_with_input_options_is_a_user_error(build: Path) -> None:
    result = _run_cli([str(build), "--input", "x:Bx64"])
    assert result.exit_code == 2 and "records its model and inputs" in result.output


def test_feeds_are_seeded_or_read_from_npz(tmp_path: Path) -> None:
    spec = ModelSpec((parse_input_spec("ids:BxS:int64"), parse_input_spec("mask:BxS:int64")), {"S": DimRange(1, 8, 16)})
    a, b = input_feeds(spec, (1, 4), seed=3), input_feeds(spec, (1, 4), seed=3)
    assert all(np.array_equal(a[k][n], b[k][n]) for k in a for n in a[k])
    assert a[4]["ids"].shape == (4, 8) and a[4]["mask"].min() == 1  # masks are all ones
    np.savez(tmp_path / "d.npz", ids=np.arange(12).reshape(3, 4), mask=np.ones((3, 4), dtype=np.int32))
    fed = input_feeds(spec, (2, 5), data=tmp_path / "d.npz")
    assert fed[5]["ids"].shape == (5, 4) and fed[5]["ids"].dtype == np.int64 and fed[5]["mask"].dtype == np.int64
    assert np.array_equal(fed[5]["ids"][3], fed[5]["ids"][0])  # 3 samples repeated to fill 5
    np.savez(tmp_path / "partial.npz", ids=np.zeros((2, 4)))
    with pytest.raises(InputError, match="no array for input"):
        input_feeds(spec, (1,), data=tmp_path / "partial.npz")


def test_the_eager_model_loads_from_the_build_snapshot_of_a_factory_source(tmp_path: Path) -> None:
    from compiler.frontend.loading import LoadedModel, snapshot_into

    zeros = models.mlp()
    for tensor in zeros.state_dict().values():
        tensor.zero_()
    snapshot = snapshot_into(tmp_path, LoadedModel("factory", None, module=zeros))
    manifest = Manifest(source=SourceRecord("examples.models:mlp", "factory", factory="examples.models:mlp",
                                            snapshot=snapshot))
    module, note = eager_model(manifest, directory=tmp_path)
    assert isinstance(module, torch.nn.Module) and "examples.models:mlp" in note
    assert float(module(torch.ones(1, 64)).abs().sum()) == 0.0  # the snapshot's weights, not the factory's
    none, why = eager_model(manifest)
    assert none is None and "snapshot" in why
    assert eager_model(Manifest(source=SourceRecord("m.onnx", "onnx")))[0] is None
    none, why = eager_model(Manifest(source=SourceRecord("m.pt", "pickle")))
    assert none is None and "--trust-pickle" in why


class CountingRunner(Runner):
    """A runner that sleeps a fixed time per execute and counts its calls (for the timing loop alone)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.name, self.device, self.input_names, self.output_names = "counting", "cpu", ["x"], ["y"]
        self.seconds, self.launches = seconds, 0

    def _activate(self) -> None:
        pass

    def _upload(self, feed: dict[str, np.ndarray]) -> None:
        self.feed = feed

    def _execute(self) -> None:
        self.launches += 1
        time.sleep(self.seconds)

    def _download(self) -> dict[str, np.ndarray]:
        return {"y": self.feed["x"] * 2}

    def _release(self) -> None:
        pass


def test_timing_honours_counts_seconds_and_the_cap() -> None:
    feed = {"x": np.ones((2, 2), dtype=np.float32)}
    runner = CountingRunner(0.001)
    runner.activate()
    timing = time_runner(runner, feed, BenchSettings(iterations=5, min_seconds=0.05, warmup=4, warmup_seconds=0))
    assert timing.warmup_runs == 4 and len(timing.device_ms) == len(timing.e2e_ms) >= 5
    assert timing.seconds >= 0.05 and runner.launches == 4 + len(timing.e2e_ms)
    assert min(timing.device_ms) >= 1.0 and all(e >= d for e, d in zip(timing.e2e_ms, timing.device_ms))
    assert np.array_equal(timing.outputs["y"], feed["x"] * 2) and not timing.stopped_early
    slow = CountingRunner(0.01)
    slow.activate()
    capped = time_runner(slow, feed, BenchSettings(iterations=1000, min_seconds=0, warmup=0,
                                                                   warmup_seconds=0, max_seconds=0.1))
    assert capped.stopped_early and len(capped.e2e_ms) < 1000


def test_accuracy_of_compares_outputs_in_order() -> None:
    ref = {"logits": np.array([[1.0, 2.0, 0.0], [3.0, 0.0, 1.0]], dtype=np.float32)}
    same = accuracy_of({"other_name": ref["logits"].copy()}, ref, 2)
    assert same.max_abs == 0 and same.cosine == pytest.approx(1.0) and same.top1_agreement == 1.0
    flipped = accuracy_of({"y": ref["logits"][:, ::-1].copy()}, ref, 2)
    assert flipped.top1_agreement == 0.5 and flipped.cosine < 1
    assert accuracy_of({"y": np.ones((2, 3, 4))}, {"y": np.ones((2, 3, 4))}, 2).top1_agreement is None


def test_settings_are_validated() -> None:
    assert parse_percent("5%") == pytest.approx(0.05) and parse_percent("12.5") == pytest.approx(0.125)
    with pytest.raises(InputError, match="not a percentage"):
        parse_percent("five")
    with pytest.raises(InputError, match="choose from"):
        BenchSettings(backends=("tensorrt", "tvm"))
    with pytest.raises(InputError, match="at least 1"):
        dataclasses.replace(BenchSettings(), iterations=0)
    assert short_runner("onnxruntime[CUDAExecutionProvider]") == "CUDA EP" and short_runner("torch") == "eager"


def test_an_engine_is_labelled_with_the_precision_of_its_onnx(build: Path) -> None:
    manifest = read_manifest(build)
    entry = EngineRecord(bucket=4, file="engines/b4.engine", sha256="0" * 64, onnx="model.fp16.onnx")
    assert manifest.engine_precision(entry) == "fp16"
    elsewhere = EngineRecord(bucket=1, file="engines/b1.engine", sha256="0" * 64, onnx="elsewhere.onnx")
    assert Manifest.from_json({"build": {"precision": "int8"}}).engine_precision(elsewhere) == "int8"


@pytest.mark.gpu
def test_cuda_backends_time_with_events_and_measure_memory(build: Path, tmp_path: Path) -> None:
    settings = BenchSettings(iterations=3, min_seconds=0.0, warmup=1, warmup_seconds=0.0,
                             backends=("torch", "torch-cudagraph"), report_dir=tmp_path, tf32=False)  # FP32 is FP32
    data = bench_directory(build, settings).data
    by = rows(data)
    assert set(by) == {(n, b) for n in ("torch/fp32", "torch/fp16", "torch-cudagraph/fp32", "torch-cudagraph/fp16")
                       for b in (1, 4)}
    assert data["device"] == "cuda" and data["machine"]["gpu"] and data["tf32"]["enabled"] is False
    for r in data["results"]:
        assert r["device"] == "cuda" and r["clock"] == "cuda_event"
        assert 0 < r["latency_ms"]["p50"] <= r["e2e_ms"]["p50"] * 1.05  # end to end holds the device time
        assert r["peak_memory_bytes"] > 0 and r["memory_method"].startswith("torch.cuda.max_memory_allocated")
        assert r["accuracy"]["cosine"] > 0.999
        if r["precision"] == "fp32":
            assert r["accuracy"]["top1_agreement"] == 1.0 and r["accuracy"]["max_abs"] < 1e-4


# --- one execution layer, one precision policy, honest accuracy columns ----------------------------------------

def _copy(build: Path, where: Path) -> Path:
    shutil.copytree(build, where, ignore=shutil.ignore_patterns("report", ".trtc.lock"))
    return where


def test_rows_run_the_serving_backends(build: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row is timed through a serving context of compiler.load's backends, not a runner of its own."""
    from compiler.backends.host import HostContext

    computed: list[str] = []
    real = HostContext.compute

    def counting(self: Any, bucket: int, call: Any) -> None:
        computed.append(type(self).__name__)
        real(self, bucket, call)

    monkeypatch.setattr(HostContext, "compute", counting)
    data = bench_directory(build, BenchSettings(**FAST, backends=("torch", "onnxruntime"), buckets=(4,),  # type: ignore[arg-type]
                                                report_dir=tmp_path, plot=False)).data
    assert {"OrtCpuContext", "TorchCpuContext"} <= set(computed)
    assert len(computed) >= 3 * len(data["results"])  # first run, warm-up and timed runs all went through it
    assert {r["runner"] for r in data["results"]} == {"torch", "onnxruntime[CPUExecutionProvider]"}


def test_each_onnx_is_checked_against_the_manifest_once(build: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The classifier check, the reference and the onnxruntime rows share one sha256 check per graph."""
    import compiler.bench.target as target_module

    checked: list[str] = []
    real = target_module.verified_onnx

    def counting(directory: Path, entry: Any, precision: str = "") -> Path:
        checked.append(precision)
        return real(directory, entry, precision)

    monkeypatch.setattr(target_module, "verified_onnx", counting)
    data = bench_directory(build, BenchSettings(**FAST, backends=("onnxruntime",), buckets=(1,),  # type: ignore[arg-type]
                                                report_dir=tmp_path, plot=False)).data
    assert sorted(checked) == ["fp16", "fp32"] and data["classifier"] is True


def test_a_backend_that_fails_is_a_row_not_a_crash(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A runner that does not open fails once for every bucket; one that fails at a bucket fails that bucket, and
    the runner is released once after its buckets."""
    import compiler.bench.measure as measure_module
    from compiler.bench.measure import RunContext, measure_plan
    from compiler.bench.plans import Plan
    from compiler.bench.report import Skipped

    context = RunContext(False, "random", {})
    settings = BenchSettings(**FAST)  # type: ignore[arg-type]
    opened: list[int] = []

    def broken() -> Any:
        opened.append(1)
        raise RuntimeError("no device\nmore detail")

    results, skipped = measure_plan(Plan("onnxruntime", "fp32", broken), (1, 4), {}, {}, settings, context)
    assert results == [] and len(opened) == 1
    assert skipped == [Skipped("onnxruntime", "fp32", None, "failed: RuntimeError: no device", failed=True)]
    assert "onnxruntime/fp32 at bucket 1 failed: RuntimeError: no device" in caplog.text

    closed: list[int] = []

    class Released(CountingRunner):
        def _release(self) -> None:
            closed.append(1)

    def measure(plan: Any, runner: Any, bucket: int, *args: Any) -> Any:
        raise ValueError(f"bucket {bucket} does not fit")

    monkeypatch.setattr(measure_module, "measure_bucket", measure)
    results, skipped = measure_plan(Plan("torch", "fp32", lambda: Released(0.0)), (1, 4), {1: {}, 4: {}},
                                    {1: {}, 4: {}}, settings, context)
    assert results == [] and closed == [1]
    assert [(s.bucket, s.reason, s.failed) for s in skipped] == [
        (b, f"failed: ValueError: bucket {b} does not fit", True) for b in (1, 4)]


def test_one_tf32_policy_per_run(build: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import compiler.bench.measure as measure_module

    seen: list[tuple[bool, bool]] = []
    real = measure_module.measure_bucket

    def watching(*args: Any, **kwargs: Any) -> Any:
        seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
        return real(*args, **kwargs)

    monkeypatch.setattr(measure_module, "measure_bucket", watching)
    directory = _copy(build, tmp_path / "b")
    manifest = manifest_json(directory)
    manifest.setdefault("build", {})["tf32"] = False
    (directory / "manifest.json").write_text(json.dumps(manifest))
    settings = BenchSettings(**FAST, backends=("torch", "onnxruntime"), buckets=(1,), plot=False)  # type: ignore[arg-type]
    off = bench_directory(directory, dataclasses.replace(settings, report_dir=tmp_path / "off"))
    assert off.data["tf32"]["enabled"] is False and off.data["tf32"]["source"] == "the manifest's build.tf32"
    assert seen and all(flags == (False, False) for flags in seen)
    seen.clear()
    on = bench_directory(directory, dataclasses.replace(settings, tf32=True, report_dir=tmp_path / "on"))
    assert on.data["tf32"] == {**on.data["tf32"], "enabled": True, "source": "--tf32"}
    assert seen and all(flags == (True, True) for flags in seen)
    assert "TF32 on" in bench_renderables(on)[0].title and "TF32 off" in bench_renderables(off)[0].title
    default = bench_directory(build, dataclasses.replace(settings, report_dir=tmp_path / "default")).data["tf32"]
    assert default["enabled"] is True and default["source"].startswith("default")


def test_accuracy_uses_the_builds_evaluation_data(build: Path, tmp_path: Path) -> None:
    directory = _copy(build, tmp_path / "b")
    rng = np.random.default_rng(11)
    images = rng.uniform(0, 1, (6, 1, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "eval.npz", images=images)
    (directory / "report").mkdir()
    (directory / "report" / "accuracy.json").write_text(json.dumps({"fp16": {
        "calibration_data": {"source": "random (smoke test only)", "random": True},
        "eval_data": {"source": str(tmp_path / "eval.npz"), "random": False}}}))
    data = bench_directory(directory, BenchSettings(**FAST, backends=("onnxruntime",), buckets=(4,),  # type: ignore[arg-type]
                                                    report_dir=tmp_path / "r", plot=False)).data
    source = data["inputs"]["source"]
    assert source.startswith(f"the build's evaluation data {tmp_path / 'eval.npz'}") and "first 4 sample" in source
    h = hashlib.sha256()
    h.update(b"images")
    h.update(images[:4].tobytes())
    assert data["inputs"]["buckets"]["4"]["sha256"] == h.hexdigest()  # the eval samples themselves were fed
    assert all(r["accuracy"]["data"] == source for r in data["results"])
    renderables = bench_renderables(BenchReport(data, tmp_path / "r" / "bench.json", tmp_path / "r" / "bench.csv",
                                                None))
    assert "evaluation data" in str(renderables[0].caption)
    # random calibration data is not used: seeded random inputs, and the report says why
    report_data = bench_directory(build, BenchSettings(**FAST, backends=("onnxruntime",), buckets=(1,),  # type: ignore[arg-type]
                                                       report_dir=tmp_path / "s", plot=False)).data
    assert report_data["inputs"]["source"] == "random normal, seed 0 (the build was calibrated on random data)"


def test_a_non_classifier_gets_no_top1_and_its_sequence_length_is_shown(tmp_path: Path) -> None:
    from rich.console import Console

    from tests.builds import build_directory

    directory = build_directory(tmp_path / "tr", "transformer_encoder", buckets=[1, 4])
    data = bench_directory(directory, BenchSettings(**FAST, buckets=(4,), report_dir=tmp_path / "r",  # type: ignore[arg-type]
                                                    plot=False)).data
    assert data["classifier"] is False and data["results"]
    for r in data["results"]:
        assert r["accuracy"]["top1_agreement"] is None and r["dims"] == {"S": 16}
    table = bench_renderables(BenchReport(data, tmp_path / "j", tmp_path / "c", None))[0]
    text = _rendered(table, Console)
    assert "top-1" not in text and "4 S=16" in text


def _rendered(table: Any, console_type: Any, width: int = 400) -> str:
    console = console_type(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(table)
    return str(console.export_text())


def test_the_table_fits_120_columns_and_says_when_there_is_no_reference(report: dict[str, Any],
                                                                        bench: BenchReport) -> None:
    from rich.console import Console

    narrow = bench_renderables(bench)[0]
    lines = _rendered(narrow, Console).splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 120 and "speed-up vs torch/fp32" in str(narrow.title)
    assert "top-1" in _rendered(narrow, Console)  # the digits CNN is a classifier
    wide = bench_renderables(bench, wide=True)[0]
    assert len(wide.columns) > len(narrow.columns) and "peak MiB" in [c.header for c in wide.columns]
    no_torch = dict(report, results=[r for r in report["results"] if r["backend"] != "torch"])
    table = bench_renderables(BenchReport(no_torch, bench.json_path, bench.csv_path, None))[0]
    assert "no torch/fp32 row" in str(table.title)
    assert not any(str(c.header).startswith("speed-up") for c in table.columns)


def test_columns_name_their_statistic_and_emulated_rows_are_marked(report: dict[str, Any], bench: BenchReport) -> None:
    """The throughput and speed-up headers name the P50 they come from, the caption says so and what an accuracy
    row is, and the CPU provider's FP16 rows are accuracy rows (with the reason among the notes) while its FP32
    rows are speed rows."""
    from compiler.bench.measure import emulated

    table = bench_renderables(bench)[0]
    headers = [str(c.header) for c in table.columns]
    assert {"P50 ms", "e2e P50 ms", "samples/s\n(P50)", "speed-up\n(P50)"} <= set(headers)
    assert "from the P50 device latency" in str(table.caption) and "*: an accuracy row" in str(table.caption)
    by = rows(report)
    assert by[(FP16_CPU, 1)]["accuracy_only"] and not by[("onnxruntime/fp32", 1)]["accuracy_only"]
    assert any(w.startswith("onnxruntime/fp16 rows are accuracy rows") for w in report["warnings"])
    assert emulated("onnxruntime", "int8", "cuda") and emulated("onnxruntime", "fp16", "cpu")
    assert not emulated("onnxruntime", "fp16", "cuda") and not emulated("tensorrt", "int8", "cuda")


@pytest.mark.gpu
@pytest.mark.ort_cuda
def test_cuda_onnxruntime_rows_run_the_serving_cuda_backend(build: Path, tmp_path: Path) -> None:
    """ONNX Runtime on CUDA is timed on the serving context's stream: its kernels fall between the CUDA events."""
    settings = BenchSettings(iterations=3, min_seconds=0.0, warmup=1, warmup_seconds=0.0, backends=("onnxruntime",),
                             report_dir=tmp_path, tf32=False)
    data = bench_directory(build, settings).data
    assert {r["name"] for r in data["results"]} == {"onnxruntime/fp32", "onnxruntime/fp16"}  # FP16 kernels on CUDA
    for r in data["results"]:
        assert r["runner"] == "onnxruntime[CUDAExecutionProvider]" and r["clock"] == "cuda_event"
        assert 0.005 < r["latency_ms"]["p50"] <= r["e2e_ms"]["p50"] * 1.05  # the run itself is inside the events
        assert r["accuracy"]["cosine"] > 0.999
