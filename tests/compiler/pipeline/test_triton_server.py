"""A real Triton Inference Server: repository entries written by `trtc export-triton`, loaded and served by it.

One ``tritonserver`` (from the dev extra's nvidia-pytriton wheel, or PATH) runs for the module on free loopback
ports, in explicit model-control mode so that each test loads the entries it wrote and reads their own load
errors; it is started without PYTHONPATH, so a trtc entry imports trtc only through the folders its config
records. The fixture stops it at the end, also when a test fails (``TritonServer.stop``: SIGTERM, then SIGKILL
to its process group). The INT8/FP16 builds and `trtc serve`'s own server are the slow tier. Where no
tritonserver can be had the module is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import compiler
from calibration.accuracy import sample_cosines
from compiler.cli import cli
from compiler.core import defaults
from compiler.core.errors import TrtcError
from compiler.pipeline.check import check_directory
from compiler.pipeline.triton import triton_repository
from compiler.pipeline.tritonserver import TritonNotFound, TritonServer, find_tritonserver, free_port
from compiler.serve.load import load
from compiler.serve.triton_model import verify_build
from tests.builds import build_directory
from tests.compiler.pipeline.test_triton import with_engines

ROOT = Path(__file__).resolve().parents[3]
LARGEST = 16  # the largest bucket of the directories below (1, 4, 8, 16)
TRITON_MISSING_BACKEND = "unable to find backend library for backend '{}'"


def _install() -> Any:
    try:
        return find_tritonserver()
    except TritonNotFound as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    install = _install()
    with TritonServer(tmp_path_factory.mktemp("repository"), explicit=True, install=install) as running:
        yield running
    assert not running.running()


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """fp32: the MLP as `trtc export` leaves it; transformer: a two-input int64 model with a dynamic length."""
    root = tmp_path_factory.mktemp("builds")
    return {"fp32": build_directory(root / "fp32", "mlp"),
            "transformer": build_directory(root / "transformer", "transformer_encoder")}


@pytest.fixture(scope="module")
def reduced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """int8 and fp16: `trtc build` of the MLP (no engines: ONNX Runtime serves the ONNX of the build's precision)."""
    root = tmp_path_factory.mktemp("reduced")
    dirs = {}
    for precision in ("int8", "fp16"):
        out = root / precision
        result = CliRunner().invoke(cli, ["build", "--model-factory", "examples.models:mlp", "--input", "x:Bx64",
                                          f"--{precision}", "--calib-data", "random", "--calib-samples", "64",
                                          "--engine", "none", "--out", str(out), "-q"])
        assert result.exit_code == 0, result.output
        dirs[precision] = out
    return dirs


@pytest.fixture(scope="module")
def mlp(builds: dict[str, Path], server: TritonServer) -> str:
    """The FP32 MLP as a loaded trtc entry, shared by the tests that only send requests to it."""
    return _entry(builds["fp32"], server, "mlp")


def _client(server: TritonServer) -> Any:
    import tritonclient.http as http

    return http.InferenceServerClient(f"{server.host}:{server.http_port}", network_timeout=60.0)


def _load(server: TritonServer, name: str) -> str | None:
    """Load ``name`` from the repository: None when it loaded, else Triton's error message."""
    from tritonclient.utils import InferenceServerException

    client = _client(server)
    try:
        client.load_model(name)
        return None
    except InferenceServerException as err:
        return str(err.message())
    finally:
        client.close()


def _protocol(kind: str) -> Any:
    if kind == "http":
        import tritonclient.http as module
    else:
        import tritonclient.grpc as module
    return module


def infer(server: TritonServer, model: str, feed: dict[str, np.ndarray], kind: str = "http",
          outputs: tuple[str, ...] = ("out",)) -> dict[str, np.ndarray]:
    """One request over HTTP or gRPC; the outputs as numpy arrays."""
    from tritonclient.utils import np_to_triton_dtype

    module = _protocol(kind)
    url = f"{server.host}:{server.http_port if kind == 'http' else server.grpc_port}"
    client = module.InferenceServerClient(url)
    try:
        inputs = []
        for name, array in feed.items():
            tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        result = client.infer(model, inputs, timeout=60) if kind == "grpc" else client.infer(model, inputs)
        return {name: result.as_numpy(name) for name in outputs}
    finally:
        client.close()


def _entry(directory: Path, server: TritonServer, name: str, **options: Any) -> str:
    """``directory`` written as the trtc entry ``name`` and loaded; fails the test with Triton's error otherwise."""
    triton_repository(directory, server.repository, name=name, platform="trtc", force=True, **options)
    error = _load(server, name)
    assert error is None, error
    return name


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_trtc_entry_answers_every_batch_size_as_engines_does_in_fp32(builds: dict[str, Path], server: TritonServer,
                                                                     mlp: str, kind: str) -> None:
    """Proves: a `--platform trtc` entry of an FP32 build, loaded by a real Triton (without PYTHONPATH), answers
    requests of every batch size from 1 to the largest bucket + 1 (which trtc's runtime runs in two parts) over
    `kind` with exactly the arrays `compiler.load(DIR)(x)` returns in this process."""
    name = mlp
    rng = np.random.default_rng(1)
    with load(builds["fp32"]) as engines:
        for batch in range(1, LARGEST + 2):
            x = rng.standard_normal((batch, 64)).astype(np.float32)
            got = infer(server, name, {"x": x}, kind)["out"]
            assert got.shape == (batch, 10) and got.dtype == np.float32
            np.testing.assert_array_equal(got, engines(x), err_msg=f"batch {batch} over {kind}")


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["int8", "fp16"])
def test_trtc_entry_of_int8_and_fp16_builds_is_within_the_gate(reduced: dict[str, Path], server: TritonServer,
                                                               precision: str) -> None:
    """Proves: an INT8 or FP16 build served by Triton through a trtc entry answers batches 1 to the largest bucket
    + 1, over HTTP and gRPC, with outputs whose every sample's cosine to `compiler.load(DIR)(x)` here reaches
    the accuracy gate's floor (defaults.GATE_MIN_COSINE) and whose values are within 1e-3 of it."""
    name = _entry(reduced[precision], server, f"mlp_{precision}")
    rng = np.random.default_rng(2)
    with load(reduced[precision]) as engines:
        for batch in range(1, LARGEST + 2):
            x = rng.standard_normal((batch, 64)).astype(np.float32)
            want = engines(x)
            output = engines.output_names[0]  # the exporter's name, not "out"
            for kind in ("http", "grpc"):
                got = infer(server, name, {"x": x}, kind, (output,))[output]
                assert got.shape == want.shape
                assert sample_cosines(got, want).min() >= defaults.GATE_MIN_COSINE, (batch, kind)
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-3, err_msg=f"batch {batch} over {kind}")


def test_two_int64_inputs_with_a_dynamic_length(builds: dict[str, Path], server: TritonServer) -> None:
    """Proves: a model with two int64 inputs whose second dimension is dynamic (config dims -1) is served by a
    trtc entry at several batch sizes and lengths with exactly `compiler.load(DIR)`'s answers."""
    name = _entry(builds["transformer"], server, "transformer")
    rng = np.random.default_rng(3)
    with load(builds["transformer"]) as engines:
        for batch, length in ((1, 1), (5, 8), (LARGEST + 1, 32)):
            feed = {"input_ids": rng.integers(0, 100, (batch, length)).astype(np.int64),
                    "attention_mask": np.ones((batch, length), np.int64)}
            got = infer(server, name, feed, "grpc")["out"]
            np.testing.assert_array_equal(got, engines(feed)["out"], err_msg=f"batch {batch}, length {length}")


def test_concurrent_clients_are_batched_by_triton(builds: dict[str, Path], server: TritonServer) -> None:
    """Proves: 16 clients sending single-row requests at once are answered correctly (each its own row, within
    1e-5 of `compiler.load(DIR)(x)`: a row may be computed in a batch of another size), and Triton's statistics
    endpoint for the entry (which served nothing else) shows batches of more than one request: its dynamic
    batcher put them together, and fewer executions than requests ran. The entry's preferred batch size is the
    clients' count, so that Triton waits its 20 ms window for company instead of running a lone request at once
    (a preferred size of 1, the default's smallest bucket, left batching to how requests happened to queue)."""
    clients, each = 16, 8
    name = _entry(builds["fp32"], server, "mlp_batched", max_wait_ms=20.0, preferred_batch_sizes=(clients,))
    rows = np.random.default_rng(4).standard_normal((clients * each, 1, 64)).astype(np.float32)

    def client(index: int) -> list[np.ndarray]:
        return [infer(server, name, {"x": rows[index * each + k]})["out"] for k in range(each)]

    with ThreadPoolExecutor(clients) as pool:
        answers = [a for part in pool.map(client, range(clients)) for a in part]
    with load(builds["fp32"]) as engines:
        for row, answer in zip(rows, answers, strict=True):
            np.testing.assert_allclose(answer, engines(row), rtol=1e-5, atol=1e-6)
    stats = _client(server).get_inference_statistics(name)["model_stats"][0]
    sizes = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}
    assert int(stats["inference_count"]) == clients * each
    assert any(size > 1 for size in sizes), sizes
    assert int(stats["execution_count"]) < clients * each


@pytest.mark.parametrize(("input_name", "shape", "dtype", "message"), [
    ("x", (2, 63), np.float32, "unexpected shape for input 'x'"),
    ("x", (2, 64), np.float64, "inference input 'x' data-type is 'FP64', but model 'mlp' expects 'FP32'"),
    ("y", (2, 64), np.float32, "unexpected inference input 'y'"),
    ("x", (LARGEST * 4 + 1, 64), np.float32, "batch-size must be <= 64"),
])
def test_bad_requests_get_tritons_error_and_the_server_keeps_serving(
        builds: dict[str, Path], server: TritonServer, mlp: str, input_name: str, shape: tuple[int, ...], dtype: Any,
        message: str) -> None:
    """Proves: a request with a wrong shape, dtype, input name or too large a batch is refused with Triton's own
    error (from the config trtc wrote), over HTTP and gRPC, and the next good request on the same entry is
    answered correctly."""
    from tritonclient.utils import InferenceServerException

    x = np.zeros((2, 64), np.float32)
    for kind in ("http", "grpc"):
        with pytest.raises(InferenceServerException, match=message.replace("(", r"\(").replace("[", r"\[")):
            infer(server, mlp, {input_name: np.zeros(shape, dtype)}, kind)
        with load(builds["fp32"]) as engines:
            np.testing.assert_array_equal(infer(server, mlp, {"x": x}, kind)["out"], engines(x))


def test_onnxruntime_and_plan_entries_fail_only_for_the_missing_backend(builds: dict[str, Path],
                                                                        server: TritonServer, tmp_path: Path) -> None:
    """Proves: Triton reads the config.pbtxt of the `onnxruntime_onnx` and `tensorrt_plan` entries and their only
    load error is the missing backend library (the wheel's Triton has the Python backend alone), while a config
    with a mistake (a preferred batch size above max_batch_size) fails with another error: so a mistake in
    what trtc writes would fail this test."""
    triton_repository(builds["fp32"], server.repository, name="ort", platform="onnxruntime_onnx", force=True)
    plan = with_engines(builds["fp32"], tmp_path / "plan", ranged=True)
    triton_repository(plan, server.repository, name="plan", platform="tensorrt_plan", force=True)
    errors = {name: _load(server, name) for name in ("ort", "plan")}
    assert errors["ort"] is not None and TRITON_MISSING_BACKEND.format("onnxruntime") in errors["ort"], errors
    assert errors["plan"] is not None and TRITON_MISSING_BACKEND.format("tensorrt") in errors["plan"], errors
    broken = server.repository / "ort_broken"
    triton_repository(builds["fp32"], server.repository, name="ort_broken", platform="onnxruntime_onnx", force=True)
    config = (broken / "config.pbtxt").read_text()
    (broken / "config.pbtxt").write_text(config.replace("preferred_batch_size: [ 1, 4, 8, 16 ]",
                                                        "preferred_batch_size: [ 1, 4, 8, 32 ]"))
    error = _load(server, "ort_broken")
    assert error is not None and "unable to find backend library" not in error, error


def test_a_tampered_build_directory_fails_the_load_naming_the_file(builds: dict[str, Path],
                                                                   server: TritonServer) -> None:
    """Proves: when a file of a trtc entry's build directory no longer matches its manifest's sha256, Triton's load
    of the entry fails with trtc's message naming that file, and the server stays live."""
    folder = triton_repository(builds["fp32"], server.repository, name="tampered", platform="trtc", force=True)
    onnx = folder / "1" / "build" / "model.onnx"
    data = bytearray(onnx.read_bytes())
    data[len(data) // 2] ^= 0xFF
    onnx.write_bytes(bytes(data))
    error = _load(server, "tampered")
    assert error is not None and f"{onnx} does not match the sha256" in error, error
    assert _client(server).is_server_live()


def test_the_entry_finds_trtc_only_through_the_path_it_records(builds: dict[str, Path], server: TritonServer) -> None:
    """Proves: the server runs without PYTHONPATH and a trtc entry records this checkout's folder first on its
    Python path; an entry that records no folders fails to load because trtc's imports are not found (so the
    entries above were served by the code of the folders they record)."""
    assert "PYTHONPATH" not in server.environment()
    folder = triton_repository(builds["fp32"], server.repository, name="no_path", platform="trtc", force=True,
                               python_path=())
    error = _load(server, "no_path")
    assert error is not None and "ModuleNotFoundError" in error, error
    recorded = triton_repository(builds["fp32"], server.repository, name="with_path", platform="trtc", force=True)
    text = (recorded / "config.pbtxt").read_text()
    assert f'string_value: "{Path(compiler.__file__).resolve().parent.parent}{os.pathsep}' in text
    assert folder.is_dir()


def test_a_stale_engine_fails_the_check_with_trtc_checks_lines(builds: dict[str, Path], tmp_path: Path) -> None:
    """Proves: where a trtc entry's engines are to run, `verify_build` raises with exactly the lines `trtc check`
    prints for the machine (here another TensorRT than the one that built them); the entry's other checks pass.
    (No TensorRT here: the model's own load takes this path only where TensorRT imports.)"""
    directory = with_engines(builds["fp32"], tmp_path / "engines", ranged=False, one_file=False)
    here = {"tensorrt": "10.14.1", "gpu": "NVIDIA H200", "compute_capability": "9.0", "platform": "linux-x86_64"}
    expected = "\n".join(check_directory(directory, here).lines())
    assert "stale" in expected
    with pytest.raises(TrtcError) as raised:
        verify_build(directory, "tensorrt", env=here)
    assert str(raised.value) == expected
    verify_build(directory, "onnxruntime")  # ONNX Runtime serves it: the engines are not checked


def _read_lines(stream: Any, lines: list[str]) -> None:
    for line in iter(stream.readline, ""):
        lines.append(line)


@pytest.mark.slow
def test_trtc_serve_answers_its_curl_example_and_stops_on_ctrl_c(builds: dict[str, Path]) -> None:
    """Proves: `trtc serve DIR` starts Triton on the ports given, prints the endpoints and a curl command that,
    run as printed, gets the model's answer for zeros (batch 1, 10 values); SIGINT (Ctrl-C) makes it stop the
    server and exit 0 with "stopped", after which nothing answers on its HTTP port."""
    _install()
    ports = [free_port() for _ in range(3)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", "from compiler.cli import main; main()", "serve", str(builds["fp32"]),
               "--port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), "--name", "m"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    errors: list[str] = []
    reader = threading.Thread(target=_read_lines, args=(process.stderr, errors), daemon=True)
    reader.start()
    pid = None
    try:
        end = time.monotonic() + 180
        while not any("Ctrl-C stops it" in line for line in errors):
            assert process.poll() is None, "".join(errors)
            assert time.monotonic() < end, "".join(errors)
            time.sleep(0.2)
        text = "".join(errors)
        assert f"HTTP http://127.0.0.1:{ports[0]}" in text and f"gRPC 127.0.0.1:{ports[1]}" in text
        pid = int(text.split("tritonserver pid ")[1].split(")")[0])
        curl = next(line.strip() for line in errors if "| curl" in line)
        answer = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60, check=True)
        output = json.loads(answer.stdout)["outputs"][0]
        assert output["name"] == "out" and output["shape"] == [1, 10] and len(output["data"]) == 10
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, "".join(errors)
        reader.join(timeout=10)
        assert errors[-1].strip() == "stopped"
        with pytest.raises(OSError):
            import urllib.request

            urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v2/health/ready", timeout=5)
    finally:
        if process.poll() is None:  # a failed assertion: stop what this test started, trtc and its tritonserver
            for group in (process.pid, pid):
                if group is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(group, signal.SIGKILL)
            process.wait(timeout=30)


def test_serve_without_triton_is_one_line_naming_the_extra(builds: dict[str, Path],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Proves: with no tritonserver on PATH and no nvidia-pytriton, `trtc serve` exits 2 with one line that names
    the extra trtc[serve], before writing anything."""
    import importlib.util

    from compiler.pipeline import tritonserver

    real: Callable[..., Any] = importlib.util.find_spec
    monkeypatch.setattr(tritonserver.shutil, "which", lambda name: None)
    monkeypatch.setattr(tritonserver.importlib.util, "find_spec",
                        lambda name, *a: None if name == "pytriton" else real(name, *a))
    result = CliRunner().invoke(cli, ["serve", str(builds["fp32"])])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: tritonserver was not found: install the extra with `pip install 'trtc[serve]'` (nvidia-pytriton "
        "ships the server), or put Triton's tritonserver on PATH"]
