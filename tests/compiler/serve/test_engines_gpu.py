"""The serving runtime on a GPU: CUDA contexts and their buffer sets, CUDA graphs of ONNX Runtime and torch, copy
streams, and TensorRT engines; each test is marked and skipped with the reason where those are absent."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from compiler.core.manifest import read_manifest
from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec
from compiler.serve import engines as runtime
from compiler.serve.batcher import DynamicBatcher
from compiler.serve.load import engines_from_module, load
from examples import models
from tests.builds import BUCKETS, MODELS, build_directory
from tests.compiler.serve.helpers import (
    call_from_threads,
    conv_relu,
    eager,
    one_context_on_cuda,
    per_position,
)

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
    # each (bucket, sequence length) served has a CUDA graph of its own, captured on first use
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
def test_onnxruntime_cuda_contexts_have_inference_sessions_of_their_own_on_their_streams(tmp_path: Path) -> None:
    """Two contexts never share an InferenceSession (stream, arena, cuDNN handles); concurrent callers get their own
    rows."""
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


@pytest.mark.gpu
@pytest.mark.parametrize("overlapped", [False, True])
@pytest.mark.parametrize("backend", ["torch", pytest.param("onnxruntime", marks=pytest.mark.ort_cuda)])
def test_one_gpu_context_takes_two_batches_in_its_two_buffer_sets(backend: str, overlapped: bool, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The second buffer set of one context: two batches queued before either is waited for, answered out of
    order; threads with host and CUDA feeds at once; ``map`` pipelines on torch's CUDA graphs (with one set it is
    the plain loop). ``overlapped``: every host input goes through its set's copy stream and device staging (large
    inputs only otherwise), and every answer is still the caller's own."""
    from compiler.backends import gpu

    if overlapped:
        monkeypatch.setattr(gpu, "OVERLAPPED_COPY_BYTES", 0)
    with one_context_on_cuda(backend, tmp_path) as engines:
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
    """Without CUDA graphs (a dynamic sequence length), ``start_parts`` hands ONNX Runtime's call to the context's
    launcher thread: two batches of other lengths in flight on one context's two sets, answered in either order;
    threads calling ``engines(x)`` while a batch is in flight there; ``map`` as the plain loop (one context whose
    calls launch every kernel has nothing to overlap); a batcher keeping two in flight; an ONNX Runtime call that
    fails there fails its batch, and the set serves again."""
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
    """On CUDA (its provider faked: the backend makes no InferenceSession before a context), a fixed-shape model with
    a convolution without a bias serves every batch at its largest bucket, so that its CUDA graph is captured and no
    InferenceSession ever changes shape (ONNX Runtime reallocates that convolution's zero bias at every change, a
    cudaFree that waits for the whole device, and two buckets' graphs cannot share one InferenceSession); other
    models keep every bucket: at three buckets it would serve on CUDA without graphs."""
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
    """ONNX Runtime's calls replayed as CUDA graphs, one per bucket captured at load (40 buckets too), each giving
    the eager model's outputs, and a graph that does not write a bucket's outputs fails the check; without graphs
    (not asked for, a dynamic sequence length, or refused by ONNX Runtime) each call launches its kernels from the
    host and still answers right."""
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

    with monkeypatch.context() as patch:  # a capture that fails: an InferenceSession without graph capture, no graphs
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


def test_serving_inference_sessions_do_not_spin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA context's ONNX Runtime InferenceSession gets one intra-op thread that sleeps when idle (threads that spin
    after each CPU node take the cores from the server's threads); ``spinning=False`` reaches ONNX Runtime."""
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
