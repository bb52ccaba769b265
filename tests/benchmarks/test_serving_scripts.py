"""The serving benchmark scripts run on the CPU (their --smoke forms) and their measuring rules hold: each test
runs a script or one of its helpers and checks what it writes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.project import ROOT


@pytest.mark.slow
def test_the_serving_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/serving_gpu.py --smoke: every cell of the serving table for each configuration of the CNN (the
    ProcessBatcher's processes, the two DynamicBatcher modes, map), each with its targets and its batch trace, and
    the threads cell again at CPython's switch interval;
    torchvision's model skipped with the reason where it does not import; one JSON and the table."""
    import json
    import subprocess

    root = ROOT
    out = tmp_path / "serving.json"
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "serving_gpu.py"), "--smoke", "--models",
                           "torchvision-resnet50,cnn", "--backends", "onnxruntime", "--out", str(out), "--work",
                           str(tmp_path / "work")], capture_output=True, text=True, timeout=600, cwd=root,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["kind"] == "trtc-serving-table" and report["smoke"] is True
    try:
        import torchvision  # noqa: F401
    except Exception:
        assert [s["model"] for s in report["skipped"]] == ["torchvision-resnet50"]
        assert "import torchvision.models failed" in report["skipped"][0]["why"]
    runs = {(r["model"], r["contexts"]): r for r in report["runs"] if r["model"] == "cnn"}
    assert set(runs) == {("cnn", 1), ("cnn", 2)}
    for r in runs.values():
        assert set(r["cells"]) == {"processes", "asyncio", "threads", "threads_switch_5ms", "map"}
        for name in ("processes", "asyncio", "threads", "threads_switch_5ms"):
            cell = r["cells"][name]
            assert cell["answered"] > 0 and cell["lost"] == cell["misrouted"] == cell["duplicated_rows"] == 0
            assert cell["p99_ms"] >= cell["p50_ms"] > 0 and r["targets"].get(f"{name}_nothing_lost", True)
            assert cell["trace"]["rows"][0] >= 1 and "bucket_changes_per_batch" in cell["trace"]
        assert len(r["cells"]["map"]["map_runs_ms"]) == len(r["cells"]["map"]["sequential_runs_ms"]) == 5
        assert r["bound"]["rows_per_s"] > 0 and r["buckets"] == [1, 4, 8] and r["launches_on_host"] is False
        assert r["run_parts"]["rows_per_s"] > 0 and (r["parallel_calls"] is None) == (r["contexts"] == 1)
    assert "processes_p99_vs_one_context" in runs["cnn", 2]["targets"]
    assert report["runs"][0]["cells"]["processes"]["client_processes"] == 2
    assert set(report["batcher_ceiling"]["cnn"]) == {"processes", "asyncio", "threads"}
    assert "serving at its bound" in done.stdout


def test_map_runs_post_stage_copies_the_outputs_out_of_the_context_then_post_processes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``serving_measure.map_run``'s post stage is what ``map``'s thread does per batch: the outputs copied out of the
    context (arrays of their own, not views of its buffers), then post-processed; each of its 20 timed calls."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import serving_measure
    from compiler.serve.load import engines_from_module
    from examples import models

    seen: list[Any] = []
    post = serving_measure.postprocess
    monkeypatch.setattr(serving_measure, "postprocess", lambda out: (seen.append(out), post(out))[1])
    model = serving_measure.Model("mlp", "", ("x:Bx64",), (), (1, 4, 8), {})
    with engines_from_module(models.mlp(), ["x:Bx64"], buckets=(1, 4, 8), device="cpu", contexts=1) as engines:
        result = serving_measure.map_run(engines, model, 4, 6)
    copied_out = [out for out in seen if isinstance(out, dict)]  # the loop and map post-process arrays
    assert len(copied_out) == 20 and result["post_ms"] > 0
    assert all(a.flags.owndata and a.shape == (4, 10) for out in copied_out for a in out.values())


@pytest.mark.slow
def test_the_serving_benchmark_measures_map_alone_for_the_segmenter(tmp_path: Path) -> None:
    """``--models segmenter:map``: engines(x) and map per context count, no batcher cell, no ceiling; its
    post-processing is a coarse label map of the outputs; a model it does not know stops it with the names it
    knows."""
    import json
    import subprocess

    from benchmarks import serving_gpu, serving_measure

    scores = np.zeros((2, 3, 16, 16), np.float32)
    scores[0, 2, ::8, ::8] = 1.0  # image 0: class 2 at the pixels kept; image 1: class 1 at one of them
    scores[1, 1, 8, 0] = 1.0
    labels = serving_measure.postprocess(scores)
    np.testing.assert_array_equal(labels, [[[2, 2], [2, 2]], [[0, 0], [1, 0]]])
    assert [(m.name, only) for m, only in serving_gpu.models_for(True)] == [("cnn", False), ("transformer", True)]
    assert [(m.name, only) for m, only in serving_gpu.models_for(False)] == [
        ("torchvision-resnet50", False), ("resnet50", True), ("transformer", True)]
    root = ROOT
    out = tmp_path / "serving.json"
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "serving_gpu.py"), "--smoke", "--models",
                           "segmenter:map", "--backends", "torch", "--out", str(out), "--work",
                           str(tmp_path / "work")], capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["batcher_ceiling"] == {"segmenter": {}}
    assert [(r["model"], r["contexts"]) for r in report["runs"]] == [("segmenter", 2), ("segmenter", 1)]
    for r in report["runs"]:
        assert set(r["targets"]) == {"map_not_slower_than_loop"} and set(r["cells"]) == {"map"}
        assert r["cells"]["map"]["map_ms"] > 0
    wrong = subprocess.run([sys.executable, str(root / "benchmarks" / "serving_gpu.py"), "--smoke", "--models",
                            "segmentor", "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=root)
    assert wrong.returncode != 0 and "no model segmentor; choose from torchvision-resnet50, cnn" in wrong.stderr


@pytest.mark.slow
def test_the_process_batcher_trace_runs_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/process_batcher_trace.py --smoke: a timeline of every batch, whose batches hold every answered
    request, and whose stages are all measured."""
    import json
    import subprocess

    root = ROOT
    out = tmp_path / "trace.json"
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "process_batcher_trace.py"), "--smoke", "--out",
                           str(out), "--work", str(tmp_path / "work"), "--requests", "200", "--runs",
                           "onnxruntime:fp32:1:processes:8"], capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    timeline = run["timeline"]
    assert run["requests_per_s"] > 0 and timeline["requests"] == 200 and timeline["batches"] >= 200 / 8
    for stage in ("wait_before_start", "start", "start_to_finish", "finish", "finish_to_wake", "client_turnaround"):
        assert 0 <= timeline[stage]["p50"] <= timeline[stage]["p99"], stage
    assert timeline["launchers"] == []  # the CPU runs each batch on the batcher's thread


@pytest.mark.slow
def test_the_ceiling_benchmark_runs(tmp_path: Path) -> None:
    """benchmarks/batcher_ceiling.py: every client mode answers every request; one JSON with the medians."""
    import json

    root = ROOT
    out = tmp_path / "ceiling.json"
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "batcher_ceiling.py"), "--requests", "300",
                           "--repeats", "1", "--threads", "8", "--coroutines", "16", "--processes", "2",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["kind"] == "trtc-batcher-ceiling" and set(report["median"]) == {
        "threads", "asyncio", "processes", "processes-asyncio"}
    assert all(len(runs) == 1 and runs[0] > 0 for runs in report["requests_per_s"].values())


def test_the_process_clients_steady_span_counts_only_while_every_process_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    """``process_clients.steady``: answers from the last process's start to the first one's end, per second, and the
    latencies of those answers, each its own; no rate and no latencies without a span or an answer in it."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import process_clients
    early = {"begin": 0.0, "end": 1.0, "ends": np.array([0.05, 0.5, 0.9, 1.0]), "latencies": np.array([1, 2, 3, 4.0])}
    late = {"begin": 0.2, "end": 2.0, "ends": np.array([0.3, 0.6, 1.5, 2.0]), "latencies": np.array([5, 6, 7, 8.0])}
    rate, latencies = process_clients.steady([early, late])
    assert rate == pytest.approx(5 / 0.8) and latencies.tolist() == [2, 3, 4, 5, 6]  # 0.5, 0.9, 1.0, 0.3, 0.6
    rate, latencies = process_clients.steady([{"begin": 1.0, "end": 2.0, "ends": [1.5], "latencies": [1.0]},
                                              {"begin": 2.5, "end": 3.0, "ends": [2.7], "latencies": [2.0]}])
    assert rate is None and latencies.size == 0  # no span
    rate, latencies = process_clients.steady([{"begin": 0.0, "end": 2.0, "ends": [0.1, 1.9], "latencies": [1.0, 2.0]},
                                              {"begin": 0.5, "end": 1.5, "ends": [], "latencies": []}])
    assert rate is None and latencies.size == 0  # no answer in the span


def test_the_closed_loop_pairs_each_answer_time_with_its_own_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread clients of ``ClosedLoop`` record when each answer came and its latency as one pair, so that the steady
    span's latencies are those of the answers it counts: each pair spans exactly one call of ``send``. (A check of
    the property: two lists appended separately mispair only when a thread is switched out between the two
    appends, which no test can bring about reliably.)"""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import process_clients

    calls: list[tuple[float, float]] = []

    def send(x: np.ndarray) -> np.ndarray:
        entered = time.monotonic()
        time.sleep(0.005 * float(x[0]))  # client i's calls take about 5i ms: another client's latency does not fit
        calls.append((entered, time.monotonic()))
        return x

    loop = process_clients.ClosedLoop(60)
    loop.in_threads(send, [np.array([float(i)]) for i in range(1, 5)], [1, 2, 3, 4])
    assert len(loop.done) == 60 and loop.lost == 0 and loop.ends == [end for end, _ in loop.done]
    for end, latency in loop.done:
        begin = end - latency
        assert any(begin <= entered and left <= end and latency - (left - entered) < 0.0025
                   for entered, left in calls), (end, latency)


@pytest.mark.parametrize("steady", [True, False])
def test_the_serving_benchmark_takes_the_process_modes_p99_over_the_steady_span(
        monkeypatch: pytest.MonkeyPatch, steady: bool) -> None:
    """``batcher_run`` in a process mode: p50/p99 of the answers the steady rate counts, the whole run's beside;
    without a steady span (None), the whole run's."""
    monkeypatch.syspath_prepend(str(ROOT))
    import torch

    from benchmarks import process_clients, serving_measure
    from compiler.serve.load import engines_from_module

    whole = np.array([0.001, 0.002, 0.003, 0.050])  # the last: a request of the run's last batches
    steady_only = np.array([0.001, 0.002, 0.003])

    def run(batcher: Any, inputs: Any, requests: int, processes: int, kind: str = "threads",
            seconds: float | None = None) -> dict[str, Any]:
        return {"seconds": 1.0, "steady_requests_per_s": 3.0 if steady else None,
                "steady_latencies": steady_only if steady else np.zeros(0), "latencies": whole, "answers": [],
                "lost": 0, "processes": processes, "cpu_seconds": 0.0}

    monkeypatch.setattr(process_clients, "run", run)
    module = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    engines = engines_from_module(module, ["images:Bx1x8x8"], buckets=(1, 4), device="cpu", contexts=1)
    model = serving_measure.Model("cnn", "", ("images:Bx1x8x8",), (), (1, 4), {})
    try:
        result = serving_measure.batcher_run(engines, model, 1, 4, 4, 5.0, mode="processes", check_rows=False,
                                         client_processes=2)
    finally:
        engines.close()
    kept = steady_only if steady else whole
    assert result["p99_ms"] == pytest.approx(float(np.percentile(kept, 99)) * 1e3)
    assert result["p50_ms"] == pytest.approx(float(np.percentile(kept, 50)) * 1e3)
    assert result["p99_ms_whole_run"] == pytest.approx(float(np.percentile(whole, 99)) * 1e3)
    assert result["requests_per_s"] == (3.0 if steady else 4.0)


def test_the_serving_benchmark_holds_each_cell_to_its_target() -> None:
    """``serving_gpu.cell_targets``: threads >= 50 % of min(bound, the threads ceiling) with p99 <= max_wait + 3
    batch times on every backend; coroutines >= 80 % of the bound, with p99 <= max_wait + 2 batch times on ONNX
    Runtime only, and the deep cell of 192 coroutines held to throughput alone on every backend; processes >= 80 %
    of the bound, and with two contexts within the one-context p99 + one batch time; every batcher cell records its
    closed-loop mean (clients / throughput); nothing lost, misrouted or duplicated; map no slower than the loop
    within the tolerance (or half the larger spread of either's runs)."""
    from benchmarks import serving_gpu

    bound = {"rows_per_s": 10_000.0, "batch_ms_mean": 6.0}
    clean = {"lost": 0, "misrouted": 0, "duplicated_rows": 0}
    threads, asyncio_, processes = (serving_gpu.Cell(n, m, 64, 100) for n, m in (
        ("threads", "threads"), ("asyncio", "asyncio"), ("processes", "processes-asyncio")))
    ort, torch_ = "onnxruntime", "torch"
    ok = {"requests_per_s": 4_100.0, "p99_ms": 22.9, **clean}
    assert all(serving_gpu.cell_targets(threads, dict(ok), bound, 8_000.0, None, torch_).values())  # 50 % of 8 k
    assert not serving_gpu.cell_targets(threads, dict(ok, requests_per_s=3_900.0), bound, 8_000.0, None, ort)[
        "threads_throughput"]
    assert not serving_gpu.cell_targets(threads, dict(ok, p99_ms=23.1), bound, None, None, torch_)["threads_p99"]
    assert not serving_gpu.cell_targets(asyncio_, dict(ok), bound, None, None, ort)["asyncio_throughput"]  # 80 %
    fast = dict(ok, requests_per_s=8_000.0, p99_ms=17.0)
    assert serving_gpu.cell_targets(asyncio_, dict(fast), bound, None, None, ort) == {
        "asyncio_throughput": True, "asyncio_p99": True, "asyncio_nothing_lost": True}
    assert not serving_gpu.cell_targets(asyncio_, dict(fast, p99_ms=17.1), bound, None, None, ort)["asyncio_p99"]
    late = dict(fast, p99_ms=30.0)
    assert serving_gpu.cell_targets(asyncio_, late, bound, None, None, torch_) == {
        "asyncio_throughput": True, "asyncio_nothing_lost": True}
    assert late["closed_loop_mean_ms"] == 1e3 * 64 / 8_000.0 and late["p99_bound_ms"] == 17.0
    deep = serving_gpu.Cell("asyncio_deep", "asyncio", 192, 100)
    assert serving_gpu.cell_targets(deep, dict(late), bound, None, None, ort) == {
        "asyncio_deep_throughput": True, "asyncio_deep_nothing_lost": True}
    two = serving_gpu.cell_targets(processes, dict(ok, requests_per_s=9_000.0, p99_ms=16.5, misrouted=1), bound,
                                   None, {"p99_ms": 10.0}, ort)
    assert two == {"processes_throughput": True, "processes_nothing_lost": False,
                   "processes_p99_vs_one_context": False}  # 16.5 > 10 + 6
    mapped = serving_gpu.Cell("map", "map", 0, 0)
    assert serving_gpu.cell_targets(mapped, {"map_ms": 1.01, "sequential_ms": 1.0}, bound, None, None, ort) == {
        "map_not_slower_than_loop": True}
    assert not serving_gpu.cell_targets(mapped, {"map_ms": 1.05, "sequential_ms": 1.0}, bound, None, None, ort)[
        "map_not_slower_than_loop"]
    noisy = {"map_ms": 1.05, "sequential_ms": 1.0, "sequential_runs_ms": [0.9, 1.0, 1.2]}  # the loop's own spread
    assert serving_gpu.cell_targets(mapped, noisy, bound, None, None, ort)["map_not_slower_than_loop"]
    noisy_map = {"map_ms": 1.05, "sequential_ms": 1.0, "sequential_runs_ms": [0.99, 1.0, 1.01],
                 "map_runs_ms": [1.0, 1.05, 1.12]}  # map's own spread
    assert serving_gpu.cell_targets(mapped, noisy_map, bound, None, None, ort)["map_not_slower_than_loop"]
    steady = dict(noisy_map, map_runs_ms=[1.04, 1.05, 1.06])  # both steady: 5 % slower is slower
    assert not serving_gpu.cell_targets(mapped, steady, bound, None, None, ort)["map_not_slower_than_loop"]
