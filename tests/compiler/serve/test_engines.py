"""The serving runtime on the CPU (ONNX Runtime and eager PyTorch backends); GPU and TensorRT paths marked.

Build directories are made directly (``tests.builds``: TorchScript export + manifest) so that the file stays
fast; ``trtc export`` itself is tested in tests/compiler/frontend/test_export.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import compiler
from compiler.backends.onnxrt import OrtCpuContext
from compiler.backends.tensorrt.runtime import EnginesNotRunnable
from compiler.core.capabilities import tensorrt_version
from compiler.core.errors import FeedError, InputError, TensorRTNotInstalled
from compiler.core.manifest import Manifest, read_manifest, recorded_tf32, settings_from_dict
from compiler.core.onnx_io import ort_session
from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec
from compiler.serve import engines as runtime
from compiler.serve.batcher import DynamicBatcher
from compiler.serve.load import engines_from_module, load
from examples import models
from tests.builds import BUCKETS, MODELS, build_directory
from tests.manifests import write_manifest_json
from tests.project import ROOT


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runtime")
    return {name: build_directory(root / name, name) for name in MODELS}


@pytest.fixture(scope="module")
def mlp_engines(dirs: dict[str, Path]) -> Iterator[runtime.Engines]:
    with load(dirs["mlp"], backend="onnxruntime", device="cpu") as engines:
        yield engines


def eager(name: str, feed: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        return MODELS[name][0]()(*[torch.from_numpy(v) for v in feed.values()]).numpy()


@pytest.fixture
def buckets_run(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(bucket, rows) of every chunk the CPU contexts run."""
    seen: list[tuple[int, int]] = []
    original = OrtCpuContext.run

    def spy(self: Any, bucket: int, call: Any, start: int, stop: int, host: bool) -> None:
        seen.append((bucket, stop - start))
        original(self, bucket, call, start, stop, host)

    monkeypatch.setattr(OrtCpuContext, "run", spy)
    return seen


# --- routing and results ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("batch", "chunks"), [(1, [(1, 1)]), (3, [(4, 3)]), (4, [(4, 4)]),
                                               (17, [(16, 16), (1, 1)]), (40, [(16, 16), (16, 16), (8, 8)])])
def test_batches_route_to_the_smallest_bucket_and_match_the_exact_batch(
        mlp_engines: runtime.Engines, dirs: dict[str, Path], buckets_run: list[tuple[int, int]], batch: int,
        chunks: list[tuple[int, int]]) -> None:
    x = np.random.default_rng(batch).standard_normal((batch, 64)).astype(np.float32)
    got = mlp_engines(x)
    assert buckets_run == chunks
    want = ort_session(dirs["mlp"] / "model.onnx").run(None, {"x": x})[0]  # the ONNX at the exact batch
    assert got.shape == (batch, 10) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, eager("mlp", {"x": x}), rtol=1e-4, atol=1e-5)


def test_numpy_in_numpy_out_torch_in_torch_out(mlp_engines: runtime.Engines) -> None:
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    out = mlp_engines(x)
    assert type(out) is np.ndarray
    as_torch = mlp_engines(torch.from_numpy(x))
    assert isinstance(as_torch, torch.Tensor) and as_torch.dtype == torch.float32 and as_torch.device.type == "cpu"
    np.testing.assert_array_equal(as_torch.numpy(), out)
    named = mlp_engines({"x": x})
    assert list(named) == ["out"] and type(named["out"]) is np.ndarray
    # results are the caller's: the next call does not overwrite them
    before = out.copy()
    mlp_engines(x * 2)
    np.testing.assert_array_equal(out, before)


def test_cpu_tensors_that_need_grad_or_are_views_or_subclasses_run_like_plain_ones(
        mlp_engines: runtime.Engines) -> None:
    """The one-call fast path for plain tensors hands these to the full checks; the results must not differ."""
    x = np.random.default_rng(4).standard_normal((3, 128)).astype(np.float32)
    expected = mlp_engines(np.ascontiguousarray(x[:, ::2]))
    for tensor in (torch.from_numpy(x[:, ::2].copy()).requires_grad_(), torch.from_numpy(x)[:, ::2],
                   torch.nn.Parameter(torch.from_numpy(x[:, ::2].copy()))):
        got = mlp_engines(tensor)
        assert type(got) is torch.Tensor and not got.requires_grad
        np.testing.assert_array_equal(got.numpy(), expected)
    with pytest.raises(FeedError, match=r"shape \(3, 128\)"):
        mlp_engines(torch.from_numpy(x))


def test_a_buffer_set_of_the_engines_is_a_runner(mlp_engines: runtime.Engines, dirs: dict[str, Path]) -> None:
    """``Engines.runner()`` runs the serving path as a ``Runner`` (what bench times): it holds one buffer set from
    activate to release, checks the feed as ``engines(x)`` does, and matches ONNX Runtime's own run of the ONNX."""
    from compiler.backends.base import Runner
    from compiler.backends.onnxrt import OnnxRuntimeRunner
    from compiler.frontend.verify import compare_outputs

    feed = {"x": np.random.default_rng(8).standard_normal((5, 64)).astype(np.float32)}
    path = read_manifest(dirs["mlp"]).onnx_for(dirs["mlp"])
    with mlp_engines.runner() as runner, OnnxRuntimeRunner(path, ["CPUExecutionProvider"]) as reference:
        assert isinstance(runner, Runner) and runner.name == "onnxruntime" and runner.input_names == ["x"]
        assert mlp_engines._idle.qsize() == mlp_engines.buffer_sets - 1  # the set is the runner's until release
        assert compare_outputs(runner.infer(feed), reference.infer(feed), 5).max_abs < 1e-5
        with pytest.raises(FeedError, match=r"shape \(5, 63\)"):
            runner.infer({"x": feed["x"][:, :63]})
    assert mlp_engines._idle.qsize() == mlp_engines.buffer_sets


def test_two_inputs_match_eager(dirs: dict[str, Path]) -> None:
    rng = np.random.default_rng(1)
    feed = {"image": rng.standard_normal((5, 3, 32, 32)).astype(np.float32),
            "features": rng.standard_normal((5, 16)).astype(np.float32)}
    with load(dirs["two_input"], backend="onnxruntime") as engines:
        got = engines(feed)
    assert list(got) == ["out"]
    np.testing.assert_allclose(got["out"], eager("two_input", feed), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("batch", "length"), [(3, 7), (17, 16), (2, 32)])
def test_dynamic_sequence_length(dirs: dict[str, Path], batch: int, length: int) -> None:
    rng = np.random.default_rng(length)
    feed = {"input_ids": rng.integers(0, 100, (batch, length)).astype(np.int64),
            "attention_mask": np.ones((batch, length), np.int64)}
    feed["attention_mask"][0, length // 2:] = 0
    with load(dirs["transformer_encoder"], backend="onnxruntime") as engines:
        got = engines(feed)["out"]
    assert got.shape == (batch, length, 64)
    np.testing.assert_allclose(got, eager("transformer_encoder", feed), rtol=1e-4, atol=2e-4)


def test_torch_backend_runs_the_source_model(dirs: dict[str, Path], mlp_engines: runtime.Engines) -> None:
    x = np.random.default_rng(2).standard_normal((6, 64)).astype(np.float32)
    with load(dirs["mlp"], backend="torch", device="cpu") as engines:
        assert engines.backend == "torch" and engines.output_names == ["out"]
        np.testing.assert_allclose(engines(x), mlp_engines(x), rtol=1e-4, atol=1e-5)


def test_engines_from_module_with_a_dynamic_dimension() -> None:
    engines = engines_from_module(models.transformer_encoder(), ["input_ids:BxS:int64", "attention_mask:BxS:int64"],
                                  buckets=[2, 4], dims={"S": "1:8:16"}, device="cpu")
    feed = {"input_ids": np.arange(5 * 9, dtype=np.int64).reshape(5, 9) % 100, "attention_mask": np.ones((5, 9),
                                                                                                        np.int64)}
    got = engines(feed)
    np.testing.assert_allclose(got["output_0"], eager("transformer_encoder", feed), rtol=1e-4, atol=1e-4)
    engines.close()


# --- checks of the feed -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("feed", "needles"), [
    (lambda: np.zeros((2, 64), np.float64), ("dtype float64", "float32", "astype")),
    (lambda: torch.zeros(2, 64, dtype=torch.float16), ("torch.float16", "torch.float32")),
    (lambda: np.zeros((2, 63), np.float32), ("(2, 63)", "Bx64", "dimension 1 must be 64")),
    (lambda: np.zeros((2, 8, 8), np.float32), ("rank 2",)),
    (lambda: np.zeros((0, 64), np.float32), ("empty",)),
    (lambda: {"y": np.zeros((2, 64), np.float32)}, ("missing ['x']", "unknown ['y']")),
    (lambda: [[0.0] * 64], ("list", "numpy array or a torch tensor")),
])
def test_bad_feeds_raise_a_clear_value_error(mlp_engines: runtime.Engines, feed: Callable[[], Any],
                                             needles: tuple[str, ...]) -> None:
    with pytest.raises(ValueError) as err:
        mlp_engines(feed())
    assert isinstance(err.value, FeedError)
    for needle in needles:
        assert needle in str(err.value)


def test_feed_checks_across_inputs(dirs: dict[str, Path]) -> None:
    rng = np.random.default_rng(3)
    image = rng.standard_normal((4, 3, 32, 32)).astype(np.float32)
    with load(dirs["two_input"], backend="onnxruntime") as engines:
        with pytest.raises(FeedError, match=r"missing \['features'\]"):
            engines({"image": image})
        with pytest.raises(FeedError, match="pass a dict"):
            engines(image)
        with pytest.raises(FeedError, match="batch 3, another input batch 4"):
            engines({"image": image, "features": np.zeros((3, 16), np.float32)})
        with pytest.raises(FeedError, match="all inputs as numpy arrays"):
            engines({"image": image, "features": torch.zeros(4, 16)})
    ids = np.zeros((2, 40), np.int64)
    with load(dirs["transformer_encoder"], backend="onnxruntime") as engines:
        with pytest.raises(FeedError, match=r"S = 40 is outside the range 1\.\.32"):
            engines({"input_ids": ids, "attention_mask": ids})
        with pytest.raises(FeedError, match="S = 7, another input S = 20"):
            engines({"input_ids": ids[:, :20], "attention_mask": np.zeros((2, 7), np.int64)})


# --- concurrency and pipelining -----------------------------------------------------------------------------------

def call_from_threads(engines: Any, inputs: list[np.ndarray], got: list[Any], count: int, timeout: float) -> None:
    """``got[i] = engines(inputs[i])`` from ``count`` threads at once, each taking every count-th input."""

    def work(start: int) -> None:
        for i in range(start, len(inputs), count):
            got[i] = engines(inputs[i])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a call did not return: the context pool deadlocked"


def test_threads_share_engines_through_the_context_pool(mlp_engines: runtime.Engines) -> None:
    rng = np.random.default_rng(4)
    inputs = [rng.standard_normal((int(rng.integers(1, 20)), 64)).astype(np.float32) for _ in range(64)]
    want = [mlp_engines(x) for x in inputs]
    got: list[Any] = [None] * len(inputs)

    call_from_threads(mlp_engines, inputs, got, 8, timeout=30)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert len(mlp_engines._contexts) <= 2
    assert not mlp_engines.starts_at_once  # on the CPU ``start_parts`` computes the batch


def test_map_yields_postprocessed_results_in_order(mlp_engines: runtime.Engines) -> None:
    rng = np.random.default_rng(5)
    batches = [rng.standard_normal((n, 64)).astype(np.float32) for n in (1, 3, 16, 5, 40, 2)]
    want = [mlp_engines(x) for x in batches]
    tops = list(mlp_engines.map(iter(batches), postprocess=lambda out: out.argmax(axis=1)))
    assert [t.tolist() for t in tops] == [w.argmax(axis=1).tolist() for w in want]
    # a postprocess that returns the buffer itself gets a copy: results stay distinct
    same = list(mlp_engines.map(batches, postprocess=lambda out: out))
    plain = list(mlp_engines.map(batches))
    for a, b, w in zip(same, plain, want):
        np.testing.assert_array_equal(a, w)
        np.testing.assert_array_equal(b, w)
    as_torch = list(mlp_engines.map([torch.from_numpy(b) for b in batches[:2]], postprocess=lambda o: o * 1))
    assert all(isinstance(t, torch.Tensor) for t in as_torch)


def test_map_overlaps_compute_with_postprocess(mlp_engines: runtime.Engines) -> None:
    """The next batch is submitted while the previous one is post-processed (CPU: in a second thread)."""
    started: list[int] = []
    release = threading.Event()
    batches = [np.full((2, 64), i, np.float32) for i in range(3)]

    def feed() -> Iterator[np.ndarray]:
        for i, b in enumerate(batches):
            started.append(i)
            yield b

    def post(out: np.ndarray) -> float:
        if len(started) < 2:  # batch 1 must get submitted while batch 0 is still being post-processed
            release.wait(timeout=5)
        return float(out.sum())

    def watch() -> None:
        while len(started) < 2:
            threading.Event().wait(0.001)
        release.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    results = list(mlp_engines.map(feed(), postprocess=post))
    watcher.join(timeout=5)
    assert release.is_set() and len(results) == 3


def test_map_stops_cleanly_and_reports_errors_in_order(mlp_engines: runtime.Engines) -> None:
    good = np.zeros((2, 64), np.float32)
    for _ in mlp_engines.map([good] * 10):
        break  # leaving early gives every context back
    results = []
    with pytest.raises(FeedError, match="dtype float64"):
        for out in mlp_engines.map([good, good, good.astype(np.float64), good]):
            results.append(out)
    assert len(results) == 2
    threads = [threading.Thread(target=mlp_engines, args=(good,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "a context leaked: callers block"


@pytest.mark.slow
def test_a_map_left_early_ends_its_thread_and_the_process_exits_cleanly(dirs: dict[str, Path]) -> None:
    """Left early, ``map`` waits for its submitting thread's last run: a process that exited while that thread ran
    inside torch aborted ("terminate called without an active exception", exit code 134). The thread's end is the
    guard; the exit codes depend on timing (without the wait, 5 of 5 runs aborted on the 2-core dev machine, while a
    reviewer's 10 of 10 did not)."""
    def submitters() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "trtc-map-submit"]

    with load(dirs["mlp"], backend="torch", device="cpu") as engines:
        for _ in engines.map([np.zeros((16, 64), np.float32)] * 100):
            break
        assert not submitters()
        for batches in ([np.zeros((4, 64), np.float32)] * 100, [np.zeros((16 * 20000, 64), np.float32)] * 3):
            mapped = engines.map(batches)  # a submitter blocked for a free set; one inside a batch of 20,000 chunks
            next(mapped)
            time.sleep(0.3)
            start = time.monotonic()
            mapped.close()
            assert time.monotonic() - start < 0.5 and not submitters()
    code = ("import sys, numpy as np, compiler\n"
            "engines = compiler.load(sys.argv[1], backend='torch', device='cpu')\n"
            "for _ in engines.map([np.zeros((16, 64), np.float32)] * 100):\n"
            "    break\n")
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", code, str(dirs["mlp"])], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-500:]


def test_map_is_the_loop_on_one_context_that_launches_its_kernels_and_pipelines_on_launchers_of_two() -> None:
    """``map`` on GPU contexts whose runs launch every kernel from the host (ONNX Runtime without CUDA graphs): with
    one context it is the plain loop (a second batch could only wait behind the first's launch: the CPU model ran
    the pipeline at 0.96-0.98x the loop, the H200 at 0.85-0.88x), with two whose ``start`` hands the run to a
    launcher thread of each context it hands batches to both launchers, so their launches overlap; every answer is
    its batch's. Taken on the CPU model of the GPU path (``benchmarks/gpu_model.py``)."""
    from benchmarks.gpu_model import Timing, model_engines, reference

    timing = dataclasses.replace(Timing.resnet50_ort(), launch_ms=0.5, gpu_ms=0.1, gpu_ms_per_row=0.0)
    xs = [np.random.default_rng(i).standard_normal((i + 1, 3, 8, 8)).astype(np.float32) for i in range(12)]
    for contexts, mode in ((1, "loop"), (2, "start")):
        with model_engines(timing, contexts, (1, 4, 16), (3, 8, 8)) as engines:
            assert engines.launches_on_host and engines._map_mode() == mode
            for got, x in zip(engines.map(xs), xs, strict=True):
                np.testing.assert_allclose(got, reference(x))
    with model_engines(dataclasses.replace(timing, launcher=False), 2, (1, 4, 16), (3, 8, 8)) as engines:
        assert not engines.launches_on_host and engines._map_mode() == "run"  # graphs: a thread queues each run


def test_every_context_is_created_at_load(dirs: dict[str, Path]) -> None:
    """Allocation (and, on a GPU, graph capture) never lands on a request: the pool is full after load."""
    with load(dirs["mlp"], backend="onnxruntime", device="cpu", contexts=3) as engines:
        assert len(engines._contexts) == 3 and len({id(c) for c in engines._contexts}) == 3


def test_map_runs_the_plain_loop_where_it_cannot_overlap(dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                         ) -> None:
    """A context that holds the host while it computes (eager torch on a GPU) gains nothing from a pipeline thread."""
    started: list[str] = []
    real_thread = threading.Thread

    def recording_thread(*args: Any, **kwargs: Any) -> threading.Thread:
        started.append(str(kwargs.get("name")))
        return real_thread(*args, **kwargs)

    monkeypatch.setattr(runtime.threading, "Thread", recording_thread)
    rng = np.random.default_rng(9)
    batches = [rng.standard_normal((n, 64)).astype(np.float32) for n in (1, 5, 16, 40)]
    with load(dirs["mlp"], backend="onnxruntime", device="cpu") as engines:
        want = [engines(b) for b in batches]
        assert [r.tolist() for r in engines.map(batches)] == [w.tolist() for w in want]
        assert started == ["trtc-map-submit"]  # this context overlaps: the pipeline
        for context in engines._contexts:
            context.overlaps = False  # type: ignore[misc]
        got = list(engines.map(batches, postprocess=lambda o: o.argmax(axis=1)))
        assert [g.tolist() for g in got] == [w.argmax(axis=1).tolist() for w in want]
        assert started == ["trtc-map-submit"]  # no second pipeline thread: the plain loop ran
    with load(dirs["mlp"], backend="onnxruntime", device="cpu", contexts=1) as engines:
        engines._contexts[0].on_gpu = True  # type: ignore[misc]
        assert [r.tolist() for r in engines.map(batches)] == [w.tolist() for w in want]
        assert started == ["trtc-map-submit"]  # a GPU with one buffer set: the plain loop
    with load(dirs["mlp"], backend="onnxruntime", device="cpu", contexts=2) as engines:
        for context in engines._contexts:
            context.on_gpu = True  # type: ignore[misc]
        assert [r.tolist() for r in engines.map(batches)] == [w.tolist() for w in want]
        assert started == ["trtc-map-submit"] * 2  # two: the pipeline


def test_a_context_runs_in_stages_as_bench_times_it(dirs: dict[str, Path]) -> None:
    """upload, compute, download on a borrowed context give what engines(x) gives (what trtc bench times)."""
    feed = ModelSpec((parse_input_spec("x:Bx64"),)).example_feed(3, seed=2)
    with load(dirs["mlp"], backend="onnxruntime", device="cpu") as engines:
        call = engines.check(feed["x"])
        bucket = engines.bucket_for(call.rows)
        assert bucket == 4 and engines.bucket_for(100) == 16
        with engines.borrow() as context:
            context.upload(bucket, call, 0, call.rows)
            context.compute(bucket, call)
            context.download(True)
            context.wait()
            staged = context.copy_outputs()["out"]
        np.testing.assert_array_equal(staged, engines(feed["x"]))


def test_onnxruntime_tf32_follows_the_manifest_or_the_argument(tmp_path: Path) -> None:
    directory = build_directory(tmp_path / "m", "mlp", build={"tf32": False})
    with load(directory, backend="onnxruntime", device="cpu") as engines:
        backend = engines._backend
        assert backend.tf32 is False and backend.cuda_options["use_tf32"] == "0"  # type: ignore[attr-defined]
    with load(directory, backend="onnxruntime", device="cpu", tf32=True) as engines:
        assert engines._backend.cuda_options["use_tf32"] == "1"  # type: ignore[attr-defined]
    assert recorded_tf32(None) is True and recorded_tf32({"tf32": False}) is False


def test_serving_and_rebuild_read_a_build_without_tf32_alike() -> None:
    """A build section of an older trtc (no ``tf32``) was built with TF32 off: ``trtc rebuild`` and the serving
    backends both read it so; no build section at all (nothing built) takes the default."""
    from compiler.core import defaults

    older = {"buckets": [1, 4], "precision": "fp32", "engine": "tensorrt"}
    assert settings_from_dict(older).tf32 is False and recorded_tf32(older) is False
    assert Manifest.from_json({"build": older}).tf32 is False
    assert recorded_tf32(None) is defaults.TF32 and Manifest().tf32 is defaults.TF32


# --- backends and loading -----------------------------------------------------------------------------------------

def test_auto_backend_falls_back_to_onnx_runtime_and_says_so_once(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    if tensorrt_version() is not None:
        pytest.skip("TensorRT is installed here: auto picks it")
    directory = build_directory(tmp_path / "m", "mlp")
    with caplog.at_level(logging.INFO, logger="compiler.serve.engines"):
        for _ in range(2):
            with load(directory) as engines:
                assert engines.backend == "onnxruntime"
                engines(np.zeros((1, 64), np.float32))
    notes = [r for r in caplog.records if "TensorRT is not installed" in r.getMessage()]
    assert len(notes) == 1 and "ONNX Runtime" in notes[0].getMessage()


def _with_engines(tmp_path: Path) -> Path:
    directory = build_directory(tmp_path / "m", "mlp", buckets=[1, 4])
    (directory / "engines").mkdir()
    (directory / "engines" / "b1.engine").write_bytes(b"not an engine")
    engines = [{"bucket": b, "file": f"engines/b{b}.engine", "sha256": "0" * 64,
                "shapes": {"x": {"min": [b, 64], "opt": [b, 64], "max": [b, 64]}}} for b in (1, 4)]
    data = json.loads((directory / "manifest.json").read_text())
    data.update(engines=engines, environment={"tensorrt": "10.13.0.35", "compute_capability": "9.0"})
    write_manifest_json(directory / "manifest.json", data)
    return directory


def test_tensorrt_backend_without_tensorrt_names_the_fix(tmp_path: Path) -> None:
    if tensorrt_version() is not None:
        pytest.skip("TensorRT is installed here")
    directory = _with_engines(tmp_path)
    with pytest.raises(TensorRTNotInstalled, match="TensorRT is not installed") as err:
        load(directory, backend="tensorrt")
    assert f"trtc rebuild {directory}" in str(err.value)


def test_stale_or_missing_engines_name_trtc_rebuild(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the installation check passed, the `trtc check` rules decide: here the files do not match."""
    import compiler.backends.tensorrt.runtime

    directory = _with_engines(tmp_path)
    monkeypatch.setattr(compiler.backends.tensorrt.runtime, "require_tensorrt", lambda directory=None: "10.13.0.35")
    with pytest.raises(EnginesNotRunnable) as err:
        load(directory, backend="tensorrt")
    message = str(err.value)
    assert f"trtc rebuild {directory}" in message
    assert "bucket 4 (engines/b4.engine): engine file missing" in message
    assert "bucket 1 (engines/b1.engine): engine file differs" in message
    bare = build_directory(tmp_path / "bare", "mlp", engines=[], engines_note="not built: TensorRT is not installed")
    with pytest.raises(EnginesNotRunnable, match=r"no TensorRT engines .*`trtc rebuild"):
        load(bare, backend="tensorrt")


def test_bad_arguments(dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(InputError, match="backend='tensorflow'"):
        load(dirs["mlp"], backend="tensorflow")
    with pytest.raises(InputError, match=r"no manifest\.json"):
        load(tmp_path)
    with pytest.raises(InputError, match="contexts=0"):
        load(dirs["mlp"], backend="onnxruntime", contexts=0)


def test_compiler_load_is_reexported_lazily() -> None:
    assert compiler.load is load
    code = ("import sys, compiler; assert 'compiler.serve.engines' not in sys.modules; "
            "assert 'torch' not in sys.modules and 'onnxruntime' not in sys.modules; print(compiler.__all__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "load" in done.stdout


def test_onnxruntime_launcher_handoffs_run_in_order_and_hand_each_set_its_own_error() -> None:
    """The launcher thread of an ONNX Runtime CUDA context without graphs (``_Handoff``, one per buffer set, one
    thread shared): jobs run in the order handed; a set's error reaches its own ``wait`` only and the set serves
    again; ``settle`` waits for a job whose caller is gone and drops its error; once the thread takes no new work
    (the interpreter shutting down) a job runs on the caller's thread."""
    from concurrent.futures import ThreadPoolExecutor

    from compiler.backends.onnxrt import _Handoff

    launcher = ThreadPoolExecutor(1)
    first, second = _Handoff(launcher), _Handoff(launcher)
    gate = threading.Event()
    ran: list[tuple[str, str]] = []

    def job(name: str, fail: bool = False) -> Callable[[], None]:
        def run() -> None:
            if name == "a":
                assert gate.wait(10)
            ran.append((name, threading.current_thread().name))
            if fail:
                raise RuntimeError(f"{name} failed")
        return run

    first.give(job("a"))
    second.give(job("b", fail=True))
    assert not first.done() and not second.done()
    gate.set()
    with pytest.raises(RuntimeError, match="b failed"):
        second.wait()
    first.wait()
    assert [name for name, _ in ran] == ["a", "b"] and first.done() and second.done()
    second.give(job("c"))
    second.wait()  # the error was b's, given once
    first.give(job("d", fail=True))
    first.settle()  # nobody waits for d: its error is dropped
    first.wait()
    assert first.done() and [name for name, _ in ran][-2:] == ["c", "d"]
    first.give(job("x", fail=True))  # failed, and never waited for
    launcher.shutdown(wait=True)
    first.give(job("e"))
    assert ran[-1] == ("e", threading.current_thread().name) and first.done()
    first.wait()  # e ran on this thread: x's error is not e's


# --- GPU and TensorRT (skipped where absent) ----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_torch_backend_on_cuda(graphs: bool) -> None:
    module = models.mlp()
    engines = engines_from_module(module, ["x:Bx64"], buckets=BUCKETS, device="cuda", cuda_graphs=graphs)
    ctx = engines._contexts[0]
    assert bool(getattr(ctx, "_graphs", None)) == graphs
    assert engines.starts_at_once == graphs  # without graphs ``start_parts`` launches every kernel itself
    x = np.random.default_rng(6).standard_normal((23, 64)).astype(np.float32)
    want = eager("mlp", {"x": x})
    np.testing.assert_allclose(engines(x), want, rtol=1e-3, atol=1e-4)  # numpy through pinned buffers
    on_gpu = engines(torch.from_numpy(x).cuda())
    assert on_gpu.device.type == "cuda"
    np.testing.assert_allclose(on_gpu.cpu().numpy(), want, rtol=1e-3, atol=1e-4)
    batches = [x[:3], x[3:19], x[19:]]
    tops = list(engines.map(batches, postprocess=lambda out: out.argmax(axis=1)))
    assert np.concatenate(tops).tolist() == want.argmax(axis=1).tolist()
    on_device = list(engines.map([torch.from_numpy(b).cuda() for b in batches], postprocess=lambda o: o))
    np.testing.assert_allclose(torch.cat(on_device).cpu().numpy(), want, rtol=1e-3, atol=1e-4)
    engines.close()


@pytest.mark.gpu
def test_torch_backend_on_cuda_with_a_dynamic_dimension() -> None:
    engines = engines_from_module(models.transformer_encoder(), ["input_ids:BxS:int64", "attention_mask:BxS:int64"],
                                  buckets=[1, 4], dims={"S": "1:8:16"}, device="cuda")
    for length in (5, 16):
        feed = {"input_ids": np.arange(6 * length, dtype=np.int64).reshape(6, length) % 100,
                "attention_mask": np.ones((6, length), np.int64)}
        np.testing.assert_allclose(engines(feed)["output_0"], eager("transformer_encoder", feed), rtol=1e-3,
                                   atol=1e-3)
    # each (bucket, sequence length) that ran got a CUDA graph of its own, captured on first use
    graphs = {key for context in engines._contexts for key, g in context._graphs.items() if g is not None}
    assert {(4, (5,)), (4, (16,))} <= graphs, graphs
    engines.close()


@pytest.mark.tensorrt
def test_tensorrt_engines_match_onnx_runtime(tmp_path: Path) -> None:
    from compiler.core.settings import BuildSettings, ExportSettings, ModelSource
    from compiler.pipeline.build import build_directory as trtc_build

    spec = ModelSpec((parse_input_spec("x:Bx64"),))
    out = tmp_path / "trt"
    trtc_build(ExportSettings(ModelSource(factory="examples.models:mlp"), out, spec, (1, 4, 8)), None,
               BuildSettings(buckets=(1, 4, 8)))
    x = np.random.default_rng(7).standard_normal((11, 64)).astype(np.float32)
    with load(out, backend="tensorrt") as engines, load(out, backend="onnxruntime", device="cpu") as reference:
        assert engines.backend == "tensorrt" and engines.device.startswith("cuda")
        np.testing.assert_allclose(engines(x), reference(x), rtol=1e-3, atol=1e-4)
        on_gpu = engines(torch.from_numpy(x).cuda())
        np.testing.assert_allclose(on_gpu.cpu().numpy(), reference(x), rtol=1e-3, atol=1e-4)
        results = list(engines.map([x[:4], x[4:]], postprocess=lambda o: o.sum(axis=1)))
        np.testing.assert_allclose(np.concatenate(results), reference(x).sum(axis=1), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.ort_cuda
@pytest.mark.parametrize("name", ["mlp", "transformer_encoder"])
def test_onnxruntime_cuda_backend(name: str, tmp_path: Path) -> None:
    directory = build_directory(tmp_path / name, name)
    engines = load(directory, backend="onnxruntime", device="cuda")
    assert str(engines.device).startswith("cuda")
    _, inputs, dims = MODELS[name]
    spec = ModelSpec(tuple(parse_input_spec(i) for i in inputs), dict(parse_dim_range(f"{k}={v}") for k, v in
                                                                      dims.items()))
    for batch in (3, 17):  # padded into bucket 4; chunked past 16
        feed = spec.example_feed(batch, seed=batch)
        want = eager(name, feed)
        got = engines(feed if len(feed) > 1 else feed[spec.input_names[0]])
        got = got["out"] if isinstance(got, dict) else got
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
        on_gpu = engines({k: torch.from_numpy(v).cuda() for k, v in feed.items()})
        assert on_gpu["out"].device.type == "cuda"
        np.testing.assert_allclose(on_gpu["out"].cpu().numpy(), want, rtol=1e-3, atol=1e-3)
    engines.close()


@pytest.mark.gpu
@pytest.mark.ort_cuda
def test_onnxruntime_cuda_contexts_have_sessions_of_their_own_on_their_streams(tmp_path: Path) -> None:
    """Two contexts never share a session (stream, arena, cuDNN handles); concurrent callers get their own rows."""
    directory = build_directory(tmp_path / "mlp", "mlp")
    with load(directory, backend="onnxruntime", device="cuda", contexts=2) as engines:
        first, second = engines._contexts
        assert first._session is not second._session  # type: ignore[attr-defined]
        assert first._on_our_stream and second._on_our_stream  # type: ignore[attr-defined]
        rng = np.random.default_rng(3)
        inputs = [rng.standard_normal((int(rng.integers(1, 17)), 64)).astype(np.float32) for _ in range(40)]
        want = [eager("mlp", {"x": x}) for x in inputs]
        got: list[Any] = [None] * len(inputs)
        call_from_threads(engines, inputs, got, 4, timeout=60)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)


def _one_context_on_cuda(backend: str, tmp_path: Path) -> runtime.Engines:
    if backend == "torch":
        return engines_from_module(models.mlp(), ["x:Bx64"], buckets=BUCKETS, device="cuda", contexts=1)
    return load(build_directory(tmp_path / "mlp", "mlp"), backend="onnxruntime", device="cuda", contexts=1)


@pytest.mark.gpu
@pytest.mark.parametrize("overlapped", [False, True])
@pytest.mark.parametrize("backend", ["torch", pytest.param("onnxruntime", marks=pytest.mark.ort_cuda)])
def test_one_gpu_context_takes_two_batches_in_its_two_buffer_sets(backend: str, overlapped: bool, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The second buffer set of one context: two batches queued before either is waited for, answered out of
    order; threads with host and CUDA feeds at once; ``map`` pipelines on torch's CUDA graphs (it ran the plain loop
    with one set). ``overlapped``: every host input goes through its set's copy stream and device staging (large
    inputs only otherwise), and every answer is still the caller's own."""
    from compiler.backends import gpu

    if overlapped:
        monkeypatch.setattr(gpu, "OVERLAPPED_COPY_BYTES", 0)
    with _one_context_on_cuda(backend, tmp_path) as engines:
        assert (engines.contexts, engines.buffer_sets) == (1, 2)
        sets: list[Any] = [engines._acquire() for _ in range(2)]
        for s in sets:
            engines._release(s)
        assert all(bool(s._device_stage) == overlapped for s in sets)  # the mlp's inputs are small
        assert len({id(s._copy_stream) for s in sets}) == (2 if overlapped else 1)  # else the context's stream
        assert not engines.launches_on_host and engines._map_mode() == "run"  # both replay CUDA graphs
        rng = np.random.default_rng(11)
        a, b = (rng.standard_normal((n, 64)).astype(np.float32) for n in (16, 9))
        name = engines.output_names[0]
        finish_a = engines.start_parts([engines.check(a)])
        try:
            finish_b = engines.start_parts([engines.check(b[:4]), engines.check(b[4:])])
            got_b = finish_b()[name]
            a_ready = finish_a.ready()
        finally:  # a batch left unfinished holds its buffer set, and the engines' close waits for it
            got_a = finish_a()[name]
        np.testing.assert_allclose(got_b, eager("mlp", {"x": b}), rtol=1e-3, atol=1e-3)
        assert a_ready  # queued before b on the one stream
        np.testing.assert_allclose(got_a, eager("mlp", {"x": a}), rtol=1e-3, atol=1e-3)
        inputs = [rng.standard_normal((int(rng.integers(1, 17)), 64)).astype(np.float32) for _ in range(48)]
        feeds: list[Any] = [torch.from_numpy(x).cuda() if i % 3 == 0 else x for i, x in enumerate(inputs)]
        got: list[Any] = [None] * len(feeds)
        call_from_threads(engines, feeds, got, 4, timeout=60)
        for i, (answer, x) in enumerate(zip(got, inputs)):
            answer = answer.cpu().numpy() if i % 3 == 0 else answer
            np.testing.assert_allclose(answer, eager("mlp", {"x": x}), rtol=1e-3, atol=1e-3)  # TF32 on
        sums = list(engines.map(inputs[:12], postprocess=lambda out: out.sum(axis=1)))
        for total, x in zip(sums, inputs[:12]):
            np.testing.assert_allclose(total, eager("mlp", {"x": x}).sum(axis=1), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.ort_cuda
def test_onnxruntime_without_graphs_queues_started_batches_from_a_thread_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CUDA graphs (a dynamic sequence length), ``start_parts`` hands ONNX Runtime's run to the context's
    launcher thread: two batches of other lengths in flight on one context's two sets, answered in either order;
    threads calling ``engines(x)`` while a batch is in flight there; ``map`` as the plain loop (one context whose
    runs launch every kernel has nothing to overlap); a batcher keeping two in flight; a run that fails there fails
    its batch, and the set serves again."""
    monkeypatch.setitem(MODELS, "per_position", (per_position, ["x:BxSx16"], {"S": "1:16:32"}))
    directory = build_directory(tmp_path / "per_position", "per_position")
    rng = np.random.default_rng(5)
    with load(directory, backend="onnxruntime", device="cuda", contexts=1) as engines:
        context = engines._contexts[0]
        assert engines.launches_on_host and engines.starts_at_once
        assert context._launcher is not None  # type: ignore[attr-defined]
        name = engines.output_names[0]  # ``Started`` batches answer with a dict by output name
        a, b = (rng.standard_normal(shape).astype(np.float32) for shape in ((16, 32, 16), (5, 8, 16)))
        finish_a = engines.start_parts([engines.check(a)])
        finish_b = engines.start_parts([engines.check(b[:2]), engines.check(b[2:])])
        assert finish_a is not None and finish_b is not None
        try:  # a batch left unfinished holds its buffer set, and the engines' close waits for it
            got_b = finish_b()[name]
        finally:
            got_a = finish_a()[name]
        np.testing.assert_allclose(got_b, eager("per_position", {"x": b}), rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(got_a, eager("per_position", {"x": a}), rtol=1e-3, atol=1e-3)
        inputs = [rng.standard_normal((int(rng.integers(1, 17)), int(rng.integers(1, 33)), 16)).astype(np.float32)
                  for _ in range(24)]
        got: list[Any] = [None] * len(inputs)
        finish_a = engines.start_parts([engines.check(a)])  # in flight on the launcher while the threads run
        assert finish_a is not None
        try:
            call_from_threads(engines, inputs, got, 3, timeout=60)
        finally:
            got_a = finish_a()[name]
        np.testing.assert_allclose(got_a, eager("per_position", {"x": a}), rtol=1e-3, atol=1e-3)
        for answer, x in zip(got, inputs):
            np.testing.assert_allclose(answer, eager("per_position", {"x": x}), rtol=1e-3, atol=1e-3)
        assert engines._map_mode() == "loop"  # one context launching every kernel: map is the plain loop
        for answer, x in zip(engines.map(inputs), inputs, strict=True):
            np.testing.assert_allclose(answer, eager("per_position", {"x": x}), rtol=1e-3, atol=1e-3)
        with DynamicBatcher(engines, max_wait_ms=2, workers=1, timeout=30) as batcher:  # two in flight
            assert engines.buffer_sets == 2
            batched: list[Any] = [None] * len(inputs)

            def submit(i: int) -> None:
                batched[i] = batcher.submit(inputs[i][:1])

            threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(inputs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
        for answer, x in zip(batched, inputs, strict=True):
            np.testing.assert_allclose(answer, eager("per_position", {"x": x[:1]}), rtol=1e-3, atol=1e-3)
        answers = [engines.start_parts([engines.check(x)]) for x in inputs[:2]]
        results = [finish()[name] for finish in answers if finish is not None]
        for result, x in zip(results, inputs[:2], strict=True):
            np.testing.assert_allclose(result, eager("per_position", {"x": x}), rtol=1e-3, atol=1e-3)

        def fails(*args: Any) -> None:
            raise RuntimeError("CUDA failure 700 (injected)")

        with monkeypatch.context() as patch:
            patch.setattr(type(context), "_compute", fails)  # on every buffer set
            failing = engines.start_parts([engines.check(a)])
            assert failing is not None
            with pytest.raises(RuntimeError, match="injected"):
                failing()
        np.testing.assert_allclose(engines.run_parts([engines.check(a)])[name], eager("per_position", {"x": a}),
                                   rtol=1e-3, atol=1e-3)


def per_position() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))


def conv_relu(bias: bool) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, bias=bias), torch.nn.ReLU())

    return make


@pytest.mark.parametrize("bias", [True, False])
def test_onnxruntime_graphs_only_where_no_run_frees_what_another_buckets_graph_reads(
        bias: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA graphs for ONNX Runtime: models whose only dynamic dimension is the batch, with outputs in our buffers;
    a convolution without a bias (ONNX Runtime reallocates a zero bias per input shape) only with one bucket."""
    from compiler.backends.onnxrt import OrtBackend

    monkeypatch.setitem(MODELS, "conv", (conv_relu(bias), ["x:Bx3x8x8"], {}))
    directory = build_directory(tmp_path / "conv", "conv")
    spec = ModelSpec((parse_input_spec("x:Bx3x8x8"),), {})
    assert OrtBackend(directory / "model.onnx", spec, (1, 4), "cpu", 0).capturable == bias
    assert OrtBackend(directory / "model.onnx", spec, (4,), "cpu", 0).capturable
    assert not OrtBackend(directory / "model.onnx", spec, (4,), "cpu", 0, cuda_graphs=False).capturable
    with load(directory, backend="onnxruntime", device="cpu") as engines:  # the CPU runs it either way
        x = np.random.default_rng(0).standard_normal((3, 3, 8, 8)).astype(np.float32)
        np.testing.assert_allclose(engines(x), eager("conv", {"x": x}), rtol=1e-4, atol=1e-5)
    sequences = ModelSpec((parse_input_spec("x:BxSx16"),), dict([parse_dim_range("S=1:16:32")]))
    monkeypatch.setitem(MODELS, "per_position", (per_position, ["x:BxSx16"], {"S": "1:16:32"}))
    path = build_directory(tmp_path / "per_position", "per_position") / "model.onnx"
    assert not OrtBackend(path, sequences, (1, 4), "cpu", 0).capturable  # a shape per call: no graphs


@pytest.mark.parametrize("bias", [True, False])
def test_onnxruntime_on_cuda_serves_a_model_with_a_bias_less_convolution_at_one_bucket(
        bias: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (its provider faked: the backend makes no session before a context), a fixed-shape model with a
    convolution without a bias serves every batch at its largest bucket, so that its CUDA graph is captured and no
    session ever changes shape (ONNX Runtime reallocates that convolution's zero bias at every change, a cudaFree
    that waits for the whole device, and two buckets' graphs cannot share the session); other models keep every
    bucket. Without this rule such a model ran on CUDA without graphs at three buckets."""
    import compiler.core.capabilities
    from compiler.backends.onnxrt import OrtBackend

    monkeypatch.setattr(compiler.core.capabilities, "ort_providers",
                        lambda prefer=None: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setitem(MODELS, "conv", (conv_relu(bias), ["x:Bx3x8x8"], {}))
    directory = build_directory(tmp_path / "conv", "conv")
    spec = ModelSpec((parse_input_spec("x:Bx3x8x8"),), {})
    backend = OrtBackend(directory / "model.onnx", spec, (1, 4, 16), "cuda", 0)
    assert backend.buckets == ((1, 4, 16) if bias else (16,))
    assert backend.capturable
    assert OrtBackend(directory / "model.onnx", spec, (1, 4, 16), "cpu", 0).buckets == (1, 4, 16)  # the CPU: all


def test_a_convolution_without_a_bias_is_found_in_subgraphs_and_functions() -> None:
    import onnx
    from onnx import TensorProto, helper

    from compiler.backends.onnxrt import _conv_without_bias

    def conv(bias: bool) -> onnx.NodeProto:
        return helper.make_node("Conv", ["x", "w", "b"] if bias else ["x", "w"], ["y"])

    def branch(bias: bool) -> onnx.GraphProto:
        return helper.make_graph([conv(bias)], "branch", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                                None)])

    def model(nodes: list[onnx.NodeProto], functions: tuple[onnx.FunctionProto, ...] = ()) -> onnx.ModelProto:
        return helper.make_model(helper.make_graph(nodes, "g", [], []), functions=list(functions))

    def if_node(bias: bool) -> onnx.NodeProto:
        return helper.make_node("If", ["c"], ["y"], then_branch=branch(bias), else_branch=branch(True))

    def function(inner: onnx.NodeProto) -> onnx.FunctionProto:
        return helper.make_function("local", "f", ["x", "w", "c"], ["y"], [inner], [helper.make_opsetid("", 17)])

    assert _conv_without_bias(model([conv(False)])) and not _conv_without_bias(model([conv(True)]))
    assert _conv_without_bias(model([if_node(False)])) and not _conv_without_bias(model([if_node(True)]))
    assert _conv_without_bias(model([], (function(if_node(False)),)))
    assert not _conv_without_bias(model([], (function(if_node(True)),)))


@pytest.mark.gpu
@pytest.mark.ort_cuda
def test_onnxruntime_cuda_graphs_replay_what_its_runs_compute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX Runtime's runs as CUDA graphs, one per bucket captured at load (40 buckets too), each giving the eager
    model's outputs, and a graph that does not write a bucket's outputs fails the check; without graphs (not asked
    for, a dynamic sequence length, or refused by ONNX Runtime) the run launches its kernels from the host and still
    answers right."""
    rng = np.random.default_rng(5)
    mlp = build_directory(tmp_path / "mlp", "mlp")
    with load(mlp, backend="onnxruntime", device="cuda", contexts=2) as engines:
        for context in engines._contexts:
            assert sorted(context._graphs) == BUCKETS  # type: ignore[attr-defined]
        assert not engines.launches_on_host
        for rows in (1, 3, 16, 21):
            x = rng.standard_normal((rows, 64)).astype(np.float32)
            np.testing.assert_allclose(engines(x), eager("mlp", {"x": x}), rtol=1e-3, atol=1e-3)
        context = engines._contexts[0]
        graph, outputs = context._graphs[4]  # type: ignore[attr-defined]
        with torch.cuda.stream(context.stream):
            graph.replay()
            expected = {name: out.clone() for name, out in outputs.items()}
        assert context._replays(graph, outputs, expected)  # type: ignore[attr-defined]
        other = context._graphs[8][0]  # type: ignore[attr-defined]  # writes bucket 8's outputs, not these
        assert not context._replays(other, outputs, expected)  # type: ignore[attr-defined]
    many = build_directory(tmp_path / "many", "mlp", buckets=list(range(1, 41)))
    with load(many, backend="onnxruntime", device="cuda", contexts=1) as engines:
        assert len(engines._contexts[0]._graphs) == 40 and not engines.launches_on_host  # type: ignore[attr-defined]
        for rows in (1, 7, 33, 40):
            x = rng.standard_normal((rows, 64)).astype(np.float32)
            np.testing.assert_allclose(engines(x), eager("mlp", {"x": x}), rtol=1e-3, atol=1e-3)
    with load(mlp, backend="onnxruntime", device="cuda", contexts=1, cuda_graphs=False) as engines:
        assert engines.launches_on_host and not engines._contexts[0]._graphs  # type: ignore[attr-defined]
        x = rng.standard_normal((5, 64)).astype(np.float32)
        np.testing.assert_allclose(engines(x), eager("mlp", {"x": x}), rtol=1e-3, atol=1e-3)

    monkeypatch.setitem(MODELS, "per_position", (per_position, ["x:BxSx16"], {"S": "1:16:32"}))
    sequences = build_directory(tmp_path / "per_position", "per_position")
    with load(sequences, backend="onnxruntime", device="cuda", contexts=1) as engines:
        assert engines.launches_on_host and not engines._contexts[0]._graphs  # type: ignore[attr-defined]
        for rows, length in ((3, 8), (16, 32), (3, 8)):
            x = rng.standard_normal((rows, length, 16)).astype(np.float32)
            np.testing.assert_allclose(engines(x), eager("per_position", {"x": x}), rtol=1e-3, atol=1e-3)

    import compiler.backends.onnxrt as onnxrt

    with monkeypatch.context() as patch:  # a capture that fails: a session made without graph capture, no graphs
        patch.setattr(onnxrt, "capture_graph", lambda stream, launch, what: None)
        with load(mlp, backend="onnxruntime", device="cuda", contexts=1) as engines:
            context = engines._contexts[0]
            assert engines.launches_on_host and not context._graphs  # type: ignore[attr-defined]
            with pytest.raises(RuntimeError, match="does not have configuration"):
                context._queue_only.get_run_config_entry("gpu_graph_id")  # type: ignore[attr-defined]
            x = rng.standard_normal((6, 64)).astype(np.float32)
            np.testing.assert_allclose(engines(x), eager("mlp", {"x": x}), rtol=1e-3, atol=1e-3)

    import compiler.core.onnx_io as onnx_io

    def refuses_graphs(path: Any, providers: Any, **kwargs: Any) -> Any:
        if any(isinstance(p, tuple) and p[1].get("enable_cuda_graph") == "1" for p in providers):
            raise RuntimeError("all compute graph nodes have not been partitioned to the CUDA EP")
        return session(path, providers, **kwargs)

    session = onnx_io.ort_session
    monkeypatch.setattr(onnx_io, "ort_session", refuses_graphs)
    with load(mlp, backend="onnxruntime", device="cuda", contexts=2) as engines:
        assert engines.launches_on_host and engines._backend.graphs_refused  # type: ignore[attr-defined]
        x = rng.standard_normal((6, 64)).astype(np.float32)
        np.testing.assert_allclose(engines(x), eager("mlp", {"x": x}), rtol=1e-3, atol=1e-3)


def test_serving_sessions_do_not_spin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA context's ONNX Runtime session gets one intra-op thread that sleeps when idle (threads that spin
    after each CPU node took the cores from the server's threads); ``spinning=False`` reaches ONNX Runtime."""
    from compiler.backends.onnxrt import OrtBackend
    from compiler.core import onnx_io
    directory = build_directory(tmp_path / "mlp", "mlp")
    path = read_manifest(directory).onnx_for(directory)
    real = onnx_io.ort_session(path, ["CPUExecutionProvider"], threads=1, spinning=False)
    options = real.get_session_options()
    assert options.intra_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"

    seen: list[dict[str, Any]] = []

    class CudaSession:
        def get_providers(self) -> list[str]:
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    def recording(model: Any, providers: Any = None, **kwargs: Any) -> CudaSession:
        seen.append(kwargs)
        return CudaSession()

    with load(directory, backend="onnxruntime", device="cpu") as engines:
        backend = engines._backend
        assert isinstance(backend, OrtBackend)
        monkeypatch.setattr(onnx_io, "ort_session", recording)
        backend.context_session(None)
        backend.threads = 3
        backend.context_session(None)
    assert [(s["threads"], s["spinning"]) for s in seen] == [(1, False), (3, False)]


@pytest.mark.parametrize("threads", [1, 3])
def test_pack_puts_every_part_at_its_offset(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batcher's pack into pinned staging, split over threads for large batches: exactly ``np.concatenate``,
    also for parts of several rows and for int64 ids into an engine's int32 buffer."""
    from compiler.backends import copies

    monkeypatch.setattr(copies, "PACK_THREADS", threads)
    monkeypatch.setattr(copies, "PACK_GROUP_BYTES", 64)
    rng = np.random.default_rng(0)
    for count in (1, 2, 5, 64):
        parts = [rng.random((int(rng.integers(1, 4)), 3, 5)).astype(np.float32) for _ in range(count)]
        out = np.zeros((sum(len(p) for p in parts), 3, 5), np.float32)
        copies.pack(parts, out)
        np.testing.assert_array_equal(out, np.concatenate(parts))
    ids = [rng.integers(0, 1000, size=(2, 7)) for _ in range(9)]
    out32 = np.zeros((18, 7), np.int32)
    copies.pack(ids, out32)
    np.testing.assert_array_equal(out32, np.concatenate(ids))


@pytest.mark.parametrize("threads", [1, 3])
def test_outputs_are_copied_out_whole_into_arrays_of_the_callers_own(threads: int, mlp_engines: runtime.Engines,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``_copy_out`` splits a large output over the pack threads, in parts of ``_PACK_GROUP_BYTES`` or more: every
    byte lands where ``copy()`` puts it, for sizes that do not divide evenly and other dtypes; a view that is not
    C-contiguous is copied whole by ``copy()``; an answer is the caller's own (the next call does not change it)."""
    from compiler.backends import copies

    monkeypatch.setattr(copies, "PACK_THREADS", threads)
    monkeypatch.setattr(copies, "PACK_GROUP_BYTES", 64)
    pool = copies.pool()
    submitted: list[Any] = []

    class Counting:
        def submit(self, call: Any) -> Any:
            submitted.append(call)
            return pool.submit(call)

    monkeypatch.setattr(copies, "pool", Counting)
    rng = np.random.default_rng(3)
    cases = [rng.random((1, 7)).astype(np.float32),  # 28 bytes: one part
             rng.random((7, 11)).astype(np.float32),  # 308 bytes, 77 values: parts of 25, 26, 26
             rng.random((13, 7)).astype(np.float16),  # 182 bytes: two parts
             rng.random(300) > 0.5,  # bool, 300 bytes
             np.asfortranarray(rng.random((10, 20)).astype(np.float32))]  # 800 bytes, not C-contiguous
    for view in cases:
        before = len(submitted)
        out = copies.copy_out(view)
        np.testing.assert_array_equal(out, view)
        assert out.dtype == view.dtype and out.flags.c_contiguous and not np.shares_memory(out, view)
        parts = min(threads, view.nbytes // 64) if view.flags.c_contiguous else 0
        assert len(submitted) - before == (parts if parts > 1 else 0)
    x, y = (rng.standard_normal((16, 64)).astype(np.float32) for _ in range(2))
    first = mlp_engines(x)
    kept = first.copy()
    second = mlp_engines(y)
    np.testing.assert_array_equal(first, kept)  # the buffers the second call wrote are not the first's answer
    assert not np.allclose(first, second)


def test_the_pack_threads_copy_in_the_callers_thread_where_the_pool_cannot_take_the_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy out called from a pack thread runs there (four such calls at once would otherwise wait for the pool
    they hold); a part's error is raised once every part has ended; once the pool takes no more work (the
    interpreter is shutting down), every part is copied in the caller's thread."""
    from concurrent.futures import ThreadPoolExecutor

    from compiler.backends import copies

    monkeypatch.setattr(copies, "PACK_THREADS", 2)
    monkeypatch.setattr(copies, "PACK_GROUP_BYTES", 64)
    views = [np.arange(100 * (i + 1), dtype=np.float32) for i in range(4)]
    busy = ThreadPoolExecutor(4, initializer=copies.mark_pack_thread)
    monkeypatch.setattr(copies, "pool", lambda: busy)  # the pool itself, all of whose threads copy out
    gate = threading.Barrier(4)  # every thread of the pool busy before any copies

    def copy_out(view: np.ndarray) -> np.ndarray:
        gate.wait(timeout=10)
        return copies.copy_out(view)

    try:
        copied = [busy.submit(copy_out, v) for v in views]
        for copy, view in zip(copied, views, strict=True):
            np.testing.assert_array_equal(copy.result(timeout=10), view)
    finally:  # threads that wait for parts queued behind them are let go: those parts are cancelled
        busy.shutdown(cancel_futures=True)
    ended = threading.Event()

    def slow() -> None:
        time.sleep(0.2)
        ended.set()

    def failing() -> None:
        raise ValueError("a part failed")

    with ThreadPoolExecutor(2) as two:
        monkeypatch.setattr(copies, "pool", lambda: two)
        with pytest.raises(ValueError, match="a part failed"):
            copies.in_parallel([failing, slow])
        assert ended.is_set()  # raised only once every part had ended
    closed = ThreadPoolExecutor(2)
    closed.shutdown()
    monkeypatch.setattr(copies, "pool", lambda: closed)
    out = np.zeros(400, np.float32)
    copies.pack([views[0], views[2][:300]], out)
    np.testing.assert_array_equal(out, np.concatenate([views[0], views[2][:300]]))
    np.testing.assert_array_equal(copies.copy_out(views[3]), views[3])


def test_start_parts_without_waiting_gives_none_while_every_buffer_set_is_taken(mlp_engines: runtime.Engines) -> None:
    x = np.ones((2, 64), np.float32)
    calls = [mlp_engines.check(x)]
    started = [mlp_engines.start_parts(calls) for _ in range(mlp_engines.buffer_sets)]
    assert mlp_engines.start_parts(calls, wait=False) is None
    first = started.pop()
    assert first is not None and first.ready()
    np.testing.assert_allclose(first()["out"], mlp_engines(x), rtol=1e-6)
    again = mlp_engines.start_parts(calls, wait=False)  # the set given back is free again
    assert again is not None
    for finish in [*started, again]:
        assert finish is not None
        finish()
