"""The serving runtime on the CPU (ONNX Runtime and eager PyTorch backends); GPU and TensorRT paths marked.

Build directories are made directly (``tests.builds``: TorchScript export + manifest) so that the file stays
fast; ``trtc export`` itself is tested in tests/compiler/frontend/test_export.py.
"""

from __future__ import annotations

import dataclasses
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

from compiler.core.errors import FeedError
from compiler.core.manifest import Manifest, read_manifest, recorded_tf32, settings_from_dict
from compiler.core.onnx_io import ort_session
from compiler.core.specs import ModelSpec, parse_input_spec
from compiler.serve import engines as runtime
from compiler.serve.load import engines_from_module, load
from examples import models
from tests.builds import build_directory
from tests.compiler.serve.helpers import (
    call_from_threads,
    eager,
)
from tests.project import ROOT

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
    from compiler.backends.onnxrt_runner import OnnxRuntimeRunner
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
